"""One runner for every absl script: help that exits 0, and user errors as one line, exit 2.

    from dlrm.scripts import cli
    if __name__ == "__main__":
        cli.run(main)

What a user sees, whatever the script:

- ``--help`` (also ``--helpshort``, ``-h``, ``-?``): the docstring of the module that defines the
  flags, then its own flags (or the script's ``short_help``); exit 0. ``--helpfull``: every flag, absl's and the libraries' too;
  exit 0. (absl alone shows the flags of ``__main__`` only, which for a thin wrapper such as
  ``triton/deployer.py`` are none, and exits 1.)
- A bad flag (a value that does not parse or is out of bounds, an unknown flag, a required flag
  left out): ``error: <message naming the flag>`` on one line of stderr; exit 2.
- ``app.UsageError`` from main, or an exception of a class in ``errors`` (by default the
  dataset, checkpoint and placement-plan errors, and the file system's refusals to write (read-only,
  full, no permission), whose messages name the file and the fix):
  ``<prefix()>error: <message>`` on one line of stderr; exit 2.
- A missing optional dependency (``dlrm.extras``): one line naming the pip extra; exit 2.
- An error class with an ``exit_code`` of its own is reported the same way with that code: a
  training run whose loss turned non-finite (``dlrm.engine.loop.NonFiniteLoss``) exits 3.
- Anything else is a bug and keeps its traceback.

Library messages name a setting in library terms, as `name` or `name=value` in backquotes (a
config field or a function parameter); ``flag_terms`` shows them as the script's flags
(``--name``, ``--name=value``, ``--name``/``--noname`` for booleans), through ``LIBRARY_FLAGS``
where the two names differ. A setting the script has no flag for is shown without the quotes,
and a hint " (or ... `setting`)" whose ``LIBRARY_FLAGS`` flag this script lacks is left out
(``verify=False`` in a script without ``--skip_checkpoint_verify``).

main's return value is the exit status (None: 0), as with ``app.run``, whose logging set-up this
keeps: it is ``app.run`` with a flags parser and a guard around main.

The other helpers every entry point shares: ``alias`` (an old flag name kept for a new one),
``our_flags`` (this program's flags, for the run log), ``rank_prefix`` and ``run_processes``
(under torchrun: errors name their rank, and a finished process leaves through ``exit_now``).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any, Callable, NoReturn

from absl import app, flags

from dlrm.extras import missing_extra

FLAGS = flags.FLAGS
# The flags ``alias`` defines belong to the module that calls it (its --help lists them), not to this one.
flags.disclaim_key_flags()

# Named, not imported: a class can only have been raised if its module was imported, so a name is
# looked up in sys.modules when an exception arrives, and a script that never loads torch (which
# the checkpoint module imports) does not pay for it here.
DEFAULT_ERRORS: tuple[type[BaseException] | str, ...] = (
    "dlrm.engine.errors.DatasetError",
    "dlrm.training.checkpoint.CheckpointError",
    "dlrm.engine.checkpoint_store.CheckpointError",  # the same class, where a script that never loads DLRM's meets it
    "dlrm.distributed.planner.PlanError",
    "dlrm.engine.storage.StorageError",
    "dlrm.engine.outputs.OutputError",
    "dlrm.engine.logger.LogOpenError",
    "dlrm.engine.config_check.ConfigValueError",  # a config setting of the wrong type or past its bounds
    "dlrm.nn.cached_embedding.CacheTooSmallError",
    "dlrm.engine.loop.NonFiniteLoss",  # exit code 3 (its exit_code)
)
USAGE_ERROR_EXIT = 2

# Library setting -> flag, where the names differ ("name=value" entries match that value only).
LIBRARY_FLAGS = {
    "verify=False": "skip_checkpoint_verify",  # load_checkpoint(verify=False)
    "capacity": "device_memory_gb",  # plan_tables(capacity=bytes per rank)
    "override": "table_placement",  # plan_tables(override=placement)
    "cache_rows": "host_table_cache_rows",  # CachedEmbedding(cache_rows=...)
    # DataConfig's synthetic settings (dlrm.data.sources), named after NVIDIA's flags there
    "synthetic_num_entries": "synthetic_dataset_num_entries",
    "synthetic_num_test_entries": "synthetic_dataset_num_test_entries",
    "synthetic_table_sizes": "synthetic_dataset_table_sizes",
    "synthetic_num_numerical": "synthetic_dataset_numerical_features",
    "synthetic_bag_sizes": "synthetic_multi_hot_sizes",
    # dlrm.training.train.TrainConfig's schedule, named as the recommender's loop names it; the
    # flags keep NVIDIA's names (a script with a flag of the setting's own name shows that one)
    "log_every_steps": "print_freq",
    "eval_every_steps": "test_freq",
    "checkpoint_every_steps": "checkpoint_freq",
}
_SETTING = re.compile(r"`(\w+)(?:=([^`\s]*))?`")
# " (or <something> `setting`)": a hint at another way, dropped where the script offers no flag for it.
_UNOFFERED_HINT = re.compile(r" \(or [^()`]*`(\w+=?[^`\s]*)`\)")

_SHORT_HELP = {"-h", "-?", "--help", "-help", "--helpshort", "-helpshort"}
_FULL_HELP = {"--helpfull", "-helpfull"}
_REQUIRED = re.compile(r"^flag --(\w+)=None: Flag --\1 must have a value other than None\.?$")


def _resolve(errors: tuple[type[BaseException] | str, ...]) -> tuple[type[BaseException], ...]:
    classes = []
    for entry in errors:
        if isinstance(entry, str):
            module_name, _, class_name = entry.rpartition(".")
            module = sys.modules.get(module_name)
            entry = getattr(module, class_name, None) if module is not None else None
            if entry is None:
                continue  # not imported: nothing of that class can have been raised
        classes.append(entry)
    return tuple(classes)


def _one_line(message: object) -> str:
    """Joins a multi-line message into one line (stripped pieces, separated by '; ')."""
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip())


def flag_terms(message: str, flag_values: flags.FlagValues = FLAGS) -> str:
    """``message`` with its `setting` names shown as the flags of ``flag_values`` (module docstring)."""
    def unoffered(setting: str) -> bool:  # an escape hatch this script has no flag for
        flag = LIBRARY_FLAGS.get(setting)
        return flag is not None and flag not in flag_values and setting not in flag_values

    def as_flag(match: re.Match) -> str:
        name, value = match.group(1), match.group(2)
        flag = LIBRARY_FLAGS.get(f"{name}={value}")
        if flag is not None:
            value = None  # the flag says it all: verify=False -> --skip_checkpoint_verify
        else:
            flag = LIBRARY_FLAGS.get(name, name)
            if flag not in flag_values and name in flag_values:
                flag = name  # this script's flag has the setting's own name
        if flag not in flag_values:
            return match.group(0)[1:-1]
        if value is None:
            return f"--{flag}"
        if getattr(flag_values[flag], "boolean", False) and value in ("True", "False"):
            return f"--{flag}" if value == "True" else f"--no{flag}"
        return f"--{flag}={value}"

    return _SETTING.sub(as_flag, _UNOFFERED_HINT.sub(lambda m: "" if unoffered(m.group(1)) else m.group(0), message))


def flags_error_message(error: flags.Error) -> str:
    """absl's error for a bad command line, on one line (a missing required flag said plainly)."""
    message = _one_line(error)
    required = _REQUIRED.match(message)
    return f"--{required.group(1)} is required (see --help)" if required else message


