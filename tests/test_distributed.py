"""Hybrid parallelism on real gloo process groups against single-device references."""

import multiprocessing
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from dlrm.data.rank_source import RankSource
from dlrm.data.rank_source import local_batch_sizes
from dlrm.data.synthetic import SyntheticDataset
from dlrm.distributed.exchange import EmbeddingExchange
from dlrm.engine.collectives import ProcessGroupCollectives
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.training.optimizers import make_optimizer
from dlrm.training.train import evaluate, make_train_step, train_step
from conftest import spawn

CPU = torch.device("cpu")
STEPS, BATCH, LR = 6, 250, 0.5  # 250 does not divide by 3 or 4: uneven local batches


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(tables, embedding_type="joint"):
    return DLRMConfig(5, tables, 8, [16, 8], [32, 16, 1], embedding_type=embedding_type)


def single_device_run(tables):
    """The reference: one process, float64, the same seed, data and steps."""
    torch.manual_seed(0)
    model = DLRM(config(tables)).double()
    opt = make_optimizer(model, LR)
    data = SyntheticDataset(5, tables, STEPS * BATCH, BATCH, seed=11, split="train")
    precision = Precision("cpu")
    losses = [float(train_step(model, data.read_batch(i), opt, precision.grad_scaler(), precision)) for i in range(STEPS)]
    test = SyntheticDataset(5, tables, 600, 128, seed=11, split="test")
    return model, losses, evaluate(model, test, CPU, precision).auc


def worker(rank, world, port, tables, plan, out_dir, embedding_type="joint"):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DLRM(config(tables, embedding_type), tables=plan[rank]).double()
    model.exchange = EmbeddingExchange(plan, rank)
    collectives = ProcessGroupCollectives(CPU)
    opt = make_optimizer(model, LR)
    precision = Precision("cpu")

    def rank_source(split, rows, batch):
        return RankSource(lambda *args: SyntheticDataset(5, tables, rows, batch, seed=11, split=split),
                          plan[rank], rank, world)

    data = rank_source("train", STEPS * BATCH, BATCH)
    step = make_train_step(model, opt, precision.grad_scaler(), precision, collectives)
    losses = []
    for i in range(STEPS):
        loss = step(data.read_batch(i))
        losses.append(float(collectives.sum(loss)))
    auc = evaluate(model, rank_source("test", 600, 128), CPU, precision, collectives=collectives).auc
    torch.save({"tables": {t: model.embeddings.table_weight(i).clone() for i, t in enumerate(plan[rank])},
                "dense": {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")},
                "losses": losses, "auc": auc}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # tear down together: gloo can abort a process whose peers vanish mid-teardown
    dist.destroy_process_group()
    os._exit(0)  # as dlrm.scripts.main does: skip finalization, where gloo's threads can abort


@pytest.mark.parametrize(
    "tables,plan",
    [
        ([3, 1000, 17, 250, 5, 40], [[0, 1, 2, 3, 4, 5]]),
        ([3, 1000, 17, 250, 5, 40], [[1, 4], [0, 2, 3, 5]]),
        ([3, 1000, 17, 250, 5, 40], [[1], [3, 0], [2, 4, 5]]),
        ([3, 1000, 17, 250, 5, 40], [[1], [3], [5, 2], [0, 4]]),
        ([300, 20, 7], [[0], [], [2, 1], []]),  # more ranks than tables: two ranks hold none
    ],
    ids=["world1", "world2", "world3", "world4", "world4-empty-ranks"],
)
def test_distributed_steps_equal_single_device_steps(tmp_path, tables, plan):
    """float64, so the only differences are the order of additions: compared at rtol 1e-10."""
    check_against_single_device(tmp_path, tables, plan, "joint")


def test_distributed_fused_embeddings_equal_single_device_sparse_sgd(tmp_path):
    """``joint_fused`` tables updating themselves on 3 processes against ``joint`` tables with
    torch's sparse SGD on one."""
    check_against_single_device(tmp_path, [3, 1000, 17, 250, 5, 40], [[1], [3, 0], [2, 4, 5]], "joint_fused")


def check_against_single_device(tmp_path, tables, plan, embedding_type):
    world = len(plan)
    spawn(worker, args=(world, free_port(), tables, plan, str(tmp_path), embedding_type), nprocs=world)
    reference, ref_losses, ref_auc = single_device_run(tables)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-10, atol=0)
        assert result["auc"] == pytest.approx(ref_auc, abs=1e-12)  # every rank computes the global AUC
        for name, value in result["dense"].items():
            torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-10, atol=1e-13, msg=name)
    held = {t: w for r in results for t, w in r["tables"].items()}
    assert sorted(held) == list(range(len(tables)))
    for t, weight in held.items():
        torch.testing.assert_close(weight, reference.embeddings.table_weight(t), rtol=1e-10, atol=1e-13)


def test_local_batch_sizes():
    assert local_batch_sizes(250, 4) == [63, 63, 62, 62]
    assert local_batch_sizes(2, 4) == [1, 1, 0, 0]
    assert sum(local_batch_sizes(65536, 3)) == 65536


def _dying_worker(rank, port, timeout_s, results):
    from dlrm.engine.process_group import DistEnv, init_process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_process_group(DistEnv(rank, 2, rank, 2), CPU, timeout_s)
    if rank == 1:
        os._exit(3)  # dies without a word, as a killed process does
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        results.put(("no error", time.monotonic() - start))
    except Exception as e:  # noqa: BLE001 - any error is the point
        results.put((type(e).__name__, time.monotonic() - start))


