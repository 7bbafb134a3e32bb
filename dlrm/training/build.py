"""A DLRM run built from its ``RunConfig``: device, precision, data, the planned model, optimizer.

What ``dlrm.api`` (and through it ``dlrm.scripts.main``) does between a ``RunConfig``
and the loop, for Python users who want the parts; ``api.train(cfg)`` is the whole job, with
the checkpoint lock, the output claims and the stop on a signal:

    device = resolve_device(cfg.base_device)  # dlrm.engine.devices
    run = build_run(cfg, device, collectives=start_processes(cfg, None, device))
    optimizer, scaler, state = start_training(run)  # state: what `resume` continues, else None
    summary = train(run.model, optimizer, scaler, run.precision, run.source("train", cfg.batch_size),
                    run.source("test", cfg.test_batch_size), cfg.train, run.device, run.logger, state,
                    run_config=cfg.to_dict(), seed=cfg.seed)  # what the checkpoint records; the one seed

(``tests/test_run_config.py`` runs these lines and checks them against the command line's run.)

Errors a user can fix raise ``ValueError`` (or the data's, checkpoint's and planner's own errors)
naming the setting of ``RunConfig`` in backquotes.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.sources import load_feature_spec, make_rank_source, make_source, table_sizes
from dlrm.distributed.parallelize import parallelize
from dlrm.distributed.planner import Plan, format_plan, load_placement, plan_tables, size_host_cache
from dlrm.distributed.sizing import device_reserve_bytes
from dlrm.engine.checkpoint_store import claim_checkpoint_path
from dlrm.engine.collectives import Collectives, process_group_collectives
from dlrm.engine.errors import DatasetError
from dlrm.engine.logger import RunLogger, check_log_form, log_kind
from dlrm.engine.outputs import TENSORBOARD, check_not_input, claim_output
from dlrm.engine.process_group import DistEnv, device_memory_bytes, join_processes
from dlrm.model.dlrm import DLRM, EMBEDDING_DTYPES, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.nn.cached_embedding import CachedEmbedding
from dlrm.nn.table_spec import TableShard
from dlrm.training import nvidia_checkpoint, saved_model
from dlrm.training.checkpoint import FORMAT, TrainState, latest_checkpoint, load_checkpoint
from dlrm.training.cuda_graphs import check_cuda_graphs_supported
from dlrm.training.optimizers import make_optimizer
from dlrm.training.run_config import RunConfig

EXCHANGE_DTYPES = {"auto": None, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def start_processes(cfg: RunConfig, env: DistEnv | None, device: torch.device) -> Collectives:
    """Joins the process group under a launcher and selects the GPU; seeds torch. Returns the
    collectives of the run (one process: the null ones)."""
    join_processes(env, device, cfg.parallel.dist_timeout)
    collectives = Collectives()
    if env is not None:
        collectives = process_group_collectives(device, gradient_sync=cfg.parallel.gradient_sync,
                                                bucket_bytes=int(cfg.parallel.gradient_bucket_mb * 2**20))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.allow_tf32
        torch.backends.cudnn.allow_tf32 = cfg.allow_tf32
    torch.manual_seed(cfg.seed)
    return collectives


def model_config(cfg: RunConfig, device: torch.device) -> tuple[FeatureSpec, DLRMConfig]:
    """The data's feature spec and the model it and ``cfg.model`` describe (checked; nothing built).
    A run serving a checkpoint (test, or an inference benchmark of ``load_checkpoint_path``)
    takes the checkpoint's model instead, checked against the data and ``cfg.model``
    (``dlrm.training.saved_model``): it needs no model setting."""
    if saved_model.starts_from_checkpoint(cfg):
        return saved_model.model_config(cfg, device)
    spec = load_feature_spec(cfg.data)
    shape = cfg.model
    interaction_op = shape.interaction_op
    if interaction_op == "auto":
        interaction_op = "cuda_dot" if device.type == "cuda" else "dot"
    model_cfg = DLRMConfig(
        num_numerical_features=spec.num_numerical,
        table_sizes=table_sizes(spec, shape.max_table_size),
        embedding_dim=shape.embedding_dim,
        bottom_mlp_sizes=list(shape.bottom_mlp_sizes),
        top_mlp_sizes=list(shape.top_mlp_sizes),
        interaction_op=interaction_op,
        dcn_num_layers=shape.dcn_num_layers,
        dcn_low_rank_dim=shape.dcn_low_rank_dim,
        embedding_type=shape.embedding_type,
        hash_indices=cfg.data.hash_indices,
        poolings=[pooling or "sum" for pooling in spec.poolings],  # one-hot: a bag of one, either pooling
        embedding_dtype=shape.embedding_dtype,
    )
    model_cfg.validate()
    if cfg.mode == "train" and cfg.train.save_checkpoint_path and cfg.train.checkpoint_format == "nvidia":
        nvidia_checkpoint.check_can_write(model_cfg)  # now, not at the first save
    return spec, model_cfg


def capacity(cfg: RunConfig, device: torch.device, local_world_size: int) -> int:
    """Bytes of tables one process may hold: ``device_memory_gb``, else 90% of its device's share."""
    if cfg.parallel.device_memory_gb is not None:
        return int(cfg.parallel.device_memory_gb * 2**30)
    return int(0.9 * device_memory_bytes(device, local_world_size))


