"""DLRM-style recommendation models: data, model, hybrid-parallel training and serving."""

from dlrm.triton_folder import hide_namespace_triton

hide_namespace_triton()  # before torch can mistake the repository's triton/ folder for Triton
