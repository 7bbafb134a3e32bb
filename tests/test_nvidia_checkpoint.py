"""Checkpoints in NVIDIA's DLRM layout (DeepLearningExamples, PyTorch/Recommendation/DLRM) load
here and are written on request.

The directories these tests load are laid out here, from the layout's definition (NVIDIA's
DlrmCheckpointWriter / DistributedCheckpointWriter), with known random weights; the reference
they are checked against is NVIDIA's model written out in float64 torch: bottom MLP with ReLU
after every layer, the tables in the order its interaction took them (its device mapping's order,
tables by decreasing size on one GPU, unless several GPUs ran with --bottom_features_ordered), the dot interaction
[bottom, strictly-lower triangle row by row, zeros to a multiple of 8], the top MLP with ReLU
after every layer, then the output layer. ``read_nvidia`` below is an independent reader of the
same layout, for what the project writes.
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch


from conftest import REPO, run_cli
import warm_python

TABLES = [30, 300, 4, 100, 7]
NUMERICAL = 3
DIM = 8
BOTTOM = [16, 8]
TOP = [32, 16, 1]
MODEL = ["--embedding_dim", str(DIM), "--bottom_mlp_sizes", ",".join(map(str, BOTTOM)),
         "--top_mlp_sizes", ",".join(map(str, TOP)), "--base_device", "cpu", "--interaction_op", "dot"]
TWO_GPUS = {"bottom_mlp": 0, "embedding": [[3, 0], [1, 4, 2]], "vectors_per_gpu": [3, 3]}
ONE_GPU = {"bottom_mlp": 0, "embedding": [list(range(len(TABLES)))], "vectors_per_gpu": [len(TABLES) + 1]}
# What NVIDIA's get_device_mapping gives for TABLES, worked out by hand from its definition (the
# tables by decreasing size; each to the bucket of fewest rows with room, ceil(5 / GPUs) a bucket).
NVIDIA_ONE_GPU = {"bottom_mlp": 0, "embedding": [[1, 3, 0, 4, 2]], "vectors_per_gpu": [6]}
NVIDIA_TWO_GPUS = {"bottom_mlp": 0, "embedding": [[3, 0, 4], [1, 2]], "vectors_per_gpu": [4, 2]}


# ----------------------------------------------------------------------------- NVIDIA's layout, by definition


def nvidia_weights(seed):
    """Random weights of NVIDIA's model: tables, bottom MLP, top MLP and output layer ([out, in] weights)."""
    g = torch.Generator().manual_seed(seed)
    n = len(TABLES) + 1
    width = DIM + n * (n - 1) // 2
    width += -width % 8

    def layers(fan_in, sizes):
        out = []
        for size in sizes:
            out.append((torch.randn(size, fan_in, generator=g) / fan_in ** 0.5, torch.randn(size, generator=g) * 0.1))
            fan_in = size
        return out

    return {"tables": [torch.rand(rows, DIM, generator=g) * 2 - 1 for rows in TABLES],
            "bottom": layers(NUMERICAL, BOTTOM), "top": layers(width, TOP)}


def write_nvidia(path, weights, mapping, bottom_features_ordered=False, epoch=0, step=17, config=None):
    """A directory as NVIDIA's checkpoint writers lay it out: every rank of ``mapping`` writes its
    tables (raw float32 bytes and a meta file with the torch.Size), rank 0 the MLPs as lists of
    float32 parameters, the output layer's state dict and metadata.pt with the run's flags."""
    os.makedirs(path, exist_ok=True)
    for bucket in mapping["embedding"]:
        for index in bucket:
            weight = weights["tables"][index]
            with open(os.path.join(path, f"bottom_model.embeddings.{index}.bin"), "wb+") as f:
                f.write(weight.numpy().astype(np.float32).tobytes())
            torch.save({"shape": weight.shape}, os.path.join(path, f"embeddings.{index}.meta.pt"))

    def mlp_state(layers):
        return {"weights": [torch.nn.Parameter(w.clone()) for w, _ in layers],
                "biases": [torch.nn.Parameter(b.clone()) for _, b in layers]}

    torch.save(mlp_state(weights["bottom"]), os.path.join(path, "bottom_model.mlp.pt"))
    torch.save(mlp_state(weights["top"][:-1]), os.path.join(path, "top_model.mlp.pt"))
    out = torch.nn.Linear(TOP[-2], TOP[-1])
    with torch.no_grad():
        out.weight.copy_(weights["top"][-1][0])
        out.bias.copy_(weights["top"][-1][1])
    torch.save(out.state_dict(), os.path.join(path, "top_model.out.pt"))
    flags = {"mode": "train", "embedding_type": "joint_sparse", "embedding_dim": DIM, "top_mlp_sizes": TOP,
             "bottom_mlp_sizes": BOTTOM, "interaction_op": "cuda_dot", "hash_indices": False, "max_table_size": None,
             "bottom_features_ordered": bottom_features_ordered, "lr": 24.0, "amp": True,
             "inference_benchmark_batch_sizes": [1, 64, 4096], **(config or {})}
    torch.save({"data": {"device_mapping": mapping, "epoch": epoch, "step": step}, "config": flags},
               os.path.join(path, "metadata.pt"))


