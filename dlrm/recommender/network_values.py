"""Strict JSON values read with messages that name the file, the JSON path and the fix.

Why apart from the network parser: these readers know JSON (types, ranges, case-insensitive
enums, keys written twice), not DSSTNE's layers; ``dlrm.recommender.network`` builds on them.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlrm.recommender.network_config import NetworkConfigError, _where


@dataclass(frozen=True)
class _Ctx:
    source: str | None

    def fail(self, path: str, problem: str) -> NetworkConfigError:
        return NetworkConfigError(f"{_where(self.source)}`{path}`: {problem}")

    def unsupported(self, path: str, value: Any, fix: str) -> NetworkConfigError:
        text = json.dumps(value)
        shown = f" = {text}" if len(text) <= 60 else ""
        return NetworkConfigError(f"{_where(self.source)}`{path}`{shown} is a DSSTNE setting this engine does not "
                                  f"implement; {fix}")


class _JsonObject(dict):
    """A JSON object that remembers keys written twice verbatim (json.load would keep only the last)."""

    duplicates: tuple[str, ...] = ()


def _pairs_hook(pairs: list[tuple[str, Any]]) -> _JsonObject:
    obj = _JsonObject()
    dups = []
    for key, value in pairs:
        if key in obj:
            dups.append(key)
        obj[key] = value
    obj.duplicates = tuple(dups)
    return obj


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _join(keys: tuple[str, ...]) -> str:
    return ", ".join(keys)


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean {json.dumps(v)}"
    if isinstance(v, str):
        return f"string {json.dumps(v)}"
    if isinstance(v, (int, float)):
        return f"number {v!r}"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _bool(ctx: _Ctx, v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise ctx.fail(path, f"expected a boolean (true or false), got {_type_name(v)}")
    return v


def _str(ctx: _Ctx, v: Any, path: str) -> str:
    if not isinstance(v, str) or not v:
        raise ctx.fail(path, f"expected a non-empty string, got {_type_name(v)}")
    return v


def _float(ctx: _Ctx, v: Any, path: str, rng: str = "") -> float:
    """A finite JSON number, checked against ``rng``: "" (any), ">=0", ">0", "[0,1)" or "[0,1]"."""
    if not _is_number(v) or not math.isfinite(v):
        raise ctx.fail(path, f"expected a number, got {_type_name(v)}")
    v = float(v)
    ok = {"": True, ">=0": v >= 0, ">0": v > 0, "[0,1)": 0 <= v < 1, "[0,1]": 0 <= v <= 1}[rng]
    if not ok:
        text = {">=0": "a number >= 0", ">0": "a number > 0", "[0,1)": "a number in [0, 1)",
                "[0,1]": "a number in [0, 1]"}[rng]
        raise ctx.fail(path, f"{v:g} is out of range; use {text}")
    return v


def _enum(ctx: _Ctx, v: Any, path: str, names: Mapping[str, str], aliases: Mapping[str, str] | None = None,
          unsupported: tuple[str, ...] = ()) -> str:
    """A case-insensitive enum value, returned canonical lower-case."""
    aliases = aliases or {}
    choices = _join(tuple(names.values()))
    if not isinstance(v, str):
        raise ctx.fail(path, f"expected a string, one of {choices}; got {_type_name(v)}")
    low = v.lower()
    if low in names:
        return low
    if low in aliases:
        return aliases[low]
    if low in (u.lower() for u in unsupported):
        raise ctx.unsupported(path, v, f"use one of {choices}")
    near = difflib.get_close_matches(low, list(names), n=1, cutoff=0.6)
    hint = f" (did you mean {names[near[0]]!r}?)" if near else ""
    raise ctx.fail(path, f"unknown value {json.dumps(v)}{hint}; use one of {choices}")


def _n(ctx: _Ctx, v: Any, path: str, allow_auto: bool) -> int | None:
    if allow_auto and isinstance(v, str) and v.lower() == "auto":
        return None
    if isinstance(v, list):
        raise ctx.unsupported(path, v, "give one positive integer"
                              + (' or "auto"' if allow_auto else ""))
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        expected = 'a positive integer or "auto"' if allow_auto else "a positive integer"
        raise ctx.fail(path, f"expected {expected}, got {_type_name(v)}")
    return v


# A DSSTNE network file is a few KB, nested four levels deep (top, Layers, a layer, WeightInit).
# The bounds keep a wrong or hostile file from costing memory (size) or overflowing Python's
# recursion in the JSON parser (depth: 100,000 nested arrays).
MAX_NETWORK_BYTES = 4 << 20
MAX_NETWORK_DEPTH = 64
_JSON_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')


def _check_depth(text: str, path: str) -> None:
    """Refuses JSON nested deeper than MAX_NETWORK_DEPTH, naming the line where it gets there
    (strings are blanked first, so brackets inside them do not count; vectorised)."""
    skeleton = _JSON_STRING.sub('""', text).encode("utf-8")
    codes = np.frombuffer(skeleton, np.uint8)
    step = ((codes == ord("[")) | (codes == ord("{"))).astype(np.int32) - ((codes == ord("]")) | (codes == ord("}")))
    depth = np.cumsum(step)
    if depth.size and int(depth.max()) > MAX_NETWORK_DEPTH:
        at = int(np.argmax(depth > MAX_NETWORK_DEPTH))
        line = skeleton.count(b"\n", 0, at) + 1
        raise NetworkConfigError(f"{path}:{line}: JSON nested more than {MAX_NETWORK_DEPTH} levels deep; a network "
                                 f"definition is a few levels of objects and arrays: fix the file")


def _load(source: str | os.PathLike) -> tuple[Any, str]:
    path = os.fspath(source)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_NETWORK_BYTES + 1)
        if len(data) > MAX_NETWORK_BYTES:
            raise NetworkConfigError(f"{path}: larger than {MAX_NETWORK_BYTES >> 20} MiB; a network definition is a "
                                     f"JSON file of a few KB: is this the network file?")
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise NetworkConfigError(f"{path}: no such network definition file; check the path") from None
    except (OSError, UnicodeDecodeError) as e:  # a directory, no permission, not UTF-8
        raise NetworkConfigError(f"{path}: cannot read the network definition ({e}); give a readable UTF-8 "
                                 f"JSON file") from None
    _check_depth(text, path)
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook), path
    except json.JSONDecodeError as e:
        raise NetworkConfigError(f"{path}:{e.lineno}:{e.colno}: invalid JSON at line {e.lineno}, column {e.colno}: "
                                 f"{e.msg}; fix the syntax there (plain JSON: no comments, no trailing "
                                 f"commas)") from None
    except ValueError as e:  # int("9" * 5000): past Python's limit on digits
        raise NetworkConfigError(f"{path}: a number cannot be read: {str(e).split('; ')[0]}; a network definition "
                                 f"holds small numbers") from None
