"""Mixed precision through torch.amp: autocast for the forward pass, a GradScaler for fp16."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


@dataclass(frozen=True)
class Precision:
    """``dtype=None`` trains in float32 (TF32 matmuls on GPUs that have them, if enabled)."""

    device_type: str
    dtype: torch.dtype | None = None

    @staticmethod
    def parse(amp: bool, amp_dtype: str, device: torch.device) -> "Precision":
        """``amp_dtype='auto'`` picks fp16 on CUDA (tensor cores, as NVIDIA's recipe) and bf16
        elsewhere (CPUs with bf16 units multiply bf16 fast; fp16 on CPU is slow and needs scaling)."""
        if not amp:
            return Precision(device.type, None)
        if amp_dtype == "auto":
            amp_dtype = "float16" if device.type == "cuda" else "bfloat16"
        dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16}
        if amp_dtype not in dtypes:
            raise ValueError(f"`amp_dtype` must be one of auto, float16, bfloat16; got {amp_dtype!r}")
        return Precision(device.type, dtypes[amp_dtype])

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
        return ShardedGradScaler(self.device_type, init_scale=init_scale, enabled=enabled, process_group=process_group)

    def __str__(self) -> str:
        return "float32" if self.dtype is None else str(self.dtype).removeprefix("torch.")
