"""TorchRec's own quantized CPU inference of a DLRM, timed: a reference point for this project's
int8 / 4-bit row-wise quantized serving path. It imports nothing from this project and runs in a
separate virtual environment with TorchRec in it.

What it measures. ``torchrec.models.dlrm.DLRM`` over an ``EmbeddingBagCollection`` with one
``EmbeddingBagConfig`` per table (sum pooling, one id per table per sample), random weights
(TorchRec's default initialisation after ``torch.manual_seed(--seed)``), in eval mode. For each
precision in ``--precisions``:

- ``fp32``: the float model as it is (``nn.EmbeddingBag`` tables, float MLPs);
- ``fp16``, ``int8``, ``int4``: a deep copy of the float model passed through
  ``torchrec.inference.modules.quantize_inference_model(model, quantization_dtype=D)`` with D =
  ``torch.half``, ``torch.int8``, ``torch.quint4x2``, as TorchRec's inference docs do it. That
  swaps the EmbeddingBagCollection for TorchRec's ``QuantEmbeddingBagCollection`` (fbgemm's
  ``IntNBitTableBatchedEmbeddingBagsCodegen`` on the host: int8 / int4 rows with a per-row fp16
  scale and bias, or fp16 rows); the dense MLPs stay fp32 (TorchRec's ``quantize_dense`` only
  lowers them to fp16, a GPU path).

Each forward is timed alone (``time.perf_counter``, under ``torch.inference_mode``) on random
valid inputs: float numerical features from ``torch.rand`` and a ``KeyedJaggedTensor`` with all
lengths 1 and ids uniform within each table; four batches are built beforehand and cycled.
``--warmup`` untimed forwards, then ``--steps`` timed ones, for each batch size in
``--batch_sizes``. Reported per (precision, batch size): p50, p99 and mean latency in ms,
samples/s (batch size / mean latency), and the bytes of the embedding tables as the module holds
them for its forward: the float tables' parameters for fp32; for the quantized module the
storage of its fbgemm table-batched modules (``weights_host`` / ``weights_dev`` /
``weights_uvm``: rows with their scale and bias, each row padded to TorchRec's row alignment of 16
bytes), with that as a ratio of the fp32 bytes. The JSON lines also give the unpadded bytes (rows
x (packed weights + 4 bytes of scale/bias)) and ``retained_copy_bytes``: TorchRec's
``QuantEmbeddingBagCollection.from_float`` keeps the unpadded quantized tensors it built the
tables from (``_table_name_to_quantized_weights``) alive beside the padded storage, so the
process really holds both.

Correctness check: on one batch of 256 samples, the largest absolute difference between each
quantized model's sigmoid outputs and the fp32 model's, and the class of the embedding module
that ran (so a quantized path that silently stayed float would show).

The environment (built and used on Python 3.11, x86-64, CPU only; torchrec 1.9.2 with
fbgemm-gpu-cpu 1.9.0 needs torch 2.14.1, whose only wheel on the package index is the CUDA
build: it requires nvidia-* packages and ``import torch`` fails without them (libcudnn.so.9), and
fbgemm-gpu-cpu 1.9.0 does not load on torch 2.13 (undefined torch symbols); so these are the
newest versions that run on a CPU-only torch, matched as fbgemm releases pair with torch)::

    python -m venv .venv-torchrec            # anywhere; here beside the repository's files
    .venv-torchrec/bin/pip install torch==2.13.0 numpy
    .venv-torchrec/bin/pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0
    .venv-torchrec/bin/pip install tensordict==0.15.3 torchmetrics==1.0.3 tqdm pyre-extensions

``torch==2.13.0`` must resolve to the CPU build (``pip list`` shows ``2.13.0+cpu`` and no
``nvidia-*`` package); where the plain index offers only the CUDA build, install the CPU wheel
from PyTorch's CPU wheel index instead. torchrec goes in with ``--no-deps`` because it requires
``fbgemm-gpu`` (the CUDA build, which would shadow fbgemm-gpu-cpu); the last line adds the
pure-Python packages that ``import torchrec, torchrec.inference`` needs. Then, e.g.::

    .venv-torchrec/bin/python benchmarks/torchrec_quantized.py \\
        --table_sizes 40000,30000,20000,10000 --embedding_dim 64 --num_numerical_features 13 \\
        --bottom_mlp_sizes 256,128,64 --top_mlp_sizes 512,256,1 --threads 2 --json out.jsonl

Layer sizes are given as NVIDIA's DLRM gives them: the bottom MLP's last size is the embedding
dimension and the top MLP's last size is 1 (TorchRec's ``dense_arch_layer_sizes`` and
``over_arch_layer_sizes`` are the same lists).
"""

