"""How to sum the replicated MLP gradients across processes: one all-reduce after the backward
(what training does by default) against bucketed all-reduces that overlap the backward (torch
DDP's, and this repository's ``OverlappedCollectives``).

    python benchmarks/gradient_sync.py --world 2 --batch 4096 --steps 30 --rounds 3

(after ``pip install -e .``). It starts ``--world`` gloo processes on this machine, builds the
hybrid-parallel model with the Criteo MLPs (26 tables of ``--rows`` rows, dim 128) and times whole
training steps, interleaving the strategies round by round so that drift in the machine's speed
hits them all alike:

- ``after_backward``: ``ProcessGroupCollectives.sync_gradients``, one flat all-reduce of every
  dense gradient once the backward is done;
- ``ddp_<MB>``: the bottom and top MLPs wrapped in ``DistributedDataParallel`` with
  ``bucket_cap_mb=<MB>`` and a comm hook that sums (the loss is already divided by the global
  batch), so buckets are all-reduced while the backward still runs;
- ``overlap_<MB>``: ``OverlappedCollectives(bucket_bytes=<MB> MiB)``, the same idea without
  wrapping the model: hooks on the dense parameters all-reduce buckets as their gradients become
  ready, and ``sync_gradients`` only waits for them;
- ``no_sync``: no gradient communication at all: the floor, showing what the sync costs.

It prints the median step time of each strategy and its ratio to ``after_backward``. Rank 0 also
checks that every strategy produced the same dense gradients as ``after_backward`` on one step
(within float tolerance, or it stops) and says whether they are equal bit for bit.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from dlrm.data.rank_source import RankSource
from dlrm.data.synthetic import SyntheticDataset
from dlrm.distributed.parallelize import parallelize
from dlrm.distributed.planner import plan_tables
from dlrm.engine.collectives import OverlappedCollectives, ProcessGroupCollectives
from dlrm.model.dlrm import DLRMConfig
from dlrm.model.precision import Precision
from dlrm.training.optimizers import make_optimizer
from dlrm.training.train import train_step

CPU = torch.device("cpu")


class _NoSync(ProcessGroupCollectives):
    """DDP already summed the gradients during the backward (or, for ``no_sync``, nobody does)."""

    def sync_gradients(self, model: torch.nn.Module) -> None:
        pass


def _sum_hook(state, bucket):  # no annotations: DDP checks them, and this module's are strings
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def _ddp(module: torch.nn.Module, bucket_mb: float) -> DistributedDataParallel:
    wrapped = DistributedDataParallel(module, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
    wrapped.register_comm_hook(None, _sum_hook)
    return wrapped


def _strategy(name: str, config: DLRMConfig, plan: list[list[int]]):
    torch.manual_seed(0)
    if name.startswith("overlap_"):  # builds its own process group: every rank, in the same order
        collectives = OverlappedCollectives(CPU, bucket_bytes=int(float(name.removeprefix("overlap_")) * 2**20))
    else:
        collectives = ProcessGroupCollectives(CPU)
    model, _ = parallelize(config, plan, CPU, collectives)
    if name.startswith("ddp_"):
        bucket_mb = float(name.removeprefix("ddp_"))
        model.bottom_mlp, model.top_mlp = _ddp(model.bottom_mlp, bucket_mb), _ddp(model.top_mlp, bucket_mb)
    if name.startswith("overlap_"):
        collectives.attach(model)  # hooks from the first step on, so the gradient check covers them
    elif name != "after_backward":
        collectives = _NoSync(CPU)
    return model, make_optimizer(model, 0.01), collectives


def _dense_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.replicated_parameters()]


def _worker(rank: int, args: argparse.Namespace, port: int, results: "mp.Queue") -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    tables = [args.rows] * 26
    config = DLRMConfig(13, tables, 128)
    plan = plan_tables(tables, 128, args.world, 2**40).tables
    precision = Precision("cpu", torch.bfloat16 if args.amp else None)
    data = RankSource(lambda *a: SyntheticDataset(13, tables, args.batch * 8, args.batch, seed=1),
                      plan[rank], rank, args.world)
    batches = [data.read_batch(i) for i in range(8)]
    names = ["after_backward", *(f"ddp_{mb:g}" for mb in args.bucket_mb),
             *(f"overlap_{mb:g}" for mb in args.bucket_mb), "no_sync"]
    built = {name: _strategy(name, config, plan) for name in names}

    reference = None  # the same first step under every strategy: same dense gradients
    exact: dict[str, bool] = {}  # and whether bit for bit the same as after_backward's
    for name, (model, optimizer, collectives) in built.items():
        train_step(model, batches[0], optimizer, precision.grad_scaler(), precision, collectives)
        if name == "no_sync":
            continue
        grads = _dense_grads(model)
        if reference is None:
            reference = grads
        exact[name] = all(torch.equal(g, r) for g, r in zip(grads, reference))
        if not all(torch.allclose(g, r, rtol=1e-5, atol=1e-7) for g, r in zip(grads, reference)):
            raise AssertionError(f"{name} summed other gradients than after_backward")

    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name, (model, optimizer, collectives) in built.items():
            for i in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                train_step(model, batches[i % 8], optimizer, precision.grad_scaler(), precision, collectives)
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        results.put(({name: statistics.median(t) for name, t in times.items()}, exact))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4096, help="global batch size")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per strategy per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket_mb", type=float, nargs="+", default=[25.0, 1.0],
                        help="bucket sizes for the ddp_ and overlap_ strategies")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.spawn(_worker, args=(args, port, results), nprocs=args.world, join=True)
    medians, exact = results.get()
    dense = 13 * 512 + 512 + 512 * 256 + 256 + 256 * 128 + 128 + 480 * 1024 + 1024 + 1024 * 1024 + 1024 \
        + 1024 * 512 + 512 + 512 * 256 + 256 + 256 + 1
    print(f"world {args.world}, global batch {args.batch}, {'bf16' if args.amp else 'fp32'}, "
          f"{torch.get_num_threads()} threads here, dense gradients {dense * 4 / 2**20:.1f} MiB per step")
    base = medians["after_backward"]
    for name, seconds in medians.items():
        print(f"{name:>16}: {seconds * 1e3:8.1f} ms/step  {args.batch / seconds:10,.0f} samples/s  "
              f"{seconds / base:5.3f}x the step time of after_backward"
              + ("" if name not in exact else f"  gradients bit for bit: {'yes' if exact[name] else 'NO'}"))


if __name__ == "__main__":
    main()
