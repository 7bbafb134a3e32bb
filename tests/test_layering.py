"""Imports flow one way: no module of dlrm/ imports one of a higher layer (docs/architecture.md).

Every import statement counts, function-level ones too, since a deferred import hides a cycle
rather than removing it.
"""

import ast
import os

from conftest import REPO

# Higher numbers may import lower ones and their own layer; never the other way.
LAYERS = {
    "kernels": 0, "data": 0,
    "nn": 1,
    "model": 2,
    "distributed": 3,  # parallelize() builds this process's part of the model
    "training": 4,
    "inference": 5,
    "recommender": 5,  # the sparse autoencoder: its own model, loops and checkpoints on the layers below
    "scripts": 6,
    "spark": 6,  # Spark jobs: launch the training script, score raw rows through preproc's transform
}
MAY_IMPORT_PREPROC = {"spark"}  # above both: preproc itself imports dlrm, never dlrm.spark


def _imports(path: str) -> list[tuple[int, str]]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def test_no_module_imports_a_higher_layer():
    root = os.path.join(REPO, "dlrm")
    packages = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and d != "__pycache__")
    assert set(packages) == set(LAYERS), "a new package needs its layer in LAYERS and docs/architecture.md"
    violations = []
    for package in packages:
        for directory, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(directory, name)
                for line, module in _imports(path):
                    parts = module.split(".")
                    if parts[0] == "preproc" and package not in MAY_IMPORT_PREPROC:
                        violations.append(f"{os.path.relpath(path, REPO)}:{line} imports {module} (preproc uses dlrm, not back)")
                    elif parts[0] == "dlrm" and len(parts) > 1 and parts[1] in LAYERS:
                        if LAYERS[parts[1]] > LAYERS[package]:
                            violations.append(f"{os.path.relpath(path, REPO)}:{line} imports {module}")
    assert not violations, "imports against the layering:\n" + "\n".join(violations)


def _raised_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """String pieces inside every ``raise`` statement (f-string parts included)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            for inner in ast.walk(node.exc):
                if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                    found.append((inner.lineno, inner.value))
    return found


def test_library_errors_name_settings_not_flags():
    """Below dlrm/scripts/, errors name a setting as `name` (a config field or parameter);
    the command-line runner shows it as the script's flag (dlrm/scripts/cli.py, flag_terms)."""
    import glob
    import re

    defined = set()
    for script in glob.glob(os.path.join(REPO, "dlrm", "scripts", "*.py")):
        defined |= set(re.findall(r"DEFINE_\w+\(\s*[\"'](\w+)[\"']", open(script, encoding="utf-8").read()))
    assert {"batch_size", "hash_indices", "cuda_graphs"} <= defined
    flag = re.compile(r"(?<![\w-])--(?:no)?(" + "|".join(sorted(defined)) + r")\b")
    violations = []
    for directory, _, files in os.walk(os.path.join(REPO, "dlrm")):
        if os.path.relpath(directory, REPO).startswith(os.path.join("dlrm", "scripts")):
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                tree = ast.parse(open(path, encoding="utf-8").read(), path)
                violations += [f"{os.path.relpath(path, REPO)}:{line}: {text!r}"
                               for line, text in _raised_strings(tree) if flag.search(text)]
    assert not violations, "library errors naming command-line flags:\n" + "\n".join(violations)
