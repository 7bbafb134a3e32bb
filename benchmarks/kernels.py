"""Each Triton kernel against its torch reference, next to the device's measured peaks.

    python benchmarks/kernels.py --device cuda                      # Criteo: 65536 x 27 x 128
    python benchmarks/kernels.py --device cuda --dtypes fp16 --shapes 65536x27x128,8192x128x64
    python benchmarks/kernels.py --device cpu                       # tiny shapes, a smoke run
    python benchmarks/kernels.py --device cuda --shapes 65536x27x128 --skip_embedding  # + FL15's MLPs

(after ``pip install -e .``). A shape is ``BATCHxNUM_FEATURESxDIM`` with NUM_FEATURES counting
the bottom MLP output (27 = bottom + 26 embeddings). On CPU the kernels run in Triton's
interpreter under ``TRITON_INTERPRET=1`` and fall back to the reference otherwise (the
``path`` column says which), so CPU numbers only show that the script works.

The MLP rows (``mlp_bottom``, ``mlp_top``: FL15's 13-512-256-128 and 480-1024-1024-512-256-1 at
batch 65536 on a GPU, batch 64 on the CPU) time a whole MLP with its fused ``Linear -> ReLU``
layers (``dlrm.kernels.linear_relu``: cuBLASLt's bias and ReLU epilogue forward, one Triton
kernel for the ReLU and bias gradients backward) against the same MLP, same weights, on the
plain path (``F.linear`` and ``relu``); fp16 and bf16 there mean autocast over fp32
parameters, as training runs them. Their bytes are each layer's GEMM operands and outputs,
their FLOPs the GEMMs'. ``--skip_mlp`` leaves them out, ``--mlp_batch_size`` sets the batch.

Columns: median time of the kernel and of the reference, speedup, achieved GB/s (bytes the
operation must move: inputs read plus outputs written, not cache traffic) and TFLOP/s (the
Gram products that are kept: ``D n (n-1)`` per sample forward, twice that backward), and the
fraction of the roofline ``max(bytes / peak GB/s, flops / peak FLOP/s)`` reached. Both peaks
are measured in the same run: a large device-to-device copy, and a large matmul in each dtype
(fp32 as torch runs it: TF32 unless ``--tf32 off``, as training runs it, and so does the kernel).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from dlrm.kernels import linear_relu
from dlrm.kernels.backend import tf32_allowed
from dlrm.kernels.dot_interaction import dot_interaction, supports
from dlrm.nn.interactions import dot_interaction_reference, dot_interaction_width
from dlrm.nn.mlp import MLP

try:  # the embedding kernels are optional here: their rows join the table when present
    from dlrm.kernels import embedding as embedding_kernels
    from dlrm.kernels import embedding_bag as bag_kernels
except ImportError:
    embedding_kernels = bag_kernels = None

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CRITEO = (65536, 27, 128)
GPU_EXTRA_SHAPES = [(65536, 9, 64), (16384, 64, 128), (4096, 128, 128)]  # small n, one 64-tile, 2x2 tiles
CPU_SHAPE = (8, 5, 16)
CPU_EXTRA_SHAPES = [(4, 9, 24)]
NUM_TABLE_FEATURES = 26  # ids per sample in the embedding benchmarks (Criteo's categorical features)
# FL15's MLPs: (name, input width, layer sizes, ReLU after the last layer, input in the compute
# dtype). The bottom MLP reads the fp32 numerical features; the top MLP the dot interaction's
# padded row (26 tables of dim 128 and the bottom output: 479 -> 480), in the compute dtype.
FL15_MLPS = [("mlp_bottom", 13, [512, 256, 128], True, False),
             ("mlp_top", 480, [1024, 1024, 512, 256, 1], False, True)]
MLP_GPU_BATCH = 65536
MLP_CPU_BATCH = 64


@dataclass(frozen=True)
class Peaks:
    """Measured device peaks: copy bandwidth (bytes/s) and matmul rate per dtype (FLOP/s)."""

    bandwidth: float
    flops: dict[torch.dtype, float]


@dataclass(frozen=True)
class Row:
    kernel: str
    shape: str
    dtype: str
    phase: str
    path: str  # "triton", "interpreted" or "reference": what the kernel call actually ran
    kernel_s: float
    reference_s: float
    bytes: float
    flops: float


# ----------------------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median seconds of one call: CUDA events around each call on a GPU (the launch queue is
    drained first), wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, warmup: int, reps: int) -> float:
    """Bytes/s of a device-to-device copy (read + write) of a buffer far larger than any cache."""
    copy_bytes = 2**30 if device.type == "cuda" else 2**24
    src = torch.ones(copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * copy_bytes / measure(lambda: dst.copy_(src), device, warmup, reps)


def matmul_flops(device: torch.device, dtype: torch.dtype, warmup: int, reps: int) -> float:
    """FLOP/s of a large square matmul in ``dtype``."""
    size = 8192 if device.type == "cuda" else 256
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / measure(lambda: a @ b, device, warmup, reps)


def measure_peaks(device: torch.device, dtypes: list[torch.dtype], warmup: int, reps: int) -> Peaks:
    return Peaks(copy_bandwidth(device, warmup, reps), {d: matmul_flops(device, d, warmup, reps) for d in dtypes})


# ----------------------------------------------------------------------------- dot interaction


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"65536x27x128,8192x64x64"`` -> ``[(65536, 27, 128), (8192, 64, 64)]``."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"a shape is BATCHxNUM_FEATURESxDIM with positive sizes, got {item!r}")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def kernel_path(bottom: torch.Tensor, embedded: torch.Tensor) -> str:
    if not supports(bottom, embedded):
        return "reference"
    return "interpreted" if bottom.device.type == "cpu" else "triton"


def dot_interaction_rows(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
                         warmup: int, reps: int) -> list[Row]:
    """Forward, backward and both, kernel against reference, at one shape and dtype."""
    batch, num_features, dim = shape
    g = torch.Generator(device=device).manual_seed(0)
    bottom = torch.randn(batch, dim, device=device, generator=g).to(dtype).requires_grad_(True)
    embedded = torch.randn(batch, num_features - 1, dim, device=device, generator=g).to(dtype).requires_grad_(True)
    width = dot_interaction_width(num_features, dim)
    grad_out = torch.randn(batch, width, device=device, generator=g).to(dtype)
    inputs = (bottom, embedded)

    def forward(fn):
        def run():
            with torch.no_grad():
                return fn(*inputs)
        return run

    def backward(fn):
        out = fn(*inputs)
        return lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True)

    def both(fn):
        return lambda: torch.autograd.grad(fn(*inputs), inputs, grad_out)

    size = bottom.element_size()
    features_bytes = batch * num_features * dim * size
    out_bytes = batch * width * size
    gram_flops = batch * dim * num_features * (num_features - 1)
    phases = [
        ("fwd", forward, features_bytes + out_bytes, gram_flops),
        ("bwd", backward, out_bytes + 2 * features_bytes, 2 * gram_flops),
        ("fwd+bwd", both, 2 * out_bytes + 3 * features_bytes, 3 * gram_flops),
    ]
    path = kernel_path(bottom, embedded)
    rows = []
    for phase, make, nbytes, flops in phases:
        kernel_s = measure(make(dot_interaction), device, warmup, reps)
        reference_s = measure(make(dot_interaction_reference), device, warmup, reps)
        rows.append(Row("dot_interaction", "x".join(map(str, shape)), dtype_name(dtype), phase, path,
                        kernel_s, reference_s, nbytes, flops))
    return rows


# ----------------------------------------------------------------------------- MLP


def mlp_path(mlp: MLP, x: torch.Tensor, dtype: torch.dtype) -> str:
    """What the MLP's first layer ran: the fused layer (compiled or interpreted) or the plain path."""
    layer = mlp.layers[0]
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        fused = linear_relu.supports(x, layer.weight, layer.bias)
    if not fused:
        return "reference"
    return "interpreted" if x.device.type == "cpu" else "triton"


