"""NVIDIA's DLRM command lines as they are: the flags of NVIDIA's ``main.py`` that
``dlrm.scripts.main`` would otherwise lack, and ``apply``, which maps them onto its own flags
before they are validated.

    NVIDIA's flag                          here
    --embedding_type custom_cuda           joint_fused on CUDA when the optimizers allow it, else joint
    --embedding_type joint_sparse          joint (whose table gradients are sparse already)
    --shuffle                              --shuffle_batch_order (its short name)
    --optimized_mlp                        no fused MLP here: the torch MLP runs (a header line says so)
    --freeze_mlps, --freeze_embeddings     that part is never updated (its gradients are still computed)
    --Adam_embedding_optimizer             --optimizer adam (torch SparseAdam's rule; the MLPs keep SGD)
    --Adam_MLP_optimizer                   --dense_optimizer adam
    --auc_device CPU|GPU                   where tests compute the AUC
    --backend                              the backend follows the device (a header line says so)
    --bottom_features_ordered              always so here (a header line says so)
    --synthetic_dataset_use_feature_spec   synthetic data shaped by the feature spec of --dataset
    --cuda_graphs on a CPU                 the run proceeds without CUDA graphs (a header line says so)

Every other flag of NVIDIA's ``main.py`` has the same name and meaning in ``dlrm.scripts.main``.
"""

from __future__ import annotations

import os

import torch
from absl import app, flags

from dlrm.data.sources import SYNTHETIC_TYPES, DataConfig, load_feature_spec
from dlrm.engine.errors import DatasetError
from dlrm.scripts.flag_table import Setting, define
from dlrm.training.optimizers import OptimizerConfig
from dlrm.training.run_config import RunConfig

FLAGS = flags.FLAGS

# --embedding_type values of NVIDIA's that ``apply`` resolves to one of this program's.
EMBEDDINGS = ("custom_cuda", "joint_sparse")
NVIDIA = "NVIDIA compatibility"  # their --help section (dlrm_flags.SECTIONS)


def _auc_device(value: str | None, values: flags.FlagValues) -> str | None:
    """--auc_device as ``evaluate`` takes it: "cpu", or None for the scores' own device."""
    return "cpu" if value == "CPU" else None


def _auc_device_flag(value: str | None) -> str | None:
    if value not in (None, "cpu"):
        raise ValueError(f"`auc_device` {value!r}: dlrm.scripts.main's flags say \"cpu\" (--auc_device CPU) "
                         "or None (where the scores are: the run's device), and nothing else")
    return "CPU" if value else None


# NVIDIA's flags that are settings of RunConfig (declared as dlrm_flags.SETTINGS are).
SETTINGS: tuple[Setting, ...] = (
    Setting("freeze_mlps", "optimizer.freeze_dense", NVIDIA,
            "NVIDIA's (debugging, benchmarking): never update the MLPs and the other non-embedding weights; their "
            "gradients are still computed, so a step costs what it costs unfrozen."),
    Setting("freeze_embeddings", "optimizer.freeze_embeddings", NVIDIA,
            "NVIDIA's (debugging, benchmarking): never update the embedding tables; their gradients are still "
            "computed."),
    Setting("auc_device", "train.auc_device", NVIDIA,
            "NVIDIA's: where tests compute the AUC (the same value either way). CPU: on the host, sparing the "
            "GPU's memory the sort of a large test split; GPU or unset: where the scores are (the run's device).",
            choices=["GPU", "CPU"], case_sensitive=False, to_config=_auc_device, to_flag=_auc_device_flag),
)
define(SETTINGS, RunConfig, RunConfig(), __name__)

