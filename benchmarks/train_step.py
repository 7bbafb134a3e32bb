"""Whole training steps per second, with and without the Triton kernels and CUDA graphs.

    python benchmarks/train_step.py --device cuda                           # FL15 tables, batch 65536
    python benchmarks/train_step.py --device cuda --precisions fp16 --variants kernels,graphs
    python benchmarks/train_step.py --device cpu                            # small tables, a smoke run
    python benchmarks/train_step.py --device cuda --host_tables 0,19        # two tables in host memory
    python benchmarks/train_step.py --device cuda --multi_hot --precisions fp32   # MLPerf DLRMv2's shape
    python benchmarks/train_step.py --device cuda --multi_hot --ragged 0.3 --variants kernels,graphs

(after ``pip install -e .``). Each variant trains the same model from the same weights on the
same pre-generated batches (synthetic, in device memory, so the reader is out of the picture):

- ``torch``:   ``joint`` embeddings (sparse gradients, torch's SGD) and the torch dot interaction,
- ``kernels``: ``joint_fused`` embeddings and the fused ``cuda_dot`` interaction,
- ``graphs``:  ``kernels`` with the whole step captured as a CUDA graph (CUDA only),
- ``plain_mlp``: ``graphs`` with the MLP layers run as ``F.linear`` + ``relu`` (not in the
  default list: ``--variants plain_mlp,graphs`` shows what the fused MLP layers give).

The MLP layers run fused (``dlrm.kernels.linear_relu``) in ``kernels`` and ``graphs``, plain in
``torch`` and ``plain_mlp``.

It prints samples/s per variant and precision, and the speedup over ``torch`` in the same run.
FL15 tables take about 16.7 GB in fp32 (plus the same again for ``torch``'s gradient buffers
at worst), so run it on a GPU with 40 GB or more, or pass ``--tables small``.

``--multi_hot``: MLPerf DLRMv2's shape instead, multi-hot bags of its 26 sizes (214 ids a sample),
DCNv2, row-wise Adagrad, its tables capped at ``--max_table_size`` rows. Its bags are full, so
every batch holds as many ids and ``graphs`` captures one step; ``--ragged P`` drops a share
``P`` of the ids at random, so batches differ and ``graphs`` pads them into buckets (one graph
each, ``dlrm.training.cuda_graphs``), whose padding the header line gives.
"""

from __future__ import annotations

import argparse
import time

import torch

from dlrm.data.batch import Bags, Batch
from dlrm.data.synthetic import (FL15_CARDINALITIES, MLPERF_DLRMV2_CARDINALITIES, MLPERF_MULTI_HOT_SIZES,
                                 SyntheticDataset)
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.training.cuda_graphs import padded_length
from dlrm.training.train import make_train_step
from dlrm.training.optimizers import OptimizerConfig, make_optimizer

PRECISIONS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
VARIANTS = {  # name -> (embedding_type, interaction_op, cuda_graphs, fused MLP layers)
    "torch": ("joint", "dot", False, False),
    "plain_mlp": ("joint_fused", "cuda_dot", True, False),
    "kernels": ("joint_fused", "cuda_dot", False, True),
    "graphs": ("joint_fused", "cuda_dot", True, True),
}


def tables(name: str) -> list[int]:
    if name == "fl15":
        return list(FL15_CARDINALITIES)
    if name == "small":
        return [100_000] * 26
    return [int(n) for n in name.split(",")]


def time_variant(config: DLRMConfig, device: torch.device, precision: Precision, batches: list,
                 steps: int, warmup: int, cuda_graphs: bool, lr: float, profile_rows: int = 0,
                 host_tables: tuple[int, ...] = (), optimizer_config: OptimizerConfig = OptimizerConfig(),
                 fused_mlp: bool = True) -> float:
    """Samples per second over ``steps`` steps after ``warmup`` untimed ones; with
    ``profile_rows``, then prints the costliest ops of 5 more steps (torch.profiler)."""
    torch.manual_seed(0)
    model = DLRM(config, device=device, host_tables=host_tables)
    for mlp in (model.bottom_mlp, model.top_mlp):
        mlp.use_kernel = None if fused_mlp else False
    optimizer = make_optimizer(model, lr, optimizer_config)
    step = make_train_step(model, optimizer, precision.grad_scaler(), precision, cuda_graphs=cuda_graphs)
    for i in range(warmup):
        step(batches[i % len(batches)])
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    sync(device)
    seconds = time.perf_counter() - start
    samples = steps * len(batches[0])
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


def ragged(batch: Batch, share: float, seed: int) -> Batch:
    """``batch`` with a share ``share`` of its multi-hot ids dropped at random (bags shrink, some
    to empty): a different number of ids in every batch, as variable-length data has."""
    bags = batch.categorical
    gen = torch.Generator(device=bags.values.device).manual_seed(seed)
    keep = torch.rand(bags.values.shape[0], generator=gen, device=bags.values.device) >= share
    kept = torch.cat([keep.new_zeros(1, dtype=torch.int64), keep.cumsum(0)])  # ids kept before each position
    return Batch(batch.numerical, Bags(bags.values[keep], kept[bags.offsets], bags.num_features), batch.label)


