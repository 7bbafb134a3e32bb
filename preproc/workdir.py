"""The work directory of a run: what makes an interrupted run resumable.

Each unit of work (an input file's counts, the vocabulary, an input file's transformed rows)
is written into ``<name>.tmp``, renamed to ``<name>`` when complete, and only then recorded by
a marker ``<name>.json`` (written to a temporary file and renamed). The marker also records
what the unit was made from (its input files' size and mtime, the vocabulary build it used).
On resume a unit whose marker is there and whose inputs are unchanged is skipped; anything else
of it is deleted and redone, so fixing a bad line in one file redoes that file (and, for a
training file, the vocabulary and the transform), not the whole run. ``manifest.json`` records
the job's identity; a work directory of a different job is refused rather than mixed in.

Nothing half-written outlives a run: a failed run removes its partial units (``*.tmp``) before
it exits, keeping only finished ones. A run killed outright (``kill -9``, power loss) cannot,
so the manifest also records which process owns the directory; the next run removes every
``*.tmp`` when that process is gone, and refuses the directory while it still runs.
"""

from __future__ import annotations

import json
import os
import shutil
import socket

from dlrm.engine.atomic import fsync_dir, pid_alive, write_text_atomically
from dlrm.engine.errors import DatasetError

MANIFEST = "manifest.json"


def atomic_write_json(path: str, data: dict) -> None:
    write_text_atomically(path, json.dumps(data, indent=1, sort_keys=True))


def file_stamp(path: str) -> list[int]:
    """What tells a changed input file: its size and modification time."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def _plain(value):
    """``value`` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


def _differences(old: dict, new: dict) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


class WorkDir:
    """Markers and unit directories under ``path``, checked against the job's identity."""

    def __init__(self, path: str, identity: dict, settings: dict, fresh: bool = False):
        self.path = path
        manifest = self.read(MANIFEST)
        owner = {"host": socket.gethostname(), "pid": os.getpid()}
        previous = (manifest or {}).get("owner") or owner
        if previous["host"] == owner["host"] and previous != owner and pid_alive(previous["pid"]):
            raise DatasetError(
                f"{path} is in use by a running preprocessing run (pid {previous['pid']}); wait for it to finish, "
                f"or, if no such run exists, delete the directory"
            )
        if fresh and os.path.exists(path):
            shutil.rmtree(path)
            manifest = None
        elif previous["host"] == owner["host"]:  # another host's run may be alive; each unit is cleared when redone
            self.remove_partial()
        os.makedirs(path, exist_ok=True)
        if manifest is None:
            self.settings = dict(settings)
            self.resumed = False
        else:
            old = manifest["identity"]
            if old.get("on_error") == "fail" and identity.get("on_error") == "skip":
                old = {**old, "on_error": "skip"}  # units finished in fail mode had no malformed line
            diff = _differences(old, identity)
            if diff:
                raise DatasetError(
                    f"{path} holds an unfinished run with other settings ({', '.join(diff)} differ); "
                    f"delete it, pass --fresh to start over, or rerun with the same settings to resume it"
                )
            self.settings = manifest["settings"]  # keep the partitioning the finished units used
            self.resumed = True
        manifest = {"identity": identity, "settings": self.settings, "owner": owner}
        atomic_write_json(os.path.join(path, MANIFEST), manifest)

    def file(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    def read(self, name: str) -> dict | None:
        try:
            with open(os.path.join(self.path, name)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def done(self, unit: str, depends=None) -> dict | None:
        """The marker of a finished unit made from ``depends``, or None (then its leftovers are removed)."""
        marker = self.read(unit + ".json")
        if marker is not None and marker.get("depends") != _plain(depends):
            marker = None
        if marker is None:
            self.clear(unit)
            if os.path.exists(self.file(unit + ".json")):
                os.unlink(self.file(unit + ".json"))
        return marker

    def clear(self, unit: str) -> None:
        for p in (self.file(unit), self.file(unit + ".tmp")):
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.unlink(p)

    def begin(self, unit: str) -> str:
        """A fresh ``<unit>.tmp`` directory to write the unit into."""
        self.clear(unit)
        tmp = self.file(unit + ".tmp")
        os.makedirs(tmp)
        return tmp

    def commit(self, unit: str, marker: dict, depends=None) -> None:
        """Rename ``<unit>.tmp`` into place (if it exists), then write the marker (with ``depends``)."""
        tmp = self.file(unit + ".tmp")
        if os.path.isdir(tmp):
            for name in os.listdir(tmp):
                p = os.path.join(tmp, name)
                if os.path.isfile(p):
                    with open(p, "rb") as f:
                        os.fsync(f.fileno())
            os.replace(tmp, self.file(unit))
            fsync_dir(os.path.dirname(self.file(unit)))
        atomic_write_json(self.file(unit + ".json"), {**marker, "depends": _plain(depends)})

    def remove_partial(self) -> None:
        """Remove every unit directory or temporary file still being written (``*.tmp``): what a
        failed run must not leave behind. Finished units and markers stay for a resume."""
        for directory, dirs, files in os.walk(self.path):
            for name in dirs + files:
                if name.endswith(".tmp"):
                    p = os.path.join(directory, name)
                    shutil.rmtree(p) if name in dirs else os.unlink(p)
            dirs[:] = [d for d in dirs if not d.endswith(".tmp")]

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
