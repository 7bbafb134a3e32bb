"""DLRM-style recommendation models: data, model, hybrid-parallel training and serving.

The Python API's calls are here too, loaded on first use so that ``import dlrm`` stays light
(it imports neither torch nor the rest of the package)::

    import dlrm

    model = dlrm.load("ckpt")                      # dlrm.api.load: a TrainedModel
    scores = model.predict(numerical, categorical)  # click probabilities
    result = dlrm.train(dlrm.RunConfig(...))        # dlrm.api.train: a TrainResult

Every public name of ``dlrm.api`` (``dlrm.api.__all__``) is an attribute of ``dlrm``.
"""

from __future__ import annotations

from typing import Any

from dlrm.triton_folder import hide_namespace_triton
from dlrm.version import __version__

hide_namespace_triton()  # before torch can mistake the repository's triton/ folder for Triton

# dlrm.api's public names, which ``dlrm.<name>`` loads on first use (kept in step with
# ``dlrm.api.__all__`` by tests/test_python_api.py).
_API_NAMES = frozenset({
    "load", "train", "evaluate", "benchmark_inference", "plan", "run",
    "TrainedModel", "TrainResult", "Evaluation", "SettingError",
    "RunConfig", "DataConfig", "ModelSettings", "OptimizerConfig", "TrainConfig", "LRSchedule", "CheckpointConfig",
    "ParallelConfig", "OutputConfig", "InferenceBenchmarkConfig", "ServingConfig",
})

__all__ = ["__version__", *sorted(_API_NAMES)]


def __getattr__(name: str) -> Any:
    """``dlrm.load`` and the API's other names, from ``dlrm.api``, imported when first asked for."""
    if name in _API_NAMES:
        from dlrm import api

        return getattr(api, name)
    raise AttributeError(f"module 'dlrm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _API_NAMES)