def mlp_rows(name: str, in_features: int, sizes: list[int], relu_last: bool, input_in_compute_dtype: bool,
             batch: int, dtype: torch.dtype, device: torch.device, warmup: int, reps: int) -> list[Row]:
    """Forward, backward and both of one MLP, fused layers against the plain path, same weights.
    fp16 / bf16 run under autocast over fp32 parameters (the training setup)."""
    torch.manual_seed(0)
    fused = MLP(in_features, sizes, relu_last=relu_last, device=device, use_kernel=True)
    plain = MLP(in_features, sizes, relu_last=relu_last, device=device, use_kernel=False)
    plain.load_state_dict(fused.state_dict())
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, in_features, device=device, generator=g)
    if input_in_compute_dtype:
        x = x.to(dtype)
    x.requires_grad_(True)
    amp = dtype != torch.float32

    def run(mlp):
        with torch.autocast(device.type, dtype=dtype, enabled=amp):
            return mlp(x)

    grad_out = torch.randn(batch, sizes[-1], device=device, generator=g).to(run(plain).dtype)

    def forward(mlp):
        return lambda: run(mlp)

    def backward(mlp):
        out = run(mlp)
        inputs = [x, *mlp.parameters()]
        return lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True)

    def both(mlp):
        inputs = [x, *mlp.parameters()]
        return lambda: torch.autograd.grad(run(mlp), inputs, grad_out)

    size = torch.empty((), dtype=dtype).element_size()
    dims = [in_features, *sizes]
    # Per layer (K inputs, N outputs): forward reads x and W and writes the output; backward
    # reads the output gradient, the output (ReLU mask), x and W, writes grad x and grad W.
    fwd_bytes = sum((batch * k + k * n + batch * n) * size for k, n in zip(dims[:-1], dims[1:]))
    bwd_bytes = sum((2 * batch * n + 2 * batch * k + 2 * k * n) * size for k, n in zip(dims[:-1], dims[1:]))
    fwd_flops = sum(2 * batch * k * n for k, n in zip(dims[:-1], dims[1:]))
    phases = [("fwd", forward, fwd_bytes, fwd_flops), ("bwd", backward, bwd_bytes, 2 * fwd_flops),
              ("fwd+bwd", both, fwd_bytes + bwd_bytes, 3 * fwd_flops)]
    path = mlp_path(fused, x, dtype)
    shape = f"{batch}x" + "-".join(map(str, dims))
    rows = []
    for phase, make, nbytes, flops in phases:
        kernel_s = measure(make(fused), device, warmup, reps)
        reference_s = measure(make(plain), device, warmup, reps)
        rows.append(Row(name, shape, dtype_name(dtype), phase, path, kernel_s, reference_s, nbytes, flops))
    return rows


