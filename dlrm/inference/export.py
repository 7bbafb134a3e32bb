"""Get a trained model out of a checkpoint and into files a server runs: TorchScript and ONNX.

Both formats hold the same graph, ``ExportableDLRM``: numerical ``[B, N]`` float32 and
categorical ``[B, F]`` int64 in, click probabilities ``[B, 1]`` out (the sigmoid of the
model's logit, which is what a serving client wants; training keeps the raw logit). Embedding
lookups are plain gathers, never EmbeddingBag, which ONNX exporters lower to a per-sample loop
that is an order of magnitude slower in ONNX Runtime.

Files are written to a temporary name in the target directory and moved into place with
``os.replace``, so a failed export never leaves a half-written file or damages an older one; a
write the file system refuses (read-only, full) is a ``StorageError`` naming the file.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from dlrm.engine.atomic import fsync_dir, temporary_name, write_atomically
from dlrm.engine.storage import check_free_space, writing
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.training.checkpoint import load_checkpoint, model_config_of, state_bytes

INPUT_NAMES = ("numerical", "categorical")
OUTPUT_NAME = "click_probability"
ONNX_MAX_BYTES = 2**31 - 1  # protobuf's limit for one file; beyond it ONNX needs external data
ONNX_DATA_SUFFIX = ".data"  # model.onnx's weights past that limit: model.onnx.data beside it
EXPORTED = "the exported model"  # what a StorageError says could not be written


def build_inference_model(checkpoint: str, device: torch.device | str = "cpu",
                          quantize_tables: str | Sequence[str] = "fp32", quantize_min_rows: int = 0) -> DLRM:
    """The DLRM described by ``checkpoint``'s ``meta.json`` (or by the files of a checkpoint in
    NVIDIA's layout), with its weights, in eval mode.

    The config comes from the checkpoint itself, so exporting needs no training flags.
    ``quantize_tables`` (one precision, or one per table) and ``quantize_min_rows`` store the
    tables row-wise quantized (``dlrm.inference.quantize``); the default keeps them as trained.
    """
    if quantize_tables != "fp32":
        from dlrm.inference.quantize import build_quantized_model

        return build_quantized_model(checkpoint, quantize_tables, quantize_min_rows, device)
    config = DLRMConfig(**model_config_of(checkpoint))  # raises CheckpointError when missing or damaged
    model = DLRM(config, device=device)
    load_checkpoint(checkpoint, model)
    return model.eval()


class ExportableDLRM(nn.Module):
    """A DLRM as a server runs it: ``(numerical, categorical) -> click_probability [B, 1]``.

    The graph is ``DLRM.forward`` itself (shared parameters, nothing copied), followed by the
    sigmoid. Its parts are written to be traced: the embedding lookups are plain gathers (a
    ``joint_fused`` table takes the joint gather while exporting), the ``hash_indices`` floor
    modulo stays in the graph, and a ``cuda_dot`` interaction runs its pure-torch reference
    under tracing and export.
    """

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        if model.embeddings.num_tables != model.config.num_categorical_features:
            raise ValueError("only a model holding all of its tables can be exported (got a hybrid-parallel shard)")
        self.model = model

    def for_onnx(self) -> "ExportableDLRM":
        """The same graph in the form ONNX can express: quantized tables split into codes and
        scale/bias tensors (``QuantizedEmbedding.for_onnx``); a float model is returned as is."""
        from dlrm.nn.quantized_embedding import QuantizedEmbedding

        if not isinstance(self.model.embeddings, QuantizedEmbedding):
            return self
        model = copy.copy(self.model)
        model._modules = dict(self.model._modules)
        model._modules["embeddings"] = self.model.embeddings.for_onnx()
        return ExportableDLRM(model)

    def forward(self, numerical: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.model(numerical, categorical)).unsqueeze(1)


def sample_inputs(config: DLRMConfig, batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random valid inputs: float32 numerical values and int64 ids within every table."""
    generator = torch.Generator().manual_seed(seed)
    numerical = torch.randn(batch_size, config.num_numerical_features, generator=generator)
    rows = torch.tensor(config.table_sizes, dtype=torch.float64)
    uniform = torch.rand(batch_size, len(config.table_sizes), generator=generator, dtype=torch.float64)
    categorical = (uniform * rows).to(torch.int64).clamp_max_(rows.to(torch.int64) - 1)
    return numerical, categorical


