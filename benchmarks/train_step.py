"""Whole training steps per second, with and without the Triton kernels and CUDA graphs.

    python benchmarks/train_step.py --device cuda                           # FL15 tables, batch 65536
    python benchmarks/train_step.py --device cuda --precisions fp16 --variants kernels,graphs
    python benchmarks/train_step.py --device cpu                            # small tables, a smoke run
    python benchmarks/train_step.py --device cuda --host_tables 0,19        # two tables in host memory

(after ``pip install -e .``). Each variant trains the same model from the same weights on the
same pre-generated batches (synthetic, in device memory, so the reader is out of the picture):

- ``torch``:   ``joint`` embeddings (sparse gradients, torch's SGD) and the torch dot interaction,
- ``kernels``: ``joint_fused`` embeddings and the fused ``cuda_dot`` interaction,
- ``graphs``:  ``kernels`` with the whole step captured as a CUDA graph (CUDA only).

It prints samples/s per variant and precision, and the speedup over ``torch`` in the same run.
FL15 tables take about 16.7 GB in fp32 (plus the same again for ``torch``'s gradient buffers
at worst), so run it on a GPU with 40 GB or more, or pass ``--tables small``.
"""

from __future__ import annotations

import argparse
import time

import torch

from dlrm.data.synthetic import FL15_CARDINALITIES, SyntheticDataset
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.training.train import make_train_step
from dlrm.training.optimizers import make_optimizer

PRECISIONS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
VARIANTS = {  # name -> (embedding_type, interaction_op, cuda_graphs)
    "torch": ("joint", "dot", False),
    "kernels": ("joint_fused", "cuda_dot", False),
    "graphs": ("joint_fused", "cuda_dot", True),
}


def tables(name: str) -> list[int]:
    if name == "fl15":
        return list(FL15_CARDINALITIES)
    if name == "small":
        return [100_000] * 26
    return [int(n) for n in name.split(",")]


def time_variant(config: DLRMConfig, device: torch.device, precision: Precision, batches: list,
                 steps: int, warmup: int, cuda_graphs: bool, lr: float, profile_rows: int = 0,
                 host_tables: tuple[int, ...] = ()) -> float:
    """Samples per second over ``steps`` steps after ``warmup`` untimed ones; with
    ``profile_rows``, then prints the costliest ops of 5 more steps (torch.profiler)."""
    torch.manual_seed(0)
    model = DLRM(config, device=device, host_tables=host_tables)
    optimizer = make_optimizer(model, lr)
    step = make_train_step(model, optimizer, precision.grad_scaler(), precision, cuda_graphs=cuda_graphs)
    for i in range(warmup):
        step(batches[i % len(batches)])
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    sync(device)
    seconds = time.perf_counter() - start
    samples = steps * batches[0].categorical.shape[0]
    if profile_rows:
        print_profile(step, batches, device, profile_rows, by_host_time=bool(host_tables))
    del model, optimizer, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return samples / seconds


def print_profile(step, batches: list, device: torch.device, rows: int, by_host_time: bool = False) -> None:
    """Device time (or host time, ``by_host_time``) per op over 5 steps, costliest first: where
    a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(5):
            step(batches[i % len(batches)])
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" and not by_host_time else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch_size", type=int, default=None, help="default: 65536 on CUDA, 1024 on CPU")
    parser.add_argument("--tables", default=None, help="fl15 | small | comma-separated sizes (default: fl15 on CUDA)")
    parser.add_argument("--precisions", default="fp32,fp16,bf16")
    parser.add_argument("--variants", default=None, help="torch,kernels,graphs (graphs on CUDA only)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: 50 on CUDA, 3 on CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 10 on CUDA, 1 on CPU)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--host_tables", default="", metavar="LIST",
                        help="comma-separated tables kept in host memory and looked up there (not with graphs)")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after each variant, print its ROWS costliest ops over 5 profiled steps "
                             "(by device time; by host time with --host_tables)")
    args = parser.parse_args()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    batch_size = args.batch_size or (65536 if cuda else 1024)
    table_sizes = tables(args.tables or ("fl15" if cuda else "small"))
    steps = args.steps or (50 if cuda else 3)
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    variants = (args.variants or ("torch,kernels,graphs" if cuda else "torch,kernels")).split(",")
    host_tables = tuple(int(t) for t in args.host_tables.split(",") if t)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    config = DLRMConfig(num_numerical_features=13, table_sizes=table_sizes)
    data = SyntheticDataset(13, table_sizes, batch_size * 4, batch_size, device=device, seed=1)
    batches = [data.read_batch(i) for i in range(len(data))]
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"device {name}; batch {batch_size}; {len(table_sizes)} tables, {sum(table_sizes):,} rows, dim "
          f"{config.embedding_dim}; {steps} timed steps after {warmup}"
          + (f"; tables {args.host_tables} in host memory" if host_tables else ""))
    print(f"{'precision':<10}{'variant':<10}{'samples/s':>14}{'vs torch':>10}")
    for precision_name in args.precisions.split(","):
        precision = Precision(device.type, PRECISIONS[precision_name])
        baseline = None
        for variant in variants:
            embedding_type, interaction_op, graphs = VARIANTS[variant]
            if graphs and (not cuda or host_tables):
                continue
            cfg = DLRMConfig(**{**config.__dict__, "embedding_type": embedding_type, "interaction_op": interaction_op})
            rate = time_variant(cfg, device, precision, batches, steps, warmup, graphs, args.lr, args.profile,
                                host_tables)
            baseline = rate if variant == "torch" else baseline
            speedup = f"{rate / baseline:.2f}x" if baseline else "-"
            print(f"{precision_name:<10}{variant:<10}{rate:>14,.0f}{speedup:>10}", flush=True)


if __name__ == "__main__":
    main()
