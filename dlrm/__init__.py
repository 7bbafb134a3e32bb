"""DLRM-style recommendation models: data, model, hybrid-parallel training and serving."""
