"""Imports flow one way: no module of dlrm/ imports one of a higher layer, no two modules import
each other (directly or around a circle), and no product imports another (docs/architecture.md).

Every import statement counts, function-level ones too, since a deferred import hides a cycle
rather than removing it. Which product a module belongs to comes from the registry,
``dlrm/products.py``, never from its file name.
"""

import ast
import os

from conftest import REPO

from dlrm.products import PRODUCTS, SHARED, product_of

# Higher numbers may import lower ones and their own layer; never the other way.
LAYERS = {
    "engine": -1,  # what both products train on; imports nothing of dlrm but itself (and dlrm.version)
    "kernels": 0, "data": 0,
    "nn": 1,
    "model": 2,
    "distributed": 3,  # parallelize() builds this process's part of the model
    "training": 4,
    "inference": 5,
    "scripts": 6,
    "spark": 6,  # Spark jobs: launch the training script, score raw rows through preproc's transform
}
# A package a product registers (dlrm/products.py) that is not in LAYERS, e.g. the recommender or
# the wide model of docs/adding_a_model.md, sits beside inference: on the engine, below the scripts.
PRODUCT_LAYER = 5
# The modules directly under dlrm/. The plain ones import nothing of dlrm; DLRM's Python API sits
# above inference and training, below the scripts; the package root is above everything (it loads
# dlrm.api's names on first use), so nothing imports it: a name comes from its own module.
ROOT_MODULE_LAYERS = {
    "dlrm.version": -2, "dlrm.extras": -2, "dlrm.triton_folder": -2, "dlrm.products": -2,
    "dlrm.api": 5.5,
    "dlrm": 7,
}
MAY_IMPORT_PREPROC = {"spark"}  # above both: preproc itself imports dlrm, never dlrm.spark


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


def _nearest(name: str, modules: dict[str, str]) -> str:
    """``name``, or the nearest package above it that is a module of dlrm (an attribute imported
    from a module counts as that module); names outside dlrm stay as they are."""
    if name != "dlrm" and not name.startswith("dlrm."):
        return name
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str, path: str, modules: dict[str, str]) -> list[tuple[int, str]]:
    """(line, imported module) of every import statement in ``path``, function-level ones too.
    ``from pkg import name`` imports ``pkg.name`` when that is a module, else ``pkg``; the implicit
    import of parent packages is not counted."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, _nearest(alias.name, modules)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                whole = f"{base}.{alias.name}"
                found.append((node.lineno, whole if whole in modules else _nearest(base, modules)))
    return list(dict.fromkeys(found))  # ``from m import a, b``: once


def _graph() -> tuple[dict[str, str], dict[str, list[tuple[int, str]]]]:
    """Every module of dlrm/ and, per module, (line, module of dlrm it imports), itself left out."""
    modules = _modules()
    edges = {m: [(line, t) for line, t in _imports(m, path, modules) if t in modules and t != m]
             for m, path in modules.items()}
    return modules, edges


def _cycles(edges: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for _, target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(edges[target])))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _package(module: str) -> str | None:
    """The package under dlrm/ that holds ``module`` ("spark" for dlrm.spark.launch), else None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or len(parts) == 2 and module not in ROOT_MODULE_LAYERS else None


def _where(path: str, line: int) -> str:
    return f"{os.path.relpath(path, REPO)}:{line}"


def layer_of(module: str) -> float | None:
    """The layer of a module of dlrm (ROOT_MODULE_LAYERS, LAYERS, or a product's package), or None."""
    if module in ROOT_MODULE_LAYERS:
        return ROOT_MODULE_LAYERS[module]
    package = _package(module)
    if package in LAYERS:
        return LAYERS[package]
    if any(package in product.packages for product in PRODUCTS.values()):
        return PRODUCT_LAYER
    return None


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    """The finder itself, on a small graph with one circle (a -> b -> c -> a) and a tail."""
    edges = {"a": [(1, "b")], "b": [(2, "c")], "c": [(3, "a"), (4, "d")], "d": [], "e": [(5, "a")]}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": [(1, "b")], "b": [], "c": [(1, "a")]}) == []


def test_imports_inside_functions_and_of_names_count_as_their_modules(tmp_path):
    """What the graph is made of, on a written file: each statement below, and nothing else."""
    source = tmp_path / "example.py"
    source.write_text("import os\n"
                      "from dlrm import __version__\n"
                      "def f():\n"
                      "    from dlrm.engine import outputs, atomic\n"
                      "    from dlrm.engine.atomic import write_atomically\n"
                      "    import dlrm.recommender.no_such_module\n"
                      "    from preproc import cli\n", encoding="utf-8")
    found = _imports("dlrm.recommender.example", str(source), _modules())
    assert found == [(1, "os"), (2, "dlrm"), (4, "dlrm.engine.outputs"), (4, "dlrm.engine.atomic"),
                     (5, "dlrm.engine.atomic"), (6, "dlrm.recommender"), (7, "preproc")]


def test_no_import_cycles():
    """No module of dlrm/ imports itself around a circle, counting every import statement."""
    modules, edges = _graph()
    assert edges["dlrm.engine.atomic"] and edges["dlrm.recommender.train"]
    report = []
    for component in _cycles(edges):
        members = set(component)
        report.append("cycle: " + ", ".join(component))
        report += [f"    {_where(modules[m], line)} imports {t}"
                   for m in component for line, t in edges[m] if t in members]
    assert not report, "import cycles among the modules of dlrm/:\n" + "\n".join(report)