def _fail(prefix: Callable[[], str], message: object, code: int = USAGE_ERROR_EXIT) -> NoReturn:
    try:
        where = prefix()
    except Exception:  # a prefix that fails must not hide the error being reported
        where = ""
    sys.stdout.flush()
    print(f"{where}error: {flag_terms(_one_line(message))}", file=sys.stderr, flush=True)
    sys.exit(code)


def _flags_module(main: Callable) -> str:
    """The name under which absl filed the flags of ``main``'s module.

    absl files the flags a module defines under its import name, or under ``sys.argv[0]`` for
    ``__main__`` (a script, or ``python -m``). ``main`` lives in the defining module, which may
    differ from ``__main__`` (``triton/deployer.py`` runs ``dlrm.scripts.deploy``'s main).
    """
    module_name = getattr(main, "__module__", None) or "__main__"
    module = sys.modules.get(module_name)
    candidates = [module_name]
    if module_name == "__main__":
        candidates.append(sys.argv[0])
    if module is not None and getattr(module, "__file__", None):
        candidates.append(module.__file__)
    by_module = {**FLAGS.flags_by_module_dict(), **FLAGS.key_flags_by_module_dict()}  # key flags: adopted ones
    for name in candidates:
        if name in by_module:
            return name
    return sys.argv[0]  # absl's own choice for --help


def _help(main: Callable, full: bool, short_help: Callable[[], str] | None = None) -> NoReturn:
    module_name = _flags_module(main)
    module = sys.modules.get(getattr(main, "__module__", "") or "__main__")
    doc = (getattr(module, "__doc__", None) or "").strip("\n")
    out = [doc.rstrip() + "\n"] if doc else []
    if full:
        out.append("flags:" + FLAGS.get_help().rstrip())
    elif short_help is not None:  # the script's own summary of its flags, e.g. grouped by section
        out.append(short_help())
        out.append("\nTry --helpfull to see every flag with its whole help text, absl's too.")
    else:
        own = FLAGS.module_help(module_name).strip("\n")
        # module_help starts with "<module name>:"; the name is an import name or a file path
        first, _, rest = own.partition("\n")
        out.append("flags:\n" + rest if first.endswith(":") else own)
        out.append("\nTry --helpfull to see every flag, absl's and the libraries' too.")
    print("\n".join(out), flush=True)
    sys.exit(0)