def table_bytes(cfg: RunConfig, model_cfg: DLRMConfig) -> dict[str, int]:
    """What a table row costs besides its values: optimizer state (training only), bytes a value."""
    state = cfg.optimizer.state_bytes_per_row(model_cfg.embedding_dim) if cfg.mode == "train" else 0
    return {"state_bytes_per_row": state, "bytes_per_value": EMBEDDING_DTYPES[model_cfg.embedding_dtype].itemsize}


def host_cache_budget(cfg: RunConfig, model_cfg: DLRMConfig, spec: FeatureSpec | None = None) -> tuple[int, list[int]]:
    """What ``host_table_cache_rows=auto`` leaves out of the device's capacity, and the least it
    must cache: the bytes a step needs besides the tables (the MLPs, with their gradients and
    optimizer state when training, and the activations of the larger of the train and test
    batches: ``device_reserve_bytes``), and per table the most distinct rows one batch may look
    up (batch x ids per sample; a variable-length bag counts one id, a lower bound only)."""
    training = cfg.mode == "train"
    batch = max(cfg.batch_size, cfg.test_batch_size) if training else cfg.test_batch_size
    reserve = device_reserve_bytes(model_cfg, batch, cfg.optimizer.dense_state_bytes(), 2 if cfg.amp else 4,
                                   training)
    ids = [1] * len(model_cfg.table_sizes)
    if spec is not None:
        ids = [size if isinstance(size, int) else 1 for size in (spec.bag_size(t) for t in range(len(ids)))]
    return reserve, [min(rows, batch * n) for rows, n in zip(model_cfg.table_sizes, ids)]


def plan_one_device(cfg: RunConfig, model_cfg: DLRMConfig, device: torch.device, logger: RunLogger,
                    spec: FeatureSpec | None = None) -> Plan:
    """Every table on this device, or the largest in host memory when they do not all fit there
    (``host_tables``), with their device cache (``host_table_cache_rows``): logs the bytes, and
    stops with the numbers (not an out-of-memory crash half-way through building the model) when
    they do not fit. Returns the plan (``host``, ``host_cache_rows``).

    ``host_table_cache_rows=auto`` caches as many rows as fit in the capacity (``capacity``:
    ``device_memory_gb``, else 90% of the GPU) less the device tables, ``host_cache_budget``'s
    reserve and the slot map, and logs that arithmetic. On a CPU run the capacity is the same
    setting, else 90% of the host's RAM: well defined, and with the cache on the CPU usually
    every host row (the host tables must be named there, ``host_tables=auto`` keeps none)."""
    host_tables = cfg.parallel.host_tables
    if device.type != "cuda" and host_tables == "auto":
        host_tables = "none"  # on the CPU the host's memory is the device's: nothing to gain
    cache_rows = cfg.parallel.host_table_cache_rows
    reserve, batch_rows = host_cache_budget(cfg, model_cfg, spec) if cache_rows == "auto" else (0, [])
    sizes = table_bytes(cfg, model_cfg)
    plan = plan_tables(model_cfg.table_sizes, model_cfg.embedding_dim, 1, capacity(cfg, device, 1),
                       host_tables=host_tables, host_capacity=int(0.9 * device_memory_bytes(torch.device("cpu"), 1)),
                       host_cache_rows=cache_rows, host_cache_reserve=reserve, host_cache_batch_rows=batch_rows,
                       **sizes)
    if cache_rows and not plan.host:
        raise ValueError("`host_table_cache_rows` caches tables kept in host memory, and every table fits on the "
                         f"device ({device.type}): name the tables to keep there in `host_tables`")
    logger.print(format_plan(plan))
    sizing = None
    if cache_rows == "auto":
        sizing = size_host_cache(plan, model_cfg.embedding_dim, sizes["bytes_per_value"], reserve, batch_rows)
        logger.print(sizing.describe())
    if plan.host:
        logger.record("plan", **plan.to_json(), bytes=[plan.device_bytes(0)], host_bytes=plan.host_bytes(),
                      **({"host_cache_auto": sizing.to_json()} if sizing is not None else {}))
    return plan