def test_every_package_and_root_module_has_a_layer():
    modules = _modules()
    root = os.path.join(REPO, "dlrm")
    packages = {d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and d != "__pycache__"}
    registered = {p for product in PRODUCTS.values() for p in product.packages}
    assert packages == set(LAYERS) | registered, \
        "a new package needs its layer in LAYERS, or its product's entry in dlrm/products.py"
    loose = {m for m in modules if m.count(".") <= 1 and m.split(".")[-1] not in packages}
    assert loose <= set(ROOT_MODULE_LAYERS), f"modules under dlrm/ with no layer: {loose - set(ROOT_MODULE_LAYERS)}"
    assert all(layer_of(m) is not None for m in modules)


def test_no_module_imports_a_higher_layer():
    modules, _ = _graph()
    violations = []
    for module, path in sorted(modules.items()):
        package = _package(module)
        for line, imported in _imports(module, path, modules):
            if imported.split(".")[0] == "preproc" and package not in MAY_IMPORT_PREPROC:
                violations.append(f"{_where(path, line)} imports {imported} (preproc uses dlrm, not back)")
            elif imported == "dlrm" and module != "dlrm":
                violations.append(f"{_where(path, line)} imports the package root dlrm: import the name from its "
                                  "own module (e.g. dlrm.version.__version__)")
            elif imported in modules and layer_of(imported) > layer_of(module):
                violations.append(f"{_where(path, line)} imports {imported} (layer {layer_of(imported)} "
                                  f"above {layer_of(module)})")
    assert not violations, "imports against the layering:\n" + "\n".join(violations)


def test_spark_and_scripts():
    """Spark jobs never import the scripts; a script imports Spark only as a spark_* entry point."""
    modules, edges = _graph()
    violations = []
    for module, imports in sorted(edges.items()):
        for line, imported in imports:
            if _package(module) == "spark" and _package(imported) == "scripts":
                violations.append(f"{_where(modules[module], line)} imports {imported} (Spark below the scripts)")
            if (_package(module) == "scripts" and _package(imported) == "spark"
                    and not module.startswith("dlrm.scripts.spark_")):
                violations.append(f"{_where(modules[module], line)} imports {imported} (only spark_* entry points may)")
    assert not violations, "imports between Spark and the scripts:\n" + "\n".join(violations)


def test_every_entry_point_belongs_to_one_product_or_is_shared():
    modules = _modules()
    listed = [m for product in PRODUCTS.values() for m in product.entry_points] + list(SHARED)
    entry = sorted(m for m in modules if m.split(".")[1:2] in (["scripts"], ["spark"]))
    wrong = {m: listed.count(m) for m in entry if listed.count(m) != 1}
    assert not wrong, f"entry points listed other than once in dlrm/products.py (name: times listed): {wrong}"
    for name, product in PRODUCTS.items():
        missing = [m for m in product.entry_points + product.modules if m not in modules and m != "dlrm.api"]
        assert not missing, f"product {name} lists modules that do not exist: {missing}"
        assert all(f"dlrm.{p}" in modules for p in product.packages), f"product {name} lists a missing package"
    packages = [p for product in PRODUCTS.values() for p in product.packages]
    assert len(packages) == len(set(packages)), "a package is listed under two products"
    assert set(LAYERS) - set(packages) == {"engine", "scripts", "spark"}, "every layer but these is a product's"


def test_the_registry_names_each_modules_product():
    """product_of against what docs/architecture.md says, module by module."""
    assert product_of("dlrm.recommender.train") == "recommender" and product_of("dlrm.scripts.main") == "dlrm"
    assert product_of("dlrm.spark.recommend") == "recommender" and product_of("dlrm.engine.loop") is None
    assert product_of("dlrm.wide.train") == "wide" and product_of("dlrm.nn.init") == "dlrm"
    assert product_of("dlrm.api") == "dlrm" and product_of("dlrm.scripts.spark_recommend") == "recommender"
    assert product_of("dlrm.scripts.cli") is None and product_of("dlrm") is None


def test_the_engine_imports_no_product_and_no_product_imports_the_other():
    modules, edges = _graph()
    violations = []
    for module, imports in sorted(edges.items()):
        mine = product_of(module)
        for line, imported in imports:
            theirs = product_of(imported)
            if module == "dlrm" and imported == "dlrm.api":
                continue  # the root loads DLRM's Python API on first use of dlrm.load, dlrm.train...
            if theirs is not None and theirs != mine:
                what = "the engine or a shared module" if mine is None else f"product {mine}"
                violations.append(f"{_where(modules[module], line)} ({what}) imports {imported} (product {theirs})")
    assert not violations, "imports across the engine's boundary:\n" + "\n".join(violations)


def test_the_engine_runs_without_either_product():
    """Imported in a fresh interpreter, every engine module loads no module of any product: only
    the engine and the plain modules under the root (dlrm.version, dlrm.triton_folder)."""
    import subprocess
    import sys

    engine = sorted(m for m in _modules() if m.startswith("dlrm.engine"))
    assert {"dlrm.engine.loop", "dlrm.engine.checkpoint_store", "dlrm.engine.collectives"} <= set(engine)
    code = ("import importlib, sys\n"
            f"for m in {engine!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.startswith('dlrm.') and not m.startswith('dlrm.engine')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    loaded = ast.literal_eval(out.strip())
    assert "dlrm.triton_folder" in loaded, out
    assert all(ROOT_MODULE_LAYERS.get(m, 0) < LAYERS["engine"] for m in loaded), out


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
        text = open(script, encoding="utf-8").read()  # flags defined directly, or from a table of settings
        defined |= set(re.findall(r"(?:DEFINE_\w+|Setting)\(\s*[\"'](\w+)[\"']", text))
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
