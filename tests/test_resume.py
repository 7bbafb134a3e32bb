"""Resuming a run: the position is kept in samples, so a new batch size continues at the next sample."""

import io
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.loader import remaining_batches
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.data.synthetic import SyntheticDataset, write_synthetic_dataset
from dlrm.engine.logger import RunLogger
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.training.checkpoint import CheckpointError, TrainState, load_checkpoint
from dlrm.training.lr_schedule import LRSchedule
from dlrm.training.optimizers import make_optimizer
from dlrm.training.train import TrainConfig, train

from conftest import REPO
import warm_python

CPU = torch.device("cpu")
TABLES = [30, 300, 4, 1000, 70]
SMALL = ["--embedding_dim", "8", "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "16,1", "--base_device", "cpu",
         "--lr", "0.5", "--warmup_steps", "0", "--decay_start_step", "0", "--decay_steps", "0"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("data"))
    write_synthetic_dataset(root, 4, TABLES, {"train": 20_000, "test": 2_000}, batch_size=4096, seed=7)
    return root


class RecordingReader(SplitBinaryReader):
    """The split-binary reader, noting every row range it reads."""

    def __init__(self, *args, reads: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads = reads

    def read_rows(self, start, count):
        self.reads.append((start, count))
        return super().read_rows(start, count)


def _train(dataset, batch_size, state, save, reads, epochs=2, max_steps=None, shuffle=False):
    spec = FeatureSpec.from_yaml(os.path.join(dataset, "feature_spec.yaml"))
    torch.manual_seed(0)
    model = DLRM(DLRMConfig(num_numerical_features=4, table_sizes=TABLES, embedding_dim=8,
                            bottom_mlp_sizes=[16, 8], top_mlp_sizes=[16, 1]))
    opt = make_optimizer(model, 0.1)
    scaler = Precision("cpu").grad_scaler()
    if state == "resume":
        state = load_checkpoint(save, model, opt, scaler)
    cfg = TrainConfig(schedule=LRSchedule(lr=0.1), epochs=epochs, max_steps=max_steps, save_checkpoint_path=save,
                      log_every_steps=1000, shuffle_batch_order=shuffle)
    source = RecordingReader(spec, "train", batch_size, reads=reads)
    return train(model, opt, scaler, Precision("cpu"), source, None, cfg, CPU, RunLogger(None, stream=io.StringIO()),
                 state=state)


def _coverage(reads, num_samples):
    """How often each sample was read."""
    seen = np.zeros(num_samples, dtype=np.int64)
    for start, count in reads:
        seen[start:start + count] += 1
    return seen


@pytest.mark.parametrize("second_batch_size", [4096, 300, 512])
def test_resume_with_another_batch_size_continues_at_the_next_sample(dataset, tmp_path, second_batch_size):
    """45 steps of 512 end 2,560 samples into epoch 1 (40 batches per epoch). Any new batch size
    reads on from sample 2,560, so every sample is read exactly once per epoch."""
    save = str(tmp_path / "ck")
    first, second = [], []
    summary = _train(dataset, 512, None, save, first, epochs=2, max_steps=45)
    assert summary["steps"] == 45
    state = load_checkpoint(save, DLRM(DLRMConfig(num_numerical_features=4, table_sizes=TABLES, embedding_dim=8,
                                                  bottom_mlp_sizes=[16, 8], top_mlp_sizes=[16, 1])))
    assert (state.epoch, state.sample_in_epoch, state.batch_size) == (1, 2560, 512)

    summary = _train(dataset, second_batch_size, "resume", save, second, epochs=3)
    epoch1_rest = -(-(20_000 - 2560) // second_batch_size)
    assert summary["steps"] == 45 + epoch1_rest + -(-20_000 // second_batch_size)
    assert summary["stop_reason"] == "completed" and summary["epochs"] == 3
    assert second[0] == (2560, min(second_batch_size, 20_000 - 2560))
    reads = first + second
    assert (_coverage(reads, 20_000) == 3).all()  # epochs 0, 1 and 2, each sample once per epoch


def test_shuffled_resume_with_another_batch_size_is_refused_before_any_step(dataset, tmp_path):
    save = str(tmp_path / "ck")
    _train(dataset, 512, None, save, [], max_steps=45, shuffle=True)
    reads = []
    with pytest.raises(CheckpointError, match=r"resume with `batch_size=512`"):
        _train(dataset, 4096, "resume", save, reads, shuffle=True)
    assert reads == []
    summary = _train(dataset, 512, "resume", save, [], shuffle=True)  # the same size continues
    assert summary["steps"] == 80


def test_remaining_batches_of_generated_data_continue_at_the_next_batch_boundary():
    source = SyntheticDataset(3, [10, 10], 1000, 300, seed=1)  # generated in whole batches of 300
    kept, order, first = remaining_batches(source, 0, 512, seed=0, shuffle=False)
    assert kept is source and list(order) == [2, 3] and first == 600
    kept, order, first = remaining_batches(source, 0, 1000, seed=0, shuffle=False)
    assert len(order) == 0 and first == 1000  # nothing left: the caller ends the epoch


def test_position_past_the_end_of_a_smaller_split_ends_the_epoch(dataset, tmp_path):
    """A checkpoint further into an epoch than this split has samples (another dataset) must not
    loop forever: the epoch ends and training goes on."""
    save = str(tmp_path / "ck")
    _train(dataset, 512, None, save, [], max_steps=1)
    state = TrainState(step=10, epoch=0, sample_in_epoch=50_000, batch_size=512)
    reads = []
    spec = FeatureSpec.from_yaml(os.path.join(dataset, "feature_spec.yaml"))
    model = DLRM(DLRMConfig(num_numerical_features=4, table_sizes=TABLES, embedding_dim=8,
                            bottom_mlp_sizes=[16, 8], top_mlp_sizes=[16, 1]))
    cfg = TrainConfig(schedule=LRSchedule(lr=0.1), epochs=2, log_every_steps=1000)
    summary = train(model, make_optimizer(model, 0.1), Precision("cpu").grad_scaler(), Precision("cpu"),
                    RecordingReader(spec, "train", 4096, reads=reads), None, cfg, CPU,
                    RunLogger(None, stream=io.StringIO()), state=state)
    assert summary["steps"] == 15 and (_coverage(reads, 20_000) == 1).all()


def _main(*args, **kwargs):
    return warm_python.run([sys.executable, "-m", "dlrm.scripts.main", *args], cwd=REPO, capture_output=True,
                          text=True, **kwargs)


def test_cli_repro_resume_with_a_larger_batch_size_finishes(dataset, tmp_path):
    """The reported hang: saved at batch 5 of epoch 1, resumed with 5 batches per epoch (the old
    position in batches left nothing to read of epoch 1, and the loop never advanced)."""
    ck, log = str(tmp_path / "ck"), str(tmp_path / "log.json")
    first = _main("--dataset", dataset, "--batch_size", "512", "--epochs", "2", "--max_steps", "45",
                  "--save_checkpoint_path", ck, "--log_path", log, *SMALL, timeout=120)
    assert first.returncode == 0, first.stderr
    second = _main("--dataset", dataset, "--batch_size", "4096", "--epochs", "20", "--resume",
                   "--save_checkpoint_path", ck, "--log_path", log, *SMALL, timeout=120)
    assert second.returncode == 0, second.stderr
    summaries = [r for r in map(json.loads, open(log)) if r["type"] == "summary"]
    assert [s["steps"] for s in summaries] == [45, 45 + 5 + 18 * 5]
    assert summaries[-1]["epochs"] == 20 and summaries[-1]["stop_reason"] == "completed"


def test_sigterm_saves_and_exits_143(dataset, tmp_path):
    ck, log = str(tmp_path / "ck"), str(tmp_path / "log.json")
    proc = warm_python.Popen(
        [sys.executable, "-m", "dlrm.scripts.main", "--dataset", dataset, "--batch_size", "64", "--epochs", "50",
         "--print_freq", "1", "--save_checkpoint_path", ck, "--log_path", log, *SMALL],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        for line in proc.stdout:
            if line.startswith("Epoch:"):
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "Saved checkpoint" in out
    (summary,) = [r for r in map(json.loads, open(log)) if r["type"] == "summary"]
    assert summary["stop_reason"] == "interrupted"
    model = DLRM(DLRMConfig(num_numerical_features=4, table_sizes=TABLES, embedding_dim=8,
                            bottom_mlp_sizes=[16, 8], top_mlp_sizes=[16, 1]))
    assert load_checkpoint(ck, model).step == summary["steps"] > 0
    assert not os.path.exists(ck + ".lock")
