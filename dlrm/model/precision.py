"""Mixed precision through torch.amp: autocast for the forward pass, a GradScaler for fp16."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dlrm.engine.devices import cpu_has_native_bf16


@dataclass(frozen=True)
class Precision:
    """``dtype=None`` trains in float32 (TF32 matmuls on GPUs that have them, if enabled).
    ``note`` says why a run got another precision than it asked for (printed in the run header)."""

    device_type: str
    dtype: torch.dtype | None = None
    note: str = field(default="", compare=False)

    @staticmethod
    def parse(amp: bool, amp_dtype: str, device: torch.device, native_bf16: bool | None = None) -> "Precision":
        """``amp_dtype='auto'`` picks fp16 on CUDA (tensor cores, as NVIDIA's recipe) and bf16 on a
        CPU with bf16 in hardware; on a CPU without it, float32, since bf16 autocast is slower
        there than no autocast at all (fp16 on CPU is slower still and needs scaling). An explicit
        ``amp_dtype`` is obeyed. ``native_bf16``: this CPU's answer (None: ``cpu_has_native_bf16()``)."""
        if not amp:
            return Precision(device.type, None)
        dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16}
        if amp_dtype not in (*dtypes, "auto"):
            raise ValueError(f"`amp_dtype` must be one of auto, float16, bfloat16; got {amp_dtype!r}")
        slow = device.type == "cpu" and not (cpu_has_native_bf16() if native_bf16 is None else native_bf16)
        if amp_dtype == "auto" and device.type == "cuda":
            return Precision(device.type, torch.float16)
        if amp_dtype == "auto" and slow:
            return Precision(device.type, None, note="AMP off: bf16 autocast is slower than float32 on a CPU without bf16 instructions "
                                                     "(AVX512-BF16, AMX), as here")
        if amp_dtype == "auto":
            return Precision(device.type, torch.bfloat16)
        note = "slow here: no bf16 instructions (AVX512-BF16, AMX) on this CPU" if slow and amp_dtype == "bfloat16" else ""
        return Precision(device.type, dtypes[amp_dtype], note=note)

    def autocast(self, cache_enabled: bool = True) -> contextlib.AbstractContextManager:
        """``cache_enabled=False`` inside CUDA graph capture: autocast's weight-cast cache would
        otherwise hold tensors from the capture that a replay never refreshes."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=cache_enabled)

    def grad_scaler(
        self, init_scale: float = 2.0**16, process_group: dist.ProcessGroup | None = None
    ) -> torch.amp.GradScaler:
        """Enabled for fp16 only: bf16 has fp32's range and needs no loss scaling.

        ``process_group``: the processes of a hybrid-parallel run. Each holds other embedding
        gradients, so one may overflow where the others do not; torch's ``ShardedGradScaler``
        combines their overflow checks, so every process skips the same steps.
        """
        enabled = self.dtype == torch.float16
        if process_group is None:
            return torch.amp.GradScaler(self.device_type, init_scale=init_scale, enabled=enabled)
        # Imported here: torch.distributed.fsdp pulls in DTensor and sympy (0.6 s at every start of
        # every entry point), and only multi-process runs need it.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.device_type, init_scale=init_scale, enabled=enabled, process_group=process_group)

    def __str__(self) -> str:
        return "float32" if self.dtype is None else str(self.dtype).removeprefix("torch.")
