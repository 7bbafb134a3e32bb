"""The predict job: what ``recommender_predict`` runs, from one ``PredictConfig``. Every user of
a CSR dataset is scored by a checkpoint's model, their seen (and filtered) items removed, and
the top K written in DSSTNE's format, with names from the index files beside the dataset.

Scoring and top K are ``dlrm.recommender.predict``'s (``recommend``), the code the in-memory
``Recommender`` (``dlrm.recommender.handle``) runs too; this module is the job around it: the
outputs claimed before any work, the names, the file, the processes under torchrun.
"""

from __future__ import annotations

import os
import time
from typing import Any

from dlrm.recommender.job_steps import (amp_dtype_of, check_dataset_dir, dist_env, job_config, open_dataset,
                                        resolve_device)
from dlrm.recommender.run_config import ConfigError, PredictConfig


def index_beside(given: str | None, input_path: str, name: str) -> tuple[str | None, bool]:
    """(the index file to name items or users by, whether it was found rather than given): the
    file given, else recommender_generate's ``name`` beside the ``input`` dataset (DIR/``name``
    for DIR/input), else None (numbers)."""
    if given:
        return given, False
    candidate = os.path.join(os.path.dirname(os.path.abspath(input_path)), name)
    return (candidate, True) if os.path.isfile(candidate) else (None, False)


def _names(setting: str, given: str | None, input_path: str, count: int, exact: bool) -> list[str]:
    """``count`` names from the index file of ``setting``: the one given, else recommender_generate's
    beside ``input``; row/column numbers without one (or with ""), said in a line."""
    from dlrm.recommender.dsstne_text import NameIndex

    name = f"{setting}.txt"
    if given == "":  # numbers, as asked
        return [str(i) for i in range(count)]
    path, found = index_beside(given, input_path, name)
    what = "users of input" if setting == "samples_index" else "items of the checkpoint's network"
    numbers = "row numbers for users" if setting == "samples_index" else "column numbers for items"
    if not path:
        print(f"note: writing {numbers}: no {setting}, and no {name} beside the input", flush=True)
        return [str(i) for i in range(count)]
    if not os.path.isfile(path):
        raise ConfigError(f"`{setting}` {path}: no such file")
    index = NameIndex.load(path)
    if index.size < count or (exact and index.size != count):
        if found:
            print(f"note: writing {numbers}: {path} beside the input names {index.size:,} entries, not the "
                  f"{count:,} {what}; give {setting}", flush=True)
            return [str(i) for i in range(count)]
        raise ConfigError(f"`{setting}` {path} names {index.size:,} entries for the {count:,} {what}; give the "
                          f"index written with that dataset")
    if found:
        print(f"names of the {what.split(' of ')[0]} from {path} (beside the input)", flush=True)
    return index.labels(count)


def is_scores(path: str) -> bool:
    """Whether file ``path`` is a float32 .npy of [samples, items], as ``scores_path`` is written."""
    import numpy as np

    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)
    except (OSError, ValueError):
        return False
    return dtype == np.float32 and len(shape) == 2


def _scores_kind():
    from dlrm.engine.outputs import OutputKind

    return OutputKind("scores file", directory=False, recognise=is_scores)


def predict(cfg: PredictConfig | str | None = None, /, *args: Any, **settings: Any) -> dict[str, Any]:
    """Writes the top ``cfg.k`` items of every user of ``cfg.input`` to ``cfg.output`` (DSSTNE's
    format), scored by the checkpoint at ``cfg.load_checkpoint_path`` (its PATH.best with
    ``best``), as ``recommender_predict`` (whose flags are the config's fields) does.
    ``predict(load_checkpoint_path, input, output, k=10, ...)`` is the same call: the arguments
    make the ``PredictConfig``; a config with arguments beside it is a ``TypeError``. Returns
    {"users", "items", "k", "seconds", "filters", "exclude_inputs", "processes", "first"}
    ("first": this process wrote the file)."""
    cfg = job_config("predict", PredictConfig, cfg, args, settings)
    env = dist_env()
    _claim_outputs(cfg, env)
    from dlrm.recommender import checkpoint
    from dlrm.recommender.item_parallel import ItemParallel

    device = resolve_device(cfg.base_device, env)
    amp_dtype = amp_dtype_of(cfg.amp, cfg.amp_dtype, device)
    path = checkpoint.model_path(cfg.load_checkpoint_path, cfg.best)
    n_input, n_output = checkpoint.sizes_of(path)
    inputs, filters = _datasets(cfg, n_input)
    item_names = _names("features_index", cfg.features_index, cfg.input, n_output, exact=False)
    user_names = _names("samples_index", cfg.samples_index, cfg.input, len(inputs), exact=True)

    from dlrm.engine.process_group import join_processes, leave_processes  # torch: imported when a run starts

    join_processes(env, device, cfg.dist_timeout)
    parallel = ItemParallel.from_process_group()
    score, item_start = checkpoint.load_scorer(path, parallel, device, amp_dtype)
    first = parallel.rank == 0
    if first:
        print(f"model: {checkpoint.describe(path)}", flush=True)
    started = time.perf_counter()
    lines = _write(cfg, score, item_start, inputs, filters, parallel, (user_names, item_names), n_output)
    # Scoring, exclusion, top K and writing; loading the model and the data is not counted.
    seconds = time.perf_counter() - started
    processes = parallel.world_size
    leave_processes(env)
    return {"users": lines, "items": n_output, "k": cfg.k, "seconds": seconds, "filters": len(filters),
            "exclude_inputs": cfg.exclude_inputs, "processes": processes, "first": first}


