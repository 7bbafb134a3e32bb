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
    "scripts": 6,
}


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
                    if parts[0] == "preproc":
                        violations.append(f"{os.path.relpath(path, REPO)}:{line} imports {module} (preproc uses dlrm, not back)")
                    elif parts[0] == "dlrm" and len(parts) > 1 and parts[1] in LAYERS:
                        if LAYERS[parts[1]] > LAYERS[package]:
                            violations.append(f"{os.path.relpath(path, REPO)}:{line} imports {module}")
    assert not violations, "imports against the layering:\n" + "\n".join(violations)
