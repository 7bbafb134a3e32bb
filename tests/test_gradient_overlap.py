"""Dense gradient all-reduce overlapping the backward (``OverlappedCollectives``) on real gloo
process groups: the same sums as the all-reduce after the backward, whatever the buckets, unused
parameters or stray backwards."""

import os

import pytest
import torch
import torch.distributed as dist

from dlrm.data.rank_source import RankSource
from dlrm.data.synthetic import SyntheticDataset
from dlrm.distributed.exchange import EmbeddingExchange
from dlrm.engine.collectives import (OverlappedCollectives, ProcessGroupCollectives,
                                          process_group_collectives)
from dlrm.engine.gradient_buckets import bucket_layout
from dlrm.model.dlrm import DLRM
from dlrm.model.precision import Precision
from dlrm.training.optimizers import make_optimizer
from dlrm.training.train import make_train_step
from test_distributed import BATCH, CPU, LR, STEPS, config, free_port, single_device_run
from conftest import spawn

SMALL, LARGE = 1024, 25 * 2**20  # several buckets; one bucket
TABLES = [3, 1000, 17, 250, 5, 40]


def _init(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)


def _finish():
    dist.barrier()  # tear down together, as tests/test_distributed.py does
    dist.destroy_process_group()
    os._exit(0)


def _train(rank, world, plan, embedding_type, collectives, exchange_group):
    torch.manual_seed(0)
    model = DLRM(config(TABLES, embedding_type), tables=plan[rank]).double()
    model.exchange = EmbeddingExchange(plan, rank, exchange_group)
    opt = make_optimizer(model, LR)
    precision = Precision("cpu")
    data = RankSource(lambda *args: SyntheticDataset(5, TABLES, STEPS * BATCH, BATCH, seed=11, split="train"),
                      plan[rank], rank, world)
    step = make_train_step(model, opt, precision.grad_scaler(), precision, collectives)
    losses, started_in_backward = [], []
    if isinstance(collectives, OverlappedCollectives):
        # how many buckets started during the backward, i.e. before sync_gradients
        original = collectives.sync_gradients

        def counting(m):
            started_in_backward.append(len(collectives.attach(m)._in_flight))
            original(m)

        collectives.sync_gradients = counting
    for i in range(STEPS):
        losses.append(float(collectives.sum(step(data.read_batch(i)))))
    return {"tables": {t: model.embeddings.table_weight(i).clone() for i, t in enumerate(plan[rank])},
            "dense": {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")},
            "losses": losses, "started_in_backward": started_in_backward,
            "buckets": len(collectives.attach(model).layout) if isinstance(collectives, OverlappedCollectives) else 1}


def _training_worker(rank, world, port, plan, embedding_type, out_dir):
    _init(rank, world, port)
    results = {"after_backward": _train(rank, world, plan, embedding_type, ProcessGroupCollectives(CPU), None)}
    for name, bucket_bytes in [("small", SMALL), ("large", LARGE)]:
        collectives = process_group_collectives(CPU, gradient_sync="overlap", bucket_bytes=bucket_bytes)
        results[name] = _train(rank, world, plan, embedding_type, collectives, collectives.group)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    _finish()


@pytest.mark.parametrize("embedding_type,plan", [
    ("joint", [[1, 4], [0, 2, 3, 5]]),
    ("joint", [[1], [3, 0], [2, 4, 5]]),
    ("joint_fused", [[1, 4], [0, 2, 3, 5]]),
    ("joint_fused", [[1], [3, 0], [2, 4, 5]]),
], ids=["joint-world2", "joint-world3", "fused-world2", "fused-world3"])
def test_overlapped_steps_equal_after_backward_and_single_device(tmp_path, embedding_type, plan):
    """float64: with 1 KB buckets (several) and 25 MB ones (one), the losses, dense weights and
    tables equal the after-backward all-reduce's bit for bit (on 3 processes with several buckets
    to the last bits: gloo's order of addition follows the buffer layout) and one process's."""
    world = len(plan)
    spawn(_training_worker, args=(world, free_port(), plan, embedding_type, str(tmp_path)), nprocs=world)
    reference, ref_losses, _ = single_device_run(TABLES)  # joint_fused on one process: tests/test_distributed.py
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    for result in results:
        base = result["after_backward"]
        assert result["small"]["buckets"] > 3 and result["large"]["buckets"] == 1
        # the first step syncs after the backward (hooks go on then); later ones start buckets early
        assert result["small"]["started_in_backward"][0] == 0
        assert all(n > 0 for n in result["small"]["started_in_backward"][1:])
        for name in ("small", "large"):
            run = result[name]
            if world == 2 or name == "large":  # see the gradient_buckets docstring on bit-identity
                assert run["losses"] == base["losses"], name
                for key, value in run["dense"].items():
                    assert torch.equal(value, base["dense"][key]), f"{name}: {key}"
                for t, weight in run["tables"].items():
                    assert torch.equal(weight, base["tables"][t]), f"{name}: table {t}"
            else:  # gloo adds 3 processes' values in an order that depends on the buffer layout
                torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(base["losses"]),
                                           rtol=1e-13, atol=0)
                for key, value in run["dense"].items():
                    torch.testing.assert_close(value, base["dense"][key], rtol=1e-12, atol=1e-15, msg=key)
                for t, weight in run["tables"].items():
                    torch.testing.assert_close(weight, base["tables"][t], rtol=1e-12, atol=1e-15)
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=1e-10, atol=0)
            if embedding_type == "joint":
                for key, value in run["dense"].items():
                    torch.testing.assert_close(value, reference.state_dict()[key], rtol=1e-10, atol=1e-13, msg=key)
                for t, weight in run["tables"].items():
                    torch.testing.assert_close(weight, reference.embeddings.table_weight(t), rtol=1e-10, atol=1e-13)