def _claim_outputs(cfg: PredictConfig, env) -> None:
    """Before any work (``dlrm.engine.outputs``): each output file is new, or this program's own
    of its kind and ``overwrite`` given; none is an input of the run or the other output; the
    first process can create them (a read-only or missing file system fails now)."""
    from dlrm.engine.storage import check_can_create
    from dlrm.engine.outputs import claim_output
    from dlrm.recommender.prediction_file import PREDICTIONS

    output, scores_path, filters = cfg.output, cfg.scores_path, list(cfg.filter)
    if scores_path and env is not None and env.world_size > 1:
        raise ConfigError("`scores_path` writes one file from one process; run without torchrun to dump the "
                          "scores, or drop `scores_path`")
    for setting, path in [("input", cfg.input)] + [("filter", p) for p in filters]:
        check_dataset_dir(setting, path)  # before torch loads: a mistyped path fails at once
    named = {"load_checkpoint_path": cfg.load_checkpoint_path, "input": cfg.input, "filter": filters,
             "features_index": cfg.features_index, "samples_index": cfg.samples_index}
    claimed = claim_output(output, PREDICTIONS, "output", inputs=named, replace=cfg.overwrite)
    if scores_path:
        scores_claim = claim_output(scores_path, _scores_kind(), "scores_path", inputs=named, replace=cfg.overwrite)
        if os.path.realpath(scores_claim) == os.path.realpath(claimed):
            raise ConfigError(f"`scores_path` {scores_path} and `output` {output} name the same file; give each its "
                              f"own")
    if env is None or env.rank == 0:
        check_can_create(output, "the predictions")
        if scores_path:
            check_can_create(scores_path, "the scores")


def _datasets(cfg: PredictConfig, n_input: int):
    """(the input dataset, the filter datasets), checked against the model and each other."""
    inputs = open_dataset("input", cfg.input)
    if inputs.n_features != n_input:
        raise ConfigError(f"`input` {cfg.input} has {inputs.n_features:,} items, the checkpoint's model {n_input:,} "
                          f"inputs; give the dataset (and features index) it was trained on")
    filters = [open_dataset("filter", p) for p in cfg.filter]
    for f in filters:
        if len(f) != len(inputs):
            raise ConfigError(f"`filter` {f.path} has {len(f):,} users, `input` {len(inputs):,}: they must hold the "
                              f"same users in the same order")
    return inputs, filters


def _write(cfg: PredictConfig, score, item_start: int, inputs, filters, parallel, names, n_output: int) -> int:
    """Ranks every user and writes the file (and ``scores_path``) from the first process, the
    others taking part in the merge of each batch; returns the lines written (0 on the others)."""
    import numpy as np

    from dlrm.engine.atomic import write_atomically
    from dlrm.engine.storage import check_free_space
    from dlrm.recommender.predict import recommend, write_predictions

    user_names, item_names = names

    def batches(scores=None):
        done = 0

        def scored(csr):
            nonlocal done
            values = score(csr)
            if scores is not None:  # before recommend() writes -inf over the excluded items
                scores[done:done + values.shape[0]] = values.float().cpu().numpy()
                done += values.shape[0]
            return values

        return recommend(scored, inputs, cfg.k, cfg.batch_size, item_start=item_start, exclude=filters,
                         exclude_inputs=cfg.exclude_inputs, parallel=parallel)

    if parallel.rank != 0:
        for _ in batches():  # the collectives of the merge, in step with the first process
            pass
        return 0
    if not cfg.scores_path:
        return write_predictions(cfg.output, batches(), user_names, item_names, cfg.score_format)
    lines = 0
    check_free_space(cfg.scores_path, len(inputs) * n_output * 4, "the scores")

    def write_scores(tmp: str) -> None:
        nonlocal lines
        scores = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(len(inputs), n_output))
        with open(tmp, "rb+") as f:  # claim the blocks: a full disk is an error now, not a SIGBUS in the memmap
            os.posix_fallocate(f.fileno(), 0, os.path.getsize(tmp))
        lines = write_predictions(cfg.output, batches(scores), user_names, item_names, cfg.score_format)
        scores.flush()
        del scores

    write_atomically(cfg.scores_path, write_scores, "the scores")
    return lines
