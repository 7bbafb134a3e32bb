"""Row-wise quantized embedding rows: the packed layout, its torch reference, and a Triton
dequantize-gather kernel for the GPU.

A table of ``R`` rows of width ``D`` is stored as ``R`` packed rows of bytes, the layout of torch's
quantized embedding-bag operators (FBGEMM's fused row-wise format), so the CPU serves it with
``torch.ops.quantized.embedding_bag_*_rowwise_offsets`` with no conversion:

=========  ==============================  ============================  ==========
precision  codes (per row)                 then, per row                 row bytes
=========  ==============================  ============================  ==========
``int8``   ``D`` bytes                     fp32 scale, fp32 bias         ``D + 8``
``int4``   ``D / 2`` bytes, 2 codes a byte fp16 scale, fp16 bias         ``D/2 + 4``
``int2``   ``D / 4`` bytes, 4 codes a byte fp16 scale, fp16 bias         ``D/4 + 4``
=========  ==============================  ============================  ==========

Element ``j`` of a row is code ``(byte[j // k] >> (bits * (j % k))) & (2**bits - 1)`` with
``k = 8 // bits`` codes a byte (low bits first), and its value is ``code * scale + bias`` in fp32.
Each row's scale and bias map its own ``[min, max]`` onto the codes, so a row of small values
keeps its precision next to a row of large ones.

``dequantize_gather(packed, ids, dim, precision, out_dtype)`` reads rows ``ids`` and writes them
dequantized in ``out_dtype``: one Triton program per block of ids and columns on a GPU (or under
``TRITON_INTERPRET=1``), ``dequantize_gather_reference`` otherwise. The kernel reads each row's
scale and bias through a float view of the same bytes, so it needs the codes to end on a float
boundary (``D`` a multiple of 4, of 8 for ``int2``); other widths take the reference.
"""

from __future__ import annotations

import torch

from dlrm.kernels.backend import exporting, interpreting, triton_installed, triton_usable

if triton_installed():
    import triton
    import triton.language as tl

    from dlrm.kernels.embedding import gather_block, store_block  # the gather program's ids, masks and store
else:  # the reference runs instead; nothing below is reached without Triton
    triton = None

# Bits per stored element of each precision a serving table may have; "fp32" and "fp16" tables
# are plain float tables, the other three packed rows.
PRECISION_BITS = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4, "int2": 2}
QUANTIZED = ("int8", "int4", "int2")
# The float type of a packed row's scale and bias.
SCALE_DTYPES = {"int8": torch.float32, "int4": torch.float16, "int2": torch.float16}
_PREPACK = {"int8": "embedding_bag_byte_prepack", "int4": "embedding_bag_4bit_prepack",
            "int2": "embedding_bag_2bit_prepack"}
_KERNELS_INTERPRETED = interpreting()
GATHER_ELEMENTS = 4096  # ids x columns per program
MAX_BLOCK_D = 128


def codes_per_byte(precision: str) -> int:
    return 8 // PRECISION_BITS[precision]


def code_bytes(dim: int, precision: str) -> int:
    """Bytes of one row's codes."""
    return dim // codes_per_byte(precision)


def row_bytes(dim: int, precision: str) -> int:
    """Bytes of one stored row of width ``dim``: codes, then scale and bias (float tables: the floats)."""
    if precision not in QUANTIZED:
        return dim * PRECISION_BITS[precision] // 8
    return code_bytes(dim, precision) + 2 * SCALE_DTYPES[precision].itemsize


def check_dim(dim: int, precision: str) -> None:
    """Raises ValueError when rows of width ``dim`` cannot be packed at ``precision``."""
    if precision not in PRECISION_BITS:
        raise ValueError(f"unknown table precision {precision!r}; choose from {list(PRECISION_BITS)}")
    if precision in QUANTIZED and dim % codes_per_byte(precision):
        raise ValueError(f"`embedding_dim` {dim} cannot be stored at {precision}: it packs "
                         f"{codes_per_byte(precision)} values a byte, so the width must be a multiple of "
                         f"{codes_per_byte(precision)}; choose int8 for these tables")


@torch.no_grad()
def quantize_rows(weight: torch.Tensor, precision: str) -> torch.Tensor:
    """``weight [R, D]`` (any float dtype, any device) as packed rows ``[R, row_bytes]`` uint8 on
    the CPU, by torch's own prepack operators (the layout its quantized lookups read)."""
    check_dim(weight.shape[1], precision)
    if precision not in QUANTIZED:
        raise ValueError(f"{precision} tables are not packed")
    rows = weight.detach().to("cpu", torch.float32).contiguous()
    prepack = getattr(torch.ops.quantized, _PREPACK[precision])
    return prepack(rows) if precision == "int8" else prepack(rows, False)


