"""The version lives in one place: ``dlrm/version.py``'s ``__version__`` (also ``dlrm.__version__``),
which the installed package reports and CHANGELOG.md names."""

from __future__ import annotations

import importlib.metadata
import os
import re
import tomllib

import dlrm
from dlrm.version import __version__

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_installed_metadata_reports_the_packages_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", __version__)
    assert importlib.metadata.version("dlrm") == __version__ == dlrm.__version__


def test_pyproject_holds_no_second_version_and_the_changelog_names_this_one():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        pyproject = tomllib.load(f)
    project = pyproject["project"]
    assert "version" not in project and "version" in project["dynamic"], "the version belongs in dlrm/version.py"
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dlrm.version.__version__"}
    release = re.sub(r"\.dev\d+$", "", __version__)
    with open(os.path.join(REPO, "CHANGELOG.md")) as f:
        assert re.search(rf"^## {re.escape(release)}\b", f.read(), re.M)
