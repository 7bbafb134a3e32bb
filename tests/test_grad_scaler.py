"""``DeviceScalerState`` against torch's own GradScaler: the same model and losses trained with
``scaler.unscale_`` / ``scaler.step`` / ``scaler.update`` (the public API, the reference) and
with the device-side calls must give the same unscaled gradients, the same skipped steps,
weights, and the same scale and growth tracker after every step."""

import re

import pytest
import torch

from dlrm.training.grad_scaler import DeviceScalerState

# Per step, a factor of the input: inf and nan overflow the scaled gradients, so the step is
# skipped and the scale backs off; with growth_interval=2, two clean steps in a row grow it.
INPUT_FACTORS = [1.0, 1.0, 1.0, float("inf"), 1.0, 1.0, float("nan"), 1.0, 1.0, 1.0]
LR = 0.1


def make_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
    x[0, 0] *= INPUT_FACTORS[step]
    return model(x).square().mean()


def test_same_scale_sequence_grads_and_weights_as_torch_grad_scaler():
    reference, device = make_model(), make_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    scaler_ref, scaler_dev = make_scaler(), make_scaler()
    scales = []
    for step in range(len(INPUT_FACTORS)):
        optimizer.zero_grad(set_to_none=True)
        scaler_ref.scale(loss_of(reference, step)).backward()
        scaler_ref.unscale_(optimizer)
        want_grads = [p.grad.clone() for p in reference.parameters()]
        scaler_ref.step(optimizer)
        scaler_ref.update()

        for p in device.parameters():
            p.grad = None
        scaler_dev.scale(loss_of(device, step)).backward()
        state = DeviceScalerState(scaler_dev)
        scale_before = state.scale_tensor().clone()
        params = list(device.parameters())
        grads = [p.grad for p in params]
        found_inf = torch.zeros(1, dtype=torch.float32)
        inv_scale = state.unscale_and_check_(grads, found_inf)
        assert float(inv_scale) == 1.0 / float(scale_before)
        with torch.no_grad():
            skip = found_inf.reshape(()) > 0
            for p, g in zip(params, grads):
                p.add_(torch.where(skip, 0.0, g), alpha=-LR)  # SGD's update, skipped on overflow
        state.update_(found_inf)

        overflow = INPUT_FACTORS[step] != 1.0
        assert bool(found_inf) == overflow, step
        if not overflow:  # after an overflow torch leaves the non-finite grads as they are, as we do
            for got, want in zip(grads, want_grads):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        for got, want in zip(device.parameters(), reference.parameters()):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert scaler_dev.state_dict() == scaler_ref.state_dict(), step  # scale and _growth_tracker
        scales.append(scaler_ref.get_scale())
    # The sequence really grows and backs off, so the comparison above is not vacuous.
    assert scales == [2.0**10, 2.0**11, 2.0**11, 2.0**10, 2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11, 2.0**11]


def test_device_state_continues_a_scaler_that_torch_updated():
    """Both paths share the state: a scaler updated by torch, then by the device calls, then
    saved, equals one updated by torch only."""
    model = make_model()
    scaler_ref, scaler_mixed = make_scaler(), make_scaler()
    for step, factor in enumerate([1.0, float("inf"), 1.0, 1.0]):
        for scaler in (scaler_ref, scaler_mixed):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay put: same grads
            optimizer.zero_grad(set_to_none=True)
            x = torch.ones(2, 4) * factor
            scaler.scale(model(x).sum()).backward()
            if scaler is scaler_mixed and step % 2:
                state = DeviceScalerState(scaler)
                found_inf = torch.zeros(1)
                state.unscale_and_check_([p.grad for p in model.parameters()], found_inf)
                state.update_(found_inf)
            else:
                scaler.step(optimizer)
                scaler.update()
        assert scaler_mixed.state_dict() == scaler_ref.state_dict(), step


def test_empty_gradient_list_only_updates_the_scale():
    scaler = make_scaler()
    scaler.scale(torch.ones(()))
    state = DeviceScalerState(scaler)
    found_inf = torch.ones(1)  # e.g. an overflow found in the embeddings' deferred gradients
    state.unscale_and_check_([], found_inf)
    state.update_(found_inf)
    assert scaler.get_scale() == 2.0**9


def test_disabled_scaler_and_missing_scale_are_refused():
    with pytest.raises(ValueError, match="enabled GradScaler"):
        DeviceScalerState(torch.amp.GradScaler("cpu", enabled=False))
    state = DeviceScalerState(make_scaler())
    with pytest.raises(RuntimeError, match=r"scaler.scale\(loss\)"):
        state.scale_tensor()


def test_missing_private_api_names_the_torch_version(monkeypatch):
    monkeypatch.delattr(torch, "_amp_update_scale_")
    with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__} lacks") + r".*torch\._amp_update_scale_"):
        DeviceScalerState(make_scaler())
    monkeypatch.undo()
    scaler = make_scaler()
    del scaler._growth_tracker
    with pytest.raises(RuntimeError, match=r"GradScaler._growth_tracker"):
        DeviceScalerState(scaler)
