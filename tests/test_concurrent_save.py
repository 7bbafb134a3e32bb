"""A reader never sees a mix of two saves: a real process saves the same checkpoint path 50 times
while this one loads it in a loop. Every load must succeed (no false "damaged") and hold one
save's weights and step, with and without checksum verification."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.training.checkpoint import TrainState, load_checkpoint, save_checkpoint
import warm_python

CONFIG = dict(num_numerical_features=3, table_sizes=[4000, 3000, 2], embedding_dim=16,
              bottom_mlp_sizes=[32, 16], top_mlp_sizes=[32, 1])

SAVER = textwrap.dedent(f"""
    import sys, time, torch
    from dlrm.model.dlrm import DLRM, DLRMConfig
    from dlrm.training.checkpoint import TrainState, save_checkpoint
    model = DLRM(DLRMConfig(**{CONFIG!r}))
    for i in range(1, 51):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(i)
        save_checkpoint(sys.argv[1], model, None, None, TrainState(step=i))
        time.sleep(0.05 * (i % 3))  # saves back to back and with pauses, as a trainer's come
""")


@pytest.mark.parametrize("verify", [True, False])
def test_loads_during_50_saves_each_come_from_one_save(tmp_path, verify):
    path = str(tmp_path / "ckpt")
    model = DLRM(DLRMConfig(**CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    save_checkpoint(path, model, None, None, TrainState(step=0))  # a first one to read from the start
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    saver = warm_python.Popen([sys.executable, "-c", SAVER, path], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    loads, steps = 0, set()
    try:
        while saver.poll() is None or loads == 0:
            state = load_checkpoint(path, model, verify=verify)
            values = torch.cat([p.detach().flatten() for p in model.parameters()])
            assert values.min() == values.max() == state.step, f"load {loads}: a mix of saves"
            loads, steps = loads + 1, steps | {state.step}
    finally:
        out = saver.communicate(timeout=120)[0]
    assert saver.returncode == 0, out
    assert loads >= 5 and len(steps) >= 3, (loads, steps)  # the reader really ran across many saves
    assert load_checkpoint(path, model, verify=verify).step == 50


def test_the_recommender_loads_one_save_while_a_real_run_saves_every_step(tmp_path):
    """recommender_train saving after each of 50 steps; this process loads the checkpoint
    meanwhile: every load succeeds and equals the checkpoint files of the step it reports."""
    import json

    from conftest import run_cli
    from dlrm.recommender import checkpoint
    from dlrm.recommender.item_parallel import ItemParallel

    run_cli("dlrm.scripts.recommender_generate", "--synthetic", "--users", "64", "--items", "300",
            "--interactions", "3000", "--output", str(tmp_path / "data"))
    network = tmp_path / "network.json"
    network.write_text(json.dumps({"Kind": "FeedForward", "Layers": [
        {"Name": "Input", "Kind": "Input", "N": "auto", "DataSet": "input", "Sparse": True},
        {"Name": "Hidden", "Kind": "Hidden", "Type": "FullyConnected", "N": 64, "Activation": "Sigmoid",
         "Source": "Input"},
        {"Name": "Output", "Kind": "Output", "Type": "FullyConnected", "N": "auto", "DataSet": "output",
         "Activation": "Sigmoid", "Sparse": True, "Source": "Hidden"}]}))
    path = str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    trainer = warm_python.Popen(
        [sys.executable, "-m", "dlrm.scripts.recommender_train", "--network", str(network), "--input",
         str(tmp_path / "data" / "all"), "--save_checkpoint_path", path, "--batch_size", "8", "--epochs", "7",
         "--max_steps", "50", "--checkpoint_every_steps", "1", "--validation_users", "0", "--base_device", "cpu"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    loads, steps = 0, set()
    try:
        while trainer.poll() is None:
            if checkpoint.latest_checkpoint(path) is None:
                continue
            model = checkpoint.load_model(path, ItemParallel.from_process_group())
            state = checkpoint.load(path, model)
            loads, steps = loads + 1, steps | {state.step}
    finally:
        out = trainer.communicate(timeout=300)[0]
    assert trainer.returncode == 0, out
    assert "Finished (max_steps) after 50 steps" in out, out
    assert loads >= 3 and len(steps) >= 2, (loads, steps)
