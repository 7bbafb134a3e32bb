"""Sweep the dot-interaction kernels' launch parameters on one device, to choose their defaults.

    python benchmarks/dot_interaction_tiles.py                     # Criteo shape, fp32/fp16/bf16
    python benchmarks/dot_interaction_tiles.py --shape 65536x27x128 --dtypes fp32

For each dtype and each phase (forward, backward) it times every combination of ``BLOCK_D``,
``num_warps``, ``num_stages`` and, for fp32, the ``tl.dot`` input precision (TF32 or IEEE),
checks each result against the float64 reference, and prints the fastest first, with the
default launch (what ``dot_interaction`` runs today) and torch's reference in the same run.
CUDA only (under the interpreter the timings mean nothing).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from dlrm.kernels import dot_interaction as dot
from dlrm.nn.interactions import dot_interaction_reference, dot_interaction_width

from kernels import measure  # benchmarks/kernels.py, beside this script

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def candidates(dtype: torch.dtype, block_n: int, dim: int, fp32_precisions: list[str]) -> list[dict]:
    precisions = fp32_precisions if dtype == torch.float32 else ["ieee"]
    block_ds = sorted({d for d in (16, 32, 64, 128) if d <= max(16, dim)})
    out = []
    for precision, block_d, warps, stages in itertools.product(precisions, block_ds, (2, 4, 8), (1, 2)):
        if block_n * block_d * dtype.itemsize > 32768:  # shared memory per operand
            continue
        out.append({"PRECISION": precision, "BLOCK_D": block_d, "num_warps": warps, "num_stages": stages})
    return out


def describe(tuning: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in tuning.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="65536x27x128", help="BxNxD: batch, vectors (bottom included), dim")
    parser.add_argument("--dtypes", default="fp32,fp16,bf16")
    parser.add_argument("--fp32_precisions", default="tf32,ieee",
                        help="tl.dot input precisions tried for fp32; the default launch follows --tf32")
    parser.add_argument("--tf32", choices=("on", "off"), default="on",
                        help="torch.backends.cuda.matmul.allow_tf32, which the default launch follows")
    parser.add_argument("--top", type=int, default=8, help="fastest launches printed per dtype and phase")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = args.tf32 == "on"
    batch, num_features, dim = map(int, args.shape.split("x"))
    block_n = dot._block_n(num_features)
    print(f"{torch.cuda.get_device_name(device)}; shape {args.shape}; BLOCK_N {block_n}; median ms of {args.reps}")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        g = torch.Generator(device=device).manual_seed(0)
        bottom = torch.randn(batch, dim, device=device, generator=g).to(dtype)
        embedded = torch.randn(batch, num_features - 1, dim, device=device, generator=g).to(dtype)
        grad_out = torch.randn(batch, dot_interaction_width(num_features, dim), device=device, generator=g).to(dtype)
        want_out = dot_interaction_reference(bottom.double(), embedded.double())
        leaves = (bottom.double().requires_grad_(), embedded.double().requires_grad_())
        want_grads = torch.autograd.grad(dot_interaction_reference(*leaves), leaves, grad_out.double())
        scale = {"out": want_out.abs().max().item(), "grad": max(g.abs().max().item() for g in want_grads)}
        tolerance = 1e-2 if dtype == torch.float32 else 3e-2  # relative to the largest value: TF32 / half

        def error(got, want, kind):
            return max((a.double() - b).abs().max().item() for a, b in zip(got, want)) / scale[kind]

        phases = {
            "fwd": (lambda t: dot._forward(bottom, embedded, dtype, t),
                    lambda got: error([got], [want_out], "out")),
            "bwd": (lambda t: dot._backward(grad_out, bottom, embedded, t),
                    lambda got: error(got, want_grads, "grad")),
        }
        torch_ms = {
            "fwd": measure(lambda: dot_interaction_reference(bottom, embedded), device, args.warmup, args.reps),
        }
        for phase, (run, check) in phases.items():
            results = []
            for tuning in [None] + candidates(dtype, block_n, dim, args.fp32_precisions.split(",")):
                try:
                    err = check(run(tuning))
                    ms = measure(lambda: run(tuning), device, args.warmup, args.reps) * 1e3
                except Exception as exc:  # a launch the compiler or the device refuses
                    print(f"  {name} {phase} {describe(tuning or {})}: {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                results.append((ms, err, tuning))
            default = next(r for r in results if r[2] is None)
            reference = f"; torch {torch_ms[phase] * 1e3:.3f} ms" if phase in torch_ms else ""
            print(f"{name} {phase}: default {describe(dot._launch(block_n, dim, dtype, phase == 'bwd', None))} "
                  f"{default[0]:.3f} ms{reference}")
            for ms, err, tuning in sorted((r for r in results if r[2] is not None and r[1] <= tolerance),
                                          key=lambda r: r[0])[: args.top]:
                print(f"  {ms:8.3f} ms  error {err:.1e}  {describe(tuning)}")
            bad = [r for r in results if r[1] > tolerance]
            if bad:
                print(f"  {len(bad)} launches off the reference by more than {tolerance}, left out")


if __name__ == "__main__":
    main()
