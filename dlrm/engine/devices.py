"""Which device a process runs on, and what the CPU does fast: facts both products start from."""

from __future__ import annotations

import functools
import os
import platform

import torch

from dlrm.engine.process_group import DistEnv


# oneDNN's ISA levels (ONEDNN_MAX_CPU_ISA caps what oneDNN uses) with bf16 dot products in hardware.
_ONEDNN_BF16_ISAS = {"AVX2_VNNI_2", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                     "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL"}
_ONEDNN_ISAS = _ONEDNN_BF16_ISAS | {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI", "DEFAULT"}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):  # x86, Arm
                    return set(value.split())
    except OSError:
        pass
    return set()


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86: AVX512-BF16 or AMX; Arm: BF16), as the
    matrix library will use it (``ONEDNN_MAX_CPU_ISA`` may cap it below).

    Without it, bf16 autocast converts in software around fp32 arithmetic: measured 2x slower than
    fp32 for the quick-start model on an AMD EPYC with oneDNN capped at AVX512_CORE_VNNI (a Cascade
    Lake's instructions). See docs/benchmarks.md.
    """
    isa = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    if isa in _ONEDNN_ISAS and isa not in _ONEDNN_BF16_ISAS:
        return False
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in _cpu_flags()
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(callable(check) for check in checks):
        return any(check() for check in checks)
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


def resolve_device(name: str | None, env: DistEnv | None = None) -> torch.device:
    """``base_device`` as a torch device with an index: None is cuda if available, else cpu; under
    a launcher (``env``) each process takes cuda:LOCAL_RANK."""
    name = name or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"`base_device` {name}: not a device; use cuda, cuda:N or cpu") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"`base_device` {name}: this program runs on cuda or cpu")
    if env is not None and device.type == "cuda":
        device = torch.device("cuda", env.local_rank)  # one GPU per process
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`base_device` {name}: CUDA is not available on this machine; use `base_device=cpu`")
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    return device
