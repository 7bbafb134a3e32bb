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


def test_the_license_file_is_the_apache_license_the_package_declares():
    """pyproject.toml says Apache-2.0: the LICENSE file beside it holds that license's text
    (setuptools ships LICENSE* files in the wheel and sdist by default)."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["license"]
    assert declared == {"text": "Apache-2.0"}
    with open(os.path.join(REPO, "LICENSE")) as f:
        text = f.read()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190
