"""The output rule: nothing the user owns is ever destroyed.

Every path a command writes (checkpoints, datasets, predictions, exports, Triton repositories,
Spark outputs, logs, TensorBoard folders) is claimed here, before any work, with one call:

    claim_output(path, CHECKPOINT_KIND, "save_checkpoint_path", inputs={"dataset": dataset},
                 replace=overwrite, keep=resume)

and the call either returns (the write may go ahead) or raises ``OutputError``, a user error
whose one line names the setting, the path and the fix, with nothing touched. The rule:

- a destination that does not exist, or an empty directory, is free;
- an existing destination that is not this program's own output of the same kind (decided by
  the kind's ``recognise``: a checkpoint's ``meta.json``, a dataset's ``feature_spec.yaml`` and
  ``.bin`` files, nothing else in it: every entry at every depth, folders too, is a name its
  writer makes, ``holds_only``) is refused, whatever the flags say: the user removes it by hand
  if that is what they want; a log is this program's when its first record says so
  (``is_json_lines_log``);
- this program's own earlier output is replaced only when the user asked for it (``replace``,
  the `overwrite` setting) or continued when they asked for that (``keep``, e.g. `resume`, or
  an appending log);
- an output is never an input of the same run, nor inside one, nor around one; a directory
  output is never the working directory nor one of its parents; a symbolic link is refused
  (its target would be written through or replaced);
- the names a writer puts beside its output (``siblings``, e.g. a checkpoint's ``.old`` and
  ``.lock``) follow the same rule;
- a path a spec names for writing must resolve inside the output directory (``inside``);
- the file system must take a new file there (``storage.check_can_create``): a read-only mount
  fails now, as a ``StorageError``, not after hours of work.

Why by content and not by a marker file: outputs written before this rule existed, and those
of NVIDIA's tools in the same format, are recognised too, and a folder that holds anything
else (a ``notes.txt``) is never taken for one.
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dlrm.engine.storage import check_can_create
from dlrm.version import __version__

PathLike = str | os.PathLike


class OutputError(ValueError):
    """A destination this run may not write; the message names the setting, path and fix."""


@dataclass(frozen=True)
class OutputKind:
    """What a writer writes. ``name``: how messages call it ("checkpoint", "dataset");
    ``directory``: a folder, else one file; ``recognise(path)``: whether the existing ``path``
    holds this program's own output of this kind."""

    name: str
    directory: bool
    recognise: Callable[[str], bool]


# A temporary of this program's writers (``dlrm.engine.atomic``): ``.<name>.<pid>@<host>.<tag>.tmp``,
# a file or a staging folder on its way to ``<name>``.
_TEMPORARY = re.compile(r"\.(?P<name>[^/]+?)\.\d+@[^/]+\.[A-Za-z0-9_]+\.tmp")

Pattern = str | re.Pattern
"""A name a writer makes, relative and '/'-separated. A ``str`` is matched one segment at a time
(``fnmatch`` within a segment: ``*`` never crosses '/'); its leading segments are the folders it
lives in, and a trailing '/' names a folder that may be empty (``"vocabulary/"``); a last segment
``**`` takes anything below (a work folder the writer alone fills). A ``re.Pattern`` must match
the whole relative path, a folder's with a '/' at its end."""


def _segments_match(segments: Sequence[str], pattern: Sequence[str], is_dir: bool) -> bool:
    """Whether entry ``segments`` (a folder when ``is_dir``) is named by the segments of a ``str`` pattern."""
    for i, segment in enumerate(segments):
        if i >= len(pattern):
            return False
        if pattern[i] == "**":
            return True
        if not fnmatch.fnmatchcase(segment, pattern[i]):
            return False
    return len(pattern) > len(segments) if is_dir else len(pattern) == len(segments)


