"""The evaluate job: what ``recommender_evaluate`` runs, from one ``EvaluateConfig``. A
checkpoint's model and the baselines (``dlrm.recommender.baselines``) rank every item a user has
not seen, on the same path (``dlrm.recommender.predict.recommend``), and their lists are scored
against the held-out items: precision, recall, NDCG and coverage at each K.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from dlrm.recommender.job_steps import (amp_dtype_of, check_dataset_dir, dist_env, job_config, open_dataset,
                                        resolve_device)
from dlrm.recommender.run_config import BASELINES, ConfigError, EvaluateConfig

REPORT_KEYS = ("input", "heldout", "checkpoint", "k", "users", "results")  # what evaluate's ``output`` holds


def _is_metrics(path: str) -> bool:
    """Whether file ``path`` is a metrics report of ``evaluate``: a JSON object of ``REPORT_KEYS``."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.loads(f.read(1 << 24))
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and sorted(report) == sorted(REPORT_KEYS)


def _metrics_kind():
    """The kind of file ``output`` is: a metrics report, which ``overwrite`` may replace."""
    from dlrm.engine.outputs import OutputKind

    return OutputKind("metrics file", directory=False, recognise=_is_metrics)


def _row(metrics) -> dict:
    """A report's row of metrics: each metric at each K, and the users with held-out items."""
    out = {}
    for m in metrics:
        out.update({f"precision@{m.k}": m.precision, f"recall@{m.k}": m.recall, f"ndcg@{m.k}": m.ndcg,
                    f"coverage@{m.k}": m.coverage})
    out["users"] = metrics[0].users
    return out


def evaluate(cfg: EvaluateConfig | str | None = None, /, *args: Any, **settings: Any) -> dict[str, Any] | None:
    """Precision, recall, NDCG and coverage at each of ``cfg.k`` of the checkpoint at
    ``cfg.load_checkpoint_path`` (if given) and of ``cfg.baselines``, ranking every item a user of
    ``cfg.input`` has not seen against their ``cfg.heldout`` items, as ``recommender_evaluate``
    (whose flags are the config's fields) does; ``output`` also writes the report as JSON.
    ``evaluate(input, heldout, load_checkpoint_path=..., k=(5, 10), ...)`` is the same call: the
    arguments make the ``EvaluateConfig``; a config with arguments beside it is a ``TypeError``.
    Returns the report (input, heldout, checkpoint, k, users, results: a row of metrics per
    model) with "n_users" and "n_items" of ``input``; under torchrun, None on every process but
    the first."""
    cfg = job_config("evaluate", EvaluateConfig, cfg, args, settings)
    input, heldout, output, load_checkpoint_path = cfg.input, cfg.heldout, cfg.output, cfg.load_checkpoint_path
    if output:  # before any work (dlrm.engine.outputs; a read-only file system too)
        from dlrm.engine.outputs import claim_output

        claim_output(output, _metrics_kind(), "output", replace=cfg.overwrite,
                     inputs={"input": input, "heldout": heldout, "load_checkpoint_path": load_checkpoint_path})
    for setting, path in (("input", input), ("heldout", heldout)):
        check_dataset_dir(setting, path)  # before torch loads: a mistyped path fails at once
    inputs, held = open_dataset("input", input), open_dataset("heldout", heldout)
    if len(inputs) != len(held) or inputs.n_features != held.n_features:
        raise ConfigError(f"`input` has {len(inputs):,} users and {inputs.n_features:,} items, `heldout` "
                          f"{len(held):,} and {held.n_features:,}: give the two halves of one held-out split "
                          f"(DIR/input and DIR/heldout of recommender_generate)")
    _check_ease_memory(cfg, inputs.n_features)
    results: dict[str, dict] = {}
    if load_checkpoint_path:
        row = _model_row(cfg, inputs, held)
        if row is None:  # under torchrun, a process other than the first
            return None
        results["model"] = row
    results.update(_baseline_rows(cfg, inputs, held))
    report = {"input": os.path.abspath(input), "heldout": os.path.abspath(heldout),
              "checkpoint": os.path.abspath(load_checkpoint_path) if load_checkpoint_path else None, "k": list(cfg.k),
              "users": next(iter(results.values()))["users"], "results": results}
    if output:
        from dlrm.engine.atomic import write_text_atomically

        write_text_atomically(output, json.dumps(report, indent=1) + "\n")
    return {**report, "n_users": len(inputs), "n_items": inputs.n_features}


