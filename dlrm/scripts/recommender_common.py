"""Helpers shared by the recommender scripts (recommender_train, _predict, _evaluate).

Flag-free: this module defines no absl flags and reads no FLAGS, so any script can import it;
each function takes the flag values it needs. torch (and the library) is imported inside the
functions only, so that --help and flag errors stay fast.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from absl import app

from dlrm.scripts import cli


def dist_env():
    """torchrun's variables, or None; torch is imported only under torchrun (fast --help and flag errors)."""
    if "WORLD_SIZE" not in os.environ:
        return None
    from dlrm.distributed.process_group import dist_env as _env

    return _env()


def rank_prefix() -> str:
    """"rank R: " under torchrun, else ""; the prefix of cli.run's messages."""
    env = dist_env()
    return f"rank {env.rank}: " if env is not None else ""


def device(name: str | None, env):
    """The torch device of --device ``name`` (None: cuda if available, else cpu); under torchrun
    cuda:LOCAL_RANK."""
    import torch

    name = name or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise app.UsageError("--device cuda: CUDA is not available on this machine; use --device cpu")
    if name == "cuda":
        return torch.device("cuda", env.local_rank if env is not None else torch.cuda.current_device())
    return torch.device("cpu")


def amp_dtype(amp: bool, dtype_name: str, device):
    """The autocast dtype of --amp and --amp_dtype ``dtype_name`` ("auto", "bf16" or "fp16") on
    ``device``, or None without --amp. auto: bf16, except on a CPU without bf16 instructions, where
    bf16 autocast is slower than float32 (``dlrm.model.precision``): float32 there, said in one line."""
    import torch

    from dlrm.model.precision import cpu_has_native_bf16

    if not amp:
        return None
    if dtype_name == "fp16" and device.type != "cuda":
        raise app.UsageError("--amp_dtype fp16 runs on cuda only; use --amp_dtype bf16 on the CPU")
    if dtype_name == "auto" and device.type == "cpu" and not cpu_has_native_bf16():
        print("--amp: training in float32: bf16 autocast is slower than float32 on a CPU without bf16 instructions "
              "(AVX512-BF16, AMX), as here; --amp_dtype bf16 forces it", flush=True)
        return None
    return torch.float16 if dtype_name == "fp16" else torch.bfloat16


def check_dataset_dir(flag: str, path: str | None, hint: str = "") -> None:
    """A usage error unless ``path`` (the value of --``flag``; None: not given) is a directory;
    ``hint`` ends the message (e.g. " (e.g. DIR/input of recommender_generate)")."""
    if path is not None and not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise app.UsageError(f"--{flag} {path} {what}; give a CSR dataset directory{hint}")


def dataset(flag: str, path: str | None, hint: str = ""):
    """The CsrDataset at ``path``, the value of --``flag`` (checked as check_dataset_dir does)."""
    if path is None:
        raise app.UsageError(f"--{flag} is required here; give a CSR dataset directory{hint}")
    check_dataset_dir(flag, path, hint)
    from dlrm.data.csr_dataset import CsrDataset

    return CsrDataset(path)


def exit_now(code: int) -> None:
    """Ends a finished multi-process run without interpreter teardown, where gloo's threads can
    abort a process that succeeded (as dlrm.scripts.main does)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def run_main(main: Callable[[list[str], object], int], argv: list[str]) -> int:
    """Runs ``main(argv, env)``: under torchrun an unexpected error is printed with its rank first
    (cli.run shows usage and library errors itself), and a finished run exits through exit_now."""
    env = dist_env()
    try:
        code = main(argv, env)
    except Exception as e:
        if env is not None and not isinstance(e, (app.UsageError, *cli._resolve(cli.DEFAULT_ERRORS))):
            print(f"{rank_prefix()}failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    if env is not None:
        exit_now(code)
    return code


def start_processes(env, device, timeout_s: float) -> None:
    """Under torchrun: joins the process group; on CUDA: selects the process's device."""
    import torch

    from dlrm.distributed.process_group import init_process_group

    if env is not None:
        init_process_group(env, device, timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def end_processes(env) -> None:
    """Under torchrun: waits for every process, then leaves the process group."""
    if env is not None:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