def host_cache_hit_rate(model: DLRM) -> float | None:
    """The share of host-table lookups the device cache served, None without a cache."""
    host = model.host_embeddings
    return host.hit_rate() if isinstance(host, CachedEmbedding) else None


def plan_ranks(cfg: RunConfig, model_cfg: DLRMConfig, env: DistEnv, device: torch.device,
               logger: RunLogger) -> list[list[int | TableShard]]:
    """Tables (or row blocks of tables) per rank: the memory-balancing planner, as ``table_placement`` says."""
    placement = load_placement(cfg.parallel.table_placement)
    plan = plan_tables(model_cfg.table_sizes, model_cfg.embedding_dim, env.world_size,
                       capacity(cfg, device, env.local_world_size), override=placement.tables,
                       row_wise=placement.row_wise, host_tables=cfg.parallel.host_tables,
                       **table_bytes(cfg, model_cfg))
    logger.print(format_plan(plan))
    logger.record("plan", **plan.to_json(), bytes=[plan.rank_bytes(r) for r in range(env.world_size)])
    return [plan.entries(rank) for rank in range(env.world_size)]


@dataclass
class Run:
    """What every mode works with: built once by ``build_run``."""

    cfg: RunConfig
    device: torch.device
    precision: Precision
    collectives: Collectives
    spec: FeatureSpec
    model_cfg: DLRMConfig
    model: DLRM
    source: Callable[[str, int], Any]  # (split, batch size) -> this process's source of the split, or None
    logger: RunLogger
    terms: Callable[[str], str] = str  # how messages name settings (a script: its flags)

    def load(self, *args: Any, path: str | None = None, **kwargs: Any) -> TrainState:
        """``load_checkpoint`` of ``path`` (default: ``load_checkpoint_path``) into the model."""
        return load_checkpoint(path or self.cfg.checkpoint.load_checkpoint_path, self.model, *args,
                               verify=self.cfg.checkpoint.verify, **kwargs)


def build_run(cfg: RunConfig, device: torch.device, env: DistEnv | None = None,
              collectives: Collectives | None = None, logger: RunLogger | None = None,
              shape: tuple[FeatureSpec, DLRMConfig] | None = None) -> Run:
    """Precision, data and the model (placed by the planner in a multi-process run, ``env``).
    ``shape``: ``model_config(cfg, device)`` when the caller has it already."""
    collectives = collectives or Collectives()
    logger = logger or RunLogger(enabled=False)
    precision = Precision.parse(cfg.amp, cfg.amp_dtype, device)
    spec, model_cfg = shape or model_config(cfg, device)
    if saved_model.starts_from_checkpoint(cfg):  # the data as the checkpoint's model reads it
        cfg = dataclasses.replace(cfg, data=saved_model.served_data(cfg.data, model_cfg))
    if env is None:
        plan = plan_one_device(cfg, model_cfg, device, logger, spec)
        model = DLRM(model_cfg, device=device, host_tables=plan.host, host_cache_rows=plan.host_cache_rows)
        source = lambda split, batch_size: make_source(cfg.data, spec, split, batch_size, device,  # noqa: E731
                                                       seed=cfg.seed)
    else:
        model, parallel = parallelize(model_cfg, plan_ranks(cfg, model_cfg, env, device, logger), device,
                                      collectives, EXCHANGE_DTYPES[cfg.parallel.exchange_dtype])
        source = lambda split, batch_size: make_rank_source(  # noqa: E731
            cfg.data, spec, split, batch_size, device, parallel.tables, parallel.rank, parallel.world_size, cfg.seed)
    if cfg.train.cuda_graphs:  # before any data is read; the training step checks again as a library guard
        check_cuda_graphs_supported(model, device, collectives.world_size, training=cfg.mode == "train")
    return Run(cfg, device, precision, collectives, spec, model_cfg, model, source, logger)


