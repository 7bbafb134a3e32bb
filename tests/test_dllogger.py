"""`--log_format dllogger`: the run log in the form NVIDIA's DLRM example writes through
DLLogger, read back by a parser written here from DLLogger's format (a line is ``DLLL `` and a
JSON object), and compared with what the project's own log records."""

import datetime
import json
import math
import re
import time

import pytest

from conftest import log_records

TABLES = [30, 300, 4, 1000, 70]
COMMON = ["--embedding_dim", "8", "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "32,16,1", "--base_device", "cpu",
          "--lr", "0.5", "--warmup_steps", "4", "--decay_start_step", "0", "--decay_steps", "0"]
TRAIN = ["--batch_size", "256", "--test_batch_size", "1000", "--epochs", "2", "--print_freq", "5", "--test_freq", "6"]

# What NVIDIA's example declares when it opens its log (dlrm/scripts/utils.py init_logging).
NVIDIA_METADATA = [("best_auc", {"unit": None}),
                   ("mean_inference_latency_batch_1", {"unit": "s"}),
                   ("mean_inference_latency_batch_64", {"unit": "s"}),
                   ("mean_inference_latency_batch_4096", {"unit": "s"}),
                   ("average_train_throughput", {"unit": "samples/s"}),
                   ("mean_inference_throughput_batch_1", {"unit": "samples/s"}),
                   ("mean_inference_throughput_batch_64", {"unit": "samples/s"}),
                   ("mean_inference_throughput_batch_4096", {"unit": "samples/s"})]


def dllogger_lines(path):
    """Every record of a DLLogger JSON-stream file: the JSON after the ``DLLL `` prefix."""
    out = []
    for line in open(path).read().splitlines():
        assert line.startswith("DLLL "), line
        out.append(json.loads(line[len("DLLL "):]))
    return out


def check_stamps(record, started, ended):
    """DLLogger's clock fields: strings of the seconds since the epoch, the local time, the seconds since open."""
    stamp = float(record["timestamp"])
    assert started <= stamp <= ended
    assert datetime.datetime.fromisoformat(record["datetime"]) == datetime.datetime.fromtimestamp(stamp)
    assert 0 <= float(record["elapsedtime"]) <= ended - started


def one_run(path, started, ended):
    """The records of one run: its METADATA, PARAMETER, steps and final, in that order."""
    for r in path:
        check_stamps(r, started, ended)
    assert [(r["type"], r["metric"], r["metadata"]) for r in path[:8]] == [("METADATA", *m) for m in NVIDIA_METADATA]
    assert path[8]["type"] == "LOG" and path[8]["step"] == "PARAMETER"
    assert all(r["type"] == "LOG" and isinstance(r["step"], list) for r in path[9:])
    assert path[-1]["step"] == [] and all(r["step"] for r in path[9:-1])
    return path[8]["data"], path[9:-1], path[-1]["data"]


@pytest.fixture(scope="module")
def dataset(synthetic_dataset):
    return synthetic_dataset(4, TABLES, {"train": 3000, "test": 2000}, batch_size=4096, seed=7)


