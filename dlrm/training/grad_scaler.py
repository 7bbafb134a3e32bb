"""Device-side fp16 loss scaling with a ``torch.amp.GradScaler``'s own state.

``fused_train_step`` cannot use ``scaler.unscale_/step/update``: they read the overflow flag
on the host (a sync per step, which a CUDA graph cannot capture) and only know optimizers,
not the embeddings' deferred updates. It needs the scaler's state tensors and the two ops
GradScaler is built on, which are private torch API. ``DeviceScalerState`` is the one place
that touches them, so a torch upgrade that renames them fails here, at construction, with a
message naming the torch version, rather than deep inside a training step.

The arithmetic is GradScaler's own (same ops, same state tensors), so the scale follows the
same growth/back-off sequence, and the scaler's ``state_dict`` stays valid for either step.
"""

from __future__ import annotations

import torch

_TORCH_OPS = ("_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_")
_SCALER_ATTRIBUTES = ("_scale", "_growth_tracker")


class DeviceScalerState:
    """An enabled ``GradScaler``'s scale and growth tracker, used on the device without syncs:
    ``unscale_and_check_`` is ``scaler.unscale_`` for a list of gradients, ``update_`` is
    ``scaler.update`` for a given overflow flag."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        if not scaler.is_enabled():
            raise ValueError("DeviceScalerState needs an enabled GradScaler (fp16); a disabled one scales nothing")
        missing = [f"torch.{name}" for name in _TORCH_OPS if not hasattr(torch, name)]
        missing += [f"GradScaler.{name}" for name in _SCALER_ATTRIBUTES if not hasattr(scaler, name)]
        if missing:
            raise RuntimeError(
                f"torch {torch.__version__} lacks the private GradScaler API that device-side loss scaling "
                f"uses ({', '.join(missing)}); adapt dlrm/training/grad_scaler.py to this torch version"
            )
        self.scaler = scaler

    def scale_tensor(self) -> torch.Tensor:
        """The scaler's live scale (0-dim float32 on the device; updated in place by ``update_``)."""
        scale = self.scaler._scale
        if scale is None:  # GradScaler creates it lazily in its first scale()
            raise RuntimeError("the GradScaler has no scale yet: call scaler.scale(loss) before the update")
        return scale

    def unscale_and_check_(self, grads: list[torch.Tensor], found_inf: torch.Tensor) -> torch.Tensor:
        """Multiplies ``grads`` (dense, on the scale's device) in place by ``1 / scale`` and adds 1
        to ``found_inf`` (float32, one element) when any of them holds inf/NaN, as
        ``scaler.unscale_`` does. Returns ``inv_scale`` (float32, one element) for other
        gradients the caller unscales itself (e.g. deferred embedding updates)."""
        inv_scale = self.scale_tensor().double().reciprocal().float()  # as GradScaler.unscale_ computes it
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return inv_scale

    def update_(self, found_inf: torch.Tensor) -> None:
        """``scaler.update()`` with this step's overflow flag (non-zero: skipped): backs the scale
        off on overflow, grows it after ``growth_interval`` clean steps, in place on the device."""
        scaler = self.scaler
        torch._amp_update_scale_(
            self.scale_tensor(), scaler._growth_tracker, found_inf,
            scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval(),
        )
