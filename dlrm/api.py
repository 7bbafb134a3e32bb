"""DLRM's Python API: one import, one call per job, and a trained model you can call.

    import dlrm
    from dlrm import api

    cfg = api.RunConfig(data=api.DataConfig(dataset="/data/criteo"), batch_size=4096,
                        train=api.TrainConfig(api.LRSchedule(lr=0.5), epochs=2, save_checkpoint_path="ckpt"),
                        output=api.OutputConfig(log_path="log.json"))
    result = api.train(cfg)                       # a TrainResult: .summary, .checkpoint_path, .load()
    model = dlrm.load("ckpt")                     # a TrainedModel, from the checkpoint alone
    scores = model.predict(numerical, categorical)  # click probabilities, numpy or torch as given
    tested = model.evaluate("/data/criteo")       # auc, loss, samples: what --mode test reports
    latency = api.benchmark_inference(cfg)        # {"inference": [one row per batch size], ...}
    sizing = api.plan(cfg)                        # {"processes": fewest that fit or None, "report": text}

Each job function is the job of ``python -m dlrm.scripts.main --mode <mode>``, which is flags ->
``RunConfig`` -> ``run_job`` here: the same settings give the same run (the flags map onto the
config one for one, ``dlrm.scripts.dlrm_flags``), with the same guarantees:

- every path the run writes is claimed before any work (``dlrm.engine.outputs``: nothing of the
  user's is replaced), and a training run holds its checkpoint's lock while it runs;
- a training run called from the main thread stops on SIGINT or SIGTERM after the step in
  flight, with its checkpoint saved (the summary's ``stop_reason`` is "interrupted" and
  ``signal`` the signal's number); the previous handlers are put back when the job ends;
- under torchrun (its variables in the environment) the job runs hybrid-parallel, one process
  each, and leaves the process group when done;
- user errors raise the library's exceptions, whose messages name the setting in backquotes:
  ``ValueError`` from ``RunConfig`` itself (checked again when the job starts, so a setting
  changed after the config was built is refused as at construction), ``SettingError`` (a ``ValueError``) for a setting
  the device or data cannot take, ``DatasetError``, ``CheckpointError``, ``OutputError``,
  ``PlanError``, and ``NonFiniteLoss`` (with the last finite checkpoint kept).

Each function runs its own mode whatever ``cfg.mode`` says (``train`` runs ``mode="train"``,
...; the config is checked again under it); ``run`` runs ``cfg.mode``. The run log
(``OutputConfig.log_path``) gets the settings as its first record, then what the CLI's run logs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import tempfile
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from dlrm.data.sources import DataConfig, make_source
from dlrm.distributed.planner import format_plan
from dlrm.distributed.sizing import format_sizing, size_processes
from dlrm.engine.checkpoint_store import CheckpointLock
from dlrm.engine.config_check import rechecked
from dlrm.engine.devices import resolve_device
from dlrm.engine.errors import DatasetError
from dlrm.engine.logger import RunLogger
from dlrm.engine.process_group import DistEnv, device_memory_bytes, dist_env, leave_processes
from dlrm.engine.signals import StopOnSignals
from dlrm.training.build import (
    Run, build_run, claim_outputs, host_cache_hit_rate, model_config, start_processes, start_training, table_bytes,
    validate_sources,
)
from dlrm.training.cuda_graphs import GraphedInference, batch_bag_limit
from dlrm.training.lr_schedule import LRSchedule
from dlrm.training.optimizers import OptimizerConfig
from dlrm.training.run_config import (
    CheckpointConfig, InferenceBenchmarkConfig, ModelSettings, OutputConfig, ParallelConfig, RunConfig, ServingConfig,
)
from dlrm.training.train import TrainConfig
from dlrm.training.train import evaluate as evaluate_split
from dlrm.training.train import train as train_loop
from dlrm.training.small_data import small_data_warning

__all__ = [
    "RunConfig", "DataConfig", "ModelSettings", "OptimizerConfig", "TrainConfig", "LRSchedule", "CheckpointConfig",
    "ParallelConfig", "OutputConfig", "InferenceBenchmarkConfig", "ServingConfig", "SettingError",
    "train", "evaluate", "benchmark_inference", "plan", "run", "load", "TrainedModel", "TrainResult", "Evaluation",
]

_FROM_ENVIRONMENT: Any = object()  # ``env``'s default: torchrun's variables when they are set


class SettingError(ValueError):
    """A setting of the run that the device, the data or the number of processes cannot take,
    found once the job looks at them; the message names the setting in backquotes."""


@contextlib.contextmanager
def _setting_errors() -> Iterator[None]:
    """A ``ValueError`` of a library call on the run's settings, as a ``SettingError``; the
    data's, checkpoint's and output rule's own errors (``ValueError`` subclasses) pass as they are."""
    try:
        yield
    except ValueError as e:
        if type(e) is not ValueError:
            raise
        raise SettingError(str(e)) from e


