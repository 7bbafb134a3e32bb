"""The recommender's default fit (settings searched on validation, then the refit) against one
plain EASE solve at the lambda the default's validation chose for EASE, in the same run, on the
same machine: the figure docs/benchmarks.md keeps.

    python benchmarks/recommender_fit_time.py DATASET_DIR [DATASET_DIR ...] [--work DIR]

Each DATASET_DIR is a CSR dataset (``recommender_generate``'s ``input/``). The default runs as a
user runs it (``python -m dlrm.scripts.recommender_train``, its time read from its log's
``fit_time`` record: the search and the refit, without start-up and saving); the plain EASE
solve is G = X^T X of the same data and one closed-form solve over every item, timed here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from dlrm.recommender import linear
from dlrm.recommender.csr_dataset import CsrDataset


def default_fit(data: str, work: str, device: str) -> dict:
    """The fit_time and summary records of ``recommender_train`` on ``data``, and EASE's lambda."""
    log = os.path.join(work, "default.jsonl")
    subprocess.run([sys.executable, "-m", "dlrm.scripts.recommender_train", "--input", data, "--save_checkpoint_path",
                    os.path.join(work, "default"), "--log_path", log, "--base_device", device], check=True)
    records = [json.loads(line) for line in open(log)]
    ease = max((r for r in records if r["type"] == "validation" and r["dropout"] == 0), key=lambda r: r["ndcg"])
    fit = next(r for r in records if r["type"] == "fit_time")
    summary = next(r for r in records if r["type"] == "summary")
    return {"fit": fit, "summary": summary, "ease_lambda": ease["regularization"]}


def plain_ease_seconds(data: str, regularization: float, device: str) -> float:
    """G of every user and one solve over every item at ``regularization``: what fitting EASE costs."""
    started = time.perf_counter()
    linear.solve(linear.gram(CsrDataset(data), device=device), linear.LinearSettings(regularization))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("datasets", nargs="+", help="CSR dataset folders")
    parser.add_argument("--work", help="a new folder to keep the checkpoints and logs in (default: a temporary "
                        "one, removed)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where both fit (default: cuda when there is one)")
    args = parser.parse_args()
    rows = []
    for i, data in enumerate(args.datasets):
        if args.work:  # kept: DIR/<i>/default is the checkpoint, DIR/<i>/default.jsonl its log
            work = os.path.join(args.work, str(i))
            os.makedirs(work)
            run = default_fit(data, work, args.device)
        else:
            with tempfile.TemporaryDirectory() as work:
                run = default_fit(data, work, args.device)
        ease = plain_ease_seconds(data, run["ease_lambda"], args.device)
        d, s = CsrDataset(data), run["summary"]
        rows.append((data, len(d), d.n_features, d.nnz, run["fit"]["seconds"], len(run["fit"]["trials"]), ease,
                     f"lambda {s['regularization']:g}, dropout {s['dropout']:g}, min_support {s['min_support']}"))
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} CPU threads")
    print("| data | users | items | interactions | default fit (s) | trials | plain EASE solve (s) | ratio | chose |")
    print("|---|---|---|---|---|---|---|---|---|")
    for data, users, items, nnz, fit, trials, ease, chose in rows:
        print(f"| {data} | {users:,} | {items:,} | {nnz:,} | {fit:.2f} | {trials} | {ease:.2f} | {fit / ease:.2f}x | "
              f"{chose} |")


if __name__ == "__main__":
    main()