# ----------------------------------------------------------------------------- embedding kernels
# The embedding kernels (dlrm/kernels/embedding.py) plug in here: one function returning rows,
# called from main() when that module imports. Gather: Criteo's ids of one batch from a joint
# table into the compute dtype. SGD update: the same ids with a gradient in the compute dtype,
# into the fp32 table, and (bf16 compute dtype) into a bf16 table with stochastic rounding.


def embedding_rows(batch: int, dim: int, table_rows: int, dtype: torch.dtype, device: torch.device,
                   warmup: int, reps: int) -> list[Row]:
    """``gather`` and ``sgd_update`` against their references (fp32 table, ``dtype`` outputs)."""
    if embedding_kernels is None:
        return []
    g = torch.Generator(device=device).manual_seed(0)
    weight = torch.rand(table_rows, dim, device=device, generator=g)
    ids = torch.randint(0, table_rows, (batch * NUM_TABLE_FEATURES,), device=device, generator=g)
    num_ids = ids.numel()
    size = torch.empty((), dtype=dtype).element_size()
    shape = f"{num_ids}ids@{table_rows}x{dim}"
    rows = []

    gather_path = "reference"
    if embedding_kernels.supports_gather(weight, ids, dtype):
        gather_path = "interpreted" if device.type == "cpu" else "triton"
    gather_bytes = num_ids * ids.element_size() + num_ids * dim * (weight.element_size() + size)
    rows.append(Row("embedding_gather", shape, dtype_name(dtype), "fwd", gather_path,
                    measure(lambda: embedding_kernels.gather(weight, ids, dtype), device, warmup, reps),
                    measure(lambda: embedding_kernels.gather_reference(weight, ids, dtype), device, warmup, reps),
                    gather_bytes, 0.0))

    grad = torch.randn(num_ids, dim, device=device, generator=g).to(dtype)
    lr = torch.tensor(1e-6, device=device)  # tiny: repeated updates keep the table in range
    grad_scale = torch.tensor(1.0, device=device)
    skip = torch.tensor(False, device=device)
    update_args = (weight, ids, grad, lr, grad_scale, skip)
    update_path = "reference"
    if embedding_kernels.supports_update(*update_args):
        update_path = "interpreted" if device.type == "cpu" else "triton"
    touched = torch.unique(ids).numel()  # each distinct row is read and written once
    update_bytes = num_ids * (ids.element_size() + dim * size) + 2 * touched * dim * weight.element_size()
    rows.append(Row("embedding_sgd_update", shape, dtype_name(dtype), "update", update_path,
                    measure(lambda: embedding_kernels.sgd_update(*update_args), device, warmup, reps),
                    measure(lambda: embedding_kernels.sgd_update_reference(*update_args), device, warmup, reps),
                    update_bytes, 0.0))
    if dtype == torch.bfloat16:
        rows.append(bf16_table_update_row(ids, grad, table_rows, dim, device, warmup, reps))
    return rows


