"""Train, test and benchmark a DLRM on one device, or hybrid-parallel on several.

    python -m dlrm.scripts.main                                  # synthetic data with signal
    torchrun --nproc_per_node 8 -m dlrm.scripts.main --dataset /data/criteo_fl15 --amp
    python -m dlrm.scripts.main --dataset /data/criteo_fl15      # a split-binary dataset
    python -m dlrm.scripts.main --mode test --dataset ... --load_checkpoint_path ckpt/
    python -m dlrm.scripts.main --mode inference_benchmark --inference_benchmark_batch_sizes 1,64,4096

Flags follow NVIDIA's DLRM example where a flag of the same name exists there, and every flag of
NVIDIA's main.py is accepted: those this program adds for them are in dlrm.scripts.nvidia_flags
(--helpfull lists them with what each maps to).
"""

from __future__ import annotations

import contextlib
import tempfile

import torch
from absl import app, flags

from dlrm.data.sources import make_source
from dlrm.distributed.planner import format_plan
from dlrm.distributed.sizing import format_sizing, size_processes
from dlrm.engine.devices import resolve_device
from dlrm.engine.logger import RunLogger
from dlrm.engine.process_group import DistEnv, device_memory_bytes
from dlrm.engine.signals import StopOnSignals
from dlrm.inference.benchmark import benchmark_inference, exported_forward, format_table
from dlrm.scripts import cli, dlrm_flags, nvidia_flags, serving_flags
from dlrm.scripts.dlrm_flags import check_args  # noqa: F401  (spark_train and the tests check flags through main)
from dlrm.training.build import Run, build_run, model_config, start_processes, start_training
from dlrm.training.build import claim_outputs, host_cache_hit_rate, table_bytes, validate_sources
from dlrm.training.checkpoint import CheckpointLock
from dlrm.training.cuda_graphs import GraphedInference
from dlrm.training.run_config import RunConfig
from dlrm.training.train import evaluate, train

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(dlrm_flags)  # --help lists them as this script's own


@contextlib.contextmanager
def _usage_errors():
    """A setting the library refuses (``ValueError``) as the one-line usage error naming the flag."""
    try:
        yield
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def _header(run: Run, env: DistEnv | None) -> str:
    n_params = sum(p.numel() for p in run.model.parameters())
    held = "" if env is None else f" on rank 0 of {env.world_size}"
    forced = "; --amp_dtype bfloat16 forces bf16" if run.precision.dtype is None else ""
    note = f" ({run.precision.note}{forced})" if run.precision.note else ""
    data = run.cfg.data
    return (f"DLRM: {len(run.model_cfg.table_sizes)} tables, {n_params:,} parameters{held}, device {run.device}, "
            f"precision {run.precision}{note}, data {data.dataset_type}{' ' + data.dataset if data.dataset else ''}")


def _run_train(run: Run) -> int:
    """Trains (from --load_checkpoint_path's weights, or continuing a run with --resume); returns
    the exit code: 0, or 128 + the signal that stopped the run after its checkpoint was saved."""
    cfg = run.cfg
    save_path = cfg.train.save_checkpoint_path
    saves = save_path and run.collectives.rank == 0  # the first process renames into place
    with CheckpointLock(save_path) if saves else contextlib.nullcontext():
        optimizer, scaler, state = start_training(run)
        train_source = run.source("train", cfg.batch_size)
        test_source = run.source("test", cfg.test_batch_size)
        validate_sources(run, train_source, test_source)
        stop = StopOnSignals()
        try:
            summary = train(run.model, optimizer, scaler, run.precision, train_source, test_source, cfg.train,
                            run.device, run.logger, state=state, run_config=cli.our_flags(),
                            should_stop=stop.event.is_set, collectives=run.collectives)
        finally:
            stop.over()
    hit_rate = host_cache_hit_rate(run.model)
    if hit_rate is not None:  # the share of host-table lookups the device cache served
        run.logger.print(f"Host table cache: hit rate {hit_rate:.4f}")
        run.logger.record("host_cache", host_cache_hit_rate=hit_rate)
    return stop.exit_code_of(summary["stop_reason"])