def test_dllogger_log_of_train_and_test_runs_appended_in_its_own_form(cli, dataset, tmp_path):
    dll, own = str(tmp_path / "dlrm.dllogger"), str(tmp_path / "own.json")
    started = time.time()
    out = cli("dlrm.scripts.main", "--dataset", dataset, *TRAIN, *COMMON, "--log_format", "dllogger",
              "--log_path", dll, "--save_checkpoint_path", str(tmp_path / "ckpt")).stdout
    ended = time.time()
    # The same run in the project's own form: the same seed takes the same steps to the same numbers.
    cli("dlrm.scripts.main", "--dataset", dataset, *TRAIN, *COMMON, "--log_path", own)
    flags, steps, final = one_run(dllogger_lines(dll), started, ended)

    (own_flags,) = log_records(own, "flags")
    differ = {"log_format", "log_path", "save_checkpoint_path", "type", "time"}
    assert flags["log_format"] == "dllogger" and flags["log_path"] == dll
    assert ({k: v for k, v in flags.items() if k not in differ}
            == {k: v for k, v in own_flags.items() if k not in differ})

    trains, evals = log_records(own, "train"), log_records(own, "eval")
    steps_per_epoch = math.ceil(3000 / 256)  # the last, partial batch is a step
    assert len(trains) >= 4 and len(evals) >= 4
    expected = []  # the project's progress and test records, in their order
    for r in map(json.loads, open(own)):
        if r["type"] == "train":
            expected.append(([r["epoch"], r["step"]], {"loss": r["loss"], "lr": r["lr"]}))
        elif r["type"] == "eval":  # DLLogger's epoch: the one its last step was in
            expected.append(([(r["step"] - 1) // steps_per_epoch, r["step"]],
                             {"auc": r["auc"], "validation_loss": r["loss"]}))
    assert [(r["step"], {k: v for k, v in r["data"].items() if k != "step_time"}) for r in steps] == expected
    # step_time is this run's own: the one its progress lines print
    printed = [float(t) for t in re.findall(r"step_time: ([0-9.]+)", out)]
    logged = [r["data"]["step_time"] for r in steps if "loss" in r["data"]]
    assert logged == pytest.approx(printed, abs=1e-6)

    (summary,) = log_records(own, "summary")
    best = max(evals, key=lambda e: e["auc"])
    assert set(final) == {"best_auc", "best_validation_loss", "training_loss", "best_epoch", "average_train_throughput"}
    assert final["best_auc"] == summary["best_auc"] == best["auc"]
    assert final["best_validation_loss"] == min(e["loss"] for e in evals)
    assert final["training_loss"] == trains[-1]["loss"]
    assert final["best_epoch"] == best["epoch"]
    (throughput,) = re.findall(r"average train throughput ([0-9,]+) samples/s", out)
    assert final["average_train_throughput"] == pytest.approx(float(throughput.replace(",", "")), abs=0.5)

    # --mode test appends its own run to the same file; its final record is NVIDIA's test-mode one
    before = open(dll, "rb").read()
    test_args = ["--mode", "test", "--dataset", dataset, "--test_batch_size", "700", "--load_checkpoint_path",
                 str(tmp_path / "ckpt"), *COMMON]
    started = time.time()
    cli("dlrm.scripts.main", *test_args, "--log_format", "dllogger", "--log_path", dll)
    ended = time.time()
    assert open(dll, "rb").read().startswith(before)
    appended = dllogger_lines(dll)[len(before.splitlines()):]
    flags, steps, final = one_run(appended, started, ended)
    assert flags["mode"] == "test" and steps == []
    cli("dlrm.scripts.main", *test_args, "--log_path", str(tmp_path / "test.json"))
    (test_summary,) = log_records(str(tmp_path / "test.json"), "summary")
    assert final == {"best_auc": test_summary["auc"], "best_validation_loss": test_summary["loss"]}

    # A log is appended to only in its own form; anything else stays as it was
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    refusals = [(own, "dllogger", "pass --log_format=json"), (dll, "json", "pass --log_format=dllogger"),
                (str(notes), "dllogger", "never replaced")]
    for path, log_format, fix in refusals:
        before = open(path, "rb").read()
        proc = cli("dlrm.scripts.main", *test_args, "--log_path", path, "--log_format", log_format, check=False)
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"error: --log_path {path} ") and fix in line, line
        assert open(path, "rb").read() == before


def test_inference_benchmark_in_dllogger_form(cli, dataset, tmp_path):
    dll = str(tmp_path / "bench.dllogger")
    started = time.time()
    out = cli("dlrm.scripts.main", "--mode", "inference_benchmark", "--dataset", dataset, *COMMON,
              "--inference_benchmark_batch_sizes", "1,64", "--inference_benchmark_steps", "20", "--log_format",
              "dllogger", "--log_path", dll).stdout
    _, steps, final = one_run(dllogger_lines(dll), started, time.time())
    assert steps == [] and set(final) == {"mean_inference_latency_batch_1", "mean_inference_throughput_batch_1",
                                          "mean_inference_latency_batch_64", "mean_inference_throughput_batch_64"}
    for size in (1, 64):
        latency = final[f"mean_inference_latency_batch_{size}"]
        assert final[f"mean_inference_throughput_batch_{size}"] == pytest.approx(size / latency)
        # the table's row of this batch size prints its mean in ms, to 3 places
        (mean_ms,) = re.findall(rf"^\s*eager\s+{size}\s+none \(cpu\)\s+([0-9.]+)\s", out, re.M)
        assert latency * 1000 == pytest.approx(float(mean_ms), abs=0.00051)
