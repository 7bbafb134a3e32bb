"""Helpers the recommender scripts alone share (recommender_train, _predict, _evaluate); those of
every script (rank prefix, exit-now, our flags, aliases) are dlrm.scripts.cli's.

It reads no FLAGS, and defines flags only when a script calls a ``define_*`` function (they
then belong to that script: its --help lists them); each other function takes the flag values
it needs. torch (and the library) is imported inside the functions only, so that --help and
flag errors stay fast.
"""

from __future__ import annotations

import os

from absl import app, flags

from dlrm.scripts import cli

flags.disclaim_key_flags()  # the define_* functions' flags belong to the script that calls them
AMP_DTYPE_HELP = ("Autocast dtype with --amp (fp16 on cuda only). auto: bf16, or float32 on a CPU without bf16 "
                  "instructions (where bf16 is slower).")


def define_checkpoint_to_load(help: str) -> None:
    """--load_checkpoint_path (alias --checkpoint, the earlier name) and --best: the trained model."""
    flags.DEFINE_string("load_checkpoint_path", None, help)
    cli.alias("checkpoint", "load_checkpoint_path", "the earlier name")
    flags.DEFINE_boolean("best", True, "Use the checkpoint of the best validation of the training run (PATH.best, "
                         "kept by recommender_train when it validates); --nobest: the run's last checkpoint.")


def define_device(amp_help: str, amp_dtypes: list[str], amp_dtype_help: str) -> None:
    """--base_device (alias --device), --amp, --amp_dtype and --dist_timeout: where and how the model runs."""
    flags.DEFINE_string("base_device", None, "Device: cuda, cuda:N or cpu; default: cuda if available, else cpu. "
                        "Under torchrun each process takes cuda:LOCAL_RANK.")
    cli.alias("device", "base_device", "the earlier name")
    flags.DEFINE_boolean("amp", False, amp_help)
    flags.DEFINE_enum("amp_dtype", "auto", amp_dtypes, amp_dtype_help)
    flags.DEFINE_float("dist_timeout", 300, "Under torchrun: seconds a collective may wait for a peer.", lower_bound=1)


def device(name: str | None, env):
    """The torch device of --base_device ``name`` (None: cuda if available, else cpu), as
    dlrm.scripts.main's: under torchrun each process takes cuda:LOCAL_RANK."""
    from dlrm.engine.devices import resolve_device

    try:
        return resolve_device(name, env)
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def amp_dtype(amp: bool, dtype_name: str, device):
    """The autocast dtype of --amp and --amp_dtype ``dtype_name`` ("auto", "bf16" or "fp16") on
    ``device``, or None without --amp. auto: bf16, except on a CPU without bf16 instructions, where
    bf16 autocast is slower than float32 (``dlrm.model.precision``): float32 there, said in one line."""
    import torch

    from dlrm.engine.devices import cpu_has_native_bf16

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
    from dlrm.recommender.csr_dataset import CsrDataset

    return CsrDataset(path)


def start_processes(env, device, timeout_s: float) -> None:
    """Under torchrun: joins the process group; on CUDA: selects the process's device."""
    import torch

    from dlrm.engine.process_group import init_process_group

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


def index_beside(given: str | None, input_path: str, name: str) -> tuple[str | None, bool]:
    """(the index file to name items or users by, whether it was found rather than given): the
    file given, else recommender_generate's ``name`` beside the --input dataset (DIR/``name``
    for DIR/input), else None (numbers)."""
    if given:
        return given, False
    candidate = os.path.join(os.path.dirname(os.path.abspath(input_path)), name)
    return (candidate, True) if os.path.isfile(candidate) else (None, False)


def score_format(value: str) -> str:
    """--score_format checked (``dlrm.recommender.topk.check_score_format``), or one line that
    gives its bounds."""
    from dlrm.recommender.topk import MAX_SCORE_PRECISION, MAX_SCORE_WIDTH, check_score_format

    try:
        return check_score_format(value)
    except ValueError:
        raise app.UsageError(f"--score_format {value!r}: give a printf format of one float, e.g. %.6g (the default) "
                             f"or %4.3f (DSSTNE's), with at most {MAX_SCORE_PRECISION} digits of precision and a "
                             f"width of at most {MAX_SCORE_WIDTH}") from None
