"""The version lives in one place: ``dlrm.__version__``, which the installed package reports and
CHANGELOG.md names."""

from __future__ import annotations

import importlib.metadata
import os
import re
import tomllib

import dlrm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_installed_metadata_reports_the_packages_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", dlrm.__version__)
    assert importlib.metadata.version("dlrm") == dlrm.__version__


def test_pyproject_holds_no_second_version_and_the_changelog_names_this_one():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert "version" not in project and "version" in project["dynamic"], "the version belongs in dlrm/__init__.py"
    release = re.sub(r"\.dev\d+$", "", dlrm.__version__)
    with open(os.path.join(REPO, "CHANGELOG.md")) as f:
        assert re.search(rf"^## {re.escape(release)}\b", f.read(), re.M)
