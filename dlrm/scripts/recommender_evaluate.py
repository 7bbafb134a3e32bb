r"""Ranking metrics of the sparse autoencoder and of standard baselines on a held-out split.

    python -m dlrm.scripts.recommender_evaluate --input /data/ml20m/input --heldout /data/ml20m/heldout \
        --load_checkpoint_path ckpt/ --k 1,5,10,20 --output metrics.json

Every user's --input items are the history a recommender sees; their --heldout items (the same
users in the same order, from recommender_generate's held-out split) are what it should find.
The model (--load_checkpoint_path) and each of --baselines rank every item the user has not seen, through
the same exclusion and top-K path, and are scored with precision, recall and NDCG at each K and
catalogue coverage (dlrm.recommender.metrics defines them). Baselines, fitted on the --input rows:
popularity (item counts), itemknn (item-item cosine kNN, --knn_neighbours), mf (implicit ALS
matrix factorisation, --mf_factors, --mf_iterations) and ease (Steck's closed-form linear
autoencoder, --ease_lambda; its items x items matrices need items^2 x 12 bytes, refused above
--ease_max_memory_gb).

Under torchrun the model is evaluated with its item layers split across the processes; the
baselines then run on the first process alone.

--output writes the metrics as a JSON object (input, heldout, checkpoint, k, users, results); an
existing --output is replaced only with --overwrite, and only when it is such a file.

--load_checkpoint_path and --base_device are dlrm.scripts.main's names; --checkpoint and
--device are kept as aliases.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

from dlrm.engine.outputs import OutputKind, claim_output
from dlrm.scripts import cli
from dlrm.scripts import recommender_common as common

BASELINES = ("popularity", "itemknn", "mf", "ease")
REPORT_KEYS = ("input", "heldout", "checkpoint", "k", "users", "results")  # what --output holds


def _is_metrics(path: str) -> bool:
    """Whether file ``path`` is a metrics report of this command: a JSON object of ``REPORT_KEYS``."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.loads(f.read(1 << 24))
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and sorted(report) == sorted(REPORT_KEYS)


METRICS = OutputKind("metrics file", directory=False, recognise=_is_metrics)

FLAGS = flags.FLAGS
flags.DEFINE_string("input", None, "CSR dataset of the users' histories (e.g. DIR/input of recommender_generate).")
flags.DEFINE_string("heldout", None, "CSR dataset of their held-out items (e.g. DIR/heldout), the same users in "
                    "the same order.")
common.define_checkpoint_to_load("Checkpoint of recommender_train to evaluate; default: the baselines only.")
flags.DEFINE_list("baselines", list(BASELINES), f"Baselines to evaluate, comma-separated, from "
                  f"{','.join(BASELINES)}; empty (--baselines=) for none.")
