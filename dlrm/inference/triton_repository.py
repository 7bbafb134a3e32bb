"""Writes a Triton Inference Server model repository from a checkpoint.

    <repository>/<model_name>/config.pbtxt
    <repository>/<model_name>/<version>/model.onnx | model.pt   (+ model.py for the python backend)

Two flavours. The production one names the platform (``onnxruntime_onnx`` or
``pytorch_libtorch``) and the server runs the file natively. The ``python`` one runs the same
file through ``triton_python_model.py`` (ONNX Runtime or TorchScript inside the python
backend), for servers built without those backends, such as the one ``nvidia-pytriton`` ships.

The exported file is checked against the eager model before the config is written, so a
repository never advertises a model that computes something else.

Deploying adds a model to a repository (``TRITON_REPOSITORY``: model folders and nothing else;
a folder holding anything else is refused); a model folder that exists already
(``TRITON_MODEL``) is written over only with ``overwrite`` (``dlrm.engine.outputs``).

Model names follow one rule (``dlrm.inference.model_names``), checked where they enter; every
string in ``config.pbtxt`` is written through ``pbtxt_string``, and the text is read back
(``dlrm.inference.pbtxt``) and compared with what was meant before anything is written.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dlrm.engine.atomic import write_atomically, write_text_atomically
from dlrm.engine.storage import check_can_create
from dlrm.engine.outputs import OutputKind, claim_output, holds_only
from dlrm.inference import triton_python_model
from dlrm.inference.model_names import check_model_name, check_version, pbtxt_string
from dlrm.inference.pbtxt import ConfigCheckError, ConfigSummary, check_config

if TYPE_CHECKING:
    from dlrm.model.dlrm import DLRM

# torch (and the exporter) load only when a model is exported, so that a deploy checks its
# destination (``claim_repository``) at once.
FORMATS = {"onnx": ("model.onnx", "onnxruntime_onnx"), "torchscript": ("model.pt", "pytorch_libtorch")}
NUMERICAL_TYPES = {"fp32": ("TYPE_FP32", "float32"), "fp16": ("TYPE_FP16", "float16")}  # Triton's type, torch's
INSTANCE_KINDS = {"gpu": "KIND_GPU", "cpu": "KIND_CPU"}
CONFIG = "config.pbtxt"


# What ``deploy`` writes in a model folder besides CONFIG: version folders of the model file
# (FORMATS) and, for the python backend, ``model.py`` (a folder may be empty while being filled).
_VERSION_FILES = re.compile(r"[0-9]+/(model\.onnx|model\.onnx\.data|model\.pt|model\.py)?")


def is_triton_model(path: str) -> bool:
    """Whether directory ``path`` is a model folder that ``deploy`` wrote and nothing else: its
    ``config.pbtxt`` and numbered version folders of the files it writes there."""
    return holds_only(path, [CONFIG, _VERSION_FILES], required=[CONFIG])


def is_triton_repository(path: str) -> bool:
    """Whether directory ``path`` is a Triton model repository and nothing else: model folders."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return all(is_triton_model(os.path.join(path, name)) and not os.path.islink(os.path.join(path, name))
               for name in names)


TRITON_REPOSITORY = OutputKind("Triton model repository", directory=True, recognise=is_triton_repository)
TRITON_MODEL = OutputKind("Triton model", directory=True, recognise=is_triton_model)


def claim_repository(repository: str, model_name: str, overwrite: bool, inputs: dict | None = None,
                     settings: tuple[str, str] = ("repository", "model_name")) -> str:
    """Checks, before any work, that ``model_name`` may be deployed into ``repository``: the
    repository is new, empty or a Triton repository (a model is added to it as a matter of
    course), and the model folder new, or an earlier one replaced with ``overwrite``; never one
    of ``inputs``. ``settings``: how messages name the two. A file system that refuses the write
    (read-only, no permission) is a ``StorageError`` now too. Returns the model folder."""
    check_model_name(model_name, settings[1])  # a plain folder name: no "..", no "/"
    claim_output(repository, TRITON_REPOSITORY, settings[0], inputs=inputs, keep=True)
    model_dir = os.path.join(os.path.abspath(repository), model_name)
    claim_output(model_dir, TRITON_MODEL, settings[1], inputs=inputs, replace=overwrite)
    check_can_create(os.path.join(model_dir, CONFIG), "the Triton model")
    return model_dir


