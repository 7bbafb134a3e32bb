"""The README's quick start prints what the README shows: its command, read from the README and
run (shortened to 12 steps and a small test split), prints lines of the same shapes as the
README's sample output, numbers aside, and the sample holds every shape the command prints."""

from __future__ import annotations

import os
import re
import shlex

from conftest import run_cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORTER = ["--max_steps", "12", "--synthetic_dataset_num_test_entries", "4096", "--test_batch_size", "4096"]  # the last value of a flag wins


def _readme() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        return f.read()


def quick_start_args() -> list[str]:
    """The arguments of the README's first training command (the quick start's last line)."""
    block = re.search(r"## Quick start\n.*?```bash\n(.*?)```", _readme(), re.S).group(1)
    words = shlex.split(block.strip().splitlines()[-1])
    assert words[:3] == ["python", "-m", "dlrm.scripts.main"], words
    return words[3:]


def sample_output() -> list[str]:
    return re.search(r"## What a run prints\n.*?```\n(.*?)```", _readme(), re.S).group(1).splitlines()


def shape(line: str) -> str:
    """A line without its figures: numbers (and lists of them) become #, runs of spaces and of
    dashes one; the run header ends at its precision, which depends on the CPU's instructions."""
    if line.startswith("DLRM: "):
        line = line.split(" precision ")[0]
    line = re.sub(r"\d[\d,.:%]*", "#", line)
    line = re.sub(r"(# ?)+", "# ", line)
    return re.sub(r"-+", "-", re.sub(r"\s+", " ", line)).strip()


def test_the_quick_start_prints_the_lines_the_readme_shows(tmp_path):
    proc = run_cli("dlrm.scripts.main", *quick_start_args(), *SHORTER, "--log_path", str(tmp_path / "log.json"))
    printed = [line for line in proc.stdout.splitlines() if line.strip()]
    assert {shape(line) for line in printed} == {shape(line) for line in sample_output()}, proc.stdout
    assert any(line.startswith("Epoch:[0/1] [5/512]") for line in printed)  # the early line, after 5 steps
