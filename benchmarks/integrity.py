"""What the safety checks cost: checkpoint checksums and the dataset scan before training.

    python benchmarks/integrity.py --table_gb 2 --dataset_rows 20000000 --dir /scratch

(after ``pip install -e .``). It saves a checkpoint of one model with ``--table_gb`` of fp32
tables and prints, in the same run:

- the save time (the CRC-32 is computed while the bytes are written, not in a second pass),
- the load time with the checksum verification and without it (``--skip_checkpoint_verify``),
- the CRC-32 throughput over the written files, cold and warm page cache aside: the files were
  just written, so this is the hashing speed, not the disk's,

and writes a split-binary dataset of ``--dataset_rows`` Criteo-shaped rows (13 numerical, 26
categorical), then times ``SplitBinaryReader.validate`` (``--validate_dataset``) over it against a
plain read of the same files, so the scan's own cost is visible.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.training.checkpoint import TrainState, file_crc32, load_checkpoint, save_checkpoint


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def checkpoint_figures(root: str, table_gb: float) -> None:
    rows = int(table_gb * 2**30 / (4 * 128) / 26)
    config = DLRMConfig(num_numerical_features=13, table_sizes=[rows] * 26, embedding_dim=128)
    model = DLRM(config)
    path = os.path.join(root, "ckpt")
    seconds = _timed(lambda: save_checkpoint(path, model, None, None, TrainState()))
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"checkpoint: {size / 1e9:.2f} GB in {len(os.listdir(path))} files")
    print(f"  save (with CRC-32 while writing)   {seconds:7.2f} s  {size / seconds / 1e9:6.2f} GB/s")
    files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".pt")]
    seconds = _timed(lambda: [file_crc32(f) for f in files])
    print(f"  CRC-32 of every file, one thread   {seconds:7.2f} s  {size / seconds / 1e9:6.2f} GB/s")
    for verify in (False, True):
        target = DLRM(config)
        seconds = _timed(lambda: load_checkpoint(path, target, verify=verify))
        label = "load, checksums verified" if verify else "load, --skip_checkpoint_verify"
        print(f"  {label:34s} {seconds:7.2f} s  {size / seconds / 1e9:6.2f} GB/s")
        del target


def dataset_figures(root: str, rows: int) -> None:
    spec = FeatureSpec.default(13, [40_000_000] * 13 + [100_000] * 13)  # int32 ids for every table
    spec.base_directory = os.path.join(root, "data")
    paths = spec.paths("train")
    rng = np.random.default_rng(0)
    os.makedirs(os.path.dirname(paths.label), exist_ok=True)
    rng.integers(0, 2, rows, dtype=np.uint8).tofile(paths.label)
    rng.standard_normal((rows, 13), dtype=np.float32).astype(np.float16).tofile(paths.numerical)
    for path, dtype, cardinality in zip(paths.categorical, spec.categorical_dtypes, spec.cardinalities):
        rng.integers(0, min(cardinality, 100_000), rows).astype(dtype).tofile(path)
    reader = SplitBinaryReader(spec, "train", 1 << 16)
    size = sum(os.path.getsize(p) for p in [paths.label, paths.numerical, *paths.categorical])
    chunk = 1 << 22
    plain = min(_timed(lambda: [c.read(s, min(chunk, rows - s)) for c in reader._columns()
                                for s in range(0, rows, chunk)]) for _ in range(2))
    scan = min(_timed(reader.validate) for _ in range(2))
    print(f"dataset: {rows:,} rows, {size / 1e9:.2f} GB (page cache warm; best of 2)")
    print(f"  plain read of every column, one thread  {plain:7.2f} s  {size / plain / 1e9:6.2f} GB/s")
    print(f"  validate (--validate_dataset)           {scan:7.2f} s  {size / scan / 1e9:6.2f} GB/s  "
          f"{rows / scan / 1e6:,.0f} M rows/s")
    reader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table_gb", type=float, default=2.0, help="GB of fp32 embedding tables to checkpoint")
    parser.add_argument("--dataset_rows", type=int, default=20_000_000, help="rows of the dataset to validate")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="dlrm-integrity-", dir=args.dir)
    try:
        print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, writing under {root}")
        checkpoint_figures(root, args.table_gb)
        dataset_figures(root, args.dataset_rows)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