@dataclass
class TritonModelConfig:
    """What ``config.pbtxt`` says about the model besides its tensors.

    ``python_backend`` picks the flavour; ``format`` the file both flavours run.
    ``preferred_batch_sizes`` and ``max_queue_delay_us`` set dynamic batching: the server
    waits up to that long to merge requests into one of those sizes.
    """

    model_name: str = "dlrm"
    format: str = "onnx"  # "onnx" | "torchscript"
    python_backend: bool = False
    numerical_type: str = "fp32"  # "fp32" | "fp16"
    max_batch_size: int = 65536
    preferred_batch_sizes: list[int] = field(default_factory=lambda: [4096, 16384])
    max_queue_delay_us: int = 100
    instance_kind: str = "gpu"  # "gpu" | "cpu"
    instance_count: int = 1
    gpus: list[int] | None = None  # None: every GPU the server sees
    version: int = 1
    intra_op_threads: int = 0  # python backend only: CPU threads per instance, 0 = the runtime's default

    def __post_init__(self) -> None:
        """The name is checked when the config is made, for API users as for the command line."""
        check_model_name(self.model_name)

    def validate(self) -> None:
        """Raise ValueError naming the field, its value and what is allowed."""
        check_model_name(self.model_name)
        choices = {"format": FORMATS, "numerical_type": NUMERICAL_TYPES, "instance_kind": INSTANCE_KINDS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {sorted(allowed)}, got {getattr(self, name)!r}")
        for name in ("max_batch_size", "instance_count", "version"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        check_version(self.version)
        bad = [b for b in self.preferred_batch_sizes if not 1 <= b <= self.max_batch_size]
        if bad:
            raise ValueError(f"preferred_batch_sizes {bad} are outside [1, max_batch_size={self.max_batch_size}]")
        if self.max_queue_delay_us < 0 or self.intra_op_threads < 0:
            raise ValueError("max_queue_delay_us and intra_op_threads must not be negative")
        if self.gpus is not None and self.instance_kind != "gpu":
            raise ValueError("gpus applies to instance_kind 'gpu' only")

    @property
    def model_file(self) -> str:
        return FORMATS[self.format][0]

    def tensor_names(self) -> tuple[str, str, str]:
        """(numerical, categorical, output). TorchScript has no tensor names, so the libtorch
        backend binds them by position and wants ``<name>__<index>``; the others use the
        exported names."""
        from dlrm.inference.export import INPUT_NAMES, OUTPUT_NAME

        if self.format == "torchscript" and not self.python_backend:
            return f"{INPUT_NAMES[0]}__0", f"{INPUT_NAMES[1]}__1", f"{OUTPUT_NAME}__0"
        return INPUT_NAMES[0], INPUT_NAMES[1], OUTPUT_NAME


def _python_parameters(cfg: TritonModelConfig) -> dict[str, str]:
    """The python backend's parameters (``triton_python_model`` reads them)."""
    parameters = {"model_file": cfg.model_file}
    if cfg.intra_op_threads:
        parameters["intra_op_threads"] = str(cfg.intra_op_threads)
    return parameters


def render_config(cfg: TritonModelConfig, num_numerical: int, num_categorical: int) -> str:
    """``config.pbtxt`` text (protobuf text format of Triton's ``ModelConfig``). Every string goes
    through ``pbtxt_string``, checked names included: a value can never end its string."""
    cfg.validate()
    q = pbtxt_string
    numerical, categorical, output = cfg.tensor_names()
    if cfg.python_backend:
        runtime = f"backend: {q('python')}"
    else:
        runtime = f"platform: {q(FORMATS[cfg.format][1])}\ndefault_model_filename: {q(cfg.model_file)}"
    preferred = ", ".join(str(int(b)) for b in cfg.preferred_batch_sizes)
    gpus = f"\n    gpus: [ {', '.join(str(int(g)) for g in cfg.gpus)} ]" if cfg.gpus else ""
    lines = [
        f"name: {q(cfg.model_name)}",
        runtime,
        f"max_batch_size: {int(cfg.max_batch_size)}",
        "input [",
        f"  {{ name: {q(numerical)} data_type: {NUMERICAL_TYPES[cfg.numerical_type][0]} "
        f"dims: [ {int(num_numerical)} ] }},",
        f"  {{ name: {q(categorical)} data_type: TYPE_INT64 dims: [ {int(num_categorical)} ] }}",
        "]",
        "output [",
        f"  {{ name: {q(output)} data_type: TYPE_FP32 dims: [ 1 ] }}",
        "]",
        "dynamic_batching {",
        *([f"  preferred_batch_size: [ {preferred} ]"] if preferred else []),
        f"  max_queue_delay_microseconds: {int(cfg.max_queue_delay_us)}",
        "}",
        "instance_group [",
        f"  {{\n    kind: {INSTANCE_KINDS[cfg.instance_kind]}\n    count: {int(cfg.instance_count)}{gpus}\n  }}",
        "]",
    ]
    if cfg.python_backend:
        lines += [f"parameters {{ key: {q(k)} value: {{ string_value: {q(v)} }} }}"
                  for k, v in _python_parameters(cfg).items()]
    return "\n".join(lines) + "\n"


def intended_summary(cfg: TritonModelConfig, num_numerical: int, num_categorical: int) -> ConfigSummary:
    """What ``render_config`` means to say, field by field, to compare its text with."""
    numerical, categorical, output = cfg.tensor_names()
    return ConfigSummary(
        name=cfg.model_name, platform="" if cfg.python_backend else FORMATS[cfg.format][1],
        backend="python" if cfg.python_backend else "",
        default_model_filename="" if cfg.python_backend else cfg.model_file, max_batch_size=cfg.max_batch_size,
        inputs=[(numerical, NUMERICAL_TYPES[cfg.numerical_type][0], [num_numerical]),
                (categorical, "TYPE_INT64", [num_categorical])],
        outputs=[(output, "TYPE_FP32", [1])],
        parameters=_python_parameters(cfg) if cfg.python_backend else {},
    )


def checked_config(cfg: TritonModelConfig, num_numerical: int, num_categorical: int) -> str:
    """``render_config``'s text after reading it back: ``ConfigCheckError`` (a ValueError) if it
    does not parse or says something else than ``cfg``, before anything is written."""
    text = render_config(cfg, num_numerical, num_categorical)
    try:
        check_config(text, intended_summary(cfg, num_numerical, num_categorical))
    except ConfigCheckError as e:
        raise ConfigCheckError(f"the config.pbtxt made for `model_name` {cfg.model_name} does not read back: {e}; "
                               "nothing was written (please report this)") from None
    return text


@dataclass
class DeployedModel:
    model_dir: str  # <repository>/<model_name>
    files: list[str]  # every file written, absolute paths
    max_abs_errors: dict[int, float]  # batch size -> error of the exported file against eager


def deploy_model(
    model: DLRM,
    repository: str,
    cfg: TritonModelConfig,
    check_batch_sizes: Sequence[int] = (1, 64, 4096),
    overwrite: bool = False,
) -> DeployedModel:
    """Exports ``model`` (on the CPU) into ``repository`` as ``cfg`` describes, checks the file
    against the eager model, then writes the config (and ``model.py`` for the python backend).

    The config is made and read back first (``checked_config``), and the repository and model
    folder claimed (``claim_repository``): an existing model folder of that name is written into
    only with ``overwrite``. Files of other versions in it are left alone; the ones written here
    replace earlier ones atomically. A failed deploy removes the folders it made, with the files
    it wrote in them.
    """
    cfg.validate()
    text = checked_config(cfg, model.config.num_numerical_features, model.config.num_categorical_features)
    model_dir = claim_repository(repository, cfg.model_name, overwrite)
    version_dir = os.path.join(model_dir, str(cfg.version))
    created = []  # deepest first
    missing = version_dir
    while not os.path.exists(missing):
        created.append(missing)
        missing = os.path.dirname(missing)
    written: list[str] = []
    try:
        return _deploy(model, model_dir, version_dir, cfg, check_batch_sizes, text, written)
    except BaseException:
        _remove_made(created, written)
        raise


def _remove_made(created: list[str], written: list[str]) -> None:
    """Removes what a failed deploy made: files it wrote inside folders it created, then those
    folders (deepest first). Files in folders that were there before are left alone."""
    for path in written:
        if os.path.dirname(path) in created:
            for name in (path, path + ".tmp"):
                try:
                    os.remove(name)
                except OSError:
                    pass
    for directory in created:
        try:
            os.rmdir(directory)
        except OSError:
            pass


def _deploy(model: DLRM, model_dir: str, version_dir: str, cfg: TritonModelConfig,
            check_batch_sizes: Sequence[int], text: str, written: list[str]) -> DeployedModel:
    import torch

    from dlrm.inference.export import check_export, export_onnx, export_torchscript

    os.makedirs(version_dir, exist_ok=True)
    model_path = os.path.join(version_dir, cfg.model_file)
    numerical_dtype = getattr(torch, NUMERICAL_TYPES[cfg.numerical_type][1])
    written.append(model_path)
    if cfg.format == "onnx":
        export_onnx(model, model_path, numerical_dtype=numerical_dtype)
    else:
        export_torchscript(model, model_path)
    errors = check_export(model, model_path, batch_sizes=check_batch_sizes, numerical_dtype=numerical_dtype)
    if cfg.python_backend:
        script = os.path.join(version_dir, "model.py")
        written.append(script)
        write_atomically(script, lambda tmp: shutil.copyfile(triton_python_model.__file__, tmp))
    config_path = os.path.join(model_dir, CONFIG)
    written.append(config_path)
    write_text_atomically(config_path, text)
    return DeployedModel(model_dir=model_dir, files=list(written), max_abs_errors=errors)


def check_quantized_target(cfg: TritonModelConfig, quantize_tables: str | Sequence[str]) -> None:
    """Quantized tables in a TorchScript file run torch's CPU quantized operators, which have no
    GPU kernels: such a file is served by CPU instances (the ONNX form runs anywhere)."""
    quantized = any(p in ("int8", "int4", "int2") for p in ([quantize_tables] if isinstance(quantize_tables, str)
                                                            else quantize_tables))
    if quantized and cfg.format == "torchscript" and cfg.instance_kind == "gpu":
        raise ValueError("a TorchScript model with quantized tables runs torch's CPU quantized embedding-bag "
                         "operators: deploy it with `instance_kind` cpu, or with `format` onnx for GPU instances")


def deploy_checkpoint(
    checkpoint: str, repository: str, cfg: TritonModelConfig, check_batch_sizes: Sequence[int] = (1, 64, 4096),
    overwrite: bool = False, quantize_tables: str | Sequence[str] = "fp32", quantize_min_rows: int = 0,
) -> DeployedModel:
    """``deploy_model`` for the model a checkpoint directory holds (config from its meta.json),
    its tables stored at ``quantize_tables`` (``dlrm.inference.quantize``)."""
    cfg.validate()
    check_quantized_target(cfg, quantize_tables)
    claim_repository(repository, cfg.model_name, overwrite, inputs={"checkpoint": checkpoint})  # before the work
    from dlrm.inference.export import build_inference_model

    model = build_inference_model(checkpoint, quantize_tables=quantize_tables, quantize_min_rows=quantize_min_rows)
    return deploy_model(model, repository, cfg, check_batch_sizes, overwrite)