# NVIDIA's flags that are no setting of their own: the alias table (flag -> what it is here).
ALIASES: dict[str, str] = {
    "Adam_embedding_optimizer": "--optimizer adam (the MLPs keep SGD unless --Adam_MLP_optimizer)",
    "Adam_MLP_optimizer": "--dense_optimizer adam",
    "synthetic_dataset_use_feature_spec": "--synthetic_dataset_table_sizes and "
                                          "--synthetic_dataset_numerical_features from --dataset's feature spec",
    "optimized_mlp": "nothing: no fused MLP here, the torch MLP runs",
    "backend": "nothing: the backend follows the device (nccl for CUDA, gloo for the CPU)",
    "bottom_features_ordered": "nothing: the features always join in the fixed order",
}

flags.DEFINE_boolean("optimized_mlp", True,
                     "NVIDIA's: apex's fused C++ MLP (default on; NVIDIA turns it off on a CPU). This engine has no "
                     "fused MLP path: the torch MLP runs either way, and --optimized_mlp given on the command line "
                     "says so in the run header.")
flags.DEFINE_boolean("Adam_embedding_optimizer", False,
                     "NVIDIA's: --optimizer adam, torch's SparseAdam rule (lazy: a row's moments move only when a "
                     "batch uses it); the MLPs keep SGD unless --Adam_MLP_optimizer or --dense_optimizer says "
                     "otherwise.")
flags.DEFINE_boolean("Adam_MLP_optimizer", False, "NVIDIA's: --dense_optimizer adam (torch.optim.Adam).")
flags.DEFINE_string("backend", None,
                    "NVIDIA's: the torch.distributed backend (NVIDIA's default: nccl). Here it follows the device, "
                    "NCCL for CUDA and gloo for the CPU, the backends the exchange supports; a value given is "
                    "noted in the run header.")
flags.DEFINE_boolean("bottom_features_ordered", False,
                     "NVIDIA's: join the bottom MLP's output in a fixed feature order, so checkpoints do not depend on "
                     "the number of GPUs. Always so here, whatever the value (a header line says so when given).")
flags.DEFINE_boolean("synthetic_dataset_use_feature_spec", False,
                     "NVIDIA's: with --dataset_type synthetic_gpu (or synthetic), generate synthetic data shaped by "
                     "the feature spec of --dataset (--feature_spec): its numerical features and cardinalities replace "
                     "--synthetic_dataset_numerical_features and --synthetic_dataset_table_sizes; "
                     "--synthetic_dataset_num_entries still sets the samples.")


def run_device_type(values: flags.FlagValues = FLAGS, device_type: str | None = None) -> str:
    """"cuda" or "cpu": where the run will compute (``device_type`` when given: a launcher's
    word for its workers' devices; else ``--base_device``, else CUDA if available)."""
    if device_type is not None and not values.base_device:
        return device_type
    name = values.base_device or ("cuda" if torch.cuda.is_available() else "cpu")
    return "cuda" if name.startswith("cuda") else "cpu"


def apply(values: flags.FlagValues = FLAGS, device_type: str | None = None) -> list[str]:
    """Maps NVIDIA's flags onto this program's, in place, before validation. Returns the lines
    the run header prints once: how a flag of NVIDIA's was read, or why it changes nothing here.
    Raises ``app.UsageError`` for a flag of NVIDIA's that contradicts one of this program's.
    ``device_type`` ("cuda", "cpu"): where the run computes, when not here (``run_device_type``)."""
    notes: list[str] = []
    _optimizers(values)
    notes += _embedding_type(values, device_type)
    notes += _synthetic_shape(values)
    if values["optimized_mlp"].present and values.optimized_mlp:
        notes.append("--optimized_mlp: this engine has no fused MLP (NVIDIA's is apex's C++ MLP); the torch MLP runs")
    for name, part in (("freeze_mlps", "the MLPs"), ("freeze_embeddings", "the embedding tables")):
        if values[name].value:
            notes.append(f"--{name}: {part} are never updated (their gradients are still computed)")
    device = run_device_type(values, device_type)
    if values.auc_device == "GPU" and device == "cpu":
        notes.append("--auc_device GPU: this run has no GPU; the AUC is computed on the CPU")
    if values.backend is not None:
        used = "nccl" if device == "cuda" else "gloo"
        notes.append(f"--backend {values.backend}: the backend follows the device here (nccl for CUDA, gloo for the "
                     f"CPU); a multi-process run of this one uses {used}")
    if values.cuda_graphs and device == "cpu":
        values["cuda_graphs"].value = False  # NVIDIA's README passes it on every command: they run as written
        notes.append("--cuda_graphs: CUDA graphs are a CUDA feature; this run is on the CPU and proceeds without them")
    if values["bottom_features_ordered"].present:
        notes.append("--bottom_features_ordered: always so here (the features join in the fixed order, so "
                     "checkpoints load on any number of processes)")
    return notes


