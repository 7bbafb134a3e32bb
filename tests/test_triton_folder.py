"""The repository's top-level ``triton/`` folder never passes for the Triton compiler.

Each test starts a fresh interpreter from the repository root, as ``python -m`` does for a
user. "Without Triton" is a machine where the real package is absent: a finder placed first on
``sys.meta_path`` looks ``triton`` up in the working directory alone, so the import finds only
the folder, exactly as on a bare install (the bare-venv check of ``.ci/run`` runs the same
commands without the finder, on a real install without Triton).
"""

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import REPO

WITHOUT_TRITON = """
import importlib.machinery, os, runpy, sys

class OnlyTheWorkingDirectory(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "triton":
            return importlib.machinery.PathFinder.find_spec(name, [os.getcwd()])
        return None

sys.meta_path.insert(0, OnlyTheWorkingDirectory)
"""


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_without_triton_the_folder_is_a_namespace_package_that_is_hidden():
    code = WITHOUT_TRITON + (
        "import importlib.util\n"
        "spec = importlib.util.find_spec('triton')\n"
        "assert spec.origin is None and list(spec.submodule_search_locations) == [os.path.join(os.getcwd(), 'triton')]\n"
        "import dlrm\n"
        "from dlrm.kernels.backend import triton_installed\n"
        "import torch.utils._triton as t\n"
        "assert not t.has_triton_package() and not triton_installed()\n"
        "try:\n"
        "    import triton\n"
        "except ImportError:\n"
        "    print('hidden')\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "hidden", proc.stderr


def test_quick_start_trains_from_the_repository_root_without_triton(tmp_path):
    # The README's first command (shortened): before the fix, torch.optim.SGD imported
    # torch._dynamo, which took the folder for Triton and died on `triton.language`.
    code = WITHOUT_TRITON + (
        "sys.argv = ['main'] + sys.argv[1:]\n"
        "runpy.run_module('dlrm.scripts.main', run_name='__main__', alter_sys=True)\n"
    )
    proc = run_python(code, "--amp", "--batch_size", "1024", "--lr", "1", "--warmup_steps", "100", "--max_steps",
                      "3", "--synthetic_dataset_num_entries", "4096", "--synthetic_dataset_num_test_entries", "2048",
                      "--synthetic_dataset_table_sizes", "100,200,300", "--log_path", str(tmp_path / "log.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Finished (completed) after 3 steps" in proc.stdout


def test_preprocessing_entry_point_hides_the_folder_too():
    code = WITHOUT_TRITON + "import preproc\nprint(sys.modules['triton'])\n"
    proc = run_python(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton").origin is None,
                    reason="needs the real triton package installed")
def test_with_triton_installed_the_real_package_wins_from_the_repository_root():
    proc = run_python("import dlrm, triton, triton.language\nprint(triton.__file__)")
    assert proc.returncode == 0, proc.stderr
    assert not proc.stdout.strip().startswith(os.path.join(REPO, "triton")), proc.stdout