def _named(segments: Sequence[str], patterns: Sequence[Pattern], is_dir: bool) -> bool:
    """Whether an entry is one ``patterns`` name; a writer's temporary counts as its target."""
    segments = [m["name"] if (m := _TEMPORARY.fullmatch(s)) else s for s in segments]
    rel = "/".join(segments) + ("/" if is_dir else "")
    for pattern in patterns:
        if isinstance(pattern, re.Pattern):
            if pattern.fullmatch(rel):
                return True
        elif _segments_match(segments, pattern.split("/"), is_dir):
            return True
    return False


def _foreign(path: str, patterns: Sequence[Pattern], limit: int = 100_000) -> str | None:
    """The first entry under ``path`` (every depth, folders too) that ``patterns`` do not name,
    or that is neither a file nor a folder (a link, a socket); "" when more than ``limit``."""
    seen = 0
    for directory, dirs, files in os.walk(path, followlinks=False):
        dirs.sort()
        for name in sorted(dirs + files):
            full = os.path.join(directory, name)
            rel = os.path.relpath(full, path).replace(os.sep, "/")
            seen += 1
            if seen > limit:
                return ""
            is_dir = os.path.isdir(full)
            if os.path.islink(full) or not (is_dir or os.path.isfile(full)):
                return rel
            if not _named(rel.split("/"), patterns, is_dir):
                return rel
    return None


def under(folder: str, patterns: Sequence[Pattern]) -> list[Pattern]:
    """``patterns`` of a folder's content, as names relative to the folder above (``folder/...``)."""
    return [re.compile(re.escape(folder) + "/" + p.pattern) if isinstance(p, re.Pattern) else f"{folder}/{p}"
            for p in patterns]


def holds_only(path: str, patterns: Sequence[Pattern], required: Sequence[str] = ()) -> bool:
    """Whether directory ``path`` holds nothing but entries (files and folders, at every depth)
    that ``patterns`` name (``Pattern``), and every file of ``required``. Why exact names: a file
    of the user's inside an output (notes, a backup folder) must make it not ours, or replacing
    the output would delete it. A writer's own temporary (``.<name>.<pid>@<host>.<tag>.tmp``) counts
    when ``<name>`` is one of its names there; no other ``*.tmp`` does."""
    return (os.path.isdir(path) and _foreign(path, patterns) is None
            and all(os.path.isfile(os.path.join(path, r)) and not os.path.islink(os.path.join(path, r))
                    for r in required))


def first_foreign(path: str, patterns: Sequence[Pattern]) -> str | None:
    """The first entry under ``path`` that ``holds_only`` would not accept (for messages)."""
    found = _foreign(path, patterns)
    return "more entries than a writer makes" if found == "" else found


def _real(path: PathLike) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _within(inner: str, outer: str) -> bool:
    """Whether real path ``inner`` is ``outer`` or lies under it."""
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def _inputs(inputs: Mapping[str, PathLike | Sequence[PathLike] | None]) -> list[tuple[str, str]]:
    found = []
    for setting, value in inputs.items():
        if value is None:
            continue
        values = [value] if isinstance(value, (str, os.PathLike)) else list(value)
        found += [(setting, os.fspath(v)) for v in values if v is not None and os.fspath(v) != ""]
    return found


def check_not_input(path: PathLike, setting: str,
                    inputs: Mapping[str, PathLike | Sequence[PathLike] | None]) -> None:
    """An output is never an input of the same run, nor inside one, nor around one."""
    out = _real(path)
    for input_setting, value in _inputs(inputs):
        source = _real(value)
        if out == source:
            relation = "is"
        elif _within(out, source):
            relation = "is inside"
        elif _within(source, out):
            relation = "contains"
        else:
            continue
        raise OutputError(f"`{setting}` {path} {relation} the input `{input_setting}` {value}: a run never writes "
                          f"over what it reads; choose another `{setting}`; nothing was changed")