def _optimizers(values: flags.FlagValues) -> None:
    """--Adam_embedding_optimizer and --Adam_MLP_optimizer as --optimizer / --dense_optimizer."""
    for nvidia, ours in (("Adam_embedding_optimizer", "optimizer"), ("Adam_MLP_optimizer", "dense_optimizer")):
        if not values[nvidia].value:
            continue
        if values[ours].present and values[ours].value != "adam":
            raise app.UsageError(f"--{nvidia} selects --{ours} adam, and --{ours} {values[ours].value} was given: "
                                 "drop one of them")
        values[ours].value = "adam"
    if values.Adam_embedding_optimizer and not values.Adam_MLP_optimizer and not values["dense_optimizer"].present:
        values["dense_optimizer"].value = "sgd"  # NVIDIA's: Adam tables beside SGD MLPs


def _embedding_type(values: flags.FlagValues, device_type: str | None) -> list[str]:
    """custom_cuda -> joint_fused on CUDA when the optimizers allow it, else joint; joint_sparse -> joint."""
    given = values.embedding_type
    if given not in EMBEDDINGS:
        return []
    resolved = "joint"
    if given == "custom_cuda" and run_device_type(values, device_type) == "cuda":
        config = OptimizerConfig(embedding=values.optimizer, dense=values.dense_optimizer)
        try:
            config.validate_fused()
            resolved = "joint_fused"
        except ValueError:
            pass  # Adagrad or Adam tables, Adam MLPs: the joint table's sparse gradients serve them
    values["embedding_type"].value = resolved
    if not values["embedding_type"].present:
        return []
    why = {"joint_fused": "the fused gather and update kernels", "joint": "one table, sparse gradients"}[resolved]
    return [f"--embedding_type {given}: {resolved} ({why})"]


def _synthetic_shape(values: flags.FlagValues) -> list[str]:
    """--synthetic_dataset_use_feature_spec: the synthetic flags taken from --dataset's feature spec."""
    if not values.synthetic_dataset_use_feature_spec:
        return []
    if values.dataset_type not in SYNTHETIC_TYPES:
        return ["--synthetic_dataset_use_feature_spec: only with --dataset_type synthetic_gpu (as NVIDIA's); this "
                "run reads --dataset"]
    if not values.dataset:
        raise app.UsageError("--synthetic_dataset_use_feature_spec shapes the synthetic data by the feature spec of "
                             "--dataset: pass --dataset")
    spec = load_feature_spec(DataConfig(dataset=values.dataset, feature_spec=values.feature_spec))
    if spec.multi_hot_features:
        raise DatasetError(f"--synthetic_dataset_use_feature_spec takes one-hot specs, and {values.dataset} has "
                           f"multi-hot features ({', '.join(spec.multi_hot_features)}): use "
                           "--synthetic_multi_hot_sizes with --synthetic_dataset_table_sizes instead")
    values["synthetic_dataset_table_sizes"].value = [str(c) for c in spec.cardinalities]
    values["synthetic_dataset_numerical_features"].value = spec.num_numerical
    path = values.feature_spec if os.path.isabs(values.feature_spec) else os.path.join(values.dataset,
                                                                                       values.feature_spec)
    return [f"--synthetic_dataset_use_feature_spec: synthetic data shaped by {path} ({spec.num_numerical} numerical "
            f"features, {len(spec.cardinalities)} tables)"]
