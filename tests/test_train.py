import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F

from dlrm.data.batch import Batch
from dlrm.data.synthetic import SyntheticDataset
from dlrm.engine.logger import RunLogger
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.training.checkpoint import load_checkpoint
from dlrm.training.lr_schedule import LRSchedule
from dlrm.training.optimizers import make_optimizer
from dlrm.training.train import TrainConfig, evaluate, train, train_step
from conftest import log_records

CPU = torch.device("cpu")
TABLES = [50, 400, 3, 1000, 20, 7, 200, 60]


def small_model(seed: int = 0, **overrides) -> DLRM:
    torch.manual_seed(seed)
    cfg = dict(num_numerical_features=13, table_sizes=TABLES, embedding_dim=16,
               bottom_mlp_sizes=[32, 16], top_mlp_sizes=[64, 32, 1])
    cfg.update(overrides)
    return DLRM(DLRMConfig(**cfg))


def sources(train_rows=64 * 1024, test_rows=16 * 1024, batch=1024):
    train_src = SyntheticDataset(13, TABLES, train_rows, batch, device=CPU, seed=3, split="train")
    test_src = SyntheticDataset(13, TABLES, test_rows, 4096, device=CPU, seed=3, split="test")
    return train_src, test_src


def run(model, cfg, train_src, test_src, precision=Precision("cpu"), state=None, log=None):
    opt = make_optimizer(model, cfg.schedule.lr)
    scaler = precision.grad_scaler()
    if state == "resume":
        state = load_checkpoint(cfg_resume_path[0], model, opt, scaler, restore_rng=True)
    logger = RunLogger(log, stream=io.StringIO())
    summary = train(model, opt, scaler, precision, train_src, test_src, cfg, CPU, logger, state=state)
    logger.close()
    return summary


cfg_resume_path = [None]


def test_train_step_equals_plain_sgd_in_float64():
    """One step against an independent float64 computation: loss, dense and sparse updates."""
    model = small_model().double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    batch = Batch(
        numerical=torch.rand(64, 13, generator=g, dtype=torch.float64),
        categorical=torch.stack([torch.randint(0, n, (64,), generator=g) for n in TABLES], 1),
        label=torch.rand(64, generator=g) < 0.3,
    )
    lr = 0.7
    opt = make_optimizer(model, lr)
    loss = train_step(model, batch, opt, Precision("cpu").grad_scaler(), Precision("cpu"))

    ref_loss = F.binary_cross_entropy_with_logits(reference(batch.numerical, batch.categorical), batch.label.double())
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=0)
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            grad = q.grad.to_dense() if q.grad.is_sparse else q.grad
            torch.testing.assert_close(p, q - lr * grad, rtol=1e-12, atol=1e-14, msg=name)
    # rows no sample used are bit-identical
    used = set(batch.categorical[:, 3].tolist())
    unused = [r for r in range(TABLES[3]) if r not in used]
    assert torch.equal(model.embeddings.table_weight(3)[unused], reference.embeddings.table_weight(3)[unused])


def test_training_learns_the_synthetic_signal(tmp_path):
    train_src, test_src = sources(train_rows=256 * 1024)
    model = small_model()
    before = evaluate(model, test_src, CPU, Precision("cpu")).auc
    cfg = TrainConfig(schedule=LRSchedule(lr=0.5, warmup_steps=20), log_every_steps=50, eval_every_steps=128)
    summary = run(model, cfg, train_src, test_src, log=str(tmp_path / "log.json"))
    assert abs(before - 0.5) < 0.05
    assert summary["best_auc"] > 0.70, summary
    evals = log_records(tmp_path / "log.json", "eval")
    assert [e["step"] for e in evals] == [128, 256]
    assert evals[-1]["auc"] > evals[0]["auc"] - 0.01


def test_bf16_autocast_trains_close_to_fp32():
    train_src, test_src = sources(train_rows=64 * 1024)
    cfg = TrainConfig(schedule=LRSchedule(lr=0.5, warmup_steps=10), log_every_steps=1000)
    fp32 = run(small_model(), cfg, train_src, test_src)
    bf16 = run(small_model(), cfg, train_src, test_src, precision=Precision("cpu", torch.bfloat16))
    assert abs(fp32["best_auc"] - bf16["best_auc"]) < 0.02