def _check_ease_memory(cfg: EvaluateConfig, n_items: int) -> None:
    """Refuses EASE over ``ease_max_memory_gb`` before anything is evaluated, not after the model."""
    if "ease" not in cfg.baselines:
        return
    from dlrm.recommender.baselines import ease_memory_bytes, memory_size

    need = ease_memory_bytes(n_items)
    if need > int(cfg.ease_max_memory_gb * 2**30):
        others = (",".join(b for b in cfg.baselines if b != "ease")
                  or ",".join(b for b in BASELINES if b != "ease"))
        raise ConfigError(f"`baselines` ease: a catalogue of {n_items:,} items needs "
                          f"{memory_size(need)} for EASE (items^2 x 12 bytes), over `ease_max_memory_gb` "
                          f"{cfg.ease_max_memory_gb:g}; raise `ease_max_memory_gb` if the machine has the memory, "
                          f"leave ease out (`baselines` {others}), or evaluate a smaller catalogue")


def _model_row(cfg: EvaluateConfig, inputs, held) -> dict | None:
    """The metrics of the checkpoint's model (every process of torchrun ranks its items); None
    on every process but the first, whose baselines run alone."""
    import torch

    from dlrm.engine.process_group import join_processes  # torch: imported when a run starts
    from dlrm.recommender import checkpoint
    from dlrm.recommender.item_parallel import ItemParallel
    from dlrm.recommender.predict import evaluate as evaluate_lists
    from dlrm.recommender.predict import recommend

    env = dist_env()
    device = resolve_device(cfg.base_device, env)
    dtype = amp_dtype_of(cfg.amp, cfg.amp_dtype, device)
    path = checkpoint.model_path(cfg.load_checkpoint_path, cfg.best)
    n_input, n_output = checkpoint.sizes_of(path)
    if (n_input, n_output) != (inputs.n_features, held.n_features):
        raise ConfigError(f"`load_checkpoint_path` {cfg.load_checkpoint_path} has {n_input:,} inputs and "
                          f"{n_output:,} outputs, `input` and `heldout` {inputs.n_features:,} and "
                          f"{held.n_features:,} items; evaluate on the datasets it was trained for")
    join_processes(env, device, cfg.dist_timeout)
    parallel = ItemParallel.from_process_group()
    score, item_start = checkpoint.load_scorer(path, parallel, device, dtype)
    if parallel.rank == 0:
        print(f"model: {checkpoint.describe(path)}", flush=True)
    started = time.perf_counter()
    lists = recommend(score, inputs, max(cfg.k), cfg.batch_size, item_start=item_start, parallel=parallel)
    row = {**_row(evaluate_lists(lists, held, cfg.k)), "seconds": time.perf_counter() - started}
    if env is not None:  # the baselines run on one process: the others are done
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return row if parallel.rank == 0 else None


def _baseline_rows(cfg: EvaluateConfig, inputs, held) -> dict[str, dict]:
    """The metrics of each of ``cfg.baselines``, fitted on ``inputs``, with their fit times."""
    if not cfg.baselines:
        return {}
    from dlrm.recommender.baselines import fit_baseline
    from dlrm.recommender.predict import evaluate as evaluate_lists
    from dlrm.recommender.predict import recommend

    rows, ks = inputs.rows(), list(cfg.k)
    fits = {"popularity": {}, "itemknn": {"neighbours": cfg.knn_neighbours},
            "mf": {"factors": cfg.mf_factors, "iterations": cfg.mf_iterations, "seed": cfg.seed},
            "ease": {"regularization": cfg.ease_lambda, "max_memory_bytes": int(cfg.ease_max_memory_gb * 2**30)}}
    results = {}
    for name in cfg.baselines:
        started = time.perf_counter()
        baseline = fit_baseline(name, rows, **fits[name])
        fitted = time.perf_counter()
        lists = recommend(lambda csr, b=baseline: b.scores(csr[0], csr[1]), inputs, max(ks), cfg.batch_size)
        results[name] = {**_row(evaluate_lists(lists, held, ks)), "fit_seconds": fitted - started,
                         "seconds": time.perf_counter() - fitted}
    return results
