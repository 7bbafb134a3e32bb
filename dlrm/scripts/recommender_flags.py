"""The flags of the recommender's command lines, generated from their configs
(dlrm.recommender.run_config): ``TRAIN`` (recommender_train, ``RecommenderConfig``),
``PREDICT`` (recommender_predict, ``PredictConfig``) and ``EVALUATE`` (recommender_evaluate,
``EvaluateConfig``).

Each ``Command`` declares every flag once as a ``Setting`` (dlrm.scripts.flag_table): its name,
the config field it sets, its ``--help`` section and its help; type and default come from the
field. The few whose name differs from their field say so by their path (``--print_freq`` sets
``train.log_every_steps``, ``--validate_every_steps`` ``train.eval_every_steps``, ``--lambda``
``model.optimizer.lambda_``), and the earlier names are aliases. From one table a script defines
its flags (``define``), reads them into its config (``config``), writes a config back as its
command line (``args``) and shows a short ``--help`` grouped by section (``short_help``).

Light on purpose: importing it loads neither torch nor the recommender's library beyond its
config module, so that ``--help`` and flag errors stay fast.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

from absl import app, flags

from dlrm.recommender.run_config import (
    AMP_DTYPES, BASELINES, MODELS, OPTIMIZERS, SCORING_AMP_DTYPES, EvaluateConfig, PredictConfig, RecommenderConfig,
)
from dlrm.scripts import cli, flag_table
from dlrm.scripts.flag_table import Setting
from dlrm.scripts.recommender_common import BEST_HELP

FLAGS = flags.FLAGS
ALIASES_SECTION = "other names"
EARLIER = "the earlier name"
AMP_DTYPE_HELP = ("Autocast dtype with --amp (fp16 on cuda only). auto: bf16, or float32 on a CPU without bf16 "
                  "instructions (where bf16 is slower).")


@dataclass(frozen=True)
class Command:
    """One command line: its ``settings`` (one flag per field of ``config_cls``), the parts built
    in ``order`` (a part's own errors before the whole's), ``aliases`` (other name -> (flag, why
    it is kept)), the ``required`` flags and the ``sections`` of its ``--help``, in order."""

    settings: tuple[Setting, ...]
    config_cls: type
    sections: tuple[str, ...]
    aliases: dict[str, tuple[str, str]]
    required: tuple[str, ...]
    order: tuple[str, ...] = ()

    @property
    def defaults(self) -> Any:
        return flag_table.field_defaults(self.config_cls)

    def define(self, module_name: str, flag_values: flags.FlagValues = FLAGS) -> None:
        """Defines the flags and aliases under ``module_name`` (a script's ``__name__``; absl files
        ``__main__``'s flags under ``sys.argv[0]``), so that its --help lists them."""
        if module_name == "__main__":
            module_name = sys.argv[0]
        flag_table.define(self.settings, self.config_cls, self.defaults, module_name, flag_values)
        for name, (original, why) in self.aliases.items():  # as dlrm.scripts.cli.alias words them
            flags.DEFINE_alias(name, original, flag_values=flag_values, module_name=module_name)
            flag_values[name].help = f"Alias of --{original} ({why})."
        flags.mark_flags_as_required(list(self.required), flag_values=flag_values)

    def config(self, values: flags.FlagValues = FLAGS) -> Any:
        """The config the flags of ``values`` describe, checked (``ConfigError`` naming settings;
        the scripts show them as flags)."""
        return flag_table.build(self.config_cls, flag_table.read_values(self.settings, self.config_cls, values),
                                self.order)

    def args(self, cfg: Any) -> list[str]:
        """The command line that reads back as ``cfg``, every setting spelled out; ``ValueError``
        naming a setting no flag can say."""
        return flag_table.args(self.settings, self.config_cls, self.defaults, cfg)

    def parse(self, args: Sequence[str], flag_values: flags.FlagValues = FLAGS) -> flags.FlagValues:
        """``args`` parsed as this command's flags (defined in ``flag_values``) into a copy of them;
        ``app.UsageError`` for a bad command line."""
        try:
            return flag_table.parse([s.flag for s in self.settings], args, flag_values)
        except flags.Error as e:
            raise app.UsageError(cli.flags_error_message(e)) from None
        except ValueError as e:
            raise app.UsageError(str(e)) from None

    def short_help(self, flag_values: flags.FlagValues = FLAGS) -> str:
        """--help's flags, each on one or two lines, by section (--helpfull: every text whole)."""
        rows = [(s.section, *flag_table.shown(flag_values, s.flag)) for s in self.settings]
        rows += [(ALIASES_SECTION, f"--{name}", flag_values[name].help) for name in self.aliases]
        return flag_table.short_help((*self.sections, ALIASES_SECTION), rows, abbreviations=True)


def device_settings(section: str, amp_path: str, amp_help: str, amp_dtype_help: str,
                    amp_dtypes: Sequence[str]) -> tuple[Setting, ...]:
    """--base_device, --amp, --amp_dtype and --dist_timeout: where and how the model runs (every
    recommender command has them; ``amp_path``: where the config keeps ``amp`` and ``amp_dtype``)."""
    return (
        Setting("base_device", "base_device", section,
                "Device: cuda, cuda:N or cpu; default: cuda if available, else cpu. Under torchrun each process "
                "takes cuda:LOCAL_RANK."),
        Setting("amp", f"{amp_path}amp", section, amp_help),
        Setting("amp_dtype", f"{amp_path}amp_dtype", section, amp_dtype_help, choices=amp_dtypes),
        Setting("dist_timeout", "dist_timeout", section, "Under torchrun: seconds a collective may wait for a peer.",
                lower_bound=1),
    )


def checkpoint_settings(section: str, help: str) -> tuple[Setting, ...]:
    """--load_checkpoint_path and --best: the trained model a scoring command loads."""
    return (Setting("load_checkpoint_path", "load_checkpoint_path", section, help),
            Setting("best", "best", section, BEST_HELP))


DEVICE_ALIASES = {"device": ("base_device", EARLIER)}
CHECKPOINT_ALIASES = {"checkpoint": ("load_checkpoint_path", EARLIER)}

TRAIN_SETTINGS: tuple[Setting, ...] = (
    Setting("input", "data.input", "data",
            "CSR dataset of the inputs (user histories), e.g. DIR/input of recommender_generate."),
    Setting("output", "data.output", "data",
            "CSR dataset of the targets, the same users in the same order; default: --input (an autoencoder "
            "reconstructs its input)."),
    Setting("model", "model.model", "model",
            "The model to train. auto: the linear item-item model (settings chosen on validation) without "
            "--network, the autoencoder with it; linear: EASE/EDLAE in closed form (items^2 x 8 bytes of memory); "
            "autoencoder: the network of --network.", choices=MODELS),
    Setting("network", "model.network", "model",
            "DSSTNE JSON network definition, e.g. configs/recommender/movielens_autoencoder.json."),
    Setting("linear_max_memory_gb", "model.linear.linear_max_memory_gb", "model",
            "The linear model's item x item matrices may take at most this much memory (items^2 x 8 bytes; x 16 "
            "to redo an ill-conditioned fit in float64); default: 80% of the device's (the GPU's, or the machine's "
            "RAM). Above it, train the autoencoder (--network).", lower_bound=0),
    Setting("optimizer", "model.optimizer.optimizer", "model", "Override the network file's Optimizer.Kind.",
            choices=OPTIMIZERS),
    Setting("alpha", "model.optimizer.alpha", "model",
            "Override Optimizer.Alpha (learning rate, > 0). Too high, and the loss diverges: the run stops with "
            "exit code 3, keeping its last finite checkpoint."),
    Setting("mu", "model.optimizer.mu", "model", "Override Optimizer.Mu (momentum; RMSProp's decay), in [0, 1)."),
    Setting("lambda", "model.optimizer.lambda_", "model",
            "Override Optimizer.Lambda (L2 weight decay of the weights, >= 0)."),
    Setting("negatives", "train.negatives", "model",
            "Sampled negative items per step (an approximation of the full loss for large catalogues); default: "
            "every item is scored.", lower_bound=1),
    Setting("validation_users", "validation.validation_users", "validation",
            "Share of the users that lend items to a validation split (seeded by --seed; at most "
            "--validation_max_users); default: 0.1 for the autoencoder, every user (1) for the linear model; 0: no "
            "validation, then --epochs is required.", lower_bound=0, upper_bound=1),
    Setting("validation_max_users", "validation.validation_max_users", "validation",
            "At most this many validation users.", lower_bound=1),
    Setting("validation_items", "validation.validation_items", "validation",
            "Share of each validation user's items held out of training and ranked (at least one item, never the "
            "whole history).", lower_bound=0, upper_bound=1),
    Setting("validation_k", "validation.validation_k", "validation",
            "K of the validation's NDCG@K (which picks the best checkpoint), P@K, R@K.", lower_bound=1),
    Setting("patience", "validation.patience", "validation",
            "Without --epochs: validations without a better NDCG@K before training stops.", lower_bound=1),
    Setting("patience_steps", "validation.patience_steps", "validation",
            "Without --epochs: training also goes on until this many steps have passed since the best NDCG@K (on "
            "small data an epoch is a few steps, and --patience epochs alone would stop a run that is still "
            "improving); 0: --patience alone.", lower_bound=0),
    Setting("validate_every_steps", "train.eval_every_steps", "validation",
            "Validate every this many steps; 0: at the end of every epoch.", lower_bound=0),
    Setting("batch_size", "batch_size", "training", "Users per step (the global batch, whatever the process count).",
            lower_bound=1),
    Setting("epochs", "train.epochs", "training",
            "Passes over the users. Default: until the validation NDCG@K has not improved for --patience "
            "validations and --patience_steps steps (at most --max_epochs); with --epochs, exactly that many (the "
            "best validation's checkpoint is still kept).", lower_bound=1),
    Setting("max_epochs", "train.max_epochs", "training", "Without --epochs: the most passes validation may ask for.",
            lower_bound=1),
    Setting("max_steps", "train.max_steps", "training",
            "Stop after this many steps of this run (the checkpoint resumes).", lower_bound=1),
    Setting("seed", "seed", "training",
            "Seed of the weights and of every random draw (user order, denoising, dropout, negatives)."),
    *device_settings("training", "train.", "Automatic mixed precision (torch.autocast, see --amp_dtype).",
                     "Autocast dtype with --amp. auto: bf16, or float32 on a CPU without bf16 instructions (where "
                     "bf16 is slower). fp16 is not offered because the training loop does no loss scaling (fp16 "
                     "gradients underflow).", AMP_DTYPES),
    Setting("save_checkpoint_path", "checkpoint.save_checkpoint_path", "checkpoints",
            "Checkpoint directory, written during and at the end of the run (and the one --resume continues)."),
    Setting("resume", "checkpoint.resume", "checkpoints",
            "Continue from the checkpoint at --save_checkpoint_path if there is one (exactly where it stopped; "
            "same --seed and --batch_size)."),
    Setting("overwrite", "checkpoint.overwrite", "checkpoints",
            "Start a new run and replace the checkpoint (and its .best) already at --save_checkpoint_path; a "
            "folder that holds anything but this program's checkpoint is never replaced."),
    Setting("checkpoint_every_steps", "train.checkpoint_every_steps", "checkpoints",
            "Save every this many steps; 0: at the end of every epoch.", lower_bound=0),
    Setting("log_path", "log_path", "logging",
            "JSON-lines log: the flags, periodic train records, checkpoints and a final summary (appended to)."),
    Setting("tensorboard_dir", "tensorboard_dir", "logging",
            "Also write the logged metrics (train/loss, validation/ndcg, ...) as TensorBoard scalars to this "
            "directory, to watch with `tensorboard --logdir DIR` (pip extra: tensorboard)."),
    Setting("print_freq", "train.log_every_steps", "logging",
            "Print and log the loss every this many steps; 0: never.", lower_bound=0),
)

PREDICT_SETTINGS: tuple[Setting, ...] = (
    *checkpoint_settings("model", "Checkpoint directory of recommender_train (its --save_checkpoint_path)."),
    Setting("input", "input", "data", "CSR dataset of the users' histories to recommend for (e.g. DIR/input)."),
    Setting("features_index", "features_index", "data",
            "Features (items) index for item names; default: the features_index.txt recommender_generate wrote "
            "beside --input (DIR/ of DIR/input), else column numbers; --features_index= for column numbers."),
    Setting("samples_index", "samples_index", "data",
            "Samples (users) index for user names; default: the samples_index.txt beside --input, else row "
            "numbers; --samples_index= for row numbers."),
    Setting("filter", "filter", "data",
            "CSR datasets (comma-separated) of further items not to recommend, row r for user r of --input."),
    Setting("exclude_inputs", "exclude_inputs", "data",
            "Never recommend the items of a user's own history (--noexclude_inputs: allow them)."),
    Setting("output", "output", "output",
            "Text file of the recommendations (DSSTNE's format), written atomically."),
    Setting("k", "k", "output", "Recommendations per user.", lower_bound=1),
    Setting("score_format", "score_format", "output",
            "printf format of the scores (one float conversion; the % may be left out): %.6g, 6 significant "
            "digits, so that a user's top K rarely tie; %4.3f is DSSTNE's (its -p 4.3f), which ties scores that "
            "differ after the 3rd decimal."),
    Setting("scores_path", "scores_path", "output",
            "Also write every raw score, before exclusion, as a float32 .npy [users, items] (one process only)."),
    Setting("overwrite", "overwrite", "output",
            "Replace the --output (and --scores_path) an earlier run wrote; a file of anything else is never "
            "replaced."),
    Setting("batch_size", "batch_size", "device", "Users scored at once.", lower_bound=1),
    *device_settings("device", "", "Automatic mixed precision (torch.autocast, see --amp_dtype).", AMP_DTYPE_HELP,
                     SCORING_AMP_DTYPES),
)


def _cut_offs(texts: list[str], values: Any = None) -> list[int]:
    """--k's comma-separated cut-offs as integers, or one line naming the one that is not."""
    ks = []
    for text in texts:
        try:
            ks.append(int(text))
        except ValueError:
            raise app.UsageError(f"--k {','.join(texts)}: {text!r} is not an integer") from None
    return ks


def _cut_off_texts(k: int | Sequence[int]) -> list[str]:
    return [str(k)] if isinstance(k, int) else [str(K) for K in k]


EVALUATE_SETTINGS: tuple[Setting, ...] = (
    Setting("input", "input", "data", "CSR dataset of the users' histories (e.g. DIR/input of recommender_generate)."),
    Setting("heldout", "heldout", "data",
            "CSR dataset of their held-out items (e.g. DIR/heldout), the same users in the same order."),
    *checkpoint_settings("model", "Checkpoint of recommender_train to evaluate; default: the baselines only."),
    Setting("baselines", "baselines", "baselines",
            f"Baselines to evaluate, comma-separated, from {','.join(BASELINES)}; empty (--baselines=) for none."),
    Setting("mf_factors", "mf_factors", "baselines", "mf: latent factors.", lower_bound=1),
    Setting("mf_iterations", "mf_iterations", "baselines", "mf: ALS iterations.", lower_bound=0),
    Setting("knn_neighbours", "knn_neighbours", "baselines", "itemknn: neighbours kept per item.", lower_bound=1),
    Setting("seed", "seed", "baselines", "mf: seed of the initial item factors."),
    Setting("ease_lambda", "ease_lambda", "baselines",
            "ease: L2 regularization lambda (> 0). Common choices are a few hundred (250 is RecBole's default); "
            "pick it on a validation split, not on --heldout."),
    Setting("ease_max_memory_gb", "ease_max_memory_gb", "baselines",
            "ease: refuse a catalogue whose items x items matrices need more GiB than this (items^2 x 12 bytes; 12 "
            "GiB: up to 32,768 items).", lower_bound=0),
    Setting("k", "k", "metrics", "Cut-offs K of the metrics, comma-separated.", flag_kind="strings",
            to_config=_cut_offs, to_flag=_cut_off_texts),
    Setting("output", "output", "metrics", "JSON file of the metrics, written atomically; default: printed only."),
    Setting("overwrite", "overwrite", "metrics",
            "Replace the --output an earlier run wrote (never a file of anything else)."),
    Setting("batch_size", "batch_size", "device", "Users ranked at once.", lower_bound=1),
    *device_settings("device", "", "Model: automatic mixed precision (torch.autocast, see --amp_dtype).",
                     AMP_DTYPE_HELP, SCORING_AMP_DTYPES),
)

TRAIN = Command(
    TRAIN_SETTINGS, RecommenderConfig, ("data", "model", "validation", "training", "checkpoints", "logging"),
    {"eval_every_steps": ("validate_every_steps", "dlrm.scripts.main's name"),
     "checkpoint_path": ("save_checkpoint_path", EARLIER), **DEVICE_ALIASES,
     "log_every_steps": ("print_freq", EARLIER)},
    ("input", "save_checkpoint_path"),
    ("data", "model.linear", "model.optimizer", "model", "validation", "train", "checkpoint"))
PREDICT = Command(PREDICT_SETTINGS, PredictConfig, ("model", "data", "output", "device"),
                  {**CHECKPOINT_ALIASES, **DEVICE_ALIASES}, ("load_checkpoint_path", "input", "output"))
EVALUATE = Command(EVALUATE_SETTINGS, EvaluateConfig, ("data", "model", "baselines", "metrics", "device"),
                   {**CHECKPOINT_ALIASES, **DEVICE_ALIASES}, ("input", "heldout"))