def train(cfg: RunConfig, env: DistEnv | None = _FROM_ENVIRONMENT) -> TrainResult:
    """Trains as ``cfg`` says (``mode="train"``); returns a ``TrainResult``: the run's summary
    (``steps``, ``epochs``, ``best_auc``, ``stop_reason`` ("completed", "auc_threshold",
    "interrupted"), throughput figures, ``last_lr``, ``signal`` (what stopped an interrupted run,
    else None) and, with a host-table cache, ``host_cache_hit_rate``), the checkpoint's path and
    the log's."""
    summary = run(cfg, env, mode="train")
    return TrainResult(summary=summary, checkpoint_path=cfg.train.save_checkpoint_path,
                       log_path=cfg.output.log_path)


def evaluate(cfg: RunConfig, env: DistEnv | None = _FROM_ENVIRONMENT) -> dict[str, Any]:
    """AUC and mean log loss of ``checkpoint.load_checkpoint_path`` on the test split
    (``mode="test"``; at ``serving``'s precision): ``auc``, ``loss``, ``samples``,
    ``average_test_throughput``. ``load(path).evaluate(dataset)`` builds ``cfg`` from the checkpoint."""
    return run(cfg, env, mode="test")


def benchmark_inference(cfg: RunConfig) -> dict[str, Any]:
    """Latency and throughput per batch size (``mode="inference_benchmark"``, ``cfg.benchmark``),
    of ``checkpoint.load_checkpoint_path`` or fresh weights: ``precision``, ``device``,
    ``threads`` and ``inference``, one dict per batch size (and host-copy variant on a GPU). One
    process: under torchrun it raises ``SettingError``, as ``--mode inference_benchmark`` does."""
    return run(cfg, mode="inference_benchmark")


def plan(cfg: RunConfig) -> dict[str, Any]:
    """The memory per process for 1, 2, 4, ... processes (up to ``plan_max_processes``) and the
    fewest that fit on devices of ``parallel.device_memory_gb`` (``mode="plan"``; nothing built):
    ``processes`` (None when none fits) and ``report``, the text ``--mode plan`` prints."""
    return run(cfg, mode="plan")


def run(cfg: RunConfig, env: DistEnv | None = _FROM_ENVIRONMENT, *, mode: str | None = None) -> dict[str, Any]:
    """The job of ``cfg.mode``, or of ``mode`` when given (the functions above), as a dict (a
    training run's is its summary). ``env``: the processes of a torchrun job (default:
    torchrun's variables, else one process). The config is checked again first, in its mode, so a
    setting changed since it was built is refused as at construction."""
    return run_job(cfg, env, mode=mode)


def _same_text(text: str) -> str:
    return text


@dataclasses.dataclass(frozen=True)
class CommandLine:
    """What a command line adds to its run, for ``dlrm.scripts.main`` (not part of the API):
    ``log_flags``, its flags as given, the run log's first record (None: the settings of the
    config); ``notes``, lines to print and log first; ``terms``, how the run's header names
    settings (a script's flags: ``dlrm.scripts.cli.flag_terms``)."""

    log_flags: dict[str, Any] | None = None
    notes: Sequence[str] = ()
    terms: Callable[[str], str] = _same_text


