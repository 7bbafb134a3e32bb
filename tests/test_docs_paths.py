"""Every repository path and relative link that README.md, CHANGELOG.md and docs/ name exists: a
reader who follows one lands on a file, not a 404. A path of NVIDIA's repository is written from
the example's own folder (`DLRM/tests/...`), so it is not read as one of this repository's."""

from __future__ import annotations

import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "CHANGELOG.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/docs/*.md"))
TOP_FOLDERS = ("dlrm", "tests", "benchmarks", "configs", "docs", "preproc", "triton", "notebooks", ".ci")
# A link's target: [text](target) or [text](target#anchor), not a URL.
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# A path under one of the repository's top folders, not inside a longer path (NVIDIA's `DLRM/tests/`)
# or a word; `*` and `?` make it a glob that must match something.
PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w./*?-]*[\w/*?])" % "|".join(re.escape(t) for t in TOP_FOLDERS))


def _missing(doc: str) -> list[str]:
    with open(os.path.join(REPO, doc)) as f:
        text = f.read()
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        if not os.path.exists(os.path.normpath(os.path.join(REPO, os.path.dirname(doc), target))):
            missing.append(f"link ({target})")
    for path in PATH.findall(text):
        if any(c in path for c in "*?"):
            if not glob.glob(os.path.join(REPO, path)):
                missing.append(f"pattern {path} (matches nothing)")
        elif not os.path.exists(os.path.join(REPO, path)):
            missing.append(path)
    return missing


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_and_link_a_doc_names_exists(doc):
    assert not _missing(doc), f"{doc} names what is not in the repository: {_missing(doc)}"


def test_the_check_finds_a_missing_path_and_a_broken_link(tmp_path, monkeypatch):
    """The check itself, on a document written to fail it, and on one that names real files."""
    monkeypatch.setattr(__import__(__name__), "REPO", str(tmp_path))
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("")
    (tmp_path / "docs" / "x.md").write_text(
        "run `tests/test_a.py`, `tests/test_*.py` and NVIDIA's `DLRM/tests/test_fspecs.sh`; see [b](b.md)\n")
    assert _missing("docs/x.md") == ["link (b.md)"]
    (tmp_path / "docs" / "b.md").write_text("`dlrm/nowhere.py`, [a](../tests/test_a.py), `benchmarks/*.sh`\n")
    assert _missing("docs/b.md") == ["dlrm/nowhere.py", "pattern benchmarks/*.sh (matches nothing)"]
    assert _missing("docs/x.md") == []
