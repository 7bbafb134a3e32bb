"""Imports flow one way: no module of dlrm/ imports one of a higher layer (docs/architecture.md).

Every import statement counts, function-level ones too, since a deferred import hides a cycle
rather than removing it.
"""

import ast
import os

from conftest import REPO

# Higher numbers may import lower ones and their own layer; never the other way.
LAYERS = {
    "engine": -1,  # what both products train on; imports nothing of dlrm but itself
    "kernels": 0, "data": 0,
    "nn": 1,
    "model": 2,
    "distributed": 3,  # parallelize() builds this process's part of the model
    "training": 4,
    "inference": 5,
    "recommender": 5,  # the sparse autoencoder: its own model, loop adapter and checkpoint format on the engine
    "wide": 5,  # the wide logistic model of docs/adding_a_model.md
    "scripts": 6,
    "spark": 6,  # Spark jobs: launch the training script, score raw rows through preproc's transform
}
# A module above its package's layer: DLRM's Python API (one call per job of dlrm.scripts.main)
# lives with the training code and runs the inference benchmark and serving precision too, so it
# sits with inference; no module below that layer may import it.
MODULE_LAYERS = {"dlrm.training.api": LAYERS["inference"]}
MAY_IMPORT_PREPROC = {"spark"}  # above both: preproc itself imports dlrm, never dlrm.spark

# Products on one engine, and none imports another. DLRM is several packages; any other package
# of LAYERS is a product of its own (the recommender, the wide model). The entry points (scripts/,
# spark/) belong to one product by file, or are shared (the CLI runner, Spark's launcher and its
# reading and writing), and the shared ones import the engine only.
DLRM_PACKAGES = {"kernels", "data", "nn", "model", "distributed", "training", "inference"}
SHARED_ENTRY_MODULES = {"dlrm.scripts", "dlrm.scripts.cli", "dlrm.spark", "dlrm.spark.launch", "dlrm.spark.job_io"}
SHARED_ROOT_MODULES = {"dlrm", "dlrm.extras", "dlrm.triton_folder"}


def _imports(path: str) -> list[tuple[int, str]]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # ``from dlrm.scripts import cli`` imports the module dlrm.scripts.cli
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names
                      if node.module.count(".") == 1 and node.module.split(".")[1] in ("scripts", "spark")
                      or f"{node.module}.{alias.name}" in MODULE_LAYERS]
    return found


def _modules() -> dict[str, str]:
    """Every module of dlrm/ (dotted name -> path)."""
    found = {}
    for directory, _, files in os.walk(os.path.join(REPO, "dlrm")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def product_of(module: str) -> str | None:
    """The product a module of dlrm belongs to: "dlrm", "recommender", "wide", or None (the engine
    and what the products share)."""
    parts = module.split(".")
    if module in SHARED_ROOT_MODULES or module in SHARED_ENTRY_MODULES or parts[1] == "engine":
        return None
    if parts[1] in ("scripts", "spark"):
        name = parts[2] if len(parts) > 2 else ""
        return "recommender" if name.startswith(("recommender", "spark_recommend", "recommend")) else "dlrm"
    return "dlrm" if parts[1] in DLRM_PACKAGES else parts[1]


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
                dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                layer = MODULE_LAYERS.get(dotted, LAYERS[package])
                for line, module in _imports(path):
                    parts = module.split(".")
                    if parts[0] == "preproc" and package not in MAY_IMPORT_PREPROC:
                        violations.append(f"{os.path.relpath(path, REPO)}:{line} imports {module} (preproc uses dlrm, not back)")
                    elif parts[0] == "dlrm" and len(parts) > 1 and parts[1] in LAYERS:
                        if MODULE_LAYERS.get(module, LAYERS[parts[1]]) > layer:
                            violations.append(f"{os.path.relpath(path, REPO)}:{line} imports {module}")
    assert not violations, "imports against the layering:\n" + "\n".join(violations)


def test_the_engine_imports_no_product_and_no_product_imports_the_other():
    modules = _modules()
    assert product_of("dlrm.recommender.train") == "recommender" and product_of("dlrm.scripts.main") == "dlrm"
    assert product_of("dlrm.spark.recommend") == "recommender" and product_of("dlrm.engine.loop") is None
    assert product_of("dlrm.wide.train") == "wide" and product_of("dlrm.nn.init") == "dlrm"
    violations = []
    for module, path in sorted(modules.items()):
        mine = product_of(module)
        for line, imported in _imports(path):
            if not imported.startswith("dlrm.") or imported not in modules:
                continue  # a name imported from a module (from dlrm.x import y), counted as dlrm.x
            theirs = product_of(imported)
            if theirs is not None and theirs != mine:
                what = "the engine" if mine is None else f"product {mine}"
                violations.append(f"{os.path.relpath(path, REPO)}:{line} ({what}) imports {imported} (product {theirs})")
    assert not violations, "imports across the engine's boundary:\n" + "\n".join(violations)


def test_the_engine_runs_without_either_product():
    """Imported in a fresh interpreter, every engine module loads no module of either product."""
    import subprocess
    import sys

    engine = sorted(m for m in _modules() if m.startswith("dlrm.engine"))
    assert {"dlrm.engine.loop", "dlrm.engine.checkpoint_store", "dlrm.engine.collectives"} <= set(engine)
    code = ("import importlib, sys\n"
            f"for m in {engine!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.startswith('dlrm.') and not m.startswith('dlrm.engine')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['dlrm.triton_folder']", out


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
