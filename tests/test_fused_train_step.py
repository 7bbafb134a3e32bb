"""``joint_fused`` embeddings with ``fused_train_step`` against the sparse-gradient path
(``joint`` + ``train_step`` + torch's SGD), which is the independent reference here: same
initial weights, same batches, so every loss and every weight must agree up to float
reassociation. On CPU the kernels run in Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

from dlrm.data.batch import Batch
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.training.train import fused_train_step, make_train_step, train_step
from dlrm.training.optimizers import make_optimizer

TABLES = [50, 7, 300, 3, 20]


def model_pair(**overrides) -> tuple[DLRM, DLRM]:
    cfg = dict(num_numerical_features=5, table_sizes=TABLES, embedding_dim=8,
               bottom_mlp_sizes=[16, 8], top_mlp_sizes=[16, 1])
    cfg.update(overrides)
    torch.manual_seed(0)
    joint = DLRM(DLRMConfig(**cfg, embedding_type="joint"))
    torch.manual_seed(0)
    fused = DLRM(DLRMConfig(**cfg, embedding_type="joint_fused"))
    assert torch.equal(joint.embeddings.weight, fused.embeddings.weight)
    return joint, fused


def batches(n: int, size: int = 48, seed: int = 1) -> list[Batch]:
    """``size * len(TABLES)`` ids a batch: 48 keeps them within one program of the update
    kernel (256 sorted ids), which the interpreter walks element by element."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        # Skewed ids, so rows repeat within a batch as they do in Criteo.
        ids = torch.stack([(torch.rand(size, generator=g) ** 3 * rows).long() for rows in TABLES], dim=1)
        out.append(Batch(torch.randn(size, 5, generator=g), ids, torch.randint(0, 2, (size,), generator=g).float()))
    return out


def run_both(precision: Precision, steps: int = 2, lr: float = 0.5, init_scale: float = 2.0**16):
    joint, fused = model_pair()
    opt_j, opt_f = make_optimizer(joint, lr), make_optimizer(fused, lr)
    scaler_j, scaler_f = precision.grad_scaler(init_scale), precision.grad_scaler(init_scale)
    losses = []
    for batch in batches(steps):
        loss_j = train_step(joint, batch, opt_j, scaler_j, precision)
        loss_f = fused_train_step(fused, batch, opt_f, scaler_f, precision)
        losses.append((float(loss_j), float(loss_f)))
    return joint, fused, losses, scaler_j, scaler_f


def assert_models_close(a: DLRM, b: DLRM, rtol: float, atol: float) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_optimizer_leaves_fused_tables_out():
    _, fused = model_pair()
    groups = {g["name"]: g["params"] for g in make_optimizer(fused, 1.0).param_groups}
    assert groups["embeddings"] == []
    assert all(p is not fused.embeddings.weight for p in groups["dense"])


def test_fp32_steps_match_sparse_sgd():
    joint, fused, losses, _, _ = run_both(Precision("cpu"))
    for lj, lf in losses:
        assert lf == pytest.approx(lj, rel=1e-5)
    assert_models_close(joint, fused, rtol=1e-5, atol=1e-6)
    assert fused.embeddings.weight.grad is None  # no dense or sparse gradient was ever built


def test_bf16_autocast_steps_match_sparse_sgd():
    joint, fused, losses, _, _ = run_both(Precision("cpu", torch.bfloat16))
    for lj, lf in losses:
        assert lf == pytest.approx(lj, rel=2e-2)
    assert_models_close(joint, fused, rtol=2e-2, atol=2e-3)


def test_fp16_loss_scaling_matches_grad_scaler():
    joint, fused, losses, scaler_j, scaler_f = run_both(Precision("cpu", torch.float16))
    assert scaler_f.get_scale() == scaler_j.get_scale()
    assert_models_close(joint, fused, rtol=1e-2, atol=1e-3)


