"""Checkpoints in NVIDIA's layout that a user hands in, crafted or damaged: every one is refused
with one line naming the file (exit 2 at the command line), within seconds and well under 1 GB,
never echoing what the file holds; and what this program writes in that layout is read from one
save while another run re-saves it, checked against the checksums written beside it.

The checkpoints are laid out by the independent writer of tests/test_nvidia_checkpoint.py, then
one file is replaced. In-process refusals run in a forked child under an address-space limit
and an alarm (``bounded``), so a loop of minutes or a 5 GB allocation fails the test quickly
instead of stalling or exhausting the machine.
"""

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import warm_python
from conftest import REPO, run_entry_points
from test_nvidia_checkpoint import MODEL, NUMERICAL, ONE_GPU, TABLES, nvidia_weights, read_nvidia, write_nvidia

SECONDS = 5
MEMORY = 1 << 30


def bounded(call):
    """``call()`` in a forked child limited to SECONDS and MEMORY more address space than now:
    ("ok", "") or (exception class name, message: its first 10,000 characters, "..." if longer)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's cleanup
        os.close(read_end)
        try:
            with open("/proc/self/statm") as f:
                pages = int(f.read().split()[0])
            limit = pages * resource.getpagesize() + MEMORY
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            signal.alarm(SECONDS)
            call()
            result = ("ok", "")
        except BaseException as e:  # noqa: BLE001 - every outcome is reported to the parent
            message = str(e)
            result = (type(e).__name__, message[:10_000] + ("..." if len(message) > 10_000 else ""))
        os.write(write_end, json.dumps(result).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, f"no result: status {status} (out of time or memory)"
    return tuple(json.loads(data))


def refused(call) -> str:
    """The one-line CheckpointError ``call()`` raises, bounded in time and memory."""
    kind, message = bounded(call)
    assert kind == "CheckpointError", (kind, message[:500])
    assert "\n" not in message and len(message) < 500, message[:500]
    return message


def read_of(path):
    from dlrm.training import nvidia_checkpoint

    return lambda: nvidia_checkpoint.read(str(path))


def load_of(path):
    from dlrm.inference.export import build_inference_model

    return lambda: build_inference_model(str(path))


@pytest.fixture(scope="module")
def weights():
    return nvidia_weights(seed=11)


@pytest.fixture
def checkpoint(tmp_path, weights):
    """A valid checkpoint of NVIDIA's, to break one file of."""
    path = tmp_path / "nv"
    write_nvidia(str(path), weights, ONE_GPU)
    return path


def metadata(path):
    return torch.load(path / "metadata.pt", weights_only=True)


def save_metadata(path, meta):
    torch.save(meta, path / "metadata.pt")


def with_mapping(path, embedding):
    meta = metadata(path)
    meta["data"]["device_mapping"]["embedding"] = embedding
    save_metadata(path, meta)
    return path


# ----------------------------------------------------------------------------- hostile files


def huge_mapping(path):
    """R3: one list of 100,000 ints referenced 100,000 times: 570 KB on disk, 10^10 entries."""
    return with_mapping(path, [list(range(100_000))] * 100_000)


def long_repr_mapping(path):
    """R3: 6 KB whose repr is megabytes (a list of floats referenced 800 times)."""
    return with_mapping(path, [[0.5] * 800] * 800)


def nan_table(path):
    """R5: a NaN in table 1's rows."""
    values = np.fromfile(path / "bottom_model.embeddings.1.bin", dtype="<f4")
    values[17] = np.nan
    values.tofile(path / "bottom_model.embeddings.1.bin")
    return path


def inf_mlp(path):
    """R5: an inf weight in the bottom MLP."""
    state = torch.load(path / "bottom_model.mlp.pt", weights_only=True)
    state["weights"][1].data[0, 0] = float("inf")
    torch.save(state, path / "bottom_model.mlp.pt")
    return path


def zero_stride_mlp(path, rows=10 ** 8):
    """R7: a bottom MLP of zero-stride tensors: a shape of ``rows`` x 3 behind one float."""
    torch.save({"weights": [torch.zeros(1).expand(rows, NUMERICAL), torch.zeros(1).expand(8, rows)],
                "biases": [torch.zeros(1).expand(rows), torch.zeros(8)]}, path / "bottom_model.mlp.pt")
    return path


def narrow_bottom(path, weights):
    """R12: a bottom MLP that ends at 4, the tables' dim being 8."""
    torch.save({"weights": [weights["bottom"][0][0].clone(), weights["bottom"][1][0][:4].clone()],
                "biases": [weights["bottom"][0][1].clone(), weights["bottom"][1][1][:4].clone()]},
               path / "bottom_model.mlp.pt")
    return path


def with_data(path, **data):
    meta = metadata(path)
    meta["data"].update(data)
    save_metadata(path, meta)
    return path


def with_config(path, **config):
    meta = metadata(path)
    meta["config"].update(config)
    save_metadata(path, meta)
    return path


