"""Size limits of the library's code: no module of dlrm/ over 650 lines and no function over 80
(from its ``def`` line to its last line, docstring included). Kernels under dlrm/kernels/ are
exempt: a Triton kernel and its torch reference are read side by side.

A module or function past a limit is split by job, not squeezed: see the house rules in
docs/architecture.md.
"""

from __future__ import annotations

import ast
import os

from conftest import REPO

MAX_MODULE_LINES = 650
MAX_FUNCTION_LINES = 80
EXEMPT = (os.path.join("dlrm", "kernels") + os.sep,)


def _modules() -> list[str]:
    """Every .py file under dlrm/ (paths relative to the repository), kernels left out."""
    found = []
    for directory, _, files in os.walk(os.path.join(REPO, "dlrm")):
        for name in files:
            path = os.path.relpath(os.path.join(directory, name), REPO)
            if name.endswith(".py") and not path.startswith(EXEMPT):
                found.append(path)
    return sorted(found)


def module_lines(text: str) -> int:
    return len(text.splitlines())


def long_functions(text: str, path: str, limit: int) -> list[str]:
    """``path:line name (N lines)`` for each function or method (nested ones too) over ``limit``."""
    out = []
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            size = node.end_lineno - node.lineno + 1
            if size > limit:
                out.append(f"{path}:{node.lineno} {node.name} ({size} lines)")
    return out


def _read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def test_the_walk_finds_the_library_and_skips_the_kernels():
    modules = _modules()
    assert os.path.join("dlrm", "nn", "embeddings.py") in modules
    assert os.path.join("dlrm", "recommender", "ratings_file.py") in modules
    assert not any(path.startswith(os.path.join("dlrm", "kernels")) for path in modules)
    kernels = [name for name in os.listdir(os.path.join(REPO, "dlrm", "kernels")) if name.endswith(".py")]
    assert kernels, "dlrm/kernels/ holds modules, so leaving it out is a real exemption"


def test_the_measures_count_from_def_to_the_last_line():
    """The measures on a made-up module built line by line, so each size is known by construction."""
    body = [f"    x{i} = {i}" for i in range(79)]
    lines = ["import os", "", "@staticmethod", "def fits():", *body, "",  # def + 79 lines: 80
             "def too_long():", '    """Doc."""', *body, "",  # def + docstring + 79: 81
             "class Holder:", "    def method(self):", "        def inner():",
             *("        " + line for line in body), "            return 1", "        return inner"]
    text = "\n".join(lines) + "\n"
    assert module_lines(text) == len(lines)
    too_long = lines.index("def too_long():") + 1
    method = lines.index("    def method(self):") + 1
    found = long_functions(text, "made_up.py", MAX_FUNCTION_LINES)
    assert sorted(found) == sorted([f"made_up.py:{too_long} too_long (81 lines)",
                                    f"made_up.py:{method} method (83 lines)",  # def + inner's 81 + return
                                    f"made_up.py:{method + 1} inner (81 lines)"]), found
    assert long_functions(text, "made_up.py", 83) == []


def test_no_module_over_650_lines():
    over = []
    for path in _modules():
        lines = module_lines(_read(path))
        if lines > MAX_MODULE_LINES:
            over.append(f"{path}:1 ({lines} lines)")
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split each by job):\n" + "\n".join(over)


def test_no_function_over_80_lines():
    over = []
    for path in _modules():
        over += long_functions(_read(path), path, MAX_FUNCTION_LINES)
    assert not over, (f"functions over {MAX_FUNCTION_LINES} lines, from def to last line (extract helpers):\n"
                      + "\n".join(over))