def run_job(cfg: RunConfig, env: DistEnv | None = _FROM_ENVIRONMENT, command_line: CommandLine = CommandLine(), *,
            mode: str | None = None) -> dict[str, Any]:
    """``run``, with what a command line adds (``CommandLine``): the one path every job takes."""
    cfg = rechecked(cfg, **({"mode": mode} if mode else {}))
    if env is _FROM_ENVIRONMENT:
        env = dist_env()
    with _setting_errors():
        device = resolve_device(cfg.base_device, env)
    if cfg.mode == "plan":
        if env is not None:
            raise SettingError("`mode=plan` sizes a run without running it: run it in one process, without torchrun")
        return _plan(cfg, device)
    if env is not None and cfg.mode == "inference_benchmark":
        raise SettingError("`mode=inference_benchmark` runs on one process: run it without torchrun")
    with _setting_errors():
        claim_outputs(cfg)  # before any work: nothing of the user's is replaced
    with _signals_restored():
        collectives = start_processes(cfg, env, device)
        output = cfg.output
        logger = RunLogger(output.log_path, enabled=collectives.rank == 0, tensorboard_dir=output.tensorboard_dir,
                           log_format=output.log_format)
        with logger:
            for note in command_line.notes:
                logger.print(note)
            with _setting_errors():
                shape = model_config(cfg, device)  # checked before the settings are recorded
                flags = command_line.log_flags
                logger.record("flags", **(flags if flags is not None else cfg.settings()))
                job = build_run(cfg, device, env, collectives, logger, shape)
            job.terms = command_line.terms
            logger.print(command_line.terms(_header(job, env)))
            result = _JOBS[cfg.mode](job)
        leave_processes(env)  # tear down together: gloo aborts if peers vanish mid-teardown
    return result