def claim_output(path: PathLike, kind: OutputKind, setting: str, *,
                 inputs: Mapping[str, PathLike | Sequence[PathLike] | None] | None = None,
                 replace: bool = False, keep: bool = False, replace_setting: str = "overwrite",
                 keep_setting: str | None = None, siblings: Mapping[str, OutputKind] | None = None) -> str:
    """Checks that ``path`` (the value of ``setting``) may receive this run's ``kind`` of output
    (module docstring) and returns it as an absolute path; raises ``OutputError`` otherwise.
    ``replace``: the user asked to replace an earlier output of this kind (``replace_setting``);
    ``keep``: to continue or add to it (``keep_setting``; None: nothing to name in messages, the
    writer adds to its own output as a matter of course, as a log does); ``siblings``: suffixes
    the writer puts beside ``path`` (``".old"``) with what each may hold."""
    raw = os.fspath(path)
    if raw == "":
        raise OutputError(f"`{setting}` is empty: name a path to write to")
    absolute = os.path.abspath(raw)
    if not kind.directory and absolute == os.devnull:
        return absolute  # output thrown away on purpose: nothing to protect
    check_not_input(absolute, setting, inputs or {})
    if os.path.islink(absolute):
        raise OutputError(f"`{setting}` {raw} is a symbolic link (to {os.readlink(absolute)}): name the real "
                          f"location instead, or remove the link; nothing was changed")
    if kind.directory and _within(_real(os.getcwd()), _real(absolute)):
        raise OutputError(f"`{setting}` {raw} is the working directory or holds it: a {kind.name} is written as a "
                          f"folder of its own; choose a new folder, e.g. `{setting}`={os.path.join(raw, kind.name.replace(' ', '_'))}; "
                          "nothing was changed")
    parent = os.path.dirname(absolute)
    while parent and not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise OutputError(f"`{setting}` {raw}: {parent} is a file, not a folder: choose a path under a folder; "
                          "nothing was changed")
    for suffix, sibling_kind in (siblings or {}).items():
        _check_existing(absolute.rstrip(os.sep) + suffix, sibling_kind, setting, raw, True, True,
                        replace_setting, keep_setting)
    _check_existing(absolute, kind, setting, raw, replace, keep, replace_setting, keep_setting)
    check_can_create(absolute, f"the {kind.name}")  # a read-only or full file system: now, not after the work
    return absolute


def _check_existing(absolute: str, kind: OutputKind, setting: str, raw: str, replace: bool, keep: bool,
                    replace_setting: str, keep_setting: str | None) -> None:
    """The part of the rule about what already stands at ``absolute``."""
    if not os.path.lexists(absolute):
        return
    shown = raw if absolute == os.path.abspath(raw) else absolute
    if os.path.islink(absolute):
        raise OutputError(f"`{setting}`: {shown} is a symbolic link: this run would write through it; remove it or "
                          "choose another path; nothing was changed")
    if kind.directory and not os.path.isdir(absolute):
        raise OutputError(f"`{setting}` {shown} is a file, not a folder: a {kind.name} is a folder; choose another "
                          "path; nothing was changed")
    if not kind.directory and not os.path.isfile(absolute):
        what = "a folder" if os.path.isdir(absolute) else "not an ordinary file"
        raise OutputError(f"`{setting}` {shown} is {what}: the {kind.name} is one file; name a file path; "
                          "nothing was changed")
    if kind.directory:
        try:
            empty = not os.listdir(absolute)
        except OSError as e:
            raise OutputError(f"`{setting}` {shown} cannot be read ({e.strerror}): choose another path; "
                              "nothing was changed") from None
        if empty:
            return
    if not kind.recognise(absolute):
        holds = f" (it holds {_example(absolute)})" if kind.directory else ""
        raise OutputError(f"`{setting}` {shown} already exists and is not a {kind.name} written by this program{holds}: "
                          f"it is never replaced; choose a new path, or remove it yourself; nothing was changed")
    if replace or keep:
        return
    hint = f"`{replace_setting}` to replace it"
    if keep_setting:
        hint = f"`{keep_setting}` to continue it, or {hint}"
    raise OutputError(f"`{setting}` {shown} already holds a {kind.name}; pass {hint}, or choose another path; "
                      "nothing was changed")