def read_nvidia(path):
    """An independent reader of NVIDIA's layout: weights as NVIDIA's model holds them, and the metadata."""
    meta = torch.load(os.path.join(path, "metadata.pt"), weights_only=True)
    tables = {}
    for index in (i for bucket in meta["data"]["device_mapping"]["embedding"] for i in bucket):
        shape = torch.load(os.path.join(path, f"embeddings.{index}.meta.pt"), weights_only=True)["shape"]
        raw = open(os.path.join(path, f"bottom_model.embeddings.{index}.bin"), "rb").read()
        tables[index] = torch.from_numpy(np.frombuffer(raw, dtype=np.float32).reshape(*shape).copy())
    bottom = torch.load(os.path.join(path, "bottom_model.mlp.pt"), weights_only=True)
    top = torch.load(os.path.join(path, "top_model.mlp.pt"), weights_only=True)
    out = torch.load(os.path.join(path, "top_model.out.pt"), weights_only=True)
    return {"tables": [tables[i] for i in range(len(tables))],
            "bottom": list(zip(bottom["weights"], bottom["biases"])),
            "top": list(zip(top["weights"], top["biases"])) + [(out["weight"], out["bias"])]}, meta


def interaction_order(mapping, bottom_features_ordered):
    """NVIDIA's model puts its tables in feature order only on several GPUs with --bottom_features_ordered."""
    if len(mapping["embedding"]) > 1 and bottom_features_ordered:
        return list(range(len(TABLES)))
    return [i for bucket in mapping["embedding"] for i in bucket]


def written_logits(path, numerical, categorical):
    """NVIDIA's forward (float64) over what a checkpoint directory holds, in the order its metadata implies."""
    weights, meta = read_nvidia(path)
    order = interaction_order(meta["data"]["device_mapping"], meta["config"].get("bottom_features_ordered", False))
    return reference_logits(weights, order, numerical, categorical)


def reference_logits(weights, order, numerical, categorical):
    """NVIDIA's forward in float64."""
    x = numerical.double()
    for w, b in weights["bottom"]:
        x = torch.relu(x @ w.double().T + b.double())
    features = torch.stack([x] + [weights["tables"][t].double()[categorical[:, t]] for t in order], dim=1)
    n = features.shape[1]
    gram = features @ features.transpose(1, 2)
    rows = [i for i in range(n) for _ in range(i)]
    cols = [j for i in range(n) for j in range(i)]
    y = torch.cat([x, gram[:, rows, cols]], dim=1)
    y = torch.cat([y, torch.zeros(len(y), -y.shape[1] % 8, dtype=y.dtype)], dim=1)
    for i, (w, b) in enumerate(weights["top"]):
        y = y @ w.double().T + b.double()
        if i < len(weights["top"]) - 1:
            y = torch.relu(y)
    return y[:, 0]


def auc_and_loss(logits, labels):
    """Mann-Whitney AUC (ties half) and mean binary cross-entropy."""
    logits, labels = logits.numpy(), labels.numpy().astype(bool)
    pos, neg = logits[labels], logits[~labels]
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    auc = greater / (len(pos) * len(neg))
    loss = np.mean(np.logaddexp(0, logits) - labels * logits)
    return float(auc), float(loss)