def _quantize(run: Run) -> None:
    """--quantize_tables: the loaded model's tables stored at the serving precision (one process)."""
    chosen = serving_flags.quantize_tables()
    if chosen == "fp32" and not FLAGS.quantize_min_rows:
        return
    if run.collectives.world_size > 1:
        raise app.UsageError("--quantize_tables serves the whole model from one process: start it without torchrun")
    from dlrm.inference.quantize import describe, quantize_model

    with _usage_errors():
        run.model = quantize_model(run.model, chosen, FLAGS.quantize_min_rows)
    run.logger.print(f"Serving precision: {describe(run.model)}")


def _run_test(run: Run) -> int:
    """AUC and loss of --load_checkpoint_path on the test split (at --quantize_tables' precision)."""
    run.load()
    _quantize(run)
    test_source = run.source("test", run.cfg.test_batch_size)
    if test_source is None:
        raise app.UsageError(f"the dataset at {run.cfg.data.dataset} has no test split")
    validate_sources(run, test_source)
    forward = GraphedInference(run.model, run.precision) if run.cfg.train.cuda_graphs else None
    result = evaluate(run.model, test_source, run.device, run.precision, collectives=run.collectives, forward=forward,
                      auc_device=run.cfg.train.auc_device)
    run.logger.print(f"Test: auc {result.auc:.6f}  loss {result.loss:.6f}  samples {result.samples}  "
                     f"throughput {result.throughput:,.0f} samples/s")
    run.logger.record("summary", auc=result.auc, loss=result.loss, samples=result.samples,
                      average_test_throughput=result.throughput)
    return 0


def _run_inference_benchmark(run: Run) -> int:
    """Latency and throughput per batch size, of the eager model, its CUDA graphs or an export."""
    if run.cfg.checkpoint.load_checkpoint_path:
        run.load()
    _quantize(run)
    batch_sizes = [int(size) for size in FLAGS.inference_benchmark_batch_sizes]  # parsed by run_config
    data = run.cfg.data
    split = "test" if data.synthetic or "test" in run.spec.splits else "train"
    available = make_source(data, run.spec, split, 1, run.device).num_samples
    for batch_size in batch_sizes:
        if not 0 < batch_size <= available:
            raise app.UsageError(
                f"--inference_benchmark_batch_sizes: {batch_size} is not between 1 and the {available} "
                f"samples of the {split} split; choose batch sizes in that range")

    def batches_for(batch_size: int) -> list:
        source = make_source(data, run.spec, split, batch_size, run.device)
        full = [i for i in range(len(source)) if i < len(source) - 1 or source.num_samples % batch_size == 0]
        return [source.read_batch(i) for i in full[:8]]

    backend, cuda_graphs = FLAGS.inference_benchmark_backend, run.cfg.train.cuda_graphs
    if backend != "eager" and (run.cfg.amp or cuda_graphs):
        raise app.UsageError(f"--inference_benchmark_backend {backend} runs the exported float32 graph: "
                             "drop --amp and --cuda_graphs")
    if FLAGS.inference_benchmark_threads:
        torch.set_num_threads(FLAGS.inference_benchmark_threads)
    with tempfile.TemporaryDirectory(prefix="dlrm-benchmark-") as export_dir:
        if backend != "eager":
            with _usage_errors():
                forward = exported_forward(run.model, backend, export_dir, run.device, FLAGS.inference_benchmark_threads)
        elif cuda_graphs:
            forward, backend = GraphedInference(run.model, run.precision), "cuda_graphs"
        else:
            forward = None
        results = benchmark_inference(
            run.model, batches_for, batch_sizes, FLAGS.inference_benchmark_steps,
            max(run.cfg.train.benchmark_warmup_steps, 10), run.device, run.precision, forward=forward, backend=backend,
        )
    threads = torch.get_num_threads()
    run.logger.print(f"Inference benchmark ({run.precision}, device {run.device}, CPU threads {threads}):\n"
                     f"{format_table(results)}")
    for r in results:
        run.logger.record("inference_benchmark", precision=str(run.precision), device=str(run.device),
                          threads=threads, **r.as_dict())
    run.logger.record("summary", inference=[r.as_dict() for r in results])
    return 0