def _parser(main: Callable, prefix: Callable[[], str],
            short_help: Callable[[], str] | None = None) -> Callable[[list[str]], list[str]]:
    def parse(argv: list[str]) -> list[str]:
        args = argv[1:]
        if "--" in args:
            args = args[: args.index("--")]
        if any(a in _FULL_HELP for a in args):
            _help(main, full=True)
        if any(a in _SHORT_HELP for a in args):
            _help(main, full=False, short_help=short_help)
        try:
            return FLAGS(argv)
        except flags.Error as e:
            _fail(prefix, flags_error_message(e))

    return parse


def run(
    main: Callable[[list[str]], int | None],
    errors: tuple[type[BaseException] | str, ...] = DEFAULT_ERRORS,
    prefix: Callable[[], str] = lambda: "",
    short_help: Callable[[], str] | None = None,
) -> NoReturn:
    """Parses the flags and runs ``main(argv)``; exits with its return value (None: 0).

    ``errors``: exception classes (or dotted names of them) that are the user's doing; each is
    reported as one line, exit 2. ``prefix()`` is called when an error is reported and goes in
    front of ``error:``, e.g. ``"rank 3: "`` in a multi-process job. ``short_help()``, when given,
    is what ``--help`` shows in place of absl's list of the script's flags.
    """
    def guarded(argv: list[str]) -> int | None:
        try:
            return main(argv)
        except app.UsageError as e:
            _fail(prefix, e)
        except ImportError as e:
            message = missing_extra(e)
            if message is None:
                raise
            _fail(prefix, message)
        except Exception as e:
            if isinstance(e, _resolve(errors)):
                _fail(prefix, e, getattr(e, "exit_code", USAGE_ERROR_EXIT))
            raise

    app.run(guarded, flags_parser=_parser(main, prefix, short_help))
    raise AssertionError("app.run returned")  # it always exits


def alias(name: str, original: str, why: str) -> None:
    """Defines --``name`` as another name of --``original`` (both set the same value), listed in
    the calling script's --help with ``why`` it is kept, e.g. "DSSTNE's name"."""
    flags.DEFINE_alias(name, original)
    FLAGS[name].help = f"Alias of --{original} ({why})."


def is_alias(flag: flags.Flag) -> bool:
    return type(flag).__name__ == "_FlagAlias"


def our_flags(flag_values: flags.FlagValues = FLAGS) -> dict[str, Any]:
    """This program's flags and their values, for the run log and the checkpoint's ``run_config``:
    every flag but absl's own, under its one name (no short names, no aliases)."""
    return {
        name: flag_values[name].value
        for name in flag_values
        if (flag := flag_values[name]).name == name and not is_alias(flag)
        and not flag_values.find_module_defining_flag(name, default="").startswith("absl")
    }


def dist_env() -> Any:
    """torchrun's variables (``DistEnv``), or None; torch is imported only under torchrun, so that
    --help and flag errors stay fast."""
    if "WORLD_SIZE" not in os.environ:
        return None
    from dlrm.engine.process_group import dist_env as _env

    return _env()


def rank_prefix() -> str:
    """"rank R: " under torchrun, else "": the prefix of ``run``'s messages in a multi-process job."""
    env = dist_env()
    return f"rank {env.rank}: " if env is not None else ""


def exit_now(code: int) -> NoReturn:
    """Ends a finished multi-process run without interpreter finalization.

    Everything is written, flushed and the process group destroyed by now. gloo's C++ threads can
    still abort the process ("terminate called without an active exception") while the
    interpreter tears down, turning a successful run into a failed job. So leave directly."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def run_processes(main: Callable[[list[str], Any], int], argv: list[str],
                  errors: tuple[type[BaseException] | str, ...] = DEFAULT_ERRORS) -> int:
    """Runs ``main(argv, env)`` (``env``: ``dist_env()``). Under torchrun an unexpected error is
    printed with its rank first (``run`` reports usage and ``errors`` itself, one line) and a
    finished process leaves through ``exit_now``."""
    env = dist_env()
    try:
        code = main(argv, env)
    except Exception as e:
        if env is not None and not isinstance(e, (app.UsageError, *_resolve(errors))):
            print(f"{rank_prefix()}failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    if env is not None:
        exit_now(code)
    return code
