"""The device cache of hot rows in front of host tables (dlrm/nn/cached_embedding.py): hit rate
against cache size, and training throughput cached against every table in device memory.

    python benchmarks/host_cache.py hit_rate                      # CPU: hit rate vs cache fraction
    python benchmarks/host_cache.py train --device cpu --tables 20000,5000 --batch_size 256 --steps 5
    python benchmarks/host_cache.py train --device cuda --table_gib 40 --hbm_gib 40 --cache_fraction 0.25
    python benchmarks/host_cache.py features --device cpu --tables 20000,5000 --batch_size 256 --steps 20 \
        --cache_fraction 0.05
    python benchmarks/host_cache.py victims --device cpu --slots 1000000 --misses 1000,50000

``hit_rate`` looks up power-law ids (``--zipf_exponent``) through caches of several sizes (a
fraction of all rows) and prints the share of ids found cached, after a warm-up. ``train`` trains
the same DLRM shape (FL15 table proportions scaled to ``--table_gib`` of fp32 rows, or
``--tables``) twice: the tables at half size all in device memory, then every table in host
memory behind a cache of ``--cache_fraction`` of the rows; it prints samples/s of both, their
ratio and the hit rate. ``--hbm_gib`` caps the device memory of the cached run (so tables
"twice the free device memory" fit a host with less RAM than twice a whole GPU).

``features`` puts the cache's options side by side on one model (every table on the host):
``host_table_cache_rows=auto``'s sizing for a device of ``--device_gib`` (default: the dense
part and a batch's activations plus ``--cache_fraction`` of the rows), then with that
many rows the time per step and hit rate without and with prefetch of the next batch's rows,
and the rows written back to the host over the steps and a read-only evaluation pass with
dirty tracking and with every evicted row written back (``track_dirty=False``, the cache before
dirty tracking).

``victims`` times the choice of the slots a step's misses evict among ``--slots`` slots with
LRU scores (many ties), ``CachedEmbedding._victims`` against the stable sort of every
candidate's score it replaced, and checks that both choose the same slots.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from dlrm.data.hidden_model import ZIPF_EXPONENT
from dlrm.data.synthetic import FL15_CARDINALITIES, SyntheticDataset
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.distributed.planner import plan_tables, size_host_cache
from dlrm.distributed.sizing import device_reserve_bytes
from dlrm.nn.cached_embedding import SLOT_BOOKKEEPING_BYTES, SLOT_STATE_BYTES, CachedEmbedding, prefetching
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


def cache_run(config: DLRMConfig, device: torch.device, batches: list, evals: list, steps: int, cache_rows: int,
              prefetch: bool, track_dirty: bool) -> dict[str, float]:
    """Trains ``steps`` steps (after 2 warm-up steps) with every table behind a cache of
    ``cache_rows``, then twice looks up half of ``evals`` without gradients and flushes (a test,
    then a checkpoint): seconds a step, the hit rate, the rows fetched ahead, and the rows written back
    by the steps and by each test and checkpoint."""
    torch.manual_seed(0)
    model = DLRM(config, device=device, host_tables=list(range(len(config.table_sizes))), host_cache_rows=cache_rows)
    cache = model.host_embeddings
    cache.track_dirty = track_dirty  # before any row is cached: as if built so
    optimizer = make_optimizer(model, 0.01, OptimizerConfig(embedding="rowwise_adagrad"))
    precision = Precision(device.type, torch.bfloat16 if device.type == "cuda" else None)
    step = make_train_step(model, optimizer, precision.grad_scaler(), precision)
    timed = [batches[2 + i % (len(batches) - 2)] for i in range(steps)]
    for batch in (prefetching(batches[:2], model) if prefetch else batches[:2]):
        step(batch)
    cache.lookups = cache.lookup_misses = cache.writebacks = cache.prefetched = 0
    synchronize(device)
    start = time.perf_counter()
    for batch in (prefetching(timed, model) if prefetch else timed):
        step(batch)
    synchronize(device)
    seconds = (time.perf_counter() - start) / steps
    result = {"step_s": seconds, "hit_rate": cache.hit_rate(), "writebacks": cache.writebacks,
              "prefetched": cache.prefetched}
    cache.writebacks = 0
    model.eval()
    half = len(evals) // 2
    for phase, part in (("test_1", evals[:half]), ("test_2", evals[half:])):
        with torch.no_grad(), precision.autocast():
            for batch in part:
                model(batch.numerical, batch.categorical)
        cache.flush_()
        result[phase] = cache.writebacks
        cache.writebacks = 0
    return result


def features(config: DLRMConfig, device: torch.device, batch_size: int, steps: int, device_gib: float,
             cache_fraction: float, zipf_exponent: float) -> None:
    """``auto`` sizing, then prefetch and dirty tracking side by side (module docstring)."""
    tables = config.table_sizes
    reserve = device_reserve_bytes(config, batch_size, dense_state_bytes=4, compute_bytes=2 if device.type == "cuda"
                                   else 4)
    row_bytes = config.embedding_dim * 4 + SLOT_STATE_BYTES + SLOT_BOOKKEEPING_BYTES
    capacity = int(device_gib * 2**30) if device_gib else \
        reserve + 4 * sum(tables) + int(cache_fraction * sum(tables)) * row_bytes
    batch_rows = [min(rows, batch_size) for rows in tables]
    plan = plan_tables(tables, config.embedding_dim, 1, capacity, host_tables=list(range(len(tables))),
                       host_cache_rows="auto", host_cache_reserve=reserve, host_cache_batch_rows=batch_rows,
                       state_bytes_per_row=4)
    print(size_host_cache(plan, config.embedding_dim, 4, reserve, batch_rows).describe())
    rows = plan.host_cache_rows
    print(f"  = {rows / sum(tables):.1%} of the {sum(tables):,} rows")
    data = SyntheticDataset(13, tables, batch_size * (steps + 2), batch_size, device=device,
                            zipf_exponent=zipf_exponent)
    batches = [data.read_batch(i) for i in range(len(data))]
    test = SyntheticDataset(13, tables, batch_size * 8, batch_size, device=device, zipf_exponent=zipf_exponent,
                            split="test")
    evals = [test.read_batch(i) for i in range(len(test))]
    runs = {name: cache_run(config, device, batches, evals, steps, rows, prefetch, track)
            for name, prefetch, track in (("no prefetch, dirty tracking", False, True),
                                          ("prefetch, dirty tracking", True, True),
                                          ("no prefetch, no dirty tracking", False, False))}
    width = max(len(name) for name in runs)
    print(f"{'':{width}}  {'ms/step':>8}  {'hit rate':>8}  {'fetched ahead':>13}  {'write-backs: steps':>18}  "
          f"{'test+flush':>10}  {'again':>6}")
    for name, r in runs.items():
        print(f"{name:{width}}  {1000 * r['step_s']:>8.2f}  {r['hit_rate']:>8.4f}  {r['prefetched']:>13,}  "
              f"{r['writebacks']:>18,}  {r['test_1']:>10,}  {r['test_2']:>6,}")
    base, ahead, untracked = runs.values()
    total = {name: r["writebacks"] + r["test_1"] + r["test_2"] for name, r in runs.items()}
    print(f"prefetch / no prefetch step time: {ahead['step_s'] / base['step_s']:.3f}; rows written back with dirty "
          f"tracking: {total[next(iter(runs))]:,}, without: {total[list(runs)[2]]:,}")


def victim_times(device: torch.device, slots: int, misses: list[int], repeats: int = 20) -> None:
    """Prints ms per choice of ``k`` victims among ``slots`` free slots: the cache's selection and
    the full stable sort of every candidate's score (the plain path), on the same scores."""
    cache = CachedEmbedding([slots], 1, cache_rows=slots, cache_device=device)
    gen = torch.Generator().manual_seed(0)
    cache.slot_score.copy_(torch.randint(-1, 200, (slots,), generator=gen))  # last step used: ties galore
    cache._score_limit = 200
    candidates = torch.arange(slots, device=device)

    def timed(fn) -> tuple[float, torch.Tensor]:
        fn()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn()
        synchronize(device)
        return (time.perf_counter() - start) / repeats * 1e3, out

    for k in misses:
        old_ms, expected = timed(lambda: candidates[torch.sort(cache.slot_score[candidates], stable=True).indices[:k]])
        new_ms, chosen = timed(lambda: cache._victims(candidates, k))
        assert torch.equal(chosen, expected)
        print(f"{slots:,} slots, {k:,} victims: selection {new_ms:.2f} ms, full stable sort {old_ms:.2f} ms "
              f"({old_ms / new_ms:.2f}x), same slots")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["hit_rate", "train", "features", "victims"])
    parser.add_argument("--slots", type=int, default=1_000_000, help="victims: cache slots")
    parser.add_argument("--misses", default="1000,50000", help="victims: rows a step fetches")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tables", default="", help="row counts (default: FL15 proportions, see --table_gib)")
    parser.add_argument("--table_gib", type=float, default=1.0, help="fp32 GiB of all tables (dim 128)")
    parser.add_argument("--hbm_gib", type=float, default=0.0, help="cap this process's device memory (cuda)")
    parser.add_argument("--zipf_exponent", type=float, default=ZIPF_EXPONENT)
    parser.add_argument("--fractions", default="0.005,0.01,0.02,0.05,0.1,0.2")
    parser.add_argument("--cache_fraction", type=float, default=0.25)
    parser.add_argument("--device_gib", type=float, default=0.0,
                        help="features: the device memory auto sizes the cache in (default: see the docstring)")
    parser.add_argument("--policy", default="lru", choices=["lru", "lfu"])
    parser.add_argument("--batch_size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.mode == "victims":
        print(f"device: {device_name(device)}")
        victim_times(device, args.slots, [int(k) for k in args.misses.split(",")])
        return
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
    if args.mode == "features":
        features(big, device, args.batch_size, args.steps, args.device_gib, args.cache_fraction, args.zipf_exponent)
        return
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