def _run_plan(cfg: RunConfig, device: torch.device) -> int:
    """--mode plan: per-process memory for 1, 2, 4, ... processes and the fewest that fit."""
    if cfg.parallel.device_memory_gb is None and device.type != "cuda":
        raise app.UsageError("--mode plan sizes for the devices the run will use: pass --device_memory_gb "
                             "(e.g. 80 for an H100)")
    with _usage_errors():
        _, model_cfg = model_config(cfg, device)
    memory_gb = cfg.parallel.device_memory_gb
    device_bytes = int(memory_gb * 2**30) if memory_gb else device_memory_bytes(device, 1)
    optimizer = cfg.optimizer
    counts = list(range(1, FLAGS.plan_max_processes + 1))
    sizings = size_processes(model_cfg, cfg.batch_size, device_bytes, counts,
                             state_bytes_per_row=optimizer.state_bytes_per_row(model_cfg.embedding_dim),
                             bytes_per_value=table_bytes(cfg, model_cfg)["bytes_per_value"],
                             dense_state_bytes=optimizer.dense_state_bytes(), compute_bytes=2 if cfg.amp else 4)
    fits = [s for s in sizings if s.plan is not None]
    shown = [s for s in sizings if s.processes & (s.processes - 1) == 0 or (fits and s is fits[0])]
    print(f"DLRM: {len(model_cfg.table_sizes)} tables, {sum(model_cfg.table_sizes):,} rows, dim "
          f"{model_cfg.embedding_dim}, batch {cfg.batch_size}, {optimizer.embedding} tables, "
          f"{'AMP' if cfg.amp else 'fp32'} compute")
    print(format_sizing(shown, device_bytes))
    from dlrm.inference.quantize import host_memory_bytes, serving_report, table_precisions

    with _usage_errors():
        chosen = table_precisions(model_cfg.table_sizes, serving_flags.quantize_tables(), FLAGS.quantize_min_rows,
                                  model_cfg.embedding_dim)
    print("\n" + serving_report(model_cfg, device_bytes, host_memory_bytes(), chosen))
    if not fits:
        print(f"No number of processes up to {FLAGS.plan_max_processes} fits: raise --plan_max_processes, lower "
              "--batch_size, or use --embedding_dtype bf16")
        return 1
    best = fits[0]
    print(f"\nFewest processes: {best.processes}. Their placement:\n{format_plan(best.plan)}")
    print(f"\nOn Spark: python -m dlrm.scripts.spark_train --num_processes {best.processes} --use_gpu "
          f"--spark_conf spark.task.resource.gpu.amount=1 -- <these flags>: {best.processes} task"
          f"{'s' if best.processes > 1 else ''} of one GPU "
          "(spark.executor.resource.gpu.amount = GPUs per executor, spark.executor.cores at least that many)")
    return 0


MODES = {"train": _run_train, "test": _run_test, "inference_benchmark": _run_inference_benchmark}


def _main(argv: list[str], env: DistEnv | None) -> int:
    """Flags -> run config -> device and process group -> model and data -> the mode's run."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    dlrm_flags.apply_preset()
    notes = nvidia_flags.apply()
    cfg = dlrm_flags.run_config()
    with _usage_errors():
        device = resolve_device(cfg.base_device, env)
    if cfg.mode == "plan":
        if env is not None:
            raise app.UsageError("--mode plan sizes a run without running it: start it without torchrun")
        return _run_plan(cfg, device)
    if env is not None and cfg.mode == "inference_benchmark":
        raise app.UsageError("--mode inference_benchmark runs on one process: start it without torchrun")
    with _usage_errors():
        # before any work: nothing of the user's is replaced
        claim_outputs(cfg, FLAGS.log_path, FLAGS.tensorboard_dir, FLAGS.log_format)
    collectives = start_processes(cfg, env, device)
    logger = RunLogger(FLAGS.log_path, enabled=collectives.rank == 0, tensorboard_dir=FLAGS.tensorboard_dir,
                       log_format=FLAGS.log_format)
    with logger:
        for note in notes:
            logger.print(note)
        with _usage_errors():
            shape = model_config(cfg, device)  # checked before the flags are recorded
            logger.record("flags", **cli.our_flags())
            run = build_run(cfg, device, env, collectives, logger, shape)
        logger.print(_header(run, env))
        exit_code = MODES[cfg.mode](run)
    if env is not None:
        torch.distributed.barrier()  # tear down together: gloo aborts if peers vanish mid-teardown
        torch.distributed.destroy_process_group()
    return exit_code


def main(argv: list[str]) -> int:
    return cli.run_processes(_main, argv)


def run() -> None:
    cli.run(main, prefix=cli.rank_prefix)


if __name__ == "__main__":
    run()