@contextlib.contextmanager
def _signals_restored() -> Iterator[None]:
    """The SIGINT and SIGTERM handlers as they were before the job, once it is over."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in before.items():
            if handler is not None:
                signal.signal(signum, handler)


def _header(run: Run, env: DistEnv | None) -> str:
    n_params = sum(p.numel() for p in run.model.parameters())
    held = "" if env is None else f" on rank 0 of {env.world_size}"
    forced = "; `amp_dtype` bfloat16 forces bf16" if run.precision.dtype is None else ""
    note = f" ({run.precision.note}{forced})" if run.precision.note else ""
    data = run.cfg.data
    return (f"DLRM: {len(run.model_cfg.table_sizes)} tables, {n_params:,} parameters{held}, device {run.device}, "
            f"precision {run.precision}{note}, data {data.dataset_type}{' ' + data.dataset if data.dataset else ''}")


def _train(run: Run) -> dict[str, Any]:
    """Trains (from ``load_checkpoint_path``'s weights, or continuing a run with ``resume``)."""
    cfg = run.cfg
    save_path = cfg.train.save_checkpoint_path
    saves = save_path and run.collectives.rank == 0  # the first process renames into place
    in_main_thread = threading.current_thread() is threading.main_thread()
    with CheckpointLock(save_path) if saves else contextlib.nullcontext():
        optimizer, scaler, state = start_training(run)
        train_source = run.source("train", cfg.batch_size)
        test_source = run.source("test", cfg.test_batch_size)
        validate_sources(run, train_source, test_source)
        warning = small_data_warning(len(train_source), cfg.batch_size, getattr(train_source, "num_samples", None),
                                     run.model_cfg.table_sizes, getattr(test_source, "num_samples", None),
                                     cfg.test_batch_size)
        if warning is not None:
            run.logger.print(run.terms(warning))
            run.logger.record("warning", message=warning)
        stop = StopOnSignals() if in_main_thread else None  # signal handlers: the main thread's only
        try:
            summary = train_loop(run.model, optimizer, scaler, run.precision, train_source, test_source, cfg.train,
                                 run.device, run.logger, state=state, run_config=cfg.to_dict(),
                                 should_stop=stop.event.is_set if stop else lambda: False,
                                 collectives=run.collectives, seed=cfg.seed,
                                 max_bag_values=batch_bag_limit(run.spec, cfg.batch_size))
        finally:
            if stop is not None:
                stop.over()
    summary = dict(summary)
    summary["signal"] = stop.signum if stop is not None and summary["stop_reason"] == "interrupted" else None
    hit_rate = host_cache_hit_rate(run.model)
    if hit_rate is not None:  # the share of host-table lookups the device cache served
        run.logger.print(f"Host table cache: hit rate {hit_rate:.4f}")
        run.logger.record("host_cache", host_cache_hit_rate=hit_rate)
        summary["host_cache_hit_rate"] = hit_rate
    return summary


def _quantize(run: Run) -> None:
    """``serving``: the loaded model's tables stored at the serving precision (one process)."""
    serving = run.cfg.serving
    if not serving.quantizing:
        return
    if run.collectives.world_size > 1:
        raise SettingError("`quantize_tables` serves the whole model from one process: run it without torchrun")
    from dlrm.inference.quantize import describe, quantize_model

    with _setting_errors():
        run.model = quantize_model(run.model, serving.quantize_tables, serving.quantize_min_rows)
    run.logger.print(f"Serving precision: {describe(run.model)}")


def _test(run: Run) -> dict[str, Any]:
    """AUC and loss of ``load_checkpoint_path`` on the test split (at ``serving``'s precision)."""
    run.load()
    _quantize(run)
    test_source = run.source("test", run.cfg.test_batch_size)
    if test_source is None:
        raise DatasetError(f"the dataset at {run.cfg.data.dataset} has no test split: `mode=test` evaluates on it")
    validate_sources(run, test_source)
    forward = GraphedInference(run.model, run.precision) if run.cfg.train.cuda_graphs else None
    result = evaluate_split(run.model, test_source, run.device, run.precision, collectives=run.collectives,
                            forward=forward, auc_device=run.cfg.train.auc_device)
    run.logger.print(f"Test: auc {result.auc:.6f}  loss {result.loss:.6f}  samples {result.samples}  "
                     f"throughput {result.throughput:,.0f} samples/s")
    summary = {"auc": result.auc, "loss": result.loss, "samples": result.samples,
               "average_test_throughput": result.throughput}
    run.logger.record("summary", **summary)
    return summary


def _benchmark(run: Run) -> dict[str, Any]:
    """Latency and throughput per batch size, of the eager model, its CUDA graphs or an export."""
    from dlrm.inference.benchmark import benchmark_inference as time_batches
    from dlrm.inference.benchmark import exported_forward, format_table

    cfg, settings = run.cfg, run.cfg.benchmark
    if cfg.checkpoint.load_checkpoint_path:
        run.load()
    _quantize(run)
    data = cfg.data
    split = "test" if data.synthetic or "test" in run.spec.splits else "train"
    available = make_source(data, run.spec, split, 1, run.device, seed=cfg.seed).num_samples
    for batch_size in settings.inference_benchmark_batch_sizes:
        if not 0 < batch_size <= available:
            raise SettingError(
                f"`inference_benchmark_batch_sizes`: {batch_size} is not between 1 and the {available} samples of "
                f"the {split} split; choose batch sizes in that range")

    def batches_for(batch_size: int) -> list:
        source = make_source(data, run.spec, split, batch_size, run.device, seed=cfg.seed)
        full = [i for i in range(len(source)) if i < len(source) - 1 or source.num_samples % batch_size == 0]
        return [source.read_batch(i) for i in full[:8]]

    backend, threads = settings.inference_benchmark_backend, settings.inference_benchmark_threads
    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="dlrm-benchmark-") as export_dir:
        if backend != "eager":
            with _setting_errors():
                forward = exported_forward(run.model, backend, export_dir, run.device, threads)
        elif cfg.train.cuda_graphs:
            forward, backend = GraphedInference(run.model, run.precision), "cuda_graphs"
        else:
            forward = None
        results = time_batches(
            run.model, batches_for, settings.inference_benchmark_batch_sizes, settings.inference_benchmark_steps,
            max(cfg.train.benchmark_warmup_steps, 10), run.device, run.precision, forward=forward, backend=backend,
        )
    used = torch.get_num_threads()
    run.logger.print(f"Inference benchmark ({run.precision}, device {run.device}, CPU threads {used}):\n"
                     f"{format_table(results)}")
    for r in results:
        run.logger.record("inference_benchmark", precision=str(run.precision), device=str(run.device),
                          threads=used, **r.as_dict())
    rows = [r.as_dict() for r in results]
    run.logger.record("summary", inference=rows)
    return {"precision": str(run.precision), "device": str(run.device), "threads": used, "inference": rows}


