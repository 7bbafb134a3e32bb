"""The device cache of hot rows in front of host tables (dlrm/nn/cached_embedding.py): hit rate
against cache size, and training throughput cached against every table in device memory.

    python benchmarks/host_cache.py hit_rate                      # CPU: hit rate vs cache fraction
    python benchmarks/host_cache.py train --device cpu --tables 20000,5000 --batch_size 256 --steps 5
    python benchmarks/host_cache.py train --device cuda --table_gib 40 --hbm_gib 40 --cache_fraction 0.25

``hit_rate`` looks up power-law ids (``--zipf_exponent``) through caches of several sizes (a
fraction of all rows) and prints the share of ids found cached, after a warm-up. ``train`` trains
the same DLRM shape (FL15 table proportions scaled to ``--table_gib`` of fp32 rows, or
``--tables``) twice: the tables at half size all in device memory, then every table in host
memory behind a cache of ``--cache_fraction`` of the rows; it prints samples/s of both, their
ratio and the hit rate. ``--hbm_gib`` caps the device memory of the cached run (so tables
"twice the free device memory" fit a host with less RAM than twice a whole GPU).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from dlrm.data.synthetic import FL15_CARDINALITIES, ZIPF_EXPONENT, SyntheticDataset
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.nn.cached_embedding import CachedEmbedding
from dlrm.training.optimizers import OptimizerConfig, make_optimizer
from dlrm.training.train import make_train_step, synchronize


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({len(names)} threads)"
    except (OSError, IndexError):
        return platform.processor() or "cpu"


def hit_rates(tables: list[int], fractions: list[float], exponent: float, batch: int, steps: int,
              warmup: int, policy: str) -> list[tuple[float, int, float]]:
    """(fraction, cache rows, hit rate over ``steps`` after ``warmup``) per fraction; a cache is
    at least one step's lookups (the most distinct rows a step can need)."""
    data = SyntheticDataset(1, tables, batch * (steps + warmup), batch, seed=5, zipf_exponent=exponent)
    batches = [data.read_batch(i).categorical for i in range(len(data))]
    out = []
    for fraction in fractions:
        rows = max(int(fraction * sum(tables)), batch * len(tables))
        cache = CachedEmbedding(tables, 4, cache_rows=rows, policy=policy)
        with torch.no_grad():
            for i, ids in enumerate(batches):
                if i == warmup:
                    cache.lookups = cache.lookup_misses = 0
                cache(ids)
        out.append((fraction, cache.cache_rows, cache.hit_rate()))
    return out


def train_rate(config: DLRMConfig, device: torch.device, batches: list, steps: int,
               cache_rows: int) -> tuple[float, float]:
    """(samples/s over ``steps`` after 2 warm-up steps, hit rate); ``cache_rows`` 0: every table on ``device``."""
    torch.manual_seed(0)
    host = list(range(len(config.table_sizes))) if cache_rows else []
    model = DLRM(config, device=device, host_tables=host, host_cache_rows=cache_rows)
    optimizer = make_optimizer(model, 0.01, OptimizerConfig(embedding="rowwise_adagrad"))
    precision = Precision(device.type, torch.bfloat16 if device.type == "cuda" else None)
    step = make_train_step(model, optimizer, precision.grad_scaler(), precision)
    for batch in batches[:2]:
        step(batch)
    cache = model.host_embeddings
    if cache is not None:
        cache.lookups = cache.lookup_misses = 0
    synchronize(device)
    start = time.perf_counter()
    for i in range(steps):
        step(batches[2 + i % (len(batches) - 2)])
    synchronize(device)
    rate = steps * batches[0].label.shape[0] / (time.perf_counter() - start)
    return rate, (cache.hit_rate() if cache is not None else 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["hit_rate", "train"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tables", default="", help="row counts (default: FL15 proportions, see --table_gib)")
    parser.add_argument("--table_gib", type=float, default=1.0, help="fp32 GiB of all tables (dim 128)")
    parser.add_argument("--hbm_gib", type=float, default=0.0, help="cap this process's device memory (cuda)")
    parser.add_argument("--zipf_exponent", type=float, default=ZIPF_EXPONENT)
    parser.add_argument("--fractions", default="0.005,0.01,0.02,0.05,0.1,0.2")
    parser.add_argument("--cache_fraction", type=float, default=0.25)
    parser.add_argument("--policy", default="lru", choices=["lru", "lfu"])
    parser.add_argument("--batch_size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.tables:
        tables = [int(n) for n in args.tables.split(",")]
    else:
        scale = args.table_gib * 2**30 / (sum(FL15_CARDINALITIES) * 128 * 4)
        tables = [max(1, int(n * scale)) for n in FL15_CARDINALITIES]
    print(f"device: {device_name(device)}; {len(tables)} tables, {sum(tables):,} rows; ids ~ (id + 1) ** "
          f"-{args.zipf_exponent}; batch {args.batch_size}")
    if args.mode == "hit_rate":
        fractions = [float(f) for f in args.fractions.split(",")]
        for fraction, rows, rate in hit_rates(tables, fractions, args.zipf_exponent, args.batch_size, args.steps,
                                              5, args.policy):
            print(f"cache {fraction:6.1%} of rows asked, {rows:,} rows ({rows / sum(tables):.1%}): hit rate {rate:.4f}")
        return
    dim = 128 if not args.tables else 16
    mlp = dict(bottom_mlp_sizes=[512, 256, dim], top_mlp_sizes=[1024, 1024, 512, 256, 1])
    big = DLRMConfig(13, tables, dim, embedding_type="joint_fused", **mlp)
    half = DLRMConfig(13, [max(1, n // 2) for n in tables], dim, embedding_type="joint_fused", **mlp)
    results = {}
    for name, config, cache_rows in (("plain", half, 0), ("cached", big, int(args.cache_fraction * sum(tables)))):
        if cache_rows and device.type == "cuda" and args.hbm_gib:  # the cached run only
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.hbm_gib * 2**30 / total), device)
        data = SyntheticDataset(13, config.table_sizes, args.batch_size * 8, args.batch_size, device=device,
                                zipf_exponent=args.zipf_exponent)
        batches = [data.read_batch(i) for i in range(len(data))]
        rate, hit = train_rate(config, device, batches, args.steps, cache_rows)
        results[name] = rate
        label = "host tables behind the cache" if cache_rows else "all in device memory, half-size tables"
        print(f"{label}: {sum(config.table_sizes):,} rows, cache {cache_rows:,} rows: {rate:,.0f} samples/s, "
              f"hit rate {hit:.4f}")
        del batches, data
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"cached / all in device memory: {results['cached'] / results['plain']:.3f}")


if __name__ == "__main__":
    main()
