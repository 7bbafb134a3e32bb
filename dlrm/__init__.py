"""DLRM-style recommendation models: data, model, hybrid-parallel training and serving."""

from dlrm.triton_folder import hide_namespace_triton

__version__ = "0.2.0.dev0"  # the one place; pyproject.toml reads it, CHANGELOG.md says what changed

hide_namespace_triton()  # before torch can mistake the repository's triton/ folder for Triton