def claim_outputs(cfg: RunConfig) -> None:
    """Before anything runs, every path the run writes obeys the output rule
    (``dlrm.engine.outputs``): the checkpoint at ``save_checkpoint_path`` (refused when another
    checkpoint is there, unless `resume` continues it or `overwrite` replaces it), the log it
    appends to, the TensorBoard folder (``cfg.output``); none is the dataset or a checkpoint it loads."""
    log_path, tensorboard_dir, log_format = cfg.output.log_path, cfg.output.tensorboard_dir, cfg.output.log_format
    load_path = cfg.checkpoint.load_checkpoint_path
    inputs = {"dataset": cfg.data.dataset if not cfg.data.synthetic else None, "load_checkpoint_path": load_path}
    save_path = cfg.train.save_checkpoint_path if cfg.mode == "train" else None
    if save_path:
        if cfg.checkpoint.resume and load_path and os.path.abspath(load_path) == os.path.abspath(save_path):
            inputs["load_checkpoint_path"] = None  # resuming the run's own checkpoint
        if cfg.train.checkpoint_format == "nvidia":
            nvidia_checkpoint.claim(save_path, inputs=inputs, replace=cfg.checkpoint.overwrite)
        else:
            claim_checkpoint_path(save_path, FORMAT, inputs=inputs, replace=cfg.checkpoint.overwrite,
                                  keep=cfg.checkpoint.resume)
        inputs["save_checkpoint_path"] = save_path  # what the others must not be inside of either
    if log_path:
        check_log_form(log_path, log_format)
        claim_output(log_path, log_kind(log_format), "log_path", inputs=inputs, keep=True)
    if tensorboard_dir:
        claim_output(tensorboard_dir, TENSORBOARD, "tensorboard_dir", inputs=inputs, keep=True)
    if log_path and tensorboard_dir:
        check_not_input(log_path, "log_path", {"tensorboard_dir": tensorboard_dir})


def start_training(run: Run) -> tuple[Any, torch.amp.GradScaler, TrainState | None]:
    """The optimizer, the gradient scaler and the state to continue from: with ``resume`` the run's
    own checkpoint (``save_checkpoint_path``) or else ``load_checkpoint_path``, exactly; without
    it ``load_checkpoint_path``'s weights and a fresh run from step 0 (NVIDIA's meaning)."""
    cfg = run.cfg
    optimizer = make_optimizer(run.model, cfg.train.schedule.lr, cfg.optimizer)
    scaler = run.precision.grad_scaler(process_group=run.collectives.process_group)
    save_path, load_path = cfg.train.save_checkpoint_path, cfg.checkpoint.load_checkpoint_path
    own = latest_checkpoint(save_path) if cfg.checkpoint.resume and save_path else None
    resume_from = own or (load_path if cfg.checkpoint.resume else None)
    if resume_from:
        state = run.load(optimizer, scaler, restore_rng=True, path=resume_from)
        run.logger.print(f"Resuming from {resume_from} at step {state.step}")
        return optimizer, scaler, state
    if load_path:
        run.load()
        run.logger.print(f"Weights from {load_path}; training starts at step 0 (resuming would continue that run)")
    return optimizer, scaler, None


def validate_sources(run: Run, *sources: object) -> None:
    """Reads every value the run will read before the first step (``validate_dataset``). Each
    process checks the columns it reads; all stop together if any finds bad data, rather than
    the others waiting for it in the first exchange until ``dist_timeout``."""
    error = None
    try:
        for source in sources:
            if run.cfg.validate_dataset and hasattr(source, "validate"):
                source.validate()
    except DatasetError as e:
        error = e
    if run.collectives.any(error is not None):
        raise error or DatasetError("another process found bad data in the dataset: its error says where")