import argparse
import copy
import importlib.metadata
import json
import os
import platform
import sys
import time
from typing import Dict, List, Optional, Tuple

PRECISIONS = ("fp32", "fp16", "int8", "int4")


class UsageError(Exception):
    pass


def _int_list(text: str, flag: str) -> List[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        raise UsageError(f"--{flag} must be a comma list of integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"--{flag} must be a non-empty comma list of positive integers, got {text!r}")
    return values


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table_sizes", default="1000,2000,500", help="rows per table, comma list")
    parser.add_argument("--embedding_dim", type=int, default=16)
    parser.add_argument("--num_numerical_features", type=int, default=13)
    parser.add_argument("--bottom_mlp_sizes", default="32,16", help="comma list; the last is --embedding_dim")
    parser.add_argument("--top_mlp_sizes", default="32,1", help="comma list; the last is 1")
    parser.add_argument("--precisions", default="fp32,int8,int4", help="comma list from fp32,fp16,int8,int4")
    parser.add_argument("--batch_sizes", default="1,64,4096", help="comma list")
    parser.add_argument("--steps", type=int, default=100, help="timed forwards per batch size")
    parser.add_argument("--warmup", type=int, default=10, help="untimed forwards before them")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write one JSON object per (precision, batch size) line here (a new file)")
    args = parser.parse_args(argv)

    args.table_sizes = _int_list(args.table_sizes, "table_sizes")
    args.bottom_mlp_sizes = _int_list(args.bottom_mlp_sizes, "bottom_mlp_sizes")
    args.top_mlp_sizes = _int_list(args.top_mlp_sizes, "top_mlp_sizes")
    args.batch_sizes = _int_list(args.batch_sizes, "batch_sizes")
    for name in ("embedding_dim", "num_numerical_features", "steps"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name} must be positive, got {getattr(args, name)}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {args.warmup}")
    if args.threads is not None and args.threads <= 0:
        raise UsageError(f"--threads must be positive, got {args.threads}")
    if args.bottom_mlp_sizes[-1] != args.embedding_dim:
        raise UsageError(
            f"--bottom_mlp_sizes must end with --embedding_dim ({args.embedding_dim}), got "
            f"{','.join(map(str, args.bottom_mlp_sizes))}"
        )
    if args.top_mlp_sizes[-1] != 1:
        raise UsageError(f"--top_mlp_sizes must end with 1, got {','.join(map(str, args.top_mlp_sizes))}")
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in PRECISIONS]
    if not precisions or unknown:
        raise UsageError(f"--precisions takes a comma list from {','.join(PRECISIONS)}, got {args.precisions!r}")
    args.precisions = list(dict.fromkeys(precisions))
    if args.json is not None:
        if os.path.lexists(args.json):
            raise UsageError(f"--json {args.json} already exists; remove it or give a new path")
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            raise UsageError(f"--json {args.json}: folder {parent} does not exist; create it or give another path")
    return args


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = _parse(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import numpy as np
    import torch
    import torchrec
    from torchrec.inference.modules import quantize_inference_model
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    num_tables = len(args.table_sizes)
    keys = [f"f{i}" for i in range(num_tables)]
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=args.embedding_dim,
            num_embeddings=rows,
            feature_names=[keys[i]],
            pooling=PoolingType.SUM,
        )
        for i, rows in enumerate(args.table_sizes)
    ]
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    float_model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=args.num_numerical_features,
        dense_arch_layer_sizes=args.bottom_mlp_sizes,
        over_arch_layer_sizes=args.top_mlp_sizes,
    ).eval()

    quant_dtypes = {"fp16": torch.half, "int8": torch.int8, "int4": torch.quint4x2}

    def embedding_module(model: torch.nn.Module) -> torch.nn.Module:
        return model.sparse_arch.embedding_bag_collection

    def table_bytes(model: torch.nn.Module) -> Dict[str, int]:
        emb = embedding_module(model)
        if isinstance(emb, torchrec.EmbeddingBagCollection):
            held = sum(p.numel() * p.element_size() for p in emb.parameters())
            return {"held": held, "unpadded": held, "retained_copy": 0}
        held = unpadded = 0
        for tbe in emb._emb_modules:
            for name in ("weights_host", "weights_dev", "weights_uvm"):
                t = getattr(tbe, name, None)
                if isinstance(t, torch.Tensor):
                    held += t.numel() * t.element_size()
            for weight, scale_bias, _ in tbe.split_embedding_weights_with_scale_bias(split_scale_bias_mode=1):
                unpadded += weight.numel() * weight.element_size()
                if scale_bias is not None:
                    unpadded += scale_bias.numel() * scale_bias.element_size()
        retained = 0
        for pair in (getattr(emb, "_table_name_to_quantized_weights", None) or {}).values():
            for t in pair:
                if isinstance(t, torch.Tensor):
                    retained += t.numel() * t.element_size()
        return {"held": held, "unpadded": unpadded, "retained_copy": retained}

    def describe(model: torch.nn.Module) -> str:
        emb = embedding_module(model)
        if isinstance(emb, torchrec.EmbeddingBagCollection):
            dtypes = sorted({str(p.dtype).replace("torch.", "") for p in emb.parameters()})
            return f"{type(emb).__module__}.{type(emb).__name__} ({'/'.join(dtypes)} tables)"
        types = sorted({spec[3].name for tbe in emb._emb_modules for spec in tbe.embedding_specs})
        tbes = sorted({type(tbe).__name__ for tbe in emb._emb_modules})
        return f"{type(emb).__module__}.{type(emb).__name__} -> {'/'.join(tbes)} ({'/'.join(types)} tables)"

    models = {}
    for precision in args.precisions:
        if precision == "fp32":
            models[precision] = float_model
        else:
            models[precision] = quantize_inference_model(
                copy.deepcopy(float_model), quantization_dtype=quant_dtypes[precision]
            ).eval()

    generator = torch.Generator().manual_seed(args.seed + 1)
    sizes = torch.tensor(args.table_sizes, dtype=torch.float64)

    def make_batch(batch: int) -> Tuple[torch.Tensor, KeyedJaggedTensor]:
        dense = torch.rand((batch, args.num_numerical_features), generator=generator)
        # KJT values are key-major: all of f0's ids for the batch, then f1's, ...
        u = torch.rand((num_tables, batch), generator=generator, dtype=torch.float64)
        ids = torch.minimum((u * sizes[:, None]).floor(), sizes[:, None] - 1).to(torch.int64)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=ids.reshape(-1),
            lengths=torch.ones(num_tables * batch, dtype=torch.int32),
        )
        return dense, kjt

    fp32_bytes = sum(t.num_embeddings * t.embedding_dim * 4 for t in tables)
    versions = {
        "torch": torch.__version__,
        "torchrec": _version("torchrec"),
        "fbgemm_gpu_cpu": _version("fbgemm-gpu-cpu"),
        "fbgemm_gpu": _version("fbgemm-gpu"),
        "python": platform.python_version(),
    }
    cpu = _cpu_model()
    threads = torch.get_num_threads()
    print(
        f"torch {versions['torch']}, torchrec {versions['torchrec']}, fbgemm-gpu-cpu {versions['fbgemm_gpu_cpu']}"
        f" (fbgemm-gpu: {versions['fbgemm_gpu']}), python {versions['python']}"
    )
    print(f"CPU: {cpu}; torch threads: {threads}")
    print(
        f"DLRM: {num_tables} tables ({sum(args.table_sizes)} rows), embedding_dim {args.embedding_dim},"
        f" {args.num_numerical_features} numerical features, bottom MLP {args.bottom_mlp_sizes},"
        f" top MLP {args.top_mlp_sizes}; one id per table per sample; seed {args.seed}"
    )
    print(f"steps {args.steps} (after {args.warmup} warmup) per batch size; 4 pre-built batches cycled")

    check_dense, check_kjt = make_batch(256)
    with torch.inference_mode():
        reference = torch.sigmoid(float_model(check_dense, check_kjt).float())
        reference_pooled = float_model.sparse_arch(check_kjt).float()
        for precision, model in models.items():
            print(f"  {precision}: {describe(model)}")
            if precision != "fp32":
                out = torch.sigmoid(model(check_dense, check_kjt).float())
                pooled = model.sparse_arch(check_kjt).float()
                line = (
                    f"      on 256 samples: max |sigmoid - fp32 sigmoid| = {(out - reference).abs().max().item():.3e},"
                    f" max |pooled embedding - fp32's| = {(pooled - reference_pooled).abs().max().item():.3e}"
                )
                if precision in ("int8", "int4"):
                    levels = 255 if precision == "int8" else 15
                    half_step = max(
                        ((w.amax(dim=1) - w.amin(dim=1)).max() / levels / 2).item()
                        for w in (p.detach() for p in embedding_module(float_model).parameters())
                    )
                    line += f" (half an {precision} step of the widest row: {half_step:.3e})"
                print(line)

    rows = []
    json_file = open(args.json, "x") if args.json is not None else None
    try:
        for precision, model in models.items():
            nbytes = table_bytes(model)
            for batch in args.batch_sizes:
                batches = [make_batch(batch) for _ in range(4)]
                times = []
                with torch.inference_mode():
                    for step in range(args.warmup + args.steps):
                        dense, kjt = batches[step % len(batches)]
                        start = time.perf_counter()
                        model(dense, kjt)
                        elapsed = time.perf_counter() - start
                        if step >= args.warmup:
                            times.append(elapsed)
                ms = np.array(times) * 1e3
                row = {
                    "precision": precision,
                    "batch_size": batch,
                    "p50_ms": float(np.percentile(ms, 50)),
                    "p99_ms": float(np.percentile(ms, 99)),
                    "mean_ms": float(ms.mean()),
                    "samples_per_s": float(batch / (ms.mean() / 1e3)),
                    "embedding_bytes": nbytes["held"],
                    "embedding_bytes_ratio": nbytes["held"] / fp32_bytes,
                    "embedding_bytes_unpadded": nbytes["unpadded"],
                    "retained_copy_bytes": nbytes["retained_copy"],
                    "fp32_embedding_bytes": fp32_bytes,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "threads": threads,
                    "cpu": cpu,
                    "versions": versions,
                    "embedding_module": describe(model),
                    "table_sizes": args.table_sizes,
                    "embedding_dim": args.embedding_dim,
                    "num_numerical_features": args.num_numerical_features,
                    "bottom_mlp_sizes": args.bottom_mlp_sizes,
                    "top_mlp_sizes": args.top_mlp_sizes,
                    "seed": args.seed,
                }
                rows.append(row)
                if json_file is not None:
                    json_file.write(json.dumps(row) + "\n")
                    json_file.flush()
    finally:
        if json_file is not None:
            json_file.close()

    header = (
        f"{'precision':<9} {'batch':>6} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9} {'samples/s':>11}"
        f" {'emb MB':>8} {'vs fp32':>7} {'unpad MB':>8} {'vs fp32':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['precision']:<9} {r['batch_size']:>6} {r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f} {r['mean_ms']:>9.3f}"
            f" {r['samples_per_s']:>11.0f} {r['embedding_bytes'] / 1e6:>8.3f} {r['embedding_bytes_ratio']:>7.3f}"
            f" {r['embedding_bytes_unpadded'] / 1e6:>8.3f} {r['embedding_bytes_unpadded'] / fp32_bytes:>7.3f}"
        )
    print(
        "emb MB: the tables as the module holds them for its forward (quantized: fbgemm rows with"
        " fp16 scale+bias, each row padded to 16 bytes); unpad MB: the same rows unpadded. TorchRec"
        " also keeps the unpadded quantized tensors it built the tables from (JSON: retained_copy_bytes)."
    )
    if args.json is not None:
        print(f"wrote {len(rows)} lines to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