def _plan(cfg: RunConfig, device: torch.device) -> dict[str, Any]:
    """Per-process memory for 1, 2, 4, ... processes and the fewest that fit, as text."""
    from dlrm.inference.quantize import host_memory_bytes, serving_report, table_precisions

    if cfg.parallel.device_memory_gb is None and device.type != "cuda":
        raise SettingError("`mode=plan` sizes for the devices the run will use: pass `device_memory_gb` "
                           "(e.g. 80 for an H100)")
    with _setting_errors():
        _, model_cfg = model_config(cfg, device)
    memory_gb = cfg.parallel.device_memory_gb
    device_bytes = int(memory_gb * 2**30) if memory_gb else device_memory_bytes(device, 1)
    optimizer = cfg.optimizer
    counts = list(range(1, cfg.plan_max_processes + 1))
    sizings = size_processes(model_cfg, cfg.batch_size, device_bytes, counts,
                             state_bytes_per_row=optimizer.state_bytes_per_row(model_cfg.embedding_dim),
                             bytes_per_value=table_bytes(cfg, model_cfg)["bytes_per_value"],
                             dense_state_bytes=optimizer.dense_state_bytes(), compute_bytes=2 if cfg.amp else 4)
    fits = [s for s in sizings if s.plan is not None]
    shown = [s for s in sizings if s.processes & (s.processes - 1) == 0 or (fits and s is fits[0])]
    lines = [f"DLRM: {len(model_cfg.table_sizes)} tables, {sum(model_cfg.table_sizes):,} rows, dim "
             f"{model_cfg.embedding_dim}, batch {cfg.batch_size}, {optimizer.embedding} tables, "
             f"{'AMP' if cfg.amp else 'fp32'} compute", format_sizing(shown, device_bytes)]
    with _setting_errors():
        chosen = table_precisions(model_cfg.table_sizes, cfg.serving.quantize_tables, cfg.serving.quantize_min_rows,
                                  model_cfg.embedding_dim)
    lines.append("\n" + serving_report(model_cfg, device_bytes, host_memory_bytes(), chosen))
    if not fits:
        lines.append(f"No number of processes up to {cfg.plan_max_processes} fits: raise `plan_max_processes`, "
                     "lower `batch_size`, or use `embedding_dtype` bf16")
        return {"processes": None, "report": "\n".join(lines)}
    best = fits[0]
    lines.append(f"\nFewest processes: {best.processes}. Their placement:\n{format_plan(best.plan)}")
    lines.append(f"\nOn Spark: python -m dlrm.scripts.spark_train --num_processes {best.processes} --use_gpu "
                 f"--spark_conf spark.task.resource.gpu.amount=1 -- <these flags>: {best.processes} task"
                 f"{'s' if best.processes > 1 else ''} of one GPU "
                 "(spark.executor.resource.gpu.amount = GPUs per executor, spark.executor.cores at least that many)")
    return {"processes": best.processes, "report": "\n".join(lines)}