def read_split(dataset, split="test"):
    """A split's inputs, read through the project's reader (not what is under test here)."""
    from dlrm.data.sources import DataConfig, load_feature_spec, make_source

    data = DataConfig(dataset_type="split_binary", dataset=dataset)
    source = make_source(data, load_feature_spec(data), split, 10_000, torch.device("cpu"))
    batches = [source.read_batch(i) for i in range(len(source))]
    return (torch.cat([b.numerical.float() for b in batches]), torch.cat([b.categorical.long() for b in batches]),
            torch.cat([b.label.float() for b in batches]))


def summary(log_path):
    return [r for r in map(json.loads, open(log_path)) if r["type"] == "summary"][-1]


def natural(weights, order):
    """NVIDIA's weights as the project's model holds them: the top MLP's first layer's inputs in table order."""
    n = len(TABLES) + 1
    position = [0] + [1 + order.index(t) for t in range(len(TABLES))]
    columns = list(range(DIM))
    for a in range(1, n):
        for b in range(a):
            p, q = max(position[a], position[b]), min(position[a], position[b])
            columns.append(DIM + p * (p - 1) // 2 + q)
    first_w, first_b = weights["top"][0]
    columns += range(len(columns), first_w.shape[1])
    return {**weights, "top": [(first_w[:, columns], first_b), *weights["top"][1:]]}


def assert_same_weights(got, want, exact=True):
    pairs = [(f"table {i}", g, w) for i, (g, w) in enumerate(zip(got["tables"], want["tables"]))]
    for part in ("bottom", "top"):
        assert len(got[part]) == len(want[part])
        for i, ((gw, gb), (ww, wb)) in enumerate(zip(got[part], want[part])):
            pairs += [(f"{part} {i} weight", gw, ww), (f"{part} {i} bias", gb, wb)]
    for name, g, w in pairs:
        assert g.shape == w.shape, name
        if exact:
            assert torch.equal(g.float(), w.float()), name
        else:
            torch.testing.assert_close(g.float(), w.float(), rtol=1e-4, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def dataset(synthetic_dataset):
    return synthetic_dataset(NUMERICAL, TABLES, {"train": 1200, "test": 800}, batch_size=400, seed=5)


@pytest.fixture(scope="module")
def weights():
    return nvidia_weights(seed=3)


@pytest.fixture(scope="module")
def two_gpu_checkpoint(tmp_path_factory, weights):
    path = str(tmp_path_factory.mktemp("nv") / "two_gpus")
    write_nvidia(path, weights, TWO_GPUS, bottom_features_ordered=False)
    return path


# ----------------------------------------------------------------------------- loading


@pytest.mark.parametrize("mapping,ordered", [(NVIDIA_ONE_GPU, False), (ONE_GPU, True), (TWO_GPUS, False),
                                             (TWO_GPUS, True)],
                         ids=["one_gpu", "one_gpu_tables_in_order", "two_gpus_device_order",
                              "two_gpus_bottom_features_ordered"])
def test_mode_test_gives_nvidia_models_auc_and_loss(dataset, weights, tmp_path, mapping, ordered):
    path, log = str(tmp_path / "nv"), str(tmp_path / "log.json")
    write_nvidia(path, weights, mapping, bottom_features_ordered=ordered)
    before = {name: open(os.path.join(path, name), "rb").read() for name in os.listdir(path)}
    out = run_cli("dlrm.scripts.main", "--mode", "test", "--dataset", dataset, "--load_checkpoint_path", path,
                  *MODEL, "--test_batch_size", "300", "--log_path", log).stdout
    numerical, categorical, labels = read_split(dataset)
    want_auc, want_loss = auc_and_loss(reference_logits(weights, interaction_order(mapping, ordered), numerical,
                                                        categorical), labels)
    got = summary(log)
    assert got["samples"] == len(labels), out
    assert got["auc"] == pytest.approx(want_auc, abs=1e-6)
    assert got["loss"] == pytest.approx(want_loss, rel=1e-5)
    # had the device order been ignored, the model would be another one
    if interaction_order(mapping, ordered) != list(range(len(TABLES))):
        wrong, _ = auc_and_loss(reference_logits(weights, list(range(len(TABLES))), numerical, categorical), labels)
        assert abs(wrong - want_auc) > 1e-5  # well outside the tolerance above
    assert {name: open(os.path.join(path, name), "rb").read() for name in os.listdir(path)} == before


def test_export_builds_the_model_from_the_checkpoint_alone(dataset, weights, two_gpu_checkpoint):
    """dlrm.scripts.export / deploy build their model with build_inference_model."""
    from dlrm.inference.export import build_inference_model

    model = build_inference_model(two_gpu_checkpoint)
    assert model.config.table_sizes == TABLES and model.config.top_mlp_sizes == TOP
    numerical, categorical, _ = read_split(dataset)
    with torch.no_grad():
        got = model(numerical, categorical).double()
    want = reference_logits(weights, TWO_GPUS["embedding"][0] + TWO_GPUS["embedding"][1], numerical, categorical)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_train_starts_from_its_weights_and_writes_nvidia_layout(dataset, weights, two_gpu_checkpoint, tmp_path):
    """A train run from NVIDIA's checkpoint: its first loss is the NVIDIA model's on the first
    batch; written in NVIDIA's layout (over an earlier one, with --overwrite), an independent
    reader finds the tensors this program's checkpoint of the same run holds, and --mode test of
    what was written gives the run's own last test."""
    order = TWO_GPUS["embedding"][0] + TWO_GPUS["embedding"][1]
    train = ["--dataset", dataset, *MODEL, "--batch_size", "400", "--test_batch_size", "800",
             "--load_checkpoint_path", two_gpu_checkpoint, "--print_freq", "1", "--warmup_steps", "0",
             "--decay_start_step", "0", "--decay_steps", "0", "--lr", "0.5", "--max_steps", "3"]
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    ours_log, theirs_log = str(tmp_path / "ours.json"), str(tmp_path / "theirs.json")
    write_nvidia(theirs, nvidia_weights(seed=99), ONE_GPU)  # an earlier NVIDIA-layout checkpoint, replaced
    proc = run_cli("dlrm.scripts.main", *train, "--save_checkpoint_path", ours, "--log_path", ours_log)
    assert f"Weights from {two_gpu_checkpoint}; training starts at step 0" in proc.stdout
    run_cli("dlrm.scripts.main", *train, "--save_checkpoint_path", theirs, "--checkpoint_format", "nvidia",
            "--overwrite", "--log_path", theirs_log)

    numerical, categorical, labels = read_split(dataset, "train")
    _, first_loss = auc_and_loss(reference_logits(weights, order, numerical[:400], categorical[:400]), labels[:400])
    for log in (ours_log, theirs_log):
        first = [r for r in map(json.loads, open(log)) if r["type"] == "train"][0]
        assert first["step"] == 1 and first["loss"] == pytest.approx(first_loss, rel=1e-5)

    dense = torch.load(os.path.join(ours, "dense.pt"), weights_only=True)
    project = {"tables": [torch.load(os.path.join(ours, f"table_{i}.pt"), weights_only=True)
                          for i in range(len(TABLES))],
               "bottom": [(dense[f"bottom_mlp.layers.{i}.weight"], dense[f"bottom_mlp.layers.{i}.bias"])
                          for i in range(len(BOTTOM))],
               "top": [(dense[f"top_mlp.layers.{i}.weight"], dense[f"top_mlp.layers.{i}.bias"])
                       for i in range(len(TOP))]}
    written, meta = read_nvidia(theirs)
    # Written for NVIDIA's one-GPU load: its device mapping, the top MLP's first layer in that order.
    assert meta["data"]["device_mapping"] == NVIDIA_ONE_GPU and meta["config"]["bottom_features_ordered"] is False
    assert_same_weights(natural(written, NVIDIA_ONE_GPU["embedding"][0]), project)
    numerical, categorical, _ = read_split(dataset)
    from dlrm.inference.export import build_inference_model

    with torch.no_grad():
        ours_logits = build_inference_model(ours)(numerical, categorical).double()
    torch.testing.assert_close(written_logits(theirs, numerical, categorical), ours_logits, rtol=1e-5, atol=1e-5)
    assert not torch.equal(written["tables"][1], weights["tables"][1])  # it did train
    assert meta["data"]["step"] == 3
    assert meta["config"]["top_mlp_sizes"] == TOP and meta["config"]["embedding_dim"] == DIM
    assert sorted(os.listdir(theirs)) == sorted(
        ["metadata.pt", "bottom_model.mlp.pt", "top_model.mlp.pt", "top_model.out.pt", "dlrm_checksums.json"]
        + [f"bottom_model.embeddings.{i}.bin" for i in range(len(TABLES))]
        + [f"embeddings.{i}.meta.pt" for i in range(len(TABLES))])

    last = [r for r in map(json.loads, open(theirs_log)) if r["type"] == "eval"][-1]
    test_log = str(tmp_path / "test.json")
    run_cli("dlrm.scripts.main", "--mode", "test", "--dataset", dataset, "--load_checkpoint_path", theirs, *MODEL,
            "--test_batch_size", "800", "--log_path", test_log)
    assert last["step"] == 3
    assert summary(test_log)["auc"] == last["auc"] and summary(test_log)["loss"] == pytest.approx(last["loss"],
                                                                                                  rel=1e-6)


def test_convert_checkpoint_goes_both_ways_with_the_same_model(dataset, weights, two_gpu_checkpoint, tmp_path):
    """NVIDIA's (device order) -> this program's -> NVIDIA's: every copy computes NVIDIA's model
    (float64 reference) and the last one holds NVIDIA's tables, in feature order; the source is
    left as it was, and --output is never a folder of the user's."""
    from dlrm.inference.export import build_inference_model

    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    before = {name: open(os.path.join(two_gpu_checkpoint, name), "rb").read()
              for name in os.listdir(two_gpu_checkpoint)}
    out = run_cli("dlrm.scripts.convert_checkpoint", "--checkpoint", two_gpu_checkpoint, "--output", ours,
                  "--to", "dlrm").stdout
    assert f"wrote {ours}" in out
    run_cli("dlrm.scripts.convert_checkpoint", "--checkpoint", ours, "--output", back, "--to", "nvidia")
    numerical, categorical, _ = read_split(dataset)
    want = reference_logits(weights, TWO_GPUS["embedding"][0] + TWO_GPUS["embedding"][1], numerical, categorical)
    for path in (ours, back):
        with torch.no_grad():
            got = build_inference_model(path)(numerical, categorical).double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    written, meta = read_nvidia(back)
    for got, table in zip(written["tables"], weights["tables"]):
        assert torch.equal(got, table)
    assert meta["data"]["device_mapping"] == NVIDIA_ONE_GPU and meta["config"]["bottom_features_ordered"] is False
    assert meta["data"]["step"] == 17
    torch.testing.assert_close(written_logits(back, numerical, categorical), want, rtol=1e-5, atol=1e-5)
    # For NVIDIA's run on two GPUs: its two-GPU device mapping, and the same model in that order.
    two = str(tmp_path / "two")
    run_cli("dlrm.scripts.convert_checkpoint", "--checkpoint", ours, "--output", two, "--to", "nvidia",
            "--nvidia_gpus", "2")
    assert read_nvidia(two)[1]["data"]["device_mapping"] == NVIDIA_TWO_GPUS
    torch.testing.assert_close(written_logits(two, numerical, categorical), want, rtol=1e-5, atol=1e-5)
    assert {name: open(os.path.join(two_gpu_checkpoint, name), "rb").read()
            for name in os.listdir(two_gpu_checkpoint)} == before

    # A second conversion into the same place needs --overwrite; a user's folder is never written into.
    again = run_cli("dlrm.scripts.convert_checkpoint", "--checkpoint", ours, "--output", back, "--to", "nvidia",
                    check=False)
    assert again.returncode == 2 and "--overwrite" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    run_cli("dlrm.scripts.convert_checkpoint", "--checkpoint", ours, "--output", back, "--to", "nvidia",
            "--overwrite")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    for to in ("nvidia", "dlrm"):
        proc = run_cli("dlrm.scripts.convert_checkpoint", "--checkpoint", ours, "--output", str(mine), "--to", to,
                       "--overwrite", check=False)
        assert proc.returncode == 2 and "--output" in proc.stderr, proc.stderr
        assert sorted(os.listdir(mine)) == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep"


def test_inference_benchmark_runs_on_nvidias_checkpoint(dataset, two_gpu_checkpoint, tmp_path):
    log = str(tmp_path / "bench.json")
    run_cli("dlrm.scripts.main", "--mode", "inference_benchmark", "--dataset", dataset, "--load_checkpoint_path",
            two_gpu_checkpoint, *MODEL, "--inference_benchmark_batch_sizes", "1,64", "--inference_benchmark_steps",
            "3", "--log_path", log)
    rows = [r for r in map(json.loads, open(log)) if r["type"] == "inference_benchmark"]
    assert sorted(r["batch_size"] for r in rows) == [1, 64]


# ----------------------------------------------------------------------------- what does not fit


def _model(**changes):
    from dlrm.model.dlrm import DLRM, DLRMConfig

    settings = dict(num_numerical_features=NUMERICAL, table_sizes=list(TABLES), embedding_dim=DIM,
                    bottom_mlp_sizes=list(BOTTOM), top_mlp_sizes=list(TOP), interaction_op="dot")
    settings.update(changes)
    return DLRM(DLRMConfig(**settings), device="cpu")


@pytest.mark.parametrize("changes,expected", [
    (dict(embedding_dim=4, bottom_mlp_sizes=[16, 4]), "embedding table 0 (bottom_model.embeddings.0.bin) has shape "
                                                      "[30, 8] in the checkpoint, [30, 4] in this run: set "
                                                      "`embedding_dim=8`"),
    (dict(table_sizes=[30, 300, 4, 100, 9]), "embedding table 4 (bottom_model.embeddings.4.bin) has shape [7, 8] in "
                                             "the checkpoint, [9, 8] in this run"),
    (dict(table_sizes=[30, 300, 4, 100]), "holds 5 embedding tables, this run's feature spec has 4"),
    (dict(top_mlp_sizes=[64, 1]), "the top MLP has layers 32,16,1 in the checkpoint, 64,1 in this run: set "
                                  "`top_mlp_sizes=32,16,1`"),
    (dict(bottom_mlp_sizes=[32, 8]), "the bottom MLP has layers 16,8 in the checkpoint, 32,8 in this run: set "
                                     "`bottom_mlp_sizes=16,8`"),
    (dict(num_numerical_features=4), "the bottom MLP takes 3 numerical features, this run's feature spec has 4"),
    (dict(interaction_op="cat"), "the top MLP takes 24 inputs (dot interaction) in the checkpoint, 48 in this run "
                                 "(cat): set `interaction_op=dot`"),
    (dict(hash_indices=True), "was trained without `hash_indices` and this run is with it"),
])
def test_mismatch_is_one_line_naming_the_setting(two_gpu_checkpoint, changes, expected):
    from dlrm.training.checkpoint import CheckpointError, load_checkpoint

    model = _model(**changes)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(two_gpu_checkpoint, model)
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # left untouched


def test_mismatch_on_the_command_line_exits_2_with_the_flag(dataset, two_gpu_checkpoint):
    proc = run_cli("dlrm.scripts.main", "--mode", "test", "--dataset", dataset, "--load_checkpoint_path",
                   two_gpu_checkpoint, *MODEL[:2], "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "64,1",
                   "--base_device", "cpu", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "--top_mlp_sizes 64,1 contradicts the checkpoint" in lines[-1], proc.stderr
    assert "saved with 32,16,1" in lines[-1]
    resume = run_cli("dlrm.scripts.main", "--dataset", dataset, "--load_checkpoint_path", two_gpu_checkpoint,
                     *MODEL, "--resume", check=False)
    assert resume.returncode == 2
    assert "holds weights only (no optimizer state): drop --resume" in resume.stderr.strip().splitlines()[-1]


def test_unsupported_layouts_are_one_line_naming_what_was_found(weights, tmp_path):
    from dlrm.training.checkpoint import CheckpointError, load_checkpoint

    def refused(path):
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(str(path), _model())
        assert "\n" not in str(e.value)
        return str(e.value)

    stray = tmp_path / "stray"
    write_nvidia(str(stray), weights, ONE_GPU)
    (stray / "model.pt").write_bytes(b"x")
    assert "holds model.pt, which NVIDIA's checkpoint writer does not write" in refused(stray)

    extra = tmp_path / "extra_table"
    write_nvidia(str(extra), weights, ONE_GPU)
    shutil.copy(extra / "bottom_model.embeddings.0.bin", extra / "bottom_model.embeddings.5.bin")
    assert "holds bottom_model.embeddings.5.bin" in refused(extra)

    missing = tmp_path / "missing"
    write_nvidia(str(missing), weights, TWO_GPUS)
    os.remove(missing / "bottom_model.embeddings.4.bin")
    assert "bottom_model.embeddings.4.bin is missing" in refused(missing)

    short = tmp_path / "short"
    write_nvidia(str(short), weights, ONE_GPU)
    with open(short / "bottom_model.embeddings.2.bin", "r+b") as f:
        f.truncate(12)
    assert "bottom_model.embeddings.2.bin: 12 bytes, its [4, 8] float32 values take 128" in refused(short)

    gap = tmp_path / "gap"
    write_nvidia(str(gap), weights, {"bottom_mlp": 0, "embedding": [[0, 1], [3, 4]], "vectors_per_gpu": [3, 2]})
    assert "lists tables [0, 1, 3, 4], not each of 0..3 once" in refused(gap)

    foreign = tmp_path / "foreign"
    write_nvidia(str(foreign), weights, ONE_GPU, config={"args": argparse.Namespace(lr=1.0)})
    assert "holds objects other than tensors and plain containers (argparse.Namespace)" in refused(foreign)


def test_nvidia_layout_is_an_output_kind(weights, tmp_path):
    """Recognised by its content: replaced only with `overwrite`; a folder holding anything else never."""
    from dlrm.engine.outputs import OutputError
    from dlrm.training import nvidia_checkpoint

    path = tmp_path / "nv"
    write_nvidia(str(path), weights, TWO_GPUS)
    with pytest.raises(OutputError, match="pass `overwrite` to replace it"):
        nvidia_checkpoint.claim(str(path))
    nvidia_checkpoint.claim(str(path), replace=True)
    (path / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="is never replaced"):
        nvidia_checkpoint.claim(str(path), replace=True)


def test_writing_refuses_what_nvidia_has_no_model_for(dataset, tmp_path):
    proc = run_cli("dlrm.scripts.main", "--dataset", dataset, "--embedding_dim", "8", "--bottom_mlp_sizes", "16,8",
                   "--top_mlp_sizes", "1", "--base_device", "cpu", "--save_checkpoint_path", str(tmp_path / "nv"),
                   "--checkpoint_format", "nvidia", check=False)
    assert proc.returncode == 2
    assert "--checkpoint_format=nvidia: NVIDIA's top model is an MLP and an output layer" \
        in proc.stderr.strip().splitlines()[-1]
    assert not os.path.exists(tmp_path / "nv")


# ----------------------------------------------------------------------------- several processes


def torchrun(nproc, *args):
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "dlrm.scripts.main", *args]
    proc = warm_python.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_two_gloo_processes_read_their_tables_and_write_theirs(dataset, weights, two_gpu_checkpoint, tmp_path):
    """Each process reads the tables (and a row-wise block of table 1) this program's planner
    gives it, whatever NVIDIA's device mapping was; each writes what it holds into NVIDIA's files."""
    order = TWO_GPUS["embedding"][0] + TWO_GPUS["embedding"][1]
    out, log = str(tmp_path / "out"), str(tmp_path / "log.json")
    placement = json.dumps({"0": [0, 2], "1": [3, 4], "row_wise": [1]})
    out_text = torchrun(2, "--dataset", dataset, *MODEL, "--batch_size", "400", "--test_batch_size", "800",
             "--load_checkpoint_path", two_gpu_checkpoint, "--lr", "0", "--max_steps", "1", "--warmup_steps", "0",
             "--decay_start_step", "0", "--decay_steps", "0", "--table_placement", placement,
             "--save_checkpoint_path", out, "--checkpoint_format", "nvidia", "--log_path", log)
    assert "1 split row-wise" in out_text
    numerical, categorical, labels = read_split(dataset)
    want_auc, _ = auc_and_loss(reference_logits(weights, order, numerical, categorical), labels)
    assert summary(log)["best_auc"] == pytest.approx(want_auc, abs=1e-6)
    written, meta = read_nvidia(out)
    assert meta["data"]["device_mapping"] == NVIDIA_ONE_GPU  # for NVIDIA's load, whatever wrote it
    assert_same_weights(natural(written, NVIDIA_ONE_GPU["embedding"][0]), natural(weights, order))