flags.DEFINE_list("k", ["1", "5", "10", "20"], "Cut-offs K of the metrics, comma-separated.")
flags.DEFINE_integer("batch_size", 1024, "Users ranked at once.", lower_bound=1)
flags.DEFINE_string("output", None, "JSON file of the metrics, written atomically; default: printed only.")
flags.DEFINE_boolean("overwrite", False, "Replace the --output an earlier run wrote (never a file of anything else).")
flags.DEFINE_integer("mf_factors", 64, "mf: latent factors.", lower_bound=1)
flags.DEFINE_integer("mf_iterations", 10, "mf: ALS iterations.", lower_bound=0)
flags.DEFINE_integer("knn_neighbours", 100, "itemknn: neighbours kept per item.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "mf: seed of the initial item factors.")
flags.DEFINE_float("ease_lambda", 250.0, "ease: L2 regularization lambda (> 0). Common choices are a few hundred "
                   "(250 is RecBole's default); pick it on a validation split, not on --heldout.")
flags.DEFINE_float("ease_max_memory_gb", 12.0, "ease: refuse a catalogue whose items x items matrices need more "
                   "GiB than this (items^2 x 12 bytes; 12 GiB: up to 32,768 items).", lower_bound=0)
common.define_device("Model: automatic mixed precision (torch.autocast, see --amp_dtype).", ["auto", "bf16", "fp16"],
                     common.AMP_DTYPE_HELP)
flags.mark_flags_as_required(["input", "heldout"])



def _ks() -> list[int]:
    ks = []
    for text in FLAGS.k:
        try:
            k = int(text)
        except ValueError:
            raise app.UsageError(f"--k {','.join(FLAGS.k)}: {text!r} is not an integer") from None
        if k < 1:
            raise app.UsageError(f"--k {','.join(FLAGS.k)}: every K must be >= 1, got {k}")
        ks.append(k)
    if not ks:
        raise app.UsageError("--k is empty; give at least one cut-off, e.g. --k 10")
    return sorted(set(ks))


def _check_flags() -> tuple[list[int], list[str]]:
    ks = _ks()
    unknown = [b for b in FLAGS.baselines if b not in BASELINES]
    if unknown:
        raise app.UsageError(f"--baselines: unknown {', '.join(map(repr, unknown))}; choose from "
                             f"{','.join(BASELINES)}")
    baselines = list(dict.fromkeys(FLAGS.baselines))
    if "ease" in baselines and not FLAGS.ease_lambda > 0:
        raise app.UsageError(f"--ease_lambda {FLAGS.ease_lambda:g}: must be > 0, so that X^T X + lambda I is "
                             f"invertible")
    if not baselines and not FLAGS.load_checkpoint_path:
        raise app.UsageError("nothing to evaluate: give --load_checkpoint_path, or baselines with --baselines")
    if FLAGS.output:  # before any work (dlrm.engine.outputs; a read-only file system too)
        claim_output(FLAGS.output, METRICS, "output", replace=FLAGS.overwrite,
                     inputs={"input": FLAGS.input, "heldout": FLAGS.heldout,
                             "load_checkpoint_path": FLAGS.load_checkpoint_path})
    return ks, baselines


def _ease_limit() -> int:
    return int(FLAGS.ease_max_memory_gb * 2**30)


def _check_ease_memory(n_items: int, baselines: list[str]) -> None:
    """Refuses EASE above --ease_max_memory_gb before anything is evaluated, not after the model."""
    from dlrm.recommender.baselines import ease_memory_bytes, memory_size

    need = ease_memory_bytes(n_items)
    if need > _ease_limit():
        others = ",".join(b for b in baselines if b != "ease") or ",".join(b for b in BASELINES if b != "ease")
        raise app.UsageError(f"--baselines ease: a catalogue of {n_items:,} items needs {memory_size(need)} for "
                             f"EASE (items^2 x 12 bytes), over --ease_max_memory_gb {FLAGS.ease_max_memory_gb:g}; "
                             f"raise --ease_max_memory_gb if the machine has the memory, leave ease out "
                             f"(--baselines {others}), or evaluate a smaller catalogue")


def _row(metrics) -> dict:
    out = {}
    for m in metrics:
        out.update({f"precision@{m.k}": m.precision, f"recall@{m.k}": m.recall, f"ndcg@{m.k}": m.ndcg,
                    f"coverage@{m.k}": m.coverage})
    out["users"] = metrics[0].users
    return out


def _table(results: dict[str, dict], ks: list[int]) -> str:
    columns = [(f"{name}@{k}", f"{key}@{k}") for k in ks for name, key in
               (("P", "precision"), ("R", "recall"), ("NDCG", "ndcg"))]
    columns.append((f"cov@{ks[-1]}", f"coverage@{ks[-1]}"))
    width = max(10, *(len(name) for name in results)) + 2
    lines = ["".ljust(width) + "".join(title.rjust(9) for title, _ in columns)]
    for name, row in results.items():
        lines.append(name.ljust(width) + "".join(f"{row[key]:9.4f}" for _, key in columns))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return cli.run_processes(_main, argv)


def _evaluate_model(inputs, heldout, ks: list[int], env) -> tuple[dict | None, bool]:
    """(the model's metrics row, whether this process goes on to the baselines)."""
    import torch

    from dlrm.recommender import checkpoint
    from dlrm.recommender.item_parallel import ItemParallel
    from dlrm.recommender.predict import evaluate, recommend

    device = common.device(FLAGS.base_device, env)
    amp_dtype = common.amp_dtype(FLAGS.amp, FLAGS.amp_dtype, device)
    path = checkpoint.model_path(FLAGS.load_checkpoint_path, FLAGS.best)
    n_input, n_output = checkpoint.sizes_of(path)
    if (n_input, n_output) != (inputs.n_features, heldout.n_features):
        raise app.UsageError(f"--load_checkpoint_path {FLAGS.load_checkpoint_path} has {n_input:,} inputs and "
                             f"{n_output:,} outputs, --input and --heldout {inputs.n_features:,} and "
                             f"{heldout.n_features:,} items; evaluate on the datasets it was trained for")
    common.start_processes(env, device, FLAGS.dist_timeout)
    parallel = ItemParallel.from_process_group()
    score, item_start = checkpoint.load_scorer(path, parallel, device, amp_dtype)
    if parallel.rank == 0:
        print(f"model: {checkpoint.describe(path)}", flush=True)
    started = time.perf_counter()
    batches = recommend(score, inputs, max(ks), FLAGS.batch_size, item_start=item_start, parallel=parallel)
    row = {**_row(evaluate(batches, heldout, ks)), "seconds": time.perf_counter() - started}
    if env is not None:  # the baselines run on one process: the others are done
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return row, parallel.rank == 0


def _main(argv: list[str], env) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    ks, baselines = _check_flags()
    for flag in ("input", "heldout"):
        common.check_dataset_dir(flag, FLAGS[flag].value)  # before torch loads: a mistyped path fails at once
    inputs, heldout = common.dataset("input", FLAGS.input), common.dataset("heldout", FLAGS.heldout)
    if len(inputs) != len(heldout) or inputs.n_features != heldout.n_features:
        raise app.UsageError(f"--input has {len(inputs):,} users and {inputs.n_features:,} items, --heldout "
                             f"{len(heldout):,} and {heldout.n_features:,}: give the two halves of one held-out "
                             f"split (DIR/input and DIR/heldout of recommender_generate)")
    if "ease" in baselines:
        _check_ease_memory(inputs.n_features, baselines)
    results: dict[str, dict] = {}
    if FLAGS.load_checkpoint_path:
        results["model"], first = _evaluate_model(inputs, heldout, ks, env)
        if not first:
            return 0
    if baselines:
        from dlrm.recommender.baselines import fit_baseline
        from dlrm.recommender.predict import evaluate, recommend

        rows = inputs.rows()
        settings = {"popularity": {}, "itemknn": {"neighbours": FLAGS.knn_neighbours},
                    "mf": {"factors": FLAGS.mf_factors, "iterations": FLAGS.mf_iterations, "seed": FLAGS.seed},
                    "ease": {"regularization": FLAGS.ease_lambda, "max_memory_bytes": _ease_limit()}}
        for name in baselines:
            started = time.perf_counter()
            baseline = fit_baseline(name, rows, **settings[name])
            fitted = time.perf_counter()
            batches = recommend(lambda csr, b=baseline: b.scores(csr[0], csr[1]), inputs, max(ks), FLAGS.batch_size)
            results[name] = {**_row(evaluate(batches, heldout, ks)), "fit_seconds": fitted - started,
                             "seconds": time.perf_counter() - fitted}
    users = next(iter(results.values()))["users"]
    print(f"{len(inputs):,} users ({users:,} with held-out items), {inputs.n_features:,} items")
    print(_table(results, ks))
    if FLAGS.output:
        from dlrm.engine.atomic import write_text_atomically

        report = {"input": os.path.abspath(FLAGS.input), "heldout": os.path.abspath(FLAGS.heldout),
                  "checkpoint": os.path.abspath(FLAGS.load_checkpoint_path) if FLAGS.load_checkpoint_path else None,
                  "k": ks,
                  "users": users, "results": results}
        write_text_atomically(FLAGS.output, json.dumps(report, indent=1) + "\n")
        print(f"wrote {FLAGS.output}")
    return 0


if __name__ == "__main__":
    cli.run(main, prefix=cli.rank_prefix)
