"""Serving precisions side by side on one trained checkpoint: test AUC, table bytes, and CPU
latency / throughput of fp32, fp16, int8, int4 and int2 tables (``--quantize_tables``).

    python benchmarks/quantized_serving.py --checkpoint /ckpt/last --dataset /data/criteo_fl15 \
        [--precisions fp32,fp16,int8,int4,int2] [--batch_sizes 1,64,4096] [--steps 200] [--threads 2] \
        [--json results.jsonl]

Each precision's model is built from the checkpoint as the deployer builds it (tables quantized
one at a time, ``dlrm.inference.quantize.build_quantized_model``); its AUC is sklearn's
``roc_auc_score`` over the whole test split. Latency is the eager model on the CPU (torch's
quantized embedding-bag operators) on real test batches, each forward timed alone; the
precisions take turns, ``--rounds`` rounds of ``--steps / --rounds`` passes each per batch size,
so that a neighbour's load on a shared machine falls on all of them alike. Every figure printed
is measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.inference.export import build_inference_model
from dlrm.inference.quantize import table_bytes
from dlrm.nn.quantized_embedding import QuantizedEmbedding


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


@torch.no_grad()
def test_auc(model: torch.nn.Module, spec: FeatureSpec, batch_size: int) -> tuple[float, int, float]:
    """AUC over the whole test split, the samples scored, and the seconds it took."""
    scores, labels = [], []
    start = time.perf_counter()
    with SplitBinaryReader(spec, "test", batch_size) as reader:
        for i in range(len(reader)):
            batch = reader.read_batch(i)
            scores.append(torch.sigmoid(model(batch.numerical.float(), batch.categorical)).numpy())
            labels.append(batch.label.numpy())
    seconds = time.perf_counter() - start
    y, p = np.concatenate(labels).astype(np.float64), np.concatenate(scores).astype(np.float64)
    return float(roc_auc_score(y, p)), len(y), seconds


@torch.no_grad()
def time_passes(model: torch.nn.Module, batches: list, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` forwards (after ``warmup`` untimed ones), batches cycled."""
    for i in range(warmup):
        model(batches[i % len(batches)].numerical, batches[i % len(batches)].categorical)
    seconds = []
    for i in range(steps):
        batch = batches[i % len(batches)]
        start = time.perf_counter()
        model(batch.numerical, batch.categorical)
        seconds.append(time.perf_counter() - start)
    return seconds


def stored_table_bytes(model: torch.nn.Module) -> int:
    tables = model.embeddings
    if isinstance(tables, QuantizedEmbedding):
        return tables.table_bytes()
    return sum(p.numel() * p.element_size() for p in tables.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--dataset", required=True, help="split-binary dataset with a test split")
    parser.add_argument("--precisions", default="fp32,fp16,int8,int4,int2")
    parser.add_argument("--batch_sizes", default="1,64,4096")
    parser.add_argument("--steps", type=int, default=200, help="timed forward passes per batch size")
    parser.add_argument("--warmup", type=int, default=20, help="untimed passes per batch size and precision")
    parser.add_argument("--rounds", type=int, default=10, help="turns the precisions take per batch size")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--auc_batch_size", type=int, default=65536)
    parser.add_argument("--json", default=None, help="also write one JSON object per result line here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = FeatureSpec.from_yaml(os.path.join(args.dataset, "feature_spec.yaml"))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    def batches_for(batch_size: int) -> list:
        with SplitBinaryReader(spec, "test", batch_size) as reader:
            return [reader.read_batch(i) for i in range(min(8, len(reader) - 1))]

    print(f"CPU: {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"checkpoint {args.checkpoint}")
    results, models = [], {}
    for name in args.precisions.split(","):
        start = time.perf_counter()
        model = build_inference_model(args.checkpoint, quantize_tables=name)
        build_s = time.perf_counter() - start
        config = model.config
        fp32_bytes = table_bytes(config.table_sizes, config.embedding_dim, ["fp32"] * len(config.table_sizes))
        auc, samples, auc_s = test_auc(model, spec, args.auc_batch_size)
        stored = stored_table_bytes(model)
        models[name] = model
        results.append({"precision": name, "test_auc": auc, "test_samples": samples, "table_bytes": stored,
                        "table_ratio": stored / fp32_bytes, "build_s": build_s,
                        "auc_samples_per_s": samples / auc_s, "latency": []})
        print(f"{name:>5}: auc {auc:.6f}  tables {stored / 2**20:,.2f} MiB ({stored / fp32_bytes:.3f}x fp32)  "
              f"built in {build_s:.1f} s", flush=True)
    for batch_size in batch_sizes:
        batches = batches_for(batch_size)
        times = {name: time_passes(model, batches, args.warmup, 0) for name, model in models.items()}  # warm up
        per_round = max(1, args.steps // args.rounds)
        for _ in range(args.rounds):
            for name, model in models.items():
                times[name] += time_passes(model, batches, 0, per_round)
        for row in results:
            ms = np.array(times[row["precision"]]) * 1e3
            row["latency"].append({"batch_size": batch_size, "passes": len(ms), "mean_ms": float(ms.mean()),
                                   "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                                   "throughput": batch_size / float(ms.mean()) * 1e3})
    base = results[0]["test_auc"]
    print(f"\n{'tables':>6} {'test AUC':>9} {'vs ' + results[0]['precision']:>9} {'MiB':>9} {'x fp32':>7}  " +
          "  ".join(f"{'b' + str(b) + ' p50/p99 ms':>20} {'samples/s':>11}" for b in batch_sizes))
    for row in results:
        cells = "  ".join(f"{t['p50_ms']:>9.3f}/{t['p99_ms']:<10.3f} {t['throughput']:>11,.0f}" for t in row["latency"])
        print(f"{row['precision']:>6} {row['test_auc']:>9.6f} {row['test_auc'] - base:>+9.6f} "
              f"{row['table_bytes'] / 2**20:>9,.2f} {row['table_ratio']:>7.3f}  {cells}")
    if args.json:
        with open(args.json, "w") as f:
            for row in results:
                f.write(json.dumps({"cpu": cpu_model(), "threads": torch.get_num_threads(), **row}) + "\n")


if __name__ == "__main__":
    main()