_JOBS = {"train": _train, "test": _test, "inference_benchmark": _benchmark}


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What ``train`` hands back: the run's ``summary`` (also read as ``result["best_auc"]`` or
    ``result.best_auc``), where its checkpoint and log are, and ``load()`` for the trained model."""

    summary: dict[str, Any]
    checkpoint_path: str | None  # ``save_checkpoint_path``; None when the run saved none
    log_path: str | None = None  # ``output.log_path``

    def __getitem__(self, key: str) -> Any:
        return self.summary[key]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "summary":  # not a summary field (and not yet set while unpickling)
            raise AttributeError(name)
        try:
            return self.summary[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no attribute or summary field {name!r}") from None

    def load(self, device: str | torch.device = "cpu", **serving: Any) -> TrainedModel:
        """The trained model, from the run's checkpoint (``load``'s arguments)."""
        if not self.checkpoint_path:
            raise SettingError("the run saved no checkpoint to load: train with `save_checkpoint_path`")
        return load(self.checkpoint_path, device, **serving)


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """A checkpoint's scores on a test split, as ``--mode test`` reports them."""

    auc: float
    loss: float  # mean log loss
    samples: int
    throughput: float  # samples per second


def load(checkpoint: str, device: str | torch.device = "cpu", *, quantize_tables: str | Sequence[str] = "fp32",
         quantize_min_rows: int = 0) -> TrainedModel:
    """The model of ``checkpoint`` (this program's layout or NVIDIA's), built from the checkpoint
    alone, on ``device``, in eval mode. ``quantize_tables`` and ``quantize_min_rows`` serve its
    tables at a lower precision, as ``ServingConfig``'s settings of the same names do."""
    from dlrm.inference.export import build_inference_model

    serving = ServingConfig(quantize_tables=quantize_tables, quantize_min_rows=quantize_min_rows)
    with _setting_errors():
        where = resolve_device(str(device), None)
        module = build_inference_model(checkpoint, where, serving.quantize_tables, serving.quantize_min_rows)
    return TrainedModel(module, checkpoint, where, serving)


Inputs = Any  # a numpy array or a torch tensor