def _require_cpu(model: DLRM) -> None:
    # Files are traced and checked on the CPU; moving the caller's model there behind its back
    # (the wrapper shares its parameters) would be a surprise, so ask for a CPU model instead.
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cpu"}:
        raise ValueError(f"export needs the model on the CPU, it is on {sorted(devices)}: "
                         "use build_inference_model(checkpoint, device='cpu')")


def _exportable(model: DLRM) -> ExportableDLRM:
    _require_cpu(model)
    return ExportableDLRM(model)


def export_torchscript(model: DLRM, path: str) -> None:
    """Writes ``model`` as a traced TorchScript file (``torch.jit.load``-able, also from C++).

    Tracing, because the model does not script; the traced graph keeps the batch dimension
    symbolic, so any batch size runs.
    """
    wrapper = _exportable(model)
    example = sample_inputs(model.config, batch_size=8)
    with torch.no_grad(), warnings.catch_warnings():
        # Shape checks fold to constants (intended); torch.jit's deprecation notice is in the docs.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(wrapper, example, check_trace=False)
        # A write that fails inside torch.jit.save aborts the process (its zip writer throws again
        # from a destructor), so a disk without room for the weights and the code is refused first.
        needed = state_bytes(model) + (1 << 20)
        check_free_space(path, needed, EXPORTED)
        write_atomically(path, lambda tmp: torch.jit.save(traced, tmp), EXPORTED, needed)