# ----------------------------------------------------------------------------- in-process


def test_a_huge_device_mapping_is_refused_at_once_by_its_length(checkpoint):
    message = refused(read_of(huge_mapping(checkpoint)))
    assert "metadata.pt: device_mapping['embedding'] has 100000 entries" in message


def test_a_mapping_of_floats_is_refused_without_its_values(checkpoint):
    message = refused(read_of(long_repr_mapping(checkpoint)))
    assert "metadata.pt" in message and "0.5" not in message, message


@pytest.mark.parametrize("damage,names", [(nan_table, ["bottom_model.embeddings.1.bin", "table 1"]),
                                          (inf_mlp, ["bottom_model.mlp.pt", "layer 1's weight"])],
                         ids=["nan_table", "inf_mlp_weight"])
def test_non_finite_weights_are_refused_naming_file_and_tensor(checkpoint, damage, names):
    message = refused(load_of(damage(checkpoint)))
    assert "non-finite" in message and all(name in message for name in names), message


def test_zero_stride_tensors_are_refused_before_any_copy(checkpoint):
    message = refused(load_of(zero_stride_mlp(checkpoint)))
    assert "bottom_model.mlp.pt: layer 0's weight is not a dense tensor" in message, message


def test_a_bottom_mlp_that_does_not_end_at_the_tables_dim_is_refused(checkpoint, weights):
    message = refused(read_of(narrow_bottom(checkpoint, weights)))
    assert "bottom MLP ends at 4" in message and "dim 8" in message, message


@pytest.mark.parametrize("data,config,expected", [
    ({"step": "abc"}, {}, "data['step'] is a str of 3"),
    ({"step": float("nan")}, {}, "data['step'] is a float"),
    ({"epoch": -3}, {}, "data['epoch'] is out of range"),
    ({"step": 10 ** 600}, {}, "data['step'] is out of range"),
    ({}, {"hash_indices": "no"}, "config['hash_indices'] is a str of 2"),
    ({}, {"bottom_features_ordered": 1}, "config['bottom_features_ordered'] is a int"),
    ({}, {"interaction_op": ["cat"]}, "config['interaction_op'] is a list of 1"),
], ids=["step_str", "step_nan", "epoch_negative", "step_huge", "hash_indices_str", "ordered_int", "op_list"])
def test_metadata_numbers_and_flags_are_typed(checkpoint, data, config, expected):
    path = with_config(with_data(checkpoint, **data), **config)
    assert expected in refused(read_of(path))


def test_what_this_program_writes_carries_checksums_that_are_verified(tmp_path, weights, checkpoint):
    from dlrm.inference.export import build_inference_model
    from dlrm.training import nvidia_checkpoint

    out = tmp_path / "written"
    nvidia_checkpoint.save(str(out), build_inference_model(str(checkpoint)), epoch=1, step=5)
    listing = json.loads((out / "dlrm_checksums.json").read_text())["files"]
    assert sorted(listing) == sorted(name for name in os.listdir(out) if name != "dlrm_checksums.json")
    assert read_nvidia(str(out))[1]["data"]["step"] == 5  # NVIDIA's files are as before, beside it
    assert nvidia_checkpoint.read(str(out)).step == 5
    with open(out / "bottom_model.embeddings.1.bin", "r+b") as f:
        f.seek(40)
        f.write(b"\x01\x02\x03\x04")  # still finite, same size: only the checksum sees it
    message = refused(load_of(out))
    assert "bottom_model.embeddings.1.bin: its checksum differs" in message, message
    torch.save({"weights": [], "biases": []}, out / "top_model.mlp.pt")
    assert "dlrm_checksums.json says it was written with another size" in refused(read_of(out))


# ----------------------------------------------------------------------------- command lines