def test_fp16_overflow_skips_every_update_including_embeddings():
    model = small_model()
    before = copy.deepcopy(model.state_dict())
    train_src, _ = sources(train_rows=1024)
    batch = train_src.read_batch(0)
    precision = Precision("cpu", torch.float16)
    scaler = precision.grad_scaler(init_scale=2.0**60)  # scaled fp16 gradients overflow to inf
    opt = make_optimizer(model, 1.0)
    train_step(model, batch, opt, scaler, precision)
    assert scaler.get_scale() < 2.0**60  # the scaler saw the overflow and backed off
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} was updated on an overflowing step"
    # with a sane scale the same step does update the embeddings
    train_step(model, batch, opt, precision.grad_scaler(init_scale=2.0**8), precision)
    assert not torch.equal(model.embeddings.table_weight(1), before_table(before, model, 1))


def before_table(state, model, i):
    weight = [v for k, v in state.items() if k.startswith("embeddings.")]
    if len(weight) == 1:
        offset = sum(model.config.table_sizes[:i])
        return weight[0][offset: offset + model.config.table_sizes[i]]
    return weight[i]


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, shuffle):
    train_src, test_src = sources(train_rows=24 * 1024)  # 24 batches per epoch
    schedule = LRSchedule(lr=0.8, warmup_steps=5, decay_start_step=20, decay_steps=30)
    common = dict(schedule=schedule, epochs=3, log_every_steps=1, eval_every_steps=16, shuffle_batch_order=shuffle)

    full_log = str(tmp_path / "full.json")
    run(small_model(), TrainConfig(**common), train_src, test_src, log=full_log)

    ckpt = str(tmp_path / "ckpt")
    part_log = str(tmp_path / "part.json")
    run(small_model(), TrainConfig(**common, max_steps=37, save_checkpoint_path=ckpt), train_src, test_src, log=part_log)
    cfg_resume_path[0] = ckpt
    run(small_model(seed=99), TrainConfig(**common), train_src, test_src, state="resume", log=part_log)

    full = [(r["step"], r["loss"], r["lr"]) for r in log_records(full_log, "train")]
    resumed = [(r["step"], r["loss"], r["lr"]) for r in log_records(part_log, "train")]
    assert len(full) == 72
    assert resumed == full  # exact: same losses bit for bit, same learning rates
    full_auc = [(r["step"], r["auc"]) for r in log_records(full_log, "eval")]
    resumed_auc = [(r["step"], r["auc"]) for r in log_records(part_log, "eval") if r["step"] != 37]  # 37: its final test
    assert resumed_auc == full_auc


def test_max_steps_auc_threshold_and_summary(tmp_path):
    train_src, test_src = sources(train_rows=64 * 1024)
    log = str(tmp_path / "log.json")
    cfg = TrainConfig(schedule=LRSchedule(lr=0.5), epochs=5, eval_every_steps=8, log_every_steps=4, auc_threshold=0.55,
                      benchmark_warmup_steps=2)
    summary = run(small_model(), cfg, train_src, test_src, log=log)
    assert summary["stop_reason"] == "auc_threshold"
    assert summary["best_auc"] >= 0.55
    assert summary["steps"] % 8 == 0 and summary["steps"] < 5 * 64
    (final,) = log_records(log, "summary")
    for key in ("best_auc", "average_train_throughput", "average_test_throughput"):
        assert final[key] > 0 and math.isfinite(final[key])

    cfg = TrainConfig(schedule=LRSchedule(lr=0.5), epochs=5, max_steps=10, log_every_steps=3, test_after=100)
    summary = run(small_model(), cfg, train_src, test_src)
    assert summary["steps"] == 10 and math.isnan(summary["best_auc"])  # test_after never reached


def test_should_stop_ends_between_steps_and_checkpoints(tmp_path):
    train_src, test_src = sources()
    calls = {"n": 0}

    def stop_after_five():
        calls["n"] += 1
        return calls["n"] >= 5

    model = small_model()
    opt = make_optimizer(model, 0.1)
    cfg = TrainConfig(schedule=LRSchedule(lr=0.1), save_checkpoint_path=str(tmp_path / "c"), log_every_steps=100)
    summary = train(model, opt, Precision("cpu").grad_scaler(), Precision("cpu"), train_src, None, cfg, CPU,
                    RunLogger(None, stream=io.StringIO()), should_stop=stop_after_five)
    assert summary["stop_reason"] == "interrupted" and summary["steps"] == 5
    assert load_checkpoint(str(tmp_path / "c"), small_model()).step == 5
