"""Train, test and benchmark a DLRM on one device, or hybrid-parallel on several.

    python -m dlrm.scripts.main                                  # synthetic data with signal
    torchrun --nproc_per_node 8 -m dlrm.scripts.main --dataset /data/criteo_fl15 --amp
    python -m dlrm.scripts.main --dataset /data/criteo_fl15      # a split-binary dataset
    python -m dlrm.scripts.main --mode test --dataset ... --load_checkpoint_path ckpt/
    python -m dlrm.scripts.main --mode inference_benchmark --inference_benchmark_batch_sizes 1,64,4096

Flags follow NVIDIA's DLRM example where a flag of the same name exists there, and every flag of
NVIDIA's main.py is accepted: those this program adds for them are in dlrm.scripts.nvidia_flags
(--helpfull lists them with what each maps to). --help lists every flag in one or two lines,
grouped by section; --helpfull gives each its whole text.

With --load_checkpoint_path, --mode test and inference_benchmark take the model from the checkpoint:
no model flag is needed (one that contradicts it is refused). Exit codes: 0 done; 1 --mode plan
found no process count that fits; 2 a usage error (one line: a flag, the data, a file); 3 the loss
turned non-finite (training stopped, with exit code 3, keeping the last finite checkpoint); 128+N
stopped by signal N after the step in flight, its checkpoint saved.
"""

from __future__ import annotations

from absl import app, flags

from dlrm import api
from dlrm.scripts import cli, dlrm_flags, nvidia_flags
from dlrm.scripts.dlrm_flags import check_args  # noqa: F401  (the tests check flags through main)

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(dlrm_flags)  # --help lists them as this script's own


def _main(argv: list[str], env: object) -> int:
    """Flags -> run config -> the job (``dlrm.api.run_job``; a Python caller runs ``dlrm.api.run``) ->
    what the script prints and its exit code: 0; 1 when ``--mode plan`` finds no number of
    processes that fits; 128 + the signal that stopped a training run after its checkpoint."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    dlrm_flags.apply_preset()
    notes = nvidia_flags.apply()
    cfg = dlrm_flags.run_config()
    try:
        result = api.run_job(cfg, env, api.CommandLine(log_flags=cli.our_flags(), notes=notes, terms=cli.flag_terms))
    except api.SettingError as e:
        raise app.UsageError(str(e)) from None
    if cfg.mode == "plan":
        print(cli.flag_terms(result["report"]))
        return 0 if result["processes"] is not None else 1
    if cfg.mode == "train" and result.get("signal") is not None:
        return 128 + result["signal"]
    return 0


def main(argv: list[str]) -> int:
    return cli.run_processes(_main, argv)


def run() -> None:
    cli.run(main, prefix=cli.rank_prefix, short_help=dlrm_flags.short_help)


if __name__ == "__main__":
    run()