class TrainedModel:
    """A trained DLRM to score with: ``predict`` on arrays in memory, ``evaluate`` on a dataset.
    ``module`` is the torch module (``DLRM``), ``config`` its ``DLRMConfig``."""

    def __init__(self, module: torch.nn.Module, checkpoint: str, device: torch.device,
                 serving: ServingConfig) -> None:
        self.module = module
        self.checkpoint = checkpoint
        self.device = device
        self.serving = serving

    @property
    def config(self) -> Any:
        return self.module.config

    def __repr__(self) -> str:
        c = self.config
        return (f"TrainedModel({self.checkpoint!r}: {c.num_numerical_features} numerical, "
                f"{c.num_categorical_features} categorical features, device {self.device})")

    def predict(self, numerical: Inputs, categorical: Inputs, *, batch_size: int = 65536) -> Inputs:
        """Click probabilities ``[N]`` of ``numerical`` ``[N, F]`` (floats) and ``categorical``
        ``[N, T]`` (integer ids; or ``dlrm.data.batch.Bags`` of multi-hot ids, scored as one
        batch), in batches of ``batch_size``, in eval mode, without gradients. A numpy
        ``numerical`` gives a numpy float32 array; a tensor gives a float32 tensor on its device."""
        from dlrm.data.batch import Bags

        if batch_size < 1:
            raise SettingError(f"`batch_size` must be at least 1, got {batch_size}")
        as_numpy = isinstance(numerical, np.ndarray)
        home = torch.device("cpu") if as_numpy else getattr(numerical, "device", torch.device("cpu"))
        num = self._numerical(numerical)
        if isinstance(categorical, Bags):
            batches = [(num, self._bags(categorical, num.shape[0]))]
        else:
            cat = self._categorical(categorical, num.shape[0])
            batches = [(num[i:i + batch_size], cat[i:i + batch_size]) for i in range(0, num.shape[0], batch_size)]
        self.module.eval()
        with torch.no_grad():
            scores = [torch.sigmoid(self.module(n.to(self.device), c.to(self.device)).float().reshape(-1))
                      for n, c in batches]
        out = torch.cat(scores) if scores else torch.zeros(0)
        return out.cpu().numpy() if as_numpy else out.to(home)

    def _numerical(self, values: Inputs) -> torch.Tensor:
        """``values`` as a float tensor ``[N, F]`` with the model's ``F``."""
        tensor = _tensor_of(values, "numerical")
        want = self.config.num_numerical_features
        if tensor.dim() != 2 or tensor.shape[1] != want:
            raise SettingError(f"`numerical`: shape {tuple(tensor.shape)}; the model takes [N, {want}]")
        tensor = tensor if tensor.is_floating_point() else tensor.float()
        if not bool(torch.isfinite(tensor).all()):  # as the dataset reader refuses them: a nan score otherwise
            row = int((~torch.isfinite(tensor)).any(dim=1).nonzero()[0])
            raise SettingError(f"`numerical`: row {row} holds a value that is not finite (nan or inf)")
        return tensor

    def _categorical(self, values: Inputs, n: int) -> torch.Tensor:
        """``values`` as int64 ids ``[n, T]`` with the model's ``T``."""
        tensor = _tensor_of(values, "categorical")
        want = self.config.num_categorical_features
        if tensor.dim() != 2 or tuple(tensor.shape) != (n, want):
            raise SettingError(f"`categorical`: shape {tuple(tensor.shape)}; the model takes [{n}, {want}] "
                               "(as many rows as `numerical`, one id per table)")
        if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
            raise SettingError(f"`categorical`: ids must be integers, got {tensor.dtype}")
        tensor = tensor.long()
        bad = tensor < 0
        if not self.config.hash_indices:  # a hashing model maps any id >= 0 into its rows
            bad |= tensor >= torch.tensor(self.config.table_sizes, device=tensor.device)
        if bool(bad.any()):
            row, column = (int(i) for i in bad.nonzero()[0])
            raise SettingError(f"`categorical`: row {row}, table {column} has id {int(tensor[row, column])}; the "
                               f"table's ids run from 0 to {self.config.table_sizes[column] - 1}"
                               + ("" if self.config.hash_indices else " (a model trained with `hash_indices` "
                                  "maps larger ids into its rows; this one was not)"))
        return tensor

    def _bags(self, bags: Any, n: int) -> Any:
        """Multi-hot ``bags`` of ``n`` samples with the model's ``T`` features, on its device."""
        want = self.config.num_categorical_features
        if bags.batch_size != n or bags.num_features != want:
            raise SettingError(f"`categorical`: bags of {bags.batch_size} samples and {bags.num_features} features; "
                               f"the model takes {n} samples (as `numerical` has) and {want} features")
        return dataclasses.replace(bags, values=bags.values.to(self.device), offsets=bags.offsets.to(self.device))

    def evaluate(self, dataset: str, *, batch_size: int = 65536, feature_spec: str = "feature_spec.yaml",
                 log_path: str | None = None) -> Evaluation:
        """AUC and mean log loss on ``dataset``'s test split (split-binary), computed by
        ``evaluate``, the job of ``--mode test``: the same numbers for the same checkpoint, data
        and ``batch_size`` (``--test_batch_size``); the model is the checkpoint's, as there.
        ``log_path``: a run log to write, as ``--log_path``."""
        cfg = RunConfig(mode="test", base_device=str(self.device), test_batch_size=batch_size,
                        data=DataConfig(dataset=dataset, feature_spec=feature_spec,
                                        hash_indices=self.config.hash_indices),
                        checkpoint=CheckpointConfig(load_checkpoint_path=self.checkpoint),
                        serving=self.serving, output=OutputConfig(log_path=log_path))
        scored = evaluate(cfg, env=None)
        return Evaluation(auc=scored["auc"], loss=scored["loss"], samples=scored["samples"],
                          throughput=scored["average_test_throughput"])


def _tensor_of(values: Inputs, name: str) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values
    if isinstance(values, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(values))
    raise SettingError(f"`{name}`: a numpy array or a torch tensor, got {type(values).__name__}")
