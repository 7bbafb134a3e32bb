"""A typed config checked again when a job starts, not only when it was built.

Both products' configs are dataclasses that check themselves in ``__post_init__``, and they are
not frozen: ``cfg.batch_size = 0`` after construction is checked by nothing. ``rechecked``
builds the config again from its values, each part before the config that holds it, so every
``__post_init__`` runs on the values the job will use, and a setting changed after
construction is refused as it would have been at construction (the same message, naming the
setting). Each product's API calls it on the config it is given.

``check_types`` is the one type check every config's ``__post_init__`` runs first, driven by
its field annotations, so that the flags, the Python APIs, Spark and a config read back from a
checkpoint (``RunConfig.from_dict``) are held to the same rule; ``check_float32`` and
``check_seed`` add the bounds that the training dtype and the random generators set.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import numbers
import os
import types
import typing
from typing import Any, TypeVar

Config = TypeVar("Config")


def rechecked(cfg: Config, **changes: Any) -> Config:
    """``cfg`` built again (``dataclasses.replace``, parts first) with ``changes`` to its own
    fields: a new object, equal to ``cfg`` without changes, checked as at construction. The
    caller's config is not changed."""
    parts = {f.name: rechecked(value) for f in dataclasses.fields(cfg)  # type: ignore[arg-type]
             if f.init and f.name not in changes and dataclasses.is_dataclass(value := getattr(cfg, f.name))
             and not isinstance(value, type)}
    return dataclasses.replace(cfg, **parts, **changes)  # type: ignore[type-var]


# ---- types and bounds: one check driven by each dataclass's annotations ----------------------

# The widest integer a setting may hold: torch's and numpy's seeds and tensors are 64-bit, and a
# value past int64 overflows where it meets them (a traceback, not a message).
INT64_MAX = 2**63 - 1
# Seeds: what torch.manual_seed and numpy accept, and what every seed derived from one
# (``seed * 1_000_003 + key`` reduced mod 2**63 - 1) stays within.
SEED_MAX = INT64_MAX
# The largest finite float32: a setting used in the training dtype's arithmetic (a learning
# rate, an epsilon, a weight decay) beyond it becomes inf there.
FLOAT32_MAX = 3.4028234663852886e38
# The smallest positive normal float32: a positive setting below it rounds towards 0 there.
FLOAT32_TINY = 1.1754943508222875e-38
# Fields whose names end so are paths: str, or os.PathLike (stored as its str).
_PATH_SUFFIXES = ("_path", "_dir")


class ConfigValueError(ValueError):
    """A config setting of the wrong type or out of its bounds, refused when the config is
    built: the message names the setting in backquotes and says what it must be."""


def shown(value: Any) -> str:
    """``value`` for a message, bounded: a short repr, its type for anything long."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {int(value.bit_length() * 0.30103) + 1} digits"
    try:
        text = repr(value)
    except Exception:  # a repr that fails must not hide the setting at fault
        text = ""
    if len(text) > 40 or not text.isprintable():
        return f"a {type(value).__name__}"
    return text


def _got(value: Any) -> str:
    """``value`` and its type, bounded, for a message refusing its type."""
    text = shown(value)
    return text if text.startswith(("a ", "an ")) else f"{text} ({type(value).__name__})"


def _hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of ``cls`` (``from __future__ import annotations`` keeps them as
    strings), cached per class."""
    cached = _HINTS.get(cls)
    if cached is None:
        cached = _HINTS[cls] = typing.get_type_hints(cls)
    return cached


_HINTS: dict[type, dict[str, Any]] = {}


def _is_int(value: Any) -> bool:
    """An integer (numpy's too), never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A real number (an int or a float, numpy's too), never a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of type ``hint``: an int is never a bool, a float is an int or a
    float, a list is a list or tuple of matching items, a union any of its members."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None) or hint is None:
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if hint is int:
        return _is_int(value)
    if hint is float:
        return _is_real(value)
    if hint is bool:
        return isinstance(value, bool)
    if origin in (list, tuple, collections.abc.Sequence):
        item = args[0] if args else Any
        if isinstance(value, str):  # a str is a Sequence[str] (one entry), never a list
            return origin is collections.abc.Sequence and _matches(value, item)
        return isinstance(value, (list, tuple)) and all(_matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, origin or hint)


def _describe(hint: Any) -> str:
    """``hint`` in words, for a message."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        words = [_describe(a) for a in args if a is not type(None)]
        return " or ".join(words) + (" or None" if type(None) in args else "")
    if origin in (list, tuple, collections.abc.Sequence):
        plural = {int: "integers", float: "finite numbers", bool: "booleans", str: "strings"}
        return f"a list of {plural.get(args[0], 'values') if args else 'values'}"
    names = {int: "an integer", float: "a finite number", bool: "True or False", str: "a string"}
    return names.get(hint, f"a {getattr(hint, '__name__', str(hint))}")