def padding_line(batches: list[Batch]) -> str:
    """How ``graphs`` pads these batches' ids: the buckets and the share of padded ids."""
    nnz = [b.categorical.values.shape[0] for b in batches]
    lengths = [padded_length(n) for n in nnz]
    return (f"; {sum(nnz) / len(nnz):,.0f} ids a batch, graphs pad them to {len(set(lengths))} bucket(s) "
            f"(+{100 * (sum(lengths) / sum(nnz) - 1):.1f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch_size", type=int, default=None, help="default: 65536 on CUDA, 1024 on CPU")
    parser.add_argument("--tables", default=None, help="fl15 | small | comma-separated sizes (default: fl15 on CUDA)")
    parser.add_argument("--precisions", default="fp32,fp16,bf16")
    parser.add_argument("--variants", default=None, help="torch,plain_mlp,kernels,graphs (graphs and plain_mlp on CUDA only)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: 50 on CUDA, 3 on CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 10 on CUDA, 1 on CPU)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--host_tables", default="", metavar="LIST",
                        help="comma-separated tables kept in host memory and looked up there (not with graphs)")
    parser.add_argument("--multi_hot", action="store_true",
                        help="MLPerf DLRMv2's shape: multi-hot bags, DCNv2, row-wise Adagrad (see above)")
    parser.add_argument("--max_table_size", type=int, default=4_000_000,
                        help="--multi_hot: rows a table at most (0: MLPerf's 40M-capped sizes as they are)")
    parser.add_argument("--ragged", type=float, default=0.0, metavar="P",
                        help="--multi_hot: drop this share of the ids at random, so batches differ in length")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after each variant, print its ROWS costliest ops over 5 profiled steps "
                             "(by device time; by host time with --host_tables)")
    args = parser.parse_args()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    batch_size = args.batch_size or (65536 if cuda else 1024)
    if args.multi_hot and not args.tables:
        cap = args.max_table_size if cuda else 1000
        table_sizes = [min(n, cap) if cap else n for n in MLPERF_DLRMV2_CARDINALITIES]
    else:
        table_sizes = tables(args.tables or ("fl15" if cuda else "small"))
    steps = args.steps or (50 if cuda else 3)
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    variants = (args.variants or ("torch,kernels,graphs" if cuda else "torch,kernels")).split(",")
    host_tables = tuple(int(t) for t in args.host_tables.split(",") if t)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    config = DLRMConfig(num_numerical_features=13, table_sizes=table_sizes)
    optimizer_config = OptimizerConfig()
    bag_sizes = None
    if args.multi_hot:
        if len(table_sizes) != len(MLPERF_MULTI_HOT_SIZES):
            parser.error(f"--multi_hot needs {len(MLPERF_MULTI_HOT_SIZES)} tables, got {len(table_sizes)}")
        bag_sizes = MLPERF_MULTI_HOT_SIZES
        config = DLRMConfig(num_numerical_features=13, table_sizes=table_sizes, interaction_op="dcn")
        optimizer_config = OptimizerConfig("rowwise_adagrad", "adagrad")
    data = SyntheticDataset(13, table_sizes, batch_size * 4, batch_size, device=device, seed=1, bag_sizes=bag_sizes)
    batches = [data.read_batch(i) for i in range(len(data))]
    if args.multi_hot and args.ragged:
        batches = [ragged(batch, args.ragged, seed=i) for i, batch in enumerate(batches)]
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"device {name}; batch {batch_size}; {len(table_sizes)} tables, {sum(table_sizes):,} rows, dim "
          f"{config.embedding_dim}; {steps} timed steps after {warmup}"
          + (f"; tables {args.host_tables} in host memory" if host_tables else "")
          + (f"; multi-hot (MLPerf DLRMv2), DCNv2, row-wise Adagrad{padding_line(batches)}" if args.multi_hot else ""))
    print(f"{'precision':<10}{'variant':<10}{'samples/s':>14}{'vs torch':>10}")
    for precision_name in args.precisions.split(","):
        precision = Precision(device.type, PRECISIONS[precision_name])
        baseline = None
        for variant in variants:
            embedding_type, interaction_op, graphs, fused_mlp = VARIANTS[variant]
            if graphs and (not cuda or host_tables):
                continue
            if args.multi_hot:
                interaction_op = "dcn"  # DCNv2 in every variant: only the embeddings and the graphs differ
            cfg = DLRMConfig(**{**config.__dict__, "embedding_type": embedding_type, "interaction_op": interaction_op})
            rate = time_variant(cfg, device, precision, batches, steps, warmup, graphs, args.lr, args.profile,
                                host_tables, optimizer_config, fused_mlp)
            baseline = rate if variant == "torch" else baseline
            speedup = f"{rate / baseline:.2f}x" if baseline else "-"
            print(f"{precision_name:<10}{variant:<10}{rate:>14,.0f}{speedup:>10}", flush=True)


if __name__ == "__main__":
    main()