def bf16_table_update_row(ids: torch.Tensor, grad: torch.Tensor, table_rows: int, dim: int, device: torch.device,
                          warmup: int, reps: int) -> Row:
    """The SGD update of a bf16 table (``embedding_dtype=bf16``) with stochastic rounding, as
    ``dlrm.nn.embeddings`` runs it: the ids as bags of one through ``bag_sgd_update``, two passes
    (fp32 run sums into an ``[N, D]`` buffer, then one rounded step per row)."""
    g = torch.Generator(device=device).manual_seed(1)
    weight = torch.rand(table_rows, dim, device=device, generator=g).to(torch.bfloat16)
    offsets = torch.arange(ids.numel() + 1, device=device)
    lr = torch.tensor(1e-6, device=device)
    scalars = (lr, torch.tensor(1.0, device=device), torch.tensor(False, device=device))
    step = torch.tensor(0, dtype=torch.int64, device=device)
    path = "reference"
    if bag_kernels.supports_bag_update(weight, ids, offsets, grad, None, *scalars, rounding_step=step):
        path = "interpreted" if device.type == "cpu" else "triton"
    touched = torch.unique(ids).numel()
    num_ids = ids.numel()
    # ids and gradient read, the fp32 buffer written and read back, each touched bf16 row read and written
    moved = (num_ids * (ids.element_size() + dim * grad.element_size()) + 2 * num_ids * dim * 4
             + 2 * touched * dim * weight.element_size())
    return Row("bf16_table_sgd_update", f"{num_ids}ids@{table_rows}x{dim}", dtype_name(grad.dtype), "update", path,
               measure(lambda: bag_kernels.bag_sgd_update(weight, ids, offsets, grad, *scalars, rounding_step=step),
                       device, warmup, reps),
               measure(lambda: bag_kernels.bag_sgd_update_reference(weight, ids, offsets, grad, *scalars, None, step),
                       device, warmup, reps),
               moved, 0.0)


# ----------------------------------------------------------------------------- report


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def roofline_seconds(row: Row, peaks: Peaks) -> float:
    """The least time the row's bytes and FLOPs need at the measured peaks."""
    flops_peak = peaks.flops[DTYPES[row.dtype]]
    return max(row.bytes / peaks.bandwidth, row.flops / flops_peak)


HEADER = (f"{'kernel':<21} {'shape':<30} {'dtype':<5} {'phase':<7} {'path':<11} {'kernel ms':>10} "
          f"{'torch ms':>10} {'speedup':>8} {'GB/s':>8} {'TFLOP/s':>8} {'roofline':>9}")


