"""Training throughput of this project against facebookresearch/dlrm, side by side on the CPU.

    python benchmarks/reference_side_by_side.py --reference_dir /path/to/facebookresearch-dlrm
    python benchmarks/reference_side_by_side.py --reference_dir ../dlrm --rounds 5 --steps 40

(from the repository root, after ``pip install -e .``; the reference checkout needs its own
imports: numpy, scikit-learn, tensorboard and tqdm, with the torch already installed.)

Each round runs, one after the other, the reference's ``dlrm_s_pytorch.py`` (float32: it has no
mixed precision on the CPU), this project's ``python -m dlrm.scripts.main`` in float32, and the
same with ``--amp`` (bf16 autocast), so a busy neighbour on the machine slows all three alike.
The reference is run as a subprocess of the checkout given; none of its code is copied here.
It prints samples/s per run, the median of each over the rounds, and ours / reference.

Both train the same model on the same shapes: 26 tables of 100,000 rows and dim 128 (one id per
sample and table), bottom MLP 13-512-256-128, dot interaction (bottom vector and the 351
pairwise dots of the 27 vectors), top MLP 479-1024-1024-512-256-1, batch 4096, plain SGD with a
constant learning rate on every weight (sparse gradients for the tables), BCE loss, random data.
(The reference's ``--arch-mlp-top`` leaves out the first width: it puts the interaction's in front.)

What each side times, and the differences that remain:

- Reference: ``--print-time --print-freq=1`` prints the milliseconds of every iteration, from
  after the batch is generated to after ``optimizer.step()`` and its LR scheduler (forward, loss
  and its copy to numpy, backward, update). Data generation (a Python loop per sample), printing
  and TensorBoard logging are outside it. The first ``--warmup`` iterations are left out here.
- Ours: ``average_train_throughput`` of the run's JSON summary: wall time from the end of the
  ``--benchmark_warmup_steps`` warm-up to the last step, so it also counts waiting for the loader
  (synthetic batches, generated on a prefetch thread: about 2 ms per batch of 4096, under 1% of a
  step), the LR schedule and the step bookkeeping. No test runs (``--test_after 2``).
- The reference's interaction output is 479 wide; ours is padded with zeros to 480 (a multiple
  of 8), so our first top layer has one more input column (0.2% more of that layer's work).
- The reference ends in a sigmoid and ``BCELoss``; ours in ``binary_cross_entropy_with_logits``.
  Its embeddings are 26 ``nn.EmbeddingBag`` (sum of one id); ours one joint table (``F.embedding``).
- Labels: the reference's are uniform random 0/1 (``--round-targets=True``), ours come from the
  synthetic hidden model. Neither changes the work of a step.
- Both run in the same environment: torch's default thread count (one per core) unless
  ``--threads`` sets ``OMP_NUM_THREADS``, plus any ``--env NAME=VALUE`` (e.g.
  ``--env THP_MEM_ALLOC_ENABLE=1``: torch's CPU allocator then asks for transparent huge pages).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TABLES, ROWS, DIM = 26, 100_000, 128
BOTTOM = [13, 512, 256, 128]
TOP_AFTER_INTERACTION = [1024, 1024, 512, 256, 1]
_REF_LINE = re.compile(r"Finished training it (\d+)/\d+ of epoch \d+, ([0-9.]+) ms/it")


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    """Runs ``cmd``, returns its stdout and stderr; raises with the tail of the output on failure."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited {proc.returncode}:\n{proc.stdout[-3000:]}")
    return proc.stdout


def reference_samples_per_s(args: argparse.Namespace, env: dict[str, str], workdir: Path) -> float:
    """The reference's throughput over its iterations after the first ``args.warmup``."""
    cmd = [
        sys.executable, str(Path(args.reference_dir) / "dlrm_s_pytorch.py"),
        f"--arch-sparse-feature-size={DIM}",
        "--arch-embedding-size=" + "-".join([str(ROWS)] * TABLES),
        "--arch-mlp-bot=" + "-".join(map(str, BOTTOM)),
        # The reference puts the interaction's width (479) in front of this list itself.
        "--arch-mlp-top=" + "-".join(map(str, TOP_AFTER_INTERACTION)),
        "--arch-interaction-op=dot",
        "--data-generation=random", "--num-indices-per-lookup=1", "--num-indices-per-lookup-fixed=True",
        "--round-targets=True", "--loss-function=bce", "--optimizer=sgd",
        f"--learning-rate={args.lr}", f"--mini-batch-size={args.batch_size}",
        f"--num-batches={args.warmup + args.steps}",
        "--print-freq=1", "--print-time", "--test-freq=0",
        f"--tensor-board-filename={workdir / 'ref_tensorboard'}",
    ]
    out = run(cmd, cwd=workdir, env=env)
    ms = {int(it): float(t) for it, t in _REF_LINE.findall(out)}
    timed = [ms[i] for i in range(args.warmup + 1, args.warmup + args.steps + 1) if i in ms]
    if len(timed) != args.steps:
        raise RuntimeError(f"expected {args.steps} timed iterations from the reference, parsed {len(timed)}:\n{out[-3000:]}")
    return args.batch_size * len(timed) / (sum(timed) / 1000.0)