def test_fp16_overflow_skips_every_update_and_backs_off():
    """A loss scale so large that the scaled gradients overflow: GradScaler skips the step; the
    fused path must skip it too (embeddings included) and halve the scale the same way."""
    precision = Precision("cpu", torch.float16)
    _, fused = model_pair()
    before = [p.detach().clone() for p in fused.parameters()]
    opt = make_optimizer(fused, 0.5)
    scaler = precision.grad_scaler(init_scale=2.0**120)
    fused_train_step(fused, batches(1)[0], opt, scaler, precision)
    for p, b in zip(fused.parameters(), before):
        assert torch.equal(p, b)
    assert scaler.get_scale() == 2.0**119
    assert not fused.embeddings.has_pending_update


def test_make_train_step_picks_the_fused_step_and_refuses_cuda_graphs_on_cpu():
    joint, fused = model_pair()
    precision = Precision("cpu")
    opt = make_optimizer(fused, 0.5)
    step = make_train_step(fused, opt, precision.grad_scaler(), precision)
    reference_opt = make_optimizer(joint, 0.5)
    for batch in batches(2):
        torch.testing.assert_close(step(batch), train_step(joint, batch, reference_opt, precision.grad_scaler(), precision))
    with pytest.raises(ValueError, match="CUDA device"):
        make_train_step(fused, opt, precision.grad_scaler(), precision, cuda_graphs=True)


def test_lr_changes_are_picked_up_every_step():
    """The step reads the learning rate from the optimizer each call (the schedule moves it)."""
    joint, fused = model_pair()
    precision = Precision("cpu")
    opt_j, opt_f = make_optimizer(joint, 0.1), make_optimizer(fused, 0.1)
    step = make_train_step(fused, opt_f, precision.grad_scaler(), precision)
    for i, batch in enumerate(batches(2)):
        for opt in (opt_j, opt_f):
            for group in opt.param_groups:
                group["lr"] = 0.1 * (i + 1)
        train_step(joint, batch, opt_j, precision.grad_scaler(), precision)
        step(batch)
    assert_models_close(joint, fused, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16])
def test_cuda_graph_step_matches_eager_fused_step(dtype):
    device = torch.device("cuda")
    _, fused = model_pair()
    eager, graphed = fused.to(device), DLRM(fused.config, device=device)
    graphed.load_state_dict(eager.state_dict())
    precision = Precision("cuda", dtype)
    opt_e, opt_g = make_optimizer(eager, 0.5), make_optimizer(graphed, 0.5)
    step_e = make_train_step(eager, opt_e, precision.grad_scaler(), precision)
    step_g = make_train_step(graphed, opt_g, precision.grad_scaler(), precision, cuda_graphs=True)
    for batch in batches(8) + batches(1, size=17, seed=5):  # a partial last batch runs eagerly
        batch = batch.to(device)
        torch.testing.assert_close(step_g(batch), step_e(batch), rtol=1e-5, atol=1e-6)
    assert_models_close(eager, graphed, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_cuda_graphs_capture_while_another_thread_pins_memory():
    """The loader's thread pins host memory (cudaHostAlloc) while the step is captured; in
    torch's default global capture mode that call invalidates the capture. Here a thread pins
    fresh buffers without pause during warmup, capture and replays, and the graphed steps still
    match eager ones; with the mode set back to "global" this fails."""
    import threading

    device = torch.device("cuda")
    _, fused = model_pair()
    eager, graphed = fused.to(device), DLRM(fused.config, device=device)
    graphed.load_state_dict(eager.state_dict())
    precision = Precision("cuda", torch.float16)
    opt_e, opt_g = make_optimizer(eager, 0.5), make_optimizer(graphed, 0.5)
    step_e = make_train_step(eager, opt_e, precision.grad_scaler(), precision)
    step_g = make_train_step(graphed, opt_g, precision.grad_scaler(), precision, cuda_graphs=True)
    stop, pinned = threading.Event(), []

    def pin_forever():
        size = 1 << 16
        while not stop.is_set():
            size += 4096  # a new size each time, so the host allocator's cache cannot serve it
            pinned.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
            del pinned[:-4]

    thread = threading.Thread(target=pin_forever, daemon=True)
    thread.start()
    try:
        for batch in batches(8):
            batch = batch.to(device)
            torch.testing.assert_close(step_g(batch), step_e(batch), rtol=1e-5, atol=1e-6)
    finally:
        stop.set()
        thread.join()
    assert len(pinned) > 0
    assert_models_close(eager, graphed, rtol=1e-5, atol=1e-6)
