"""RecBole 1.2.1's general recommenders beside this project's baselines, on one split of a project
CSR dataset (e.g. MovieLens-100k: DIR/input holds each user's training items, DIR/heldout the
items held out of them).

    python -m venv /path/to/recbole-venv
    /path/to/recbole-venv/bin/pip install torch==2.13.0 recbole==1.2.1 "numpy<2" "pandas<2.3" \\
        "setuptools>=77.0.3,<81" scipy lightgbm xgboost
    OMP_NUM_THREADS=1 /path/to/recbole-venv/bin/python benchmarks/recbole_side_by_side.py \\
        --input DIR/input --heldout DIR/heldout --project_python "$(command -v python)" \\
        --workdir /tmp/recbole_run --output /tmp/recbole_run.json

Two Pythons take part, since RecBole 1.2.1 needs numpy < 2 and must not be one of this project's
dependencies: the script runs under a separate virtual environment with ``recbole==1.2.1``
(plus its needs: ``numpy<2``, ``pandas<2.3``, lightgbm and xgboost importable, a CPU torch;
pin torch, or pip may settle on an older CUDA build to satisfy a setuptools cap: torch 2.13
needs setuptools >= 77.0.3, and the ray that recbole imports needs ``pkg_resources``, gone
from setuptools 81),
and calls ``--project_python`` (the interpreter with this project installed) for what only the
project does: reading the CSR datasets, scoring RecBole's recommendations with the project's
metric definitions, and the project's own EASE (``python -m dlrm.scripts.recommender_evaluate``).
That interpreter runs this same file with ``--helper``, with this checkout first on PYTHONPATH.
``--quick`` runs one setting per model and at most 3 epochs: a smoke test, not a result.

Threads: ``OMP_NUM_THREADS`` (1 when unset) for torch, numpy and the project's helper runs. On
a busy 2-core machine one thread was 2-3 times faster than two for these small models.
RecBole loads its own checkpoints with ``torch.load``: torch >= 2.6 needs
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` for them (set here when unset).

The split (RecBole atomic files under ``--workdir``, "benchmark files" in RecBole's terms):

- ``tune.train.inter`` / ``tune.valid.inter`` / ``tune.test.inter``: valid = a draw of each
  user's input items, train = the rest of the input, test = the held-out items. The draw:
  ``numpy.random.default_rng(--seed)``, users in row order, for each ``rng.choice(n, m,
  replace=False)`` of the user's n input items with m = floor(``--valid_fraction`` * n + 0.5),
  at least 1 and at most n - 1 (a user with one input item gives none to valid). This is not
  the rule of the project's own validation split; it only has to be fixed and stated.
- ``final.train.inter`` = the whole input, ``final.valid.inter`` = ``final.test.inter`` = the
  held-out items (RecBole needs a valid file; nothing is chosen on it, see below).
Users and items keep the project's ids as tokens (row number, column number), so RecBole's
recommendations map back to the project's ids exactly. Both files sets hold the same
interactions, so RecBole's catalogue is the same in both: every column that occurs in input or
held-out (an item in neither cannot be ranked by RecBole; the script reports the count).

Protocol, per model:

1. Choice on valid: every setting of the model's grid is trained on ``tune.train`` with RecBole's
   trainer, evaluated on ``tune.valid`` after every epoch (``eval_step`` 1) and stopped early
   (``stopping_step`` 10, on NDCG@10, at most ``--max_epochs``); the best epoch's weights are
   kept (RecBole's checkpoint). The setting with the highest valid NDCG@10 wins (the first in
   grid order on a tie). Its epoch count = the best epoch + 1 (RecBole's own record in the
   checkpoint). Pop, ItemKNN and EASE have no epochs (RecBole's TraditionalTrainer: one pass).
2. Reported ("comparable", the main figures): the chosen setting is trained again on
   ``final.train`` (= the whole input: train + valid) for exactly that epoch count, with no
   evaluation during training and no early stopping (the test split decides nothing), then
   evaluated once on the held-out items. At that point RecBole's model reads the user's whole
   input as its history (the autoencoders' input row, EASE's and ItemKNN's X) and ranks all
   items of its catalogue (``eval_args: {mode: full, order: RO, group_by: user}``: full sort,
   no sampled negatives) except that input: the project's protocol (``recommender_evaluate``:
   history = input, rank every item not in input, score against held-out).
3. Also reported ("recbole_default"): the model chosen in step 1 (trained on ``tune.train``,
   best epoch) evaluated on ``tune.test``, as RecBole does it with a three-way split: the
   model's input is ``tune.train`` only, and both train and valid items are left out of the
   ranking. Less history, so lower numbers; not comparable with the project's figures.

Metrics: RecBole's own NDCG@10, Recall@10 and Precision@10 (its evaluator), and the same
recommendations (RecBole's top 10 per user, taken from its ``_full_sort_batch_eval`` with history
already masked) scored by the project's ``dlrm.recommender.metrics``. The definitions agree on
precision (hits / 10) and NDCG (binary gain, log2 discount, ideal DCG over min(10, |held-out|)),
and differ on recall: RecBole's is hits / |held-out|, the project's hits / min(10, |held-out|)
(users with more than 10 held-out items can reach 1.0), so the project's recall is higher.
Times: wall seconds of building RecBole's model (where ItemKNN and EASE do all their work) and
its trainer's ``fit``; for the choice runs they include the per-epoch valid evaluation, for the
final run they do not.

Check: EASE with RecBole's chosen ``reg_weight`` through the project
(``python -m dlrm.scripts.recommender_evaluate --baselines ease --ease_lambda X --k 10``) and
through ``dlrm.recommender.baselines.EASE`` directly, whose top 10 lists are compared with
RecBole's one by one. RecBole's EASE inverts X^T X + lambda I in float32, the project in float64,
so near-ties may swap; the NDCG@10 should agree to about 1e-3.

RecBole settings not named above stay at RecBole's defaults (``train_batch_size`` 2048, Adam,
the models' own yaml, ``seed`` 2020 set before each run), except ``train_neg_sample_args: None``
(none of these six models uses sampled negatives, and with RecBole's default of one uniform
negative per positive Pop would count the sampled negatives as views) and ``eval_batch_size``
2^22 (RecBole's full-sort evaluation puts eval_batch_size // n_items users in a batch: its
default 4096 gives 2 users a batch on MovieLens-100k; the size changes no figure, only time)
and ``metric_decimal_place`` 8 (RecBole rounds its metrics to 4 places by default).

Known RecBole 1.2.1 fault, left as it is: Pop counts an item at most once per training batch
(``item_cnt[item] = item_cnt[item] + 1`` with repeated indices; RecBole issues #1844, #2198), so
its counts saturate at the number of batches and its ranking is not item popularity. The
project's ``popularity`` on the same split is printed beside it for that reason.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
for _name in ("MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_name, os.environ["OMP_NUM_THREADS"])
os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
K = 10
MODELS = ["Pop", "ItemKNN", "EASE", "MultiDAE", "MultiVAE", "RecVAE"]
# Each model's grid: a list of settings (RecBole config keys); the first is used by --quick.
GRIDS: dict[str, list[dict]] = {
    "Pop": [{}],
    "ItemKNN": [{"k": k, "shrink": 0.0} for k in (50, 100, 200)],
    "EASE": [{"reg_weight": r} for r in (100.0, 250.0, 500.0, 1000.0)],
    "MultiDAE": [{"learning_rate": lr} for lr in (1e-3, 3e-3)],
    "MultiVAE": [{"learning_rate": lr} for lr in (1e-3, 3e-3)],
    "RecVAE": [{"learning_rate": lr} for lr in (1e-3, 3e-3)],
}
TRADITIONAL = {"Pop", "ItemKNN", "EASE"}
# RecBole's full-sort evaluation puts eval_batch_size // n_items users in a batch: its default
# 4096 gives 2 users per batch on MovieLens-100k, and evaluation dominated the run time.
EVAL_BATCH_SIZE = 1 << 22


class UserError(Exception):
    """A mistake in the command line or environment: printed as one line, exit 2."""


def fail(message: str) -> None:
    print(f"recbole_side_by_side: {message}", file=sys.stderr)
    raise SystemExit(2)


# ---------------------------------------------------------------- helper (project's python)

def helper_dump(args: argparse.Namespace) -> None:
    """Writes the input and held-out CSR rows to an .npz (run by the project's python)."""
    from dlrm.recommender.csr_dataset import CsrDataset
    inp, held = CsrDataset(args.input).rows(), CsrDataset(args.heldout).rows()
    if inp.n_samples != held.n_samples:
        raise UserError(f"--input has {inp.n_samples} users and --heldout {held.n_samples}; they must be the same "
                        f"users in the same order (the two halves of one split)")
    np.savez(args.out, input_offsets=inp.offsets, input_indices=inp.indices, heldout_offsets=held.offsets,
             heldout_indices=held.indices, n_items=max(inp.n_features, held.n_features))


def helper_score(args: argparse.Namespace) -> None:
    """Scores each [users, K] array of ``--recs`` with the project's metrics, and the project's
    EASE top-K against RecBole's (run by the project's python)."""
    import torch
    from dlrm.recommender.baselines import EASE, ItemKNN
    from dlrm.recommender.csr_dataset import CsrDataset
    from dlrm.recommender.metrics import ranking_metrics
    from dlrm.recommender.topk import exclude_, top_k
    inp, held = CsrDataset(args.input).rows(), CsrDataset(args.heldout).rows()
    n_items = max(inp.n_features, held.n_features)
    recs = np.load(args.recs)
    out: dict = {"metrics": {}}
    for name in recs.files:
        m = ranking_metrics(recs[name], held.offsets, held.indices, K, n_items)
        out["metrics"][name] = {f"ndcg@{K}": m.ndcg, f"recall@{K}": m.recall, f"precision@{K}": m.precision,
                                f"coverage@{K}": m.coverage, "users": m.users}
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    fits = []
    if args.ease_lambda is not None:
        fits.append(("EASE", "project_ease_direct", {"ease_lambda": args.ease_lambda},
                     lambda: EASE().fit(inp, regularization=args.ease_lambda)))
    if args.itemknn_k is not None:
        fits.append(("ItemKNN", "project_itemknn_direct", {"neighbours": args.itemknn_k, "shrink": 0.0},
                     lambda: ItemKNN().fit(inp, neighbours=args.itemknn_k, shrink=0.0)))
    for name, key, setting, fit in fits:
        start = time.perf_counter()
        model = fit()
        fit_seconds = time.perf_counter() - start
        scores = model.scores(inp.offsets, inp.indices)
        exclude_(scores, torch.from_numpy(inp.offsets), torch.from_numpy(inp.indices.astype(np.int64)))
        _, items = top_k(scores, K)
        ours = items.numpy().astype(np.int64)
        m = ranking_metrics(ours, held.offsets, held.indices, K, n_items)
        entry = {**setting, "fit_seconds": fit_seconds, f"ndcg@{K}": m.ndcg, f"recall@{K}": m.recall,
                 f"precision@{K}": m.precision}
        if f"{name}.final" in recs.files:
            theirs = recs[f"{name}.final"]
            overlap = [len(set(a) & set(b)) / K for a, b in zip(ours.tolist(), theirs.tolist())]
            entry.update(users_same_top10_in_order=int((ours == theirs).all(1).sum()), users=int(ours.shape[0]),
                         mean_top10_overlap=float(np.mean(overlap)))
        out[key] = entry
    Path(args.out).write_text(json.dumps(out, indent=1))


def helper_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="recbole_side_by_side.py --helper")
    p.add_argument("what", choices=["dump", "score"])
    p.add_argument("--input", required=True)
    p.add_argument("--heldout", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--recs")
    p.add_argument("--ease_lambda", type=float)
    p.add_argument("--itemknn_k", type=int)
    args = p.parse_args(argv)
    try:
        (helper_dump if args.what == "dump" else helper_score)(args)
    except UserError as e:
        fail(str(e))
    except Exception as e:  # the project's own one-line errors (DatasetError, ValueError)
        if type(e).__name__ in ("DatasetError", "OutputError", "ValueError", "FileNotFoundError"):
            fail(str(e))
        raise


# ---------------------------------------------------------------- split export

def valid_draw(offsets: np.ndarray, indices: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask over ``indices``: True for the input items drawn into valid (the rule in the
    module docstring)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(indices.shape[0], bool)
    for r in range(offsets.shape[0] - 1):
        lo, n = int(offsets[r]), int(offsets[r + 1] - offsets[r])
        if n < 2:
            continue
        m = min(max(int(math.floor(fraction * n + 0.5)), 1), n - 1)
        mask[lo + rng.choice(n, m, replace=False)] = True
    return mask


def write_inter(path: Path, users: np.ndarray, items: np.ndarray) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("user_id:token\titem_id:token\n")
        f.writelines(f"{u}\t{i}\n" for u, i in zip(users.tolist(), items.tolist()))


def export_split(rows: dict, data_dir: Path, fraction: float, seed: int) -> dict:
    """Writes the atomic files of datasets ``tune`` and ``final`` under ``data_dir``."""
    io, ii = rows["input_offsets"], rows["input_indices"].astype(np.int64)
    ho, hi = rows["heldout_offsets"], rows["heldout_indices"].astype(np.int64)
    iu = np.repeat(np.arange(io.shape[0] - 1), np.diff(io))
    hu = np.repeat(np.arange(ho.shape[0] - 1), np.diff(ho))
    in_valid = valid_draw(io, ii, fraction, seed)
    parts = {
        "tune": {"train": (iu[~in_valid], ii[~in_valid]), "valid": (iu[in_valid], ii[in_valid]), "test": (hu, hi)},
        "final": {"train": (iu, ii), "valid": (hu, hi), "test": (hu, hi)},
    }
    counts = {}
    for name, files in parts.items():
        (data_dir / name).mkdir(parents=True)
        for part, (u, i) in files.items():
            write_inter(data_dir / name / f"{name}.{part}.inter", u, i)
            counts[f"{name}.{part}"] = int(u.shape[0])
    items_seen = np.union1d(ii, hi)
    return {"users": int(io.shape[0] - 1), "n_items_project": int(rows["n_items"]),
            "n_items_recbole": int(items_seen.shape[0]), "interactions": counts,
            "valid_rule": f"numpy default_rng({seed}); per user in row order rng.choice(n, m, replace=False) of the "
                          f"n input items, m = floor({fraction} * n + 0.5) clipped to [1, n - 1]"}


# ---------------------------------------------------------------- RecBole runs

def recbole_config(model: str, dataset: str, data_dir: Path, workdir: Path, params: dict, epochs: int, seed: int):
    from recbole.config import Config
    config_dict = {
        "data_path": str(data_dir), "benchmark_filename": ["train", "valid", "test"],
        "load_col": {"inter": ["user_id", "item_id"]},
        "eval_args": {"mode": "full", "order": "RO", "group_by": "user"},
        "metrics": ["NDCG", "Recall", "Precision"], "topk": [K], "valid_metric": f"NDCG@{K}",
        "eval_batch_size": EVAL_BATCH_SIZE, "metric_decimal_place": 8,
        "train_neg_sample_args": None, "epochs": epochs, "eval_step": 1, "stopping_step": 10,
        "seed": seed, "reproducibility": True, "use_gpu": False, "show_progress": False,
        "checkpoint_dir": str(workdir / "saved"), "save_dataset": False, "save_dataloaders": False,
        "log_wandb": False,
    }
    config_dict.update(params)
    return Config(model=model, dataset=dataset, config_dict=config_dict)


def recbole_top_k(trainer, data, dataset) -> np.ndarray:
    """[users, K] project item ids (row r = project user r), RecBole's ranking with history masked."""
    import torch
    uid_field, iid_field = dataset.uid_field, dataset.iid_field
    n_users = max(int(t) for t in dataset.field2id_token[uid_field][1:]) + 1
    out = np.full((n_users, K), -1, np.int64)
    item_tokens = np.array([-1] + [int(t) for t in dataset.field2id_token[iid_field][1:]], np.int64)
    user_tokens = np.array([-1] + [int(t) for t in dataset.field2id_token[uid_field][1:]], np.int64)
    trainer.model.eval()
    with torch.no_grad():
        for batched in data:
            interaction, scores, _, _ = trainer._full_sort_batch_eval(batched)
            top = torch.topk(scores, K, dim=1).indices.cpu().numpy()
            out[user_tokens[interaction[uid_field].cpu().numpy()]] = item_tokens[top]
    return out


def recbole_run(model: str, dataset: str, data_dir: Path, workdir: Path, params: dict, epochs: int, seed: int,
                choose: bool) -> dict:
    """One RecBole training run. ``choose``: train on dataset's train with early stopping on its
    valid, test the best epoch's model; else: train ``epochs`` epochs with no evaluation, test."""
    import torch
    from recbole.data import create_dataset, data_preparation
    from recbole.utils import get_model, get_trainer, init_seed
    config = recbole_config(model, dataset, data_dir, workdir, params, epochs, seed)
    init_seed(config["seed"], config["reproducibility"])
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    ds = create_dataset(config)
    train_data, valid_data, test_data = data_preparation(config, ds)
    init_seed(config["seed"], config["reproducibility"])
    start = time.perf_counter()  # ItemKNN and EASE do their whole fit in the constructor
    net = get_model(config["model"])(config, train_data._dataset).to(config["device"])
    build_seconds = time.perf_counter() - start
    trainer = get_trainer(config["MODEL_TYPE"], config["model"])(config, net)
    counter = EpochCounter(trainer)
    start = time.perf_counter()
    if choose:
        best_score, best_valid = trainer.fit(train_data, valid_data, saved=True, show_progress=False, verbose=False)
        fit_seconds = build_seconds + time.perf_counter() - start
        state = torch.load(trainer.saved_model_file, map_location="cpu", weights_only=False)
        best_epoch = int(state["epoch"])
        test_result = trainer.evaluate(test_data, load_best_model=True, show_progress=False)
        result = {"valid_ndcg@10": float(best_score), "valid": {k: float(v) for k, v in best_valid.items()},
                  "best_epoch": best_epoch, "epochs": best_epoch + 1, "epochs_run": counter.n}
        os.remove(trainer.saved_model_file)
    else:
        trainer.fit(train_data, None, saved=False, show_progress=False, verbose=False)
        fit_seconds = build_seconds + time.perf_counter() - start
        test_result = trainer.evaluate(test_data, load_best_model=False, show_progress=False)
        result = {"epochs": counter.n}
    result.update(fit_seconds=fit_seconds, test={k: float(v) for k, v in test_result.items()},
                  top10=recbole_top_k(trainer, test_data, ds), n_items_recbole=int(ds.item_num - 1))
    return result


class EpochCounter:
    """Counts the epochs a trainer ran (RecBole keeps no count after early stopping)."""

    def __init__(self, trainer):
        self.n = 0
        inner = trainer._train_epoch

        def counted(*a, **kw):
            self.n += 1
            return inner(*a, **kw)
        trainer._train_epoch = counted


def metric_triple(d: dict) -> str:
    return f"{d['ndcg@10']:.4f} | {d['recall@10']:.4f} | {d['precision@10']:.4f}"


def table(results: dict) -> str:
    lines = ["| Model | chosen on valid | epochs | NDCG@10 | Recall@10 | Precision@10 | Recall@10 (project def.) "
             "| train s | NDCG@10 (RecBole default protocol) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["models"].items():
        f = r["final"]
        chosen = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["chosen"].items()) or "-"
        lines.append(f"| RecBole {name} | {chosen} | {f['epochs'] if name not in TRADITIONAL else '-'} | "
                     f"{metric_triple(f['recbole_metrics'])} | {f['project_metrics']['recall@10']:.4f} | "
                     f"{f['fit_seconds']:.1f} | {r['recbole_default']['recbole_metrics']['ndcg@10']:.4f} |")
    for name, c in results.get("project", {}).get("results", {}).items():
        setting = f"lambda={results['ease_check']['ease_lambda']:g}" if name == "ease" else "-"
        lines.append(f"| project {name} (recommender_evaluate) | {setting} | - | {c['ndcg@10']:.4f} | - | "
                     f"{c['precision@10']:.4f} | {c['recall@10']:.4f} | {c['fit_seconds']:.1f} | - |")
    return "\n".join(lines)


def run_project(python: str, args: list[str], env: dict) -> None:
    try:
        proc = subprocess.run([python, *args], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, check=False)
    except OSError as e:
        raise UserError(f"--project_python {python}: cannot run it ({e.strerror}); name the python that has this "
                        f"project installed, e.g. \"$(command -v python)\" outside the RecBole environment") from None
    if proc.returncode != 0:
        raise UserError(f"{shlex.join([python, *args[:3]])} ... exited {proc.returncode}: "
                        f"{proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ''}")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="project CSR dataset of the users' input items")
    p.add_argument("--heldout", required=True, help="project CSR dataset of their held-out items")
    p.add_argument("--project_python", required=True,
                   help="the python with this project installed (reads the CSR data, scores, runs the EASE check)")
    p.add_argument("--workdir", help="new or empty folder for RecBole's files (default: a new temporary folder)")
    p.add_argument("--output", help="JSON file of the results (default: workdir/results.json)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier --output of this script")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {','.join(MODELS)}")
    p.add_argument("--valid_fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0, help="seed of the valid draw")
    p.add_argument("--recbole_seed", type=int, default=2020, help="RecBole's seed (its default)")
    p.add_argument("--max_epochs", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="first setting per model, <= 3 epochs: a smoke test")
    args = p.parse_args(argv)
    t0 = time.perf_counter()

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        raise UserError(f"--models: unknown {','.join(bad) or '(none given)'}; choose from {','.join(MODELS)}")
    if not 0.0 < args.valid_fraction < 1.0:
        raise UserError(f"--valid_fraction must be in (0, 1), got {args.valid_fraction}")
    if args.max_epochs < 1:
        raise UserError(f"--max_epochs must be >= 1, got {args.max_epochs}")
    try:
        import recbole
    except ImportError:
        raise UserError("recbole is not importable by this python; run the script with the python of a virtual "
                        "environment holding recbole==1.2.1 (see the module docstring)") from None
    if recbole.__version__ != "1.2.1":
        print(f"note: recbole {recbole.__version__}, not the 1.2.1 this script was written for", file=sys.stderr)
    for flag in ("input", "heldout"):
        if not (Path(getattr(args, flag)) / "header.json").is_file():
            raise UserError(f"--{flag} {getattr(args, flag)}: not a CSR dataset folder (no header.json)")
    output = Path(args.output).resolve() if args.output else None
    if output is not None and not (output.parent.is_dir() and os.access(output.parent, os.W_OK)):
        raise UserError(f"--output {output}: its folder {output.parent} does not exist or is not writable; create it "
                        f"or name a file in another folder")
    if output is not None and output.exists():
        try:
            mine = json.loads(output.read_text()).get("benchmark") == "recbole_side_by_side"
        except (OSError, ValueError, AttributeError):
            mine = False
        if not mine:
            raise UserError(f"--output {output} exists and is not a result of this script; name another file")
        if not args.overwrite:
            raise UserError(f"--output {output} exists; pass --overwrite to replace it, or name another file")
    if args.workdir:
        workdir = Path(args.workdir).resolve()
        if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
            raise UserError(f"--workdir {workdir} exists and is not an empty folder; name a new one")
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="recbole_side_by_side_"))
    output = output or workdir / "results.json"
    inp, held = str(Path(args.input).resolve()), str(Path(args.heldout).resolve())
    env = dict(os.environ)
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    # The project's code of this script's checkout, whatever checkout --project_python has installed.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    me = str(Path(__file__).resolve())

    print(f"workdir {workdir}", flush=True)
    run_project(args.project_python, [me, "--helper", "dump", "--input", inp, "--heldout", held, "--out",
                                      str(workdir / "rows.npz")], env)
    rows = dict(np.load(workdir / "rows.npz"))
    split = export_split(rows, workdir / "data", args.valid_fraction, args.seed)
    print(f"split: {split['users']} users, {split['n_items_project']} items "
          f"({split['n_items_recbole']} occur in input or held-out), {split['interactions']}", flush=True)
    os.chdir(workdir)  # RecBole writes log_tensorboard/ into the working directory

    import torch
    results: dict = {
        "benchmark": "recbole_side_by_side",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "script_commit": git_commit(),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": int(os.environ["OMP_NUM_THREADS"]),
                    "platform": platform.platform()},
        "versions": {"python": platform.python_version(), "recbole": recbole.__version__, "torch": torch.__version__,
                     "numpy": np.__version__},
        "input": inp, "heldout": held, "workdir": str(workdir), "split": split,
        "settings": {"valid_fraction": args.valid_fraction, "seed": args.seed, "recbole_seed": args.recbole_seed,
                     "max_epochs": args.max_epochs, "stopping_step": 10, "quick": args.quick},
        "models": {},
    }
    recs: dict[str, np.ndarray] = {}
    data_dir = workdir / "data"
    for name in models:
        grid = GRIDS[name][:1] if args.quick else GRIDS[name]
        max_epochs = min(args.max_epochs, 3) if args.quick else args.max_epochs
        runs = []
        for params in grid:
            r = recbole_run(name, "tune", data_dir, workdir, params, max_epochs, args.recbole_seed, choose=True)
            top = r.pop("top10")
            runs.append({"params": params, **r, "_top10": top})
            print(f"{name} {params}: valid NDCG@10 {r['valid_ndcg@10']:.4f} (best epoch {r['best_epoch']}), "
                  f"{r['fit_seconds']:.1f} s", flush=True)
        best = max(runs, key=lambda x: x["valid_ndcg@10"])  # max keeps the first of equals
        recs[f"{name}.recbole_default"] = best["_top10"]
        final = recbole_run(name, "final", data_dir, workdir, best["params"], best["epochs"], args.recbole_seed,
                            choose=False)
        recs[f"{name}.final"] = final.pop("top10")
        print(f"{name} chosen {best['params']}, {best['epochs']} epochs: test NDCG@10 {final['test']['ndcg@10']:.4f}, "
              f"fit {final['fit_seconds']:.1f} s", flush=True)
        results["models"][name] = {
            "grid": [{k: v for k, v in x.items() if k != "_top10"} for x in runs],
            "chosen": best["params"],
            "recbole_default": {"recbole_metrics": best["test"]},
            "final": {"epochs": final["epochs"], "fit_seconds": final["fit_seconds"], "recbole_metrics": final["test"],
                      "n_items_ranked": final["n_items_recbole"]},
        }

    np.savez(workdir / "recs.npz", **recs)
    ease_lambda = results["models"].get("EASE", {}).get("chosen", {}).get("reg_weight")
    score_args = [me, "--helper", "score", "--input", inp, "--heldout", held, "--recs", str(workdir / "recs.npz"),
                  "--out", str(workdir / "project_scores.json")]
    if ease_lambda is not None:
        score_args += ["--ease_lambda", repr(float(ease_lambda))]
    itemknn_k = results["models"].get("ItemKNN", {}).get("chosen", {}).get("k")
    if itemknn_k is not None:
        score_args += ["--itemknn_k", str(int(itemknn_k))]
    run_project(args.project_python, score_args, env)
    scores = json.loads((workdir / "project_scores.json").read_text())
    for name, r in results["models"].items():
        r["final"]["project_metrics"] = scores["metrics"][f"{name}.final"]
        r["recbole_default"]["project_metrics"] = scores["metrics"][f"{name}.recbole_default"]
    # The project's own figures on the same split, by its command line: popularity (beside
    # RecBole's Pop) and EASE with RecBole's chosen reg_weight (the check).
    baselines = ["popularity"] + (["ease"] if ease_lambda is not None else [])
    cli = ["-m", "dlrm.scripts.recommender_evaluate", "--input", inp, "--heldout", held, "--baselines",
           ",".join(baselines), "--ease_lambda", repr(float(ease_lambda or 250.0)), "--k", str(K), "--output",
           str(workdir / "project_baselines.json")]
    run_project(args.project_python, cli, env)
    results["project"] = {"command": shlex.join([args.project_python, *cli]),
                          "results": json.loads((workdir / "project_baselines.json").read_text())["results"]}
    if ease_lambda is not None:
        project = results["project"]["results"]["ease"]
        rb = results["models"]["EASE"]["final"]
        results["ease_check"] = {
            "ease_lambda": float(ease_lambda), "project_cli": project, "project_direct": scores["project_ease_direct"],
            "recbole_ndcg@10": rb["recbole_metrics"]["ndcg@10"],
            "ndcg@10_difference": rb["recbole_metrics"]["ndcg@10"] - project["ndcg@10"],
        }
    if itemknn_k is not None:
        results["itemknn_check"] = {"k": int(itemknn_k), "shrink": 0.0,
                                    "recbole": results["models"]["ItemKNN"]["final"]["project_metrics"],
                                    "project_direct": scores["project_itemknn_direct"]}
    results["total_seconds"] = time.perf_counter() - t0
    md = table(results)
    results["table_markdown"] = md
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, output)
    print()
    print(md)
    print()
    for key, name, setting in (("ease_check", "EASE", "lambda"), ("itemknn_check", "ItemKNN", "k")):
        if key not in results:
            continue
        c = results[key]
        d = c["project_direct"]
        rb = results["models"][name]["final"]["project_metrics"]
        print(f"{name} check ({setting} {c.get('ease_lambda', c.get('k')):g}): NDCG@10 RecBole {rb['ndcg@10']:.5f}, "
              f"project {d['ndcg@10']:.5f}; same top-10 list in order for {d['users_same_top10_in_order']}/"
              f"{d['users']} users, mean top-10 overlap {d['mean_top10_overlap']:.4f}")
    if "ease_check" in results:
        c = results["ease_check"]
        print(f"EASE: RecBole's own NDCG@10 {c['recbole_ndcg@10']:.8f}, the project's recommender_evaluate "
              f"{c['project_cli']['ndcg@10']:.8f} (difference {c['ndcg@10_difference']:+.1e})")
    print(f"\n{results['total_seconds']:.0f} s in all; wrote {output}")


def git_commit() -> str:
    """The commit of this script's checkout (with "+changes" when the script differs from it)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(Path(__file__).resolve())],
                               cwd=REPO_ROOT, check=False).returncode != 0
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--helper"]:
        helper_main(sys.argv[2:])
    else:
        try:
            main(sys.argv[1:])
        except UserError as e:
            fail(str(e))