# One runner for the three commands (tests/entry_point_runner.py runs one script): this script
# runs the module its first argument names as ``python -m`` would, with the arguments after it.
DISPATCH = """
import runpy, sys
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""
PRELOAD = ["dlrm.api", "dlrm.inference.export", "dlrm.inference.triton_repository"]  # no flags


def run_cases(tmp_path, cases):
    """Each of ``cases`` (a module and its arguments) as ``python -m module args``."""
    script = tmp_path / "dispatch.py"
    script.write_text(DISPATCH)
    return run_entry_points(str(script), [{"args": args, "cwd": REPO} for args in cases], tmp_path, preload=PRELOAD,
                            timeout=300)


def one_line_exit_2(result, *expected):
    lines = result["stderr"].strip().splitlines()
    assert result["returncode"] == 2 and len(lines) == 1, result
    assert len(lines[0]) < 600 and all(e in lines[0] for e in expected), lines[0]


def hostile_copies(tmp_path, weights, names=None):
    """Directories of each hostile kind (of ``names``; all by default): name -> (path, what its
    one line says)."""
    made = {}
    for name, damage, expected in [
            ("huge_mapping", huge_mapping, "has 100000 entries"), ("nan_table", nan_table, "non-finite"),
            ("inf_mlp", inf_mlp, "non-finite"), ("zero_stride", lambda p: zero_stride_mlp(p, 10 ** 6), "not a dense"),
            ("narrow_bottom", lambda p: narrow_bottom(p, weights), "bottom MLP ends at 4"),
            ("step_str", lambda p: with_data(p, step="abc"), "data['step']"),
            ("step_nan", lambda p: with_data(p, step=float("nan")), "data['step']"),
            ("hash_no", lambda p: with_config(p, hash_indices="no"), "config['hash_indices']")]:
        if names is not None and name not in names:
            continue
        path = tmp_path / name
        write_nvidia(str(path), weights, ONE_GPU)
        made[name] = (str(damage(path)), expected)
    return made


def test_command_lines_refuse_each_hostile_checkpoint_in_one_line(tmp_path, weights, synthetic_dataset):
    """convert_checkpoint (each kind, and a huge --nvidia_gpus), main --mode test and deploy."""
    dataset = synthetic_dataset(NUMERICAL, TABLES, {"train": 400, "test": 400}, batch_size=200, seed=5)
    made = hostile_copies(tmp_path, weights)
    convert = "dlrm.scripts.convert_checkpoint"
    cases = [[convert, "--checkpoint", path, "--output", str(tmp_path / f"out_{name}"), "--to", "dlrm"]
             for name, (path, _) in made.items()]
    cases.append([convert, "--checkpoint", made["nan_table"][0], "--output", str(tmp_path / "out_gpus"), "--to",
                  "nvidia", "--nvidia_gpus", "1000000000000"])
    tested = ["huge_mapping", "nan_table"]
    cases += [["dlrm.scripts.main", "--mode", "test", "--dataset", dataset, "--load_checkpoint_path", made[name][0],
               *MODEL, "--test_batch_size", "200"] for name in tested]
    cases.append(["dlrm.scripts.deploy", "--checkpoint", made["huge_mapping"][0], "--model_repository",
                  str(tmp_path / "repo")])
    results = run_cases(tmp_path, cases)
    for (name, (path, expected)), result in zip(made.items(), results):
        one_line_exit_2(result, path, expected)
        assert not os.path.exists(tmp_path / f"out_{name}")
    one_line_exit_2(results[len(made)], "--nvidia_gpus", "at most 1024")
    for name, result in zip(tested, results[len(made) + 1:]):
        one_line_exit_2(result, *made[name])
    one_line_exit_2(results[-1], *made["huge_mapping"])
    assert not os.path.exists(tmp_path / "repo")


# ----------------------------------------------------------------------------- read while re-saved

CONFIG = dict(num_numerical_features=3, table_sizes=[4000, 3000, 2], embedding_dim=16,
              bottom_mlp_sizes=[32, 16], top_mlp_sizes=[32, 1])
SAVES = 15
SAVER = textwrap.dedent(f"""
    import sys, time, torch
    from dlrm.model.dlrm import DLRM, DLRMConfig
    from dlrm.training import nvidia_checkpoint
    model = DLRM(DLRMConfig(**{CONFIG!r}))
    for i in range(1, {SAVES} + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(i)
        nvidia_checkpoint.save(sys.argv[1], model, epoch=0, step=i)
        time.sleep(0.03 * (i % 3))  # back to back and with pauses, as a trainer's saves come
""")


def test_reads_during_saves_in_nvidias_layout_each_come_from_one_save(tmp_path):
    """A real process re-saves in NVIDIA's layout while this one loads: every load succeeds (no
    false "damaged" or "incomplete") and holds one save's weights and step."""
    from dlrm.model.dlrm import DLRM, DLRMConfig
    from dlrm.training import nvidia_checkpoint
    from dlrm.training.checkpoint import load_checkpoint

    path = str(tmp_path / "nv")
    model = DLRM(DLRMConfig(**CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    nvidia_checkpoint.save(path, model, epoch=0, step=0)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    saver = warm_python.Popen([sys.executable, "-c", SAVER, path], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    loads, steps = 0, set()
    try:
        while saver.poll() is None or loads == 0:
            if loads % 2:
                step = nvidia_checkpoint.load(path, model)["step"]
            else:  # through the program's loader, which tells the layouts apart while the directory is swapped
                load_checkpoint(path, model)
                step = None
            values = torch.cat([p.detach().flatten() for p in model.parameters()])
            assert values.min() == values.max() and step in (None, values[0]), f"load {loads}: a mix of saves"
            ckpt = nvidia_checkpoint.read(path)
            assert all(bool((w == ckpt.step).all()) for w, _ in ckpt.bottom + ckpt.top), "a mix of saves"
            loads, steps = loads + 1, steps | {int(values[0])}
    finally:
        out = saver.communicate(timeout=120)[0]
    assert saver.returncode == 0, out
    assert loads >= 5 and len(steps) >= 3, (loads, steps)
    assert nvidia_checkpoint.load(path, model)["step"] == SAVES