def ours_samples_per_s(args: argparse.Namespace, env: dict[str, str], workdir: Path, amp: bool) -> float:
    """This project's ``average_train_throughput`` after ``args.warmup`` steps."""
    log_path = workdir / f"ours_{'bf16' if amp else 'fp32'}.json"
    log_path.unlink(missing_ok=True)
    steps = args.warmup + args.steps
    cmd = [
        sys.executable, "-m", "dlrm.scripts.main", "--base_device", "cpu",
        "--embedding_dim", str(DIM),
        "--synthetic_dataset_table_sizes", ",".join([str(ROWS)] * TABLES),
        "--synthetic_dataset_numerical_features", str(BOTTOM[0]),
        "--bottom_mlp_sizes", ",".join(map(str, BOTTOM[1:])),
        "--top_mlp_sizes", ",".join(map(str, TOP_AFTER_INTERACTION)),
        "--interaction_op", "dot", "--optimizer", "sgd",
        "--batch_size", str(args.batch_size),
        "--synthetic_dataset_num_entries", str(steps * args.batch_size),
        "--synthetic_dataset_num_test_entries", str(args.batch_size), "--test_batch_size", str(args.batch_size),
        "--max_steps", str(steps), "--benchmark_warmup_steps", str(args.warmup),
        "--print_freq", str(steps), "--test_after", "2",
        "--lr", str(args.lr), "--warmup_steps", "0", "--decay_start_step", "0", "--decay_steps", "0",
        "--log_path", str(log_path),
    ] + (["--amp"] if amp else [])
    run(cmd, cwd=REPO_ROOT, env=env)
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    summary = next(r for r in records if r.get("type") == "summary")
    return float(summary["average_train_throughput"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference_dir", required=True,
                        help="a checkout of facebookresearch/dlrm (the directory holding dlrm_s_pytorch.py)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (reference, fp32, bf16 each)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per run, before the timed ones")
    parser.add_argument("--batch_size", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=0.1, help="constant SGD learning rate on both sides")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both (default: torch's)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for both sides (repeatable)")
    args = parser.parse_args()
    if not (Path(args.reference_dir) / "dlrm_s_pytorch.py").is_file():
        parser.error(f"--reference_dir {args.reference_dir} holds no dlrm_s_pytorch.py")

    env = dict(os.environ)
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--env {item!r}: expected NAME=VALUE")
        env[name] = value
    sides = {
        "reference fp32": lambda d: reference_samples_per_s(args, env, d),
        "ours fp32": lambda d: ours_samples_per_s(args, env, d, amp=False),
        "ours bf16": lambda d: ours_samples_per_s(args, env, d, amp=True),
    }
    results: dict[str, list[float]] = {name: [] for name in sides}
    settings = [f"OMP_NUM_THREADS={args.threads}"] * (args.threads is not None) + args.env
    print(f"batch {args.batch_size}, {args.steps} timed steps after {args.warmup}, {args.rounds} rounds; samples/s"
          + (f"; {' '.join(settings)}" if settings else ""))
    print(f"{'round':>5}  " + "  ".join(f"{name:>14}" for name in sides), flush=True)
    with tempfile.TemporaryDirectory(prefix="dlrm_side_by_side_") as tmp:
        for r in range(args.rounds):
            start = time.perf_counter()
            for name, measure in sides.items():
                results[name].append(measure(Path(tmp)))
            row = "  ".join(f"{results[name][-1]:>14,.0f}" for name in sides)
            print(f"{r + 1:>5}  {row}   ({time.perf_counter() - start:.0f} s)", flush=True)
    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"{'median':>6} " + "  ".join(f"{medians[name]:>14,.0f}" for name in sides))
    reference = medians["reference fp32"]
    print(f"ours fp32 / reference: {medians['ours fp32'] / reference:.2f}x   "
          f"ours bf16 / reference: {medians['ours bf16'] / reference:.2f}x")


if __name__ == "__main__":
    main()