def test_a_dead_peer_ends_the_survivor_within_the_timeout():
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_dying_worker, args=(r, port, 5.0, results)) for r in range(2)]
    for p in procs:
        p.start()
    outcome, waited = results.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    assert outcome != "no error"
    assert waited < 30, f"survivor waited {waited:.1f}s"


def _open_files(root):
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sorted(os.path.relpath(p, root) for p in paths if p.startswith(root))


@pytest.mark.parametrize("world", [1, 3, 4])
def test_rank_source_reads_own_columns_and_rows_only(tmp_path, world):
    from dlrm.data.feature_spec import FeatureSpec
    from dlrm.data.sources import DataConfig, make_rank_source, make_source

    tables = [3, 1000, 17, 250, 5, 40]
    root = str(tmp_path)
    spec = FeatureSpec.default(5, tables, splits=("train",), base_directory=root)
    from dlrm.data.split_binary_writer import SplitBinaryWriter

    data = SyntheticDataset(5, tables, 1000, 1000, seed=2)
    with SplitBinaryWriter(spec, "train") as w:
        w.write(data.read_batch(0))
    cfg = DataConfig(dataset=root)
    whole = make_source(cfg, spec, "train", 301, CPU)  # 301 rows per batch: uneven over 3 and 4
    full_batches = [whole.read_batch(i) for i in range(len(whole))]
    whole.close()
    plan = [[1, 4], [0, 2, 3], [5]] if world == 3 else [[5], [0], [], [1, 2, 3, 4]] if world == 4 else [list(range(6))]
    for rank in range(world):
        source = make_rank_source(cfg, spec, "train", 301, CPU, plan[rank], rank, world)
        files = _open_files(root)
        assert files == sorted([f"train/cat_{t}.bin" for t in plan[rank]] + ["train/label.bin", "train/numerical.bin"])
        for i, full in enumerate(full_batches):
            mine = source.read_batch(i)
            sizes = local_batch_sizes(len(full), world)
            rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
            assert mine.categorical.shape == (len(full), len(plan[rank]))
            assert (mine.categorical.long() == full.categorical[:, plan[rank]].long()).all()
            assert (mine.numerical == full.numerical[rows]).all() and (mine.label == full.label[rows]).all()
        source.close()


def _overflow_worker(rank, world, port, out_dir, embedding_type, agree):
    """Two fp16 steps on 2 processes. In the first, rank 1 makes the gradient of table 0 (held
    by rank 0) non-finite on its way back through the all-to-all: only rank 0's embedding
    gradients overflow; rank 1 sees finite gradients everywhere."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tables, plan = [50, 40, 30], [[0, 1], [2]]
    model = DLRM(config(tables, embedding_type), tables=plan[rank])
    model.exchange = EmbeddingExchange(plan, rank)
    collectives = ProcessGroupCollectives(CPU)
    precision = Precision("cpu", torch.float16)
    scaler = precision.grad_scaler(init_scale=2.0**8, process_group=collectives.process_group if agree else None)
    opt = make_optimizer(model, LR)
    step = make_train_step(model, opt, scaler, precision, collectives)
    poisoned = [True]

    def poison_table_0(module, inputs, embedded):
        if rank == 1 and poisoned[0]:
            embedded.register_hook(lambda g: torch.cat([g[:, :1] * float("inf"), g[:, 1:]], dim=1))

    model.exchange.register_forward_hook(poison_table_0)
    data = RankSource(lambda *args: SyntheticDataset(5, tables, 2 * BATCH, BATCH, seed=11, split="train"),
                      plan[rank], rank, world)
    weights = []
    for i in range(2):
        poisoned[0] = i == 0
        step(data.read_batch(i))
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
    torch.save({"initial_scale": 2.0**8, "scales": scaler.get_scale(), "weights": weights,
                "dense_names": [k for k in weights[0] if not k.startswith("embeddings.")]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.parametrize("embedding_type", ["joint", "joint_fused"])
def test_an_overflow_on_one_process_skips_the_step_on_every_process(tmp_path, embedding_type):
    """fp16 loss scaling: a step is skipped on every process or on none, so the replicated MLPs
    stay identical across processes, and the scale backs off everywhere."""
    torch.manual_seed(0)
    tables = [50, 40, 30]
    initial = {}
    for rank, held in enumerate([[0, 1], [2]]):
        torch.manual_seed(0)
        initial[rank] = {k: v.clone() for k, v in DLRM(config(tables, embedding_type), tables=held).state_dict().items()}
    spawn(_overflow_worker, args=(2, free_port(), str(tmp_path), embedding_type, True), nprocs=2)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for rank, result in enumerate(results):
        for name, value in result["weights"][0].items():  # the overflowing step changed nothing
            assert torch.equal(value, initial[rank][name]), f"rank {rank} updated {name} on an overflowing step"
        assert result["scales"] == 2.0**7, "the scale backs off once, on every process"
        changed = [n for n, v in result["weights"][1].items() if not torch.equal(v, initial[rank][n])]
        assert changed, f"rank {rank} skipped the clean second step too"
    for name in results[0]["dense_names"]:  # replicated weights agree after both steps
        assert torch.equal(results[0]["weights"][1][name], results[1]["weights"][1][name]), name
