"""Batch-read throughput of the split-binary reader against plain np.memmap slicing.

    python -m dlrm.scripts.prepare_synthetic_dataset --synthetic_dataset_dir DIR --preset criteo_fl15 \
        --synthetic_dataset_num_entries 2097152
    python benchmarks/read_throughput.py DIR [BATCH_SIZE]

The file is read once before timing, so this measures the reader on a warm page cache (the
reader's own cost), not the disk.
"""

import sys
import time

import numpy as np
import torch

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.loader import PrefetchLoader, batch_order
from dlrm.data.split_binary import SplitBinaryReader

spec = FeatureSpec.from_yaml(sys.argv[1])
B = int(sys.argv[2]) if len(sys.argv) > 2 else 65536
r = SplitBinaryReader(spec, "train", B)
order = batch_order(len(r), 0, 1, True)
for i in order: r.read_batch(i)  # warm the page cache


def bench(name, fn):
    ts = []
    for _ in range(3):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    print(f"{name:45s} {r.num_samples / min(ts) / 1e6:7.2f} M samples/s")


bench("SplitBinaryReader.read_batch (checks ids)", lambda: [r.read_batch(i) for i in order])
r2 = SplitBinaryReader(spec, "train", B, check_ids=False)
bench("SplitBinaryReader.read_batch (no id check)", lambda: [r2.read_batch(i) for i in order])
bench("PrefetchLoader over the reader", lambda: list(PrefetchLoader(r, order, "cpu")))
paths = spec.paths("train")
mm = [np.memmap(p, dtype=d, mode="r") for p, d in zip(paths.categorical, spec.categorical_dtypes)]
num = np.memmap(paths.numerical, dtype=np.float16, mode="r").reshape(-1, spec.num_numerical)
lab = np.memmap(paths.label, dtype=np.bool_, mode="r")


def plain():
    for i in order:
        s = slice(i * B, (i + 1) * B)
        torch.from_numpy(np.array(num[s])); torch.from_numpy(np.array(lab[s]))
        torch.from_numpy(np.stack([m[s] for m in mm], 1).astype(np.int64))


bench("plain np.memmap slicing + torch.from_numpy", plain)