def test_bucket_layout_partitions_parameters_in_reverse_order():
    model = DLRM(config(TABLES)).double()
    params = model.replicated_parameters()
    for bucket_bytes in [1, 100, 1024, 4096, 2**20]:
        layout = bucket_layout(params, bucket_bytes)
        assert sorted(i for bucket in layout for i in bucket) == list(range(len(params))), "a partition"
        starts = [bucket[0] for bucket in layout]
        assert starts == sorted(starts, reverse=True), "filled from the last parameter to the first"
        for bucket in layout:
            assert bucket == list(range(bucket[0], bucket[-1] + 1)), "consecutive, in parameter order"
        for bucket in layout:
            nbytes = sum(params[i].numel() * params[i].element_size() for i in bucket)
            assert nbytes <= bucket_bytes or len(bucket) == 1
        assert layout == bucket_layout(params, bucket_bytes)  # deterministic
    assert len(bucket_layout(params, 2**20)) == 1
    assert len(bucket_layout(params, 1)) == len(params)
    mixed = [torch.zeros(4, dtype=torch.float32), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)]
    assert bucket_layout(mixed, 2**20) == [[2], [1], [0]]
    assert bucket_layout([torch.zeros(4)] * 3, 2**20) == [[0, 1, 2]]  # one dtype per bucket
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucket_layout(params, 0)


class _Partly(torch.nn.Module):
    """``unused`` never gets a gradient; ``rank_one`` only on process 1."""

    def __init__(self, dtype):
        super().__init__()
        self.first = torch.nn.Linear(6, 40, dtype=dtype)
        self.unused = torch.nn.Linear(6, 3, dtype=dtype)
        self.rank_one = torch.nn.Linear(40, 40, dtype=dtype)
        self.last = torch.nn.Linear(40, 1, dtype=dtype)

    def replicated_parameters(self):
        return list(self.parameters())

    def loss(self, x, rank):
        h = torch.relu(self.first(x))
        if rank == 1:
            h = h + self.rank_one(h)
        return self.last(h).square().sum()


def _reference_sum(model, group):
    """The after-backward sum, written out: every local gradient (zeros where none), all-reduced flat."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.replicated_parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    return [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in model.replicated_parameters()]),
                                          model.replicated_parameters())]


def _unused_worker(rank, world, port, out_dir):
    _init(rank, world, port)
    results = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        model = _Partly(dtype)
        collectives = OverlappedCollectives(CPU, bucket_bytes=512)
        collectives.attach(model)  # overlap from the first step
        generator = torch.Generator().manual_seed(rank)
        outcome = []
        for step in range(3):
            x = torch.randn(8, 6, generator=generator).to(dtype)
            model.zero_grad(set_to_none=True)
            if step == 1:
                # a stray backward whose sums nobody collects, then (without zeroing) the step's
                # own: the hooks drop the first's sums; the step sums the accumulated gradients
                model.loss(x, rank).backward()
                with collectives.no_sync(model):  # a backward on this process only: no collective
                    if rank == 0:
                        model.loss(x * 2, rank).backward()
            model.loss(x, rank).backward()
            expected = _reference_sum(model, collectives.group)  # not the buckets' group: sums are in flight there
            collectives.sync_gradients(model)
            outcome.append([(p.grad.clone(), e) for p, e in zip(model.replicated_parameters(), expected)])
        results[str(dtype)] = outcome
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    _finish()


def test_unused_and_rank_dependent_parameters_stray_backwards_and_dtypes(tmp_path):
    """2 processes, 512-byte buckets: a parameter no process uses and one only process 1 uses
    finish without deadlock with the reference sums (zeros where no process had a gradient), in
    float64, float32, bfloat16 and float16; a backward not followed by ``sync_gradients`` is not
    counted twice and one inside ``no_sync`` issues no collective."""
    spawn(_unused_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for dtype, steps in results[0].items():
        for step, pairs in enumerate(steps):
            for i, (grad, expected) in enumerate(pairs):
                assert torch.equal(grad, expected), f"{dtype} step {step} parameter {i}"
                assert torch.equal(grad, results[1][dtype][step][i][0]), "both processes hold the same sum"
        unused_weight = steps[0][2][0]
        assert not unused_weight.any(), "the unused Linear gets a zero gradient"
        assert steps[0][4][0].any(), "rank_one's gradient from process 1 reaches process 0"


def test_gradient_sync_names():
    with pytest.raises(ValueError, match="`gradient_sync`"):
        process_group_collectives(CPU, gradient_sync="sometimes")
