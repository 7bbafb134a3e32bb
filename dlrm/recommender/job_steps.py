"""Steps every recommender job (train, predict, evaluate, the in-memory ``Recommender``) takes
before its work: its datasets opened and checked, its device and autocast dtype resolved, the
process group's environment read, signal handlers that stop a run after its step, and the config
of a call made from a config or from its fields. Kept apart from the jobs so that each job's
module holds that job alone, and none imports another job or ``api``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
from typing import Any, Iterator, TypeVar

from dlrm.engine.config_check import rechecked
from dlrm.recommender.run_config import ConfigError, EvaluateConfig, PredictConfig


def check_dataset_dir(setting: str, path: str | None, hint: str = "") -> None:
    """``ConfigError`` unless ``path`` (the value of ``setting``; None: not given) is a directory."""
    if path is not None and not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"`{setting}` {path} {what}; give a CSR dataset directory{hint}")


def open_dataset(setting: str, path: str | None, hint: str = ""):
    """The CsrDataset at ``path``, the value of ``setting`` (checked as ``check_dataset_dir``)."""
    if path is None:
        raise ConfigError(f"`{setting}` is required here; give a CSR dataset directory{hint}")
    check_dataset_dir(setting, path, hint)
    from dlrm.recommender.csr_dataset import CsrDataset

    return CsrDataset(path)


def resolve_device(name: str | None, env):
    """The torch device of ``base_device`` ``name`` (None: cuda if there is one) for this process
    of ``env``; a name torch refuses is a ``ConfigError``."""
    from dlrm.engine.devices import resolve_device as engine_device

    try:
        return engine_device(name, env)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def amp_dtype_of(amp: bool, dtype_name: str, device):
    """The autocast dtype of ``amp`` and ``amp_dtype`` (auto, bf16 or fp16) on ``device``, or None.
    auto: bf16, except on a CPU without bf16 instructions, where bf16 autocast is slower than
    float32: float32 there, said in one line."""
    import torch

    from dlrm.engine.devices import cpu_has_native_bf16

    if not amp:
        return None
    if dtype_name == "fp16" and device.type != "cuda":
        raise ConfigError("`amp_dtype` fp16 runs on cuda only; use `amp_dtype` bf16 on the CPU")
    if dtype_name == "auto" and device.type == "cpu" and not cpu_has_native_bf16():
        print("`amp`: training in float32: bf16 autocast is slower than float32 on a CPU without bf16 instructions "
              "(AVX512-BF16, AMX), as here; `amp_dtype` bf16 forces it".replace("`", ""), flush=True)
        return None
    return torch.float16 if dtype_name == "fp16" else torch.bfloat16


def dist_env():
    """torchrun's environment of this process, or None outside torchrun."""
    if "WORLD_SIZE" not in os.environ:
        return None
    from dlrm.engine.process_group import dist_env as engine_env

    return engine_env()


@contextlib.contextmanager
def stop_on_signals() -> Iterator[Any]:
    """``StopOnSignals`` for the run (None outside the main thread, where no handler can be set),
    the previous handlers restored afterwards."""
    from dlrm.engine.signals import StopOnSignals

    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stop = StopOnSignals()
    try:
        yield stop
    finally:
        stop.over()
        for s, handler in previous.items():
            signal.signal(s, handler)


def plain(message: object) -> str:
    """A network file's message with its JSON paths in quotes: `Alpha` there is a key of the
    file, not a setting."""
    return str(message).replace("`", "'")


JobConfig = TypeVar("JobConfig", PredictConfig, EvaluateConfig)


def job_config(job: str, cls: type[JobConfig], cfg: Any, args: tuple, settings: dict[str, Any]) -> JobConfig:
    """The config of a call of ``job``: ``cfg`` itself when it is a ``cls``, else ``cls`` of the
    arguments (the short form: the config's fields as arguments, checked as the config checks
    them). A config and settings together are a ``TypeError``: the config is the whole run."""
    if isinstance(cfg, cls):
        if args or settings:
            given = ", ".join([*(repr(a) for a in args), *settings])
            raise TypeError(f"{job}() takes a {cls.__name__} or its settings, not both (got {given} beside the "
                            f"config); use dataclasses.replace(cfg, ...) to change a setting")
        return rechecked(cfg)  # a setting changed since the config was built is checked too
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        raise TypeError(f"{job}() takes a {cls.__name__}, got {type(cfg).__name__}")
    return cls(*((cfg, *args) if cfg is not None or args else ()), **settings)


def device_memory(device) -> int:
    """Bytes of memory of ``device``: the GPU's, or the machine's RAM."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
