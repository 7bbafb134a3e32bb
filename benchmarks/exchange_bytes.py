"""Bytes on the wire per training step against the cost model of docs/distributed.md.

    python benchmarks/exchange_bytes.py --world 2 --batch 4096 --placement auto

(after ``pip install -e .``). It starts ``--world`` gloo processes on this machine, which talk over
the loopback interface, and reads the interface's transmit counter (``/proc/net/dev``, ``lo``)
around two phases of ``--steps`` steps each: forward and backward only (the embedding all-to-all,
once each way) and the dense gradients' all-reduce only. Everything on the loopback interface
counts, TCP/IP headers included, so run it on an otherwise idle machine. It prints, per phase, the
measured bytes per step for all processes together, the bytes the cost model predicts, and their
ratio:

- all-to-all, one pass: ``B x E x D x b x (W - 1) / W`` bytes, where ``E`` counts one entry per
  whole table and one per non-empty row-wise block (a row-wise block sends partial sums for the
  whole batch, like a whole table) and ``b`` is 4, or 2 with ``--amp`` (bf16 autocast: the
  exchange carries the compute dtype); forward and backward each do one pass.
- all-reduce of the ``P`` replicated parameters (fp32): ``2 x (W - 1) x P x 4`` bytes for all
  processes together (a ring: each process sends ``2 x (W - 1) / W`` of the buffer).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dlrm.data.rank_source import RankSource
from dlrm.data.synthetic import SyntheticDataset
from dlrm.distributed.parallelize import parallelize
from dlrm.distributed.planner import load_placement, plan_tables
from dlrm.engine.collectives import ProcessGroupCollectives
from dlrm.model.dlrm import DLRMConfig
from dlrm.model.precision import Precision
from dlrm.nn.table_spec import TableShard
from dlrm.training.train import global_batch_loss

CPU = torch.device("cpu")


def loopback_sent() -> int:
    """Bytes the loopback interface has transmitted since boot."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def _worker(rank: int, args: argparse.Namespace, port: int, results: "mp.Queue") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    tables = [args.rows] * args.tables
    placement = load_placement(args.placement)
    plan = plan_tables(tables, args.dim, args.world, int(args.capacity_gb * 2**30), override=placement.tables,
                       row_wise=placement.row_wise)
    entries = [plan.entries(r) for r in range(args.world)]
    config = DLRMConfig(13, tables, args.dim, [512, 256, args.dim], [1024, 1024, 512, 256, 1])
    collectives = ProcessGroupCollectives(CPU)
    torch.manual_seed(0)
    model, parallel = parallelize(config, entries, CPU, collectives)
    data = RankSource(lambda *a: SyntheticDataset(13, tables, args.batch * 2, args.batch, seed=1),
                      parallel.tables, rank, args.world)
    batch = data.read_batch(0)
    precision = Precision("cpu", torch.bfloat16 if args.amp else None)
    model.zero_grad(set_to_none=True)
    global_batch_loss(model, batch, precision).backward()  # warm-up: connections, buffers
    collectives.sync_gradients(model)

    counts = []
    for phase in ("exchange", "all_reduce"):
        dist.barrier()
        before = loopback_sent()
        for _ in range(args.steps):
            if phase == "exchange":
                model.zero_grad(set_to_none=True)
                global_batch_loss(model, batch, precision).backward()
            else:
                collectives.sync_gradients(model)
        dist.barrier()
        counts.append(loopback_sent() - before)
    if rank == 0:
        blocks = sum(1 for rank_entries in entries for e in rank_entries if isinstance(e, TableShard))
        results.put({"counts": counts, "entries": sum(map(len, entries)), "blocks": blocks,
                     "dense": sum(p.numel() for p in model.replicated_parameters())})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4096, help="global batch size")
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=10_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="steps per phase")
    parser.add_argument("--placement", default="auto", help="as --table_placement: auto, table_wise, row_wise, JSON")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast: the all-to-all carries 2-byte values")
    parser.add_argument("--capacity_gb", type=float, default=1024.0, help="memory per process for tables")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").Queue()
    mp.spawn(_worker, args=(args, port, results), nprocs=args.world, join=True)
    got = results.get()
    world, value_bytes = args.world, 2 if args.amp else 4
    exchange = 2 * args.batch * got["entries"] * args.dim * value_bytes * (world - 1) / world
    all_reduce = 2 * (world - 1) * got["dense"] * 4  # fp32 gradients, with or without autocast
    print(f"{world} processes, batch {args.batch}, {args.tables} tables of {args.rows:,} rows, dim {args.dim}, "
          f"{'bf16' if args.amp else 'fp32'}, placement {args.placement}: {got['entries']} entries ({got['blocks']} row-wise blocks), "
          f"{got['dense']:,} dense parameters")
    print(f"{'phase':<32} {'measured':>14} {'model':>14} {'ratio':>7}")
    for name, measured, model in (("all-to-all, forward + backward", got["counts"][0], exchange),
                                  ("dense gradient all-reduce", got["counts"][1], all_reduce)):
        per_step = measured / args.steps
        print(f"{name:<32} {per_step:>14,.0f} {model:>14,.0f} {per_step / model:>7.3f}")


if __name__ == "__main__":
    main()
