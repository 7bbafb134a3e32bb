"""The version lives in one place: ``dlrm/version.py``'s ``__version__`` (also ``dlrm.__version__``),
which the installed package reports and CHANGELOG.md names."""

from __future__ import annotations

import glob
import importlib.metadata
import os
import re
import tomllib

import dlrm
from dlrm.version import __version__

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_installed_metadata_reports_the_packages_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", __version__)
    assert importlib.metadata.version("dlrm-engine") == __version__ == dlrm.__version__


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


# Import names of the distributions `dependencies` declares.
_IMPORT_NAMES = {"torch": "torch", "numpy": "numpy", "absl-py": "absl", "scipy": "scipy", "pyyaml": "yaml"}
# Modules that run only where an extra is installed (a Spark worker's Python has pyspark).
_EXTRA_ONLY = {os.path.join("dlrm", "spark", "worker_daemon.py")}


def _module_level_imports() -> dict[str, set[str]]:
    """Third-party modules imported at module level under dlrm/ (what `import dlrm.x` needs), each
    with the files that import it; imports inside functions belong to an extra and are left out."""
    import ast
    import sys

    found: dict[str, set[str]] = {}
    for path in sorted(glob.glob(os.path.join(REPO, "dlrm", "**", "*.py"), recursive=True)):
        name = os.path.relpath(path, REPO)
        if name in _EXTRA_ONLY:
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                if root not in sys.stdlib_module_names and root not in ("dlrm", "__future__"):
                    found.setdefault(root, set()).add(name)
    return found


def test_the_dependencies_are_exactly_what_the_package_imports():
    """A module-level import of a package the install line does not bring breaks `import dlrm.x`
    for a new user; a declared package nothing imports is weight they download for nothing."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    declared = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert declared == set(_IMPORT_NAMES), f"declared {sorted(declared)}: map each to its import name here"
    imported = _module_level_imports()
    undeclared = {m: sorted(files)[:3] for m, files in imported.items() if m not in _IMPORT_NAMES.values()}
    assert not undeclared, f"imported at module level but not in `dependencies`: {undeclared}"
    assert set(_IMPORT_NAMES.values()) <= set(imported), "a declared dependency nothing imports"
    assert "scikit-learn" in " ".join(project["optional-dependencies"]["test"])  # the tests' reference AUC


def test_a_checkpoint_and_both_forms_of_log_record_the_version_that_wrote_them(tmp_path):
    """A checkpoint's ``meta.json`` (``written_by``) and the first record of a log, in this
    program's JSON lines and in NVIDIA's DLLogger form, say which version wrote them: a user who
    finds a run's files months later can tell what made them."""
    import json

    from conftest import run_cli

    small = ["--synthetic_dataset_table_sizes", "100,200", "--synthetic_dataset_num_entries", "4096",
             "--synthetic_dataset_num_test_entries", "1024", "--batch_size", "512", "--max_steps", "2",
             "--embedding_dim", "4", "--bottom_mlp_sizes", "8,4", "--top_mlp_sizes", "8,1", "--base_device", "cpu"]
    run_cli("dlrm.scripts.main", *small, "--save_checkpoint_path", str(tmp_path / "ck"),
            "--log_path", str(tmp_path / "log.json"))
    run_cli("dlrm.scripts.main", *small, "--log_format", "dllogger", "--log_path", str(tmp_path / "dllogger.json"))
    with open(tmp_path / "ck" / "meta.json") as f:
        assert json.load(f)["written_by"] == {"program": "dlrm-engine", "version": __version__}
    with open(tmp_path / "log.json") as f:
        first = json.loads(f.readline())
    assert (first["type"], first["program"], first["version"]) == ("header", "dlrm-engine", __version__)
    with open(tmp_path / "dllogger.json") as f:
        line = f.readline()
    assert line.startswith("DLLL ") and json.loads(line[5:])["version"] == __version__


def test_every_optional_module_names_an_extra_that_brings_it():
    """A command that lacks an optional module says which extra to install (``dlrm.extras``):
    that extra exists and lists the module's distribution; preprocessing on one machine does not
    pull Spark (pyspark and pandas are the `spark` extra's)."""
    from dlrm.extras import EXTRAS

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for module, extra in EXTRAS.items():
        names = {re.split(r"[\[<>=!~ ]", requirement)[0] for requirement in extras[extra]}
        assert module in names, (module, extra, names)
    local = {re.split(r"[\[<>=!~ ]", requirement)[0] for requirement in extras["preproc"]}
    assert local == {"polars", "pyarrow"} and EXTRAS["pyspark"] == "spark"