@contextlib.contextmanager
def _quiet_loggers(*names: str) -> Iterator[None]:
    """The exporter's log lines below errors, silenced: the opset it writes first and converts
    down (the file is then checked in ONNX Runtime against the eager model, ``check_export``),
    the torchvision operators it skips registering (a DLRM has none). Each export printed 6 such
    lines, one saying the conversion "may not be successful"."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def export_onnx(model: DLRM, path: str, opset: int = 17, numerical_dtype: torch.dtype = torch.float32,
                external_data: bool | None = None) -> None:
    """Writes ``model`` as an ONNX file with a dynamic batch axis: one self-contained file, or,
    with ``external_data`` (None: when the weights pass protobuf's 2 GiB), the graph in ``path``
    and the weights in ``path + ".data"`` beside it (ONNX's external-data format, which ONNX
    Runtime and Triton read from the model's folder). Both files are written into a staging
    folder and moved into place, the weights first: ``path`` never names weights that are not there.

    Uses the ``torch.export``-based exporter (``dynamo=True``, needs ``onnxscript``). The
    legacy TorchScript-based one (``dynamo=False``) is deprecated, and it mis-exports the dot
    interaction's padding width: it lowers Python's floor division of a traced shape to a
    truncating ONNX Div, so ONNX Runtime fails on a negative size. Inputs ``numerical``
    float32 ``[batch, N]`` and ``categorical`` int64 ``[batch, F]``, output
    ``click_probability`` ``[batch, 1]``.

    ``numerical_dtype=torch.float16`` makes the ``numerical`` input float16 (cast to float32
    first thing in the graph): datasets store numerical features as float16, so a client sends
    half the bytes and loses nothing.
    """
    wrapper = _exportable(model).for_onnx()
    size = sum(t.numel() * t.element_size() for t in (*wrapper.parameters(), *wrapper.buffers()))
    external = size >= ONNX_MAX_BYTES if external_data is None else external_data
    if size >= ONNX_MAX_BYTES and not external:
        raise ValueError(f"the model's weights take {size / 2**30:.1f} GiB; a single ONNX file holds at most 2 GiB: "
                         "export with external_data (weights in a .data file beside it), or TorchScript")
    if numerical_dtype not in (torch.float32, torch.float16):
        raise ValueError(f"numerical_dtype must be torch.float32 or torch.float16, got {numerical_dtype}")
    numerical, categorical = sample_inputs(model.config, batch_size=8)  # not 1: torch.export would specialise on it
    example = (numerical.to(numerical_dtype), categorical)
    batch = torch.export.Dim("batch")

    def write(tmp: str) -> None:
        with torch.no_grad(), warnings.catch_warnings(), _quiet_loggers("torch.onnx", "onnxscript"):
            warnings.simplefilter("ignore")  # exporter chatter (deprecations, opset conversion notes)
            torch.onnx.export(
                wrapper,
                example,
                tmp,
                dynamo=True,
                external_data=external,  # the weights in tmp + ".data" (named in the graph by that file name)
                input_names=list(INPUT_NAMES),
                output_names=[OUTPUT_NAME],
                dynamic_shapes=({0: batch}, {0: batch}),
                opset_version=opset,
                verbose=False,
            )

    if not external:
        write_atomically(path, write, EXPORTED, size)
        return
    _write_with_external_data(path, write, size)


def _write_with_external_data(path: str, write: Callable[[str], None], size: int) -> None:
    """``write(p)`` makes ``p`` and ``p + ".data"`` (the graph names the data file by its base
    name, so both are written under their final names, in a staging folder beside ``path``);
    they are moved into place data first. A failure leaves ``path`` and its data as they were."""
    check_free_space(path, size, EXPORTED)
    staging = temporary_name(path)
    os.mkdir(staging)
    try:
        staged = os.path.join(staging, os.path.basename(path))
        with writing(path, EXPORTED, size):
            write(staged)
            os.replace(staged + ONNX_DATA_SUFFIX, path + ONNX_DATA_SUFFIX)
            os.replace(staged, path)
            fsync_dir(os.path.dirname(os.path.abspath(path)))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_exported(
    path: str, device: torch.device | str = "cpu", threads: int = 0
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Loads an exported file the way a server would and returns ``run(numerical, categorical)
    -> click_probability [B, 1]``: ONNX Runtime (CPU) for ``.onnx``, ``torch.jit.load`` on
    ``device`` otherwise. Inputs of any float / integer dtype are cast to what the file takes
    (inside the timed work, as a server receiving other dtypes would have to). ``threads``:
    ONNX Runtime's intra-op threads (0: its default, one per core); TorchScript uses torch's."""
    if path.endswith(".onnx"):
        import onnxruntime as ort

        if torch.device(device).type != "cpu":
            raise ValueError(f"ONNX files run on the CPU here (ONNX Runtime's CPU provider), not on {device}")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
        numerical_type = torch.float16 if session.get_inputs()[0].type == "tensor(float16)" else torch.float32

        def run_onnx(numerical: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
            feeds = {INPUT_NAMES[0]: numerical.to(numerical_type).numpy(),
                     INPUT_NAMES[1]: categorical.to(torch.int64).numpy()}
            return torch.from_numpy(session.run([OUTPUT_NAME], feeds)[0])

        return run_onnx
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(path, map_location=device)

    def run_torchscript(numerical: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return module(numerical, categorical.to(torch.int64))

    return run_torchscript


def check_export(
    model: DLRM,
    path: str,
    batch_sizes: Sequence[int] = (1, 64, 4096),
    rtol: float = 1e-5,
    atol: float = 1e-6,
    numerical_dtype: torch.dtype = torch.float32,
) -> dict[int, float]:
    """Runs the exported file (ONNX Runtime for ``.onnx``, ``torch.jit.load`` otherwise) against
    the eager model's ``sigmoid(logits)`` on random valid inputs at each batch size.

    The file gets ``numerical`` in ``numerical_dtype`` (float16 for a file exported with a
    float16 input); the eager model gets the same values, widened to float32.

    Returns ``{batch_size: max abs error}``; raises ``AssertionError`` with the error when an
    output is outside ``|got - want| <= atol + rtol * |want|`` (a NaN on either side is), or has
    the wrong shape.
    """
    _require_cpu(model)
    run = load_exported(path)
    errors: dict[int, float] = {}
    for batch_size in batch_sizes:
        numerical, categorical = sample_inputs(model.config, batch_size, seed=batch_size)
        numerical = numerical.to(numerical_dtype)
        with torch.no_grad():
            want = torch.sigmoid(model(numerical.float(), categorical)).unsqueeze(1)
        got = run(numerical, categorical)
        if tuple(got.shape) != tuple(want.shape):
            raise AssertionError(
                f"{path}: batch {batch_size}: output shape {tuple(got.shape)}, expected {tuple(want.shape)}"
            )
        error = (got - want).abs()
        errors[batch_size] = float(error.max())
        # ``error <= tol`` negated, not ``error > tol``: a NaN output (or reference) compares false
        # to everything, and must fail the check rather than pass it.
        if not bool((error <= atol + rtol * want.abs()).all()):
            raise AssertionError(
                f"{path}: batch {batch_size}: max abs error {errors[batch_size]:.3g} exceeds atol={atol} rtol={rtol}"
            )
    return errors