def _normalized(value: Any, hint: Any, path: bool) -> Any:
    """``value`` as the plain Python value the config stores: a path as its str, a numpy number
    as an int or float (JSON, checkpoints and equality see plain values)."""
    if path and isinstance(value, os.PathLike) and _matches("", hint):
        return os.fspath(value)
    if _is_int(value) and type(value) is not int and _matches(0, hint):
        return int(value)
    if _is_real(value) and not _is_int(value) and type(value) is not float and _matches(0.0, hint):
        return float(value)
    return value


def _check_scalars(name: str, value: Any) -> None:
    """Numbers within what the code's arithmetic holds: an int within int64, a float finite."""
    if _is_int(value) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ConfigValueError(f"`{name}` is out of range (got {shown(value)}): at most {INT64_MAX} (2**63 - 1) in "
                               "size")
    if _is_real(value) and not _is_int(value) and not math.isfinite(value):
        raise ConfigValueError(f"`{name}` must be a finite number, got {shown(value)}")
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_scalars(name, item)


def check_types(cfg: Any, error: type[ValueError] = ConfigValueError, paths: tuple[str, ...] = (),
                names: dict[str, str] | None = None) -> None:
    """Refuses a field of dataclass ``cfg`` whose value is not of its annotated type (integers
    are ints, never bools or floats; floats are real, finite numbers, an int allowed; booleans
    are bools; paths, fields named ``*_path``, ``*_dir`` or in ``paths``, are str or
    os.PathLike), or a
    number past int64. Raises ``error`` naming the field, so that a value of the wrong type is
    refused when the config is built, before any output is claimed; a plain value replaces a
    path object or numpy number (``object.__setattr__``: frozen configs too). A message names a
    field as ``names`` says (default: its own name, a trailing ``_`` dropped: ``lambda_``)."""
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        hint = hints.get(f.name, Any)
        value = getattr(cfg, f.name)
        plain = _normalized(value, hint, f.name.endswith(_PATH_SUFFIXES) or f.name in paths)
        name = (names or {}).get(f.name, f.name.rstrip("_"))
        if not _matches(plain, hint):
            raise error(f"`{name}` must be {_describe(hint)}, got {_got(value)}")
        try:
            _check_scalars(name, plain)
        except ConfigValueError as e:
            raise error(str(e)) from None
        if plain is not value:
            object.__setattr__(cfg, f.name, plain)


def check_float32(error: type[ValueError] = ConfigValueError, **settings: float | None) -> None:
    """Each setting given (not None) must be finite in float32, the dtype training computes in
    (a learning rate of 1e308 is finite here and inf there)."""
    for name, value in settings.items():
        if value is not None and not abs(value) <= FLOAT32_MAX:
            raise error(f"`{name}` is beyond float32's range, the training dtype (got {shown(value)}): give a value "
                        f"of at most {FLOAT32_MAX:.4g} in size")


def check_float32_positive(error: type[ValueError] = ConfigValueError, **settings: float | None) -> None:
    """Each setting given (not None) must be positive and stay so in float32: an epsilon that
    rounds to 0 there divides by zero."""
    check_float32(error, **settings)
    for name, value in settings.items():
        if value is not None and not value >= FLOAT32_TINY:
            raise error(f"`{name}` must be at least {FLOAT32_TINY:.4g} (float32's smallest normal number, the "
                        f"training dtype), got {shown(value)}")


def check_seed(value: int, name: str = "seed", error: type[ValueError] = ConfigValueError) -> None:
    """A seed in 0..``SEED_MAX``: what torch and numpy take, and what the seeds derived from it fit."""
    if not 0 <= value <= SEED_MAX:
        raise error(f"`{name}` is out of range (got {shown(value)}): give a seed from 0 to {SEED_MAX} (2**63 - 1)")