def dequantize_rows(rows: torch.Tensor, dim: int, precision: str, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows ``[N, row_bytes]`` uint8 -> values ``[N, dim]`` in ``out_dtype`` (computed in
    fp32; float64 when asked for, as tests' exact reference). Plain torch ops, any device."""
    n = rows.shape[0]
    width = code_bytes(dim, precision)
    compute = torch.float64 if out_dtype == torch.float64 else torch.float32
    if precision == "int8":
        codes = rows[:, :width].to(compute)
    else:
        bits = PRECISION_BITS[precision]
        raw = rows[:, :width].to(torch.int32)
        fields = [(raw >> (bits * k)) & ((1 << bits) - 1) for k in range(codes_per_byte(precision))]
        codes = torch.stack(fields, dim=2).reshape(n, dim).to(compute)
    scale_bias = rows[:, width:width + 2 * SCALE_DTYPES[precision].itemsize].contiguous()
    scale_bias = scale_bias.view(SCALE_DTYPES[precision]).to(compute)
    return (codes * scale_bias[:, :1] + scale_bias[:, 1:]).to(out_dtype)


def dequantize_gather_reference(packed: torch.Tensor, ids: torch.Tensor, dim: int, precision: str,
                                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``ids`` of ``packed``, dequantized: ``[N, dim]`` in ``out_dtype`` (torch)."""
    return dequantize_rows(packed.index_select(0, ids.reshape(-1)), dim, precision, out_dtype)


def supports_dequantize_gather(packed: torch.Tensor, ids: torch.Tensor, dim: int, precision: str,
                               out_dtype: torch.dtype) -> bool:
    """Whether ``dequantize_gather`` runs its kernel: contiguous packed rows whose codes end on a
    float boundary, 1-D int64 ids, a float output, all on one device Triton can use."""
    return (
        triton is not None
        and not exporting()
        and triton_usable(packed, ids)
        and (packed.device.type != "cpu" or _KERNELS_INTERPRETED)
        and precision in QUANTIZED
        and packed.dtype == torch.uint8
        and packed.dim() == 2
        and packed.is_contiguous()
        and packed.shape[1] == row_bytes(dim, precision)
        and code_bytes(dim, precision) % SCALE_DTYPES[precision].itemsize == 0
        and ids.dim() == 1
        and ids.dtype == torch.int64
        and ids.is_contiguous()
        and out_dtype in (torch.float32, torch.float16, torch.bfloat16)
    )


if triton is not None:

    @triton.jit
    def _dequantize_gather_kernel(packed_ptr, scale_ptr, ids_ptr, out_ptr, n, num_rows, dim, row_bytes,
                                  code_bytes, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program ``(i, j)``: ids ``[i*BLOCK_N, +BLOCK_N)`` x columns ``[j*BLOCK_D, +BLOCK_D)``.
        ``scale_ptr`` is the packed bytes seen as floats (fp32 for 8 bits, fp16 below), so a
        row's scale and bias are two loads; ids outside ``[0, num_rows)`` read zeros."""
        idx, cols, idx_ok, col_ok, rows, row_ok = gather_block(ids_ptr, n, num_rows, dim, BLOCK_N, BLOCK_D)
        per_byte: tl.constexpr = 8 // BITS
        byte = tl.load(packed_ptr + rows[:, None] * row_bytes + (cols // per_byte)[None, :],
                       mask=row_ok[:, None] & col_ok[None, :], other=0).to(tl.int32)
        code = (byte >> ((cols % per_byte) * BITS)[None, :]) & ((1 << BITS) - 1)
        float_bytes: tl.constexpr = 4 if BITS == 8 else 2
        first = (rows * row_bytes + code_bytes) // float_bytes
        scale = tl.load(scale_ptr + first, mask=row_ok, other=0.0).to(tl.float32)
        bias = tl.load(scale_ptr + first + 1, mask=row_ok, other=0.0).to(tl.float32)
        vals = code.to(tl.float32) * scale[:, None] + bias[:, None]
        store_block(out_ptr, vals, idx, cols, idx_ok, col_ok, dim)


def dequantize_gather(packed: torch.Tensor, ids: torch.Tensor, dim: int, precision: str,
                      out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``ids`` of ``packed`` dequantized, ``[N, dim]`` in ``out_dtype``: one kernel (the
    reference when ``supports_dequantize_gather`` says no)."""
    ids = ids.reshape(-1)
    if not supports_dequantize_gather(packed, ids, dim, precision, out_dtype):
        return dequantize_gather_reference(packed, ids, dim, precision, out_dtype)
    n = ids.shape[0]
    out = torch.empty(n, dim, dtype=out_dtype, device=packed.device)
    if n == 0:
        return out
    block_d = min(max(triton.next_power_of_2(dim), 16), MAX_BLOCK_D)
    block_n = max(GATHER_ELEMENTS // block_d, 16)
    grid = (triton.cdiv(n, block_n), triton.cdiv(dim, block_d))
    scales = packed.view(SCALE_DTYPES[precision])  # the same bytes, as floats
    _dequantize_gather_kernel[grid](packed, scales, ids, out, n, packed.shape[0], dim, packed.shape[1],
                                    code_bytes(dim, precision), BITS=PRECISION_BITS[precision],
                                    BLOCK_N=block_n, BLOCK_D=block_d)
    return out