def _example(path: str) -> str:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return "entries that cannot be listed"
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def inside(output_dir: PathLike, relative: PathLike, what: str) -> str:
    """The path a spec names for writing (``relative``, e.g. a CSV file of a feature spec),
    resolved inside ``output_dir``; an absolute path, or one that climbs out with ``..`` or
    through a link, is an ``OutputError`` naming ``what``."""
    rel = os.fspath(relative)
    base = _real(output_dir)
    target = os.path.join(base, rel)
    if os.path.isabs(rel) or not _within(_real(target), base):
        raise OutputError(f"{what} {rel!r} would be written outside the output folder {output_dir}: "
                          "paths a spec names for writing must be relative and stay inside it")
    return target


# ----------------------------------------------------------------------------- common kinds


def head_lines(path: str, limit: int = 1 << 20) -> list[bytes] | None:
    """The whole lines of the first ``limit`` bytes of file ``path`` (a line cut at the limit is
    left out), for a ``recognise`` that judges a text file by its head; None when unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(limit)
            more = f.read(1) != b""
    except OSError:
        return None
    if more:
        head = head[:head.rfind(b"\n") + 1]
    lines = head.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines


PROGRAM = "dlrm-engine"
"""The mark of this program's logs: the first record a log file gets carries ``"program": PROGRAM``
(``dlrm.engine.logger``), so a JSON-lines file of anyone else's is never taken for one."""


def header_record() -> dict:
    """A new JSON-lines log's first record: this program's mark and the version that wrote it."""
    return {"type": "header", "time": time.time(), "program": PROGRAM, "version": __version__}


def _legacy_first(record: dict, prefix: str) -> bool:
    """Whether ``record``, the first of a log without the mark, is one that this program wrote
    first before it had the mark: in its own form the record's first keys ``type`` ("flags", or
    "summary" when the run failed at once) and ``time``, or the first result of the Triton client
    (``triton/client.py``); in DLLogger's, NVIDIA's first METADATA."""
    keys = list(record)
    if prefix:
        return (keys[:4] == ["timestamp", "datetime", "elapsedtime", "type"] and record["type"] == "METADATA"
                and record.get("metric") == "best_auc" and record.get("metadata") == {"unit": None})
    if (keys[:3] == ["type", "split", "batch_size"] and record["type"] == "score") \
            or (keys[:2] == ["type", "batch_size"] and record["type"] == "soak"):
        return True
    time_ = record.get("time")
    return (keys[:2] == ["type", "time"] and record["type"] in ("flags", "summary")
            and isinstance(time_, (int, float)) and not isinstance(time_, bool))


def is_json_lines_log(path: str, prefix: str = "") -> bool:
    """A JSON-lines log of this program: empty, or its first line ``prefix`` (DLLogger's form puts
    ``DLLL `` before each) and a JSON object with this program's mark (``PROGRAM``), or one that
    this program wrote first before it had the mark (``_legacy_first``)."""
    import json

    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 20)
    except OSError:
        return False
    if not first.strip():
        return os.path.getsize(path) == 0
    if not first.startswith(prefix.encode()):
        return False
    try:
        record = json.loads(first[len(prefix.encode()):])
    except ValueError:
        return False
    if not isinstance(record, dict) or "type" not in record:
        return False
    return record.get("program") == PROGRAM or _legacy_first(record, prefix)


LOG = OutputKind("run log", directory=False, recognise=is_json_lines_log)
TENSORBOARD = OutputKind("TensorBoard folder", directory=True,
                         recognise=lambda p: holds_only(p, ["events.out.tfevents.*"]))  # SummaryWriter's files
