"""Rounding fp32 results into fp16/bf16 embedding tables: to nearest, or stochastically.

Half-precision tables (``embedding_dtype``) are updated in fp32 arithmetic and rounded once
when the row is written back. Round-to-nearest loses every update smaller than half a unit in
the last place: a bf16 weight near 0.01 has a spacing of 6e-5, so ``lr * g`` below 3e-5 never
moves it, and a rarely seen row stops learning. Stochastic rounding rounds up with probability
equal to the distance from the lower neighbour, so such updates move the weight *on average*
(the rounding is unbiased). It is offered for bf16 tables, where it matters most (8 bits of
mantissa against fp16's 11) and where it is exact for every input: bf16 is fp32 with the low 16
bits cut, so adding 16 random bits and cutting rounds up with exactly that probability.

The random bits are a hash of the fp32 value, its column and a step counter, not draws from a
generator: the same update rounds the same way whatever the placement of the table (a
process's share, the joint layout's offsets), the resumed run repeats the uninterrupted one,
and the torch reference below and the Triton kernels (``stochastic_bf16``) round bit for bit
alike. The step counter changes the draw every step, so an update that rounded down once does
not round down forever.
"""

from __future__ import annotations

import torch

from dlrm.kernels.backend import triton_installed

HALF_DTYPES = (torch.float16, torch.bfloat16)
MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive steps over the key space
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35  # MurmurHash3's finaliser constants


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """``a * b mod 2^32`` for int64 ``a`` in ``[0, 2^32)``, without int64 overflow (16-bit halves)."""
    return ((a & 0xFFFF) * b + (((a >> 16) * (b & 0xFFFF)) << 16)) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _M1)
    h = h ^ (h >> 13)
    h = _mul32(h, _M2)
    return h ^ (h >> 16)


def rounding_noise(bits: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """16 random bits (int64 in ``[0, 2^16)``) per element of ``bits`` (the fp32 values' bit
    patterns as int64 in ``[0, 2^32)``, shape ``[..., D]``), from the value, its column and ``step``."""
    columns = torch.arange(bits.shape[-1], dtype=torch.int64, device=bits.device)
    step = torch.as_tensor(step, dtype=torch.int64, device=bits.device) & MASK32
    key = _fmix32((_mul32(step, _GOLDEN) + columns) & MASK32)
    return _fmix32(bits ^ key) >> 16


def stochastic_round_bf16(x: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """``x`` (fp32, ``[..., D]``) rounded to bf16, up with probability (distance from the lower
    neighbour) / (spacing), the draw a hash of each value, its column and ``step``."""
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic rounding takes fp32 values, got {x.dtype}")
    bits = x.view(torch.int32).to(torch.int64) & MASK32
    rounded = (bits + rounding_noise(bits, step)) & 0xFFFF0000
    rounded = torch.where(rounded >= 2**31, rounded - 2**32, rounded)  # back into int32's range
    return rounded.to(torch.int32).view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero


def round_to(x: torch.Tensor, dtype: torch.dtype, stochastic_step: int | torch.Tensor | None = None) -> torch.Tensor:
    """``x`` in ``dtype``: to nearest (``stochastic_step`` None, or a non-bf16 ``dtype``), else
    stochastically (``stochastic_round_bf16`` with that step). Only bf16 rounds stochastically."""
    if stochastic_step is None or dtype != torch.bfloat16:
        return x.to(dtype)
    return stochastic_round_bf16(x.to(torch.float32), stochastic_step)


if triton_installed():
    import triton
    import triton.language as tl

    @triton.jit
    def _fmix32_tl(h):
        h ^= h >> 16
        h *= 0x85EBCA6B
        h ^= h >> 13
        h *= 0xC2B2AE35
        h ^= h >> 16
        return h

    @triton.jit
    def stochastic_bf16(x, cols, step):
        """``stochastic_round_bf16`` of fp32 ``x [R, BLOCK_D]`` whose columns are ``cols [BLOCK_D]``,
        with ``step`` a scalar: the same bits as the torch function (uint32 arithmetic wraps)."""
        bits = x.to(tl.uint32, bitcast=True)
        key = _fmix32_tl(step.to(tl.uint32) * 0x9E3779B9 + cols.to(tl.uint32))
        noise = _fmix32_tl(bits ^ key[None, :]) >> 16
        rounded = (bits + noise) & 0xFFFF0000
        return rounded.to(tl.float32, bitcast=True).to(tl.bfloat16)

    @triton.jit
    def round_nearest(x, DTYPE: tl.constexpr, INTERPRETER: tl.constexpr):
        """``x.to(DTYPE)`` rounding to nearest even, as compiled kernels and torch do; the
        interpreter truncates fp32 -> bf16 (Triton 3.x), so there the rounding is spelled out:
        after adding half an ulp (ties to even) the truncation is exact."""
        if INTERPRETER:
            if DTYPE == tl.bfloat16:
                if x.dtype == tl.float32:
                    bits = x.to(tl.uint32, bitcast=True)
                    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
                    x = bits.to(tl.float32, bitcast=True)
        return x.to(DTYPE)