def format_row(row: Row, peaks: Peaks) -> str:
    tflops = f"{row.flops / row.kernel_s / 1e12:8.3g}" if row.flops else f"{'-':>8}"
    return (f"{row.kernel:<21} {row.shape:<30} {row.dtype:<5} {row.phase:<7} {row.path:<11} "
            f"{row.kernel_s * 1e3:10.4g} {row.reference_s * 1e3:10.4g} {row.reference_s / row.kernel_s:7.3g}x "
            f"{row.bytes / row.kernel_s / 1e9:8.4g} {tflops} {roofline_seconds(row, peaks) / row.kernel_s:8.1%}")


def format_peaks(peaks: Peaks, device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rates = ", ".join(f"{dtype_name(d)} {f / 1e12:.1f} TFLOP/s" for d, f in peaks.flops.items())
    tf32 = device.type == "cuda" and tf32_allowed()
    return f"device {name}: copy {peaks.bandwidth / 1e9:.1f} GB/s; matmul {rates}{' (fp32 as TF32)' if tf32 else ''}"


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch_size", type=int, default=None,
                        help=f"default {CRITEO[0]} on GPU, {CPU_SHAPE[0]} on CPU")
    parser.add_argument("--num_features", type=int, default=None, help="vectors in the interaction, bottom included")
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--dtypes", default="fp32,fp16,bf16")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="BxNxD,... dot-interaction shapes instead of the main shape and a few others")
    parser.add_argument("--table_rows", type=int, default=None, help="rows of the embedding table (default 4M on GPU)")
    parser.add_argument("--skip_embedding", action="store_true", help="leave out the embedding kernels")
    parser.add_argument("--skip_mlp", action="store_true", help="leave out FL15's MLPs")
    parser.add_argument("--mlp_batch_size", type=int, default=None,
                        help=f"batch of the MLP rows (default {MLP_GPU_BATCH} on GPU, {MLP_CPU_BATCH} on CPU)")
    parser.add_argument("--tf32", choices=("on", "off"), default="on",
                        help="fp32 matmuls (torch's and the kernels') in TF32, as training runs them (--allow_tf32)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args(argv)
    gpu = torch.device(args.device).type == "cuda"
    main_shape = CRITEO if gpu else CPU_SHAPE
    args.batch_size = args.batch_size or main_shape[0]
    args.num_features = args.num_features or main_shape[1]
    args.dim = args.dim or main_shape[2]
    if args.shapes is None:
        extras = GPU_EXTRA_SHAPES if gpu else CPU_EXTRA_SHAPES
        args.shapes = [(args.batch_size, args.num_features, args.dim)] + extras
    args.table_rows = args.table_rows or (4 * 2**20 if gpu else 1000)
    args.mlp_batch_size = args.mlp_batch_size or (MLP_GPU_BATCH if gpu else MLP_CPU_BATCH)
    args.warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    args.reps = args.reps if args.reps is not None else (20 if gpu else 2)
    try:
        args.dtypes = [DTYPES[name.strip()] for name in args.dtypes.split(",")]
    except KeyError as e:
        parser.error(f"--dtypes takes a comma-separated subset of {list(DTYPES)}, got {e.args[0]!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32 == "on"
    peaks = measure_peaks(device, args.dtypes, args.warmup, args.reps)
    print(format_peaks(peaks, device))
    print(HEADER)
    for shape in args.shapes:
        for dtype in args.dtypes:
            for row in dot_interaction_rows(shape, dtype, device, args.warmup, args.reps):
                print(format_row(row, peaks), flush=True)
    if not args.skip_mlp:
        for name, in_features, sizes, relu_last, input_in_compute_dtype in FL15_MLPS:
            for dtype in args.dtypes:
                for row in mlp_rows(name, in_features, sizes, relu_last, input_in_compute_dtype, args.mlp_batch_size,
                                    dtype, device, args.warmup, args.reps):
                    print(format_row(row, peaks), flush=True)
    if args.skip_embedding:
        return
    if embedding_kernels is None:
        print("embedding kernels: dlrm.kernels.embedding is not available, skipped")
        return
    for dtype in args.dtypes:
        for row in embedding_rows(args.batch_size, args.dim, args.table_rows, dtype, device, args.warmup, args.reps):
            print(format_row(row, peaks), flush=True)


if __name__ == "__main__":
    main()
