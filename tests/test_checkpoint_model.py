"""A checkpoint alone describes its model: ``--mode test``, ``--mode inference_benchmark`` and
export run with no model flag on checkpoints of every interaction (dot, cat, dcn), embedding
storage (joint, multi_table, joint_fused) and table dtype (fp32, fp16, bf16), capped tables
(``--max_table_size`` with ``--hash_indices``), NVIDIA's layout and the committed checkpoint of an
earlier version; a model flag that contradicts the checkpoint is one line naming both values, exit 2.

The references: the AUC the training run logged for the same checkpoint and test split, and for
the committed fixture a forward pass computed here with sklearn's AUC.
"""

import os
import shutil

import pytest
import torch
from sklearn.metrics import roc_auc_score

from conftest import REPO, log_records, run_entry_points
from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.training.checkpoint import load_checkpoint, read_meta

TABLES = [20, 50, 7]
MODEL = ["--embedding_dim", "8", "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "8,1"]
FAST = ["--base_device", "cpu", "--batch_size", "256", "--test_batch_size", "512", "--lr", "0.5", "--warmup_steps",
        "0", "--decay_start_step", "0", "--decay_steps", "0", "--optimizer", "sgd", "--dense_optimizer", "sgd"]
KINDS = {  # each a checkpoint trained with these flags besides MODEL
    "dot": ["--interaction_op", "dot", "--embedding_type", "joint", "--hash_indices", "--max_table_size", "30"],
    "cat": ["--interaction_op", "cat", "--embedding_type", "multi_table", "--embedding_dtype", "fp16"],
    "dcn": ["--interaction_op", "dcn", "--dcn_num_layers", "2", "--dcn_low_rank_dim", "4", "--embedding_type",
            "joint_fused", "--embedding_dtype", "bf16"],
}
FIXTURE = os.path.join(REPO, "tests", "fixtures", "checkpoints", "dlrm_row_wise_2_processes")
PRELOAD = ("dlrm.scripts.dlrm_flags", "dlrm.training.build", "dlrm.training.train")


def _main(cases: list[list[str]], workdir) -> list[dict]:
    return run_entry_points("dlrm.scripts.main", cases, workdir, preload=PRELOAD)


def _ok(result: dict) -> dict:
    assert result["returncode"] == 0, result["stderr"][-3000:]
    return result


def _one_line_error(result: dict) -> str:
    """The one line a refused command prints (exit 2)."""
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert result["returncode"] == 2 and len(lines) == 1, result["stderr"][-3000:]
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.fixture(scope="module")
def trained(synthetic_dataset, tmp_path_factory):
    """The checkpoints of KINDS, trained through the command line; their final eval AUCs."""
    data = synthetic_dataset(3, TABLES, {"train": 2048, "test": 1024}, batch_size=512, seed=3)
    root = tmp_path_factory.mktemp("checkpoints")
    cases = [["--dataset", data, *MODEL, *FAST, *flags, "--save_checkpoint_path", str(root / kind),
              "--log_path", str(root / f"{kind}.json")] for kind, flags in KINDS.items()]
    for result in _main(cases, root):
        _ok(result)
    aucs = {kind: log_records(str(root / f"{kind}.json"), "eval")[-1]["auc"] for kind in KINDS}
    return data, root, aucs


def test_test_and_benchmark_need_no_model_flag(trained, tmp_path):
    data, root, aucs = trained
    base = ["--base_device", "cpu", "--dataset", data]
    cases = [[*base, "--mode", "test", "--load_checkpoint_path", str(root / kind), "--test_batch_size", "333",
              "--log_path", str(tmp_path / f"test_{kind}.json")] for kind in KINDS]
    cases += [[*base, "--mode", "inference_benchmark", "--load_checkpoint_path", str(root / kind),
               "--inference_benchmark_batch_sizes", "1,64", "--inference_benchmark_steps", "3",
               "--log_path", str(tmp_path / f"bench_{kind}.json")] for kind in KINDS]
    for result in _main(cases, tmp_path):
        _ok(result)
    for kind in KINDS:
        (summary,) = log_records(str(tmp_path / f"test_{kind}.json"), "summary")
        assert summary["samples"] == 1024
        assert summary["auc"] == pytest.approx(aucs[kind], abs=1e-6), kind
        rows = log_records(str(tmp_path / f"bench_{kind}.json"), "inference_benchmark")
        assert [r["batch_size"] for r in rows] == [1, 64], kind


def test_a_contradicting_model_flag_or_unfit_data_is_one_line_naming_both(trained, synthetic_dataset, tmp_path):
    data, root, _ = trained
    base = ["--base_device", "cpu", "--dataset", data, "--mode", "test"]
    refused = {  # flags -> checkpoint, what the message must name
        ("--embedding_dim", "64"): ("dot", ["--embedding_dim 64", "saved with 8"]),
        ("--top_mlp_sizes", "4,1"): ("cat", ["--top_mlp_sizes 4,1", "saved with 8,1"]),
        ("--interaction_op", "cat"): ("dot", ["--interaction_op cat", "saved with dot"]),
        ("--embedding_dtype", "fp16"): ("dcn", ["--embedding_dtype fp16", "saved with bf16"]),
        ("--dcn_low_rank_dim", "8"): ("dcn", ["--dcn_low_rank_dim 8", "saved with 4"]),
        ("--max_table_size", "40", "--hash_indices"): ("dot", ["--max_table_size 40", "saved with 30"]),
        ("--hash_indices",): ("cat", ["--hash_indices", "trained without it"]),
    }
    cases = [[*base, "--load_checkpoint_path", str(root / kind), *flags] for flags, (kind, _) in refused.items()]
    cases.append([*base[:-1], "inference_benchmark", "--load_checkpoint_path", str(root / "cat"), "--embedding_dim",
                  "16"])
    other = synthetic_dataset(3, [7, 3], {"train": 512, "test": 2000}, batch_size=500, seed=11)
    wider = synthetic_dataset(3, [20, 60, 7], {"test": 512}, batch_size=512, seed=4)
    unfit = [["--dataset", other], ["--dataset", wider], ["--synthetic_dataset_table_sizes", "20,50"]]
    cases += [["--mode", "test", "--base_device", "cpu", "--load_checkpoint_path", str(root / "cat"), *flags]
              for flags in unfit]
    results = _main(cases, tmp_path)
    expected = [*refused.values(), ("cat", ["--embedding_dim 16", "saved with 8"]),
                ("cat", ["holds 3 embedding tables", "2 categorical features", "--dataset"]),
                ("cat", ["table 1 has 50 rows", "60"]), ("cat", ["--synthetic_dataset_table_sizes"])]
    for result, (kind, names) in zip(results, expected, strict=True):
        line = _one_line_error(result)
        assert str(root / kind) in line and all(name in line for name in names), line


def test_the_committed_checkpoint_of_an_earlier_version_needs_no_model_flag(synthetic_dataset, tmp_path):
    """Its meta.json records no run settings; its tables fit a dataset of 3 numerical features
    and cardinalities [7, 3], and synthetic data takes that shape by itself."""
    data = synthetic_dataset(3, [7, 3], {"train": 512, "test": 2000}, batch_size=500, seed=11)
    cases = [["--mode", "test", "--base_device", "cpu", "--dataset", data, "--load_checkpoint_path", FIXTURE,
              "--test_batch_size", "700", "--log_path", str(tmp_path / "data.json")],
             ["--mode", "test", "--base_device", "cpu", "--load_checkpoint_path", FIXTURE, "--test_batch_size", "512",
              "--synthetic_dataset_num_test_entries", "1024", "--log_path", str(tmp_path / "synthetic.json")],
             ["--mode", "test", "--base_device", "cpu", "--load_checkpoint_path", FIXTURE, "--test_batch_size", "512",
              "--synthetic_dataset_num_test_entries", "1024", "--log_path", str(tmp_path / "flags.json"),
              "--embedding_dim", "4", "--bottom_mlp_sizes", "8,4", "--top_mlp_sizes", "8,1",
              "--synthetic_dataset_table_sizes", "7,3", "--synthetic_dataset_numerical_features", "3"]]
    for result in _main(cases, tmp_path):
        _ok(result)
    model = DLRM(DLRMConfig(**read_meta(FIXTURE)["model_config"]))
    load_checkpoint(FIXTURE, model)
    spec = FeatureSpec.from_yaml(os.path.join(data, "feature_spec.yaml"))
    batch = SplitBinaryReader(spec, "test", 2000).read_batch(0)
    with torch.no_grad():
        scores = model(batch.numerical, batch.categorical).numpy()
    (summary,) = log_records(str(tmp_path / "data.json"), "summary")
    assert summary["auc"] == pytest.approx(roc_auc_score(batch.label.numpy(), scores), abs=1e-6)
    (synthetic,) = log_records(str(tmp_path / "synthetic.json"), "summary")
    (flagged,) = log_records(str(tmp_path / "flags.json"), "summary")
    assert synthetic["samples"] == flagged["samples"] == 1024 and synthetic["auc"] == flagged["auc"]


def test_nvidia_layout_needs_no_model_flag_and_names_the_flag_its_metadata_lacks(trained, tmp_path):
    """The capped dot checkpoint converted to NVIDIA's layout tests as the original; with
    hash_indices taken out of its metadata (as a run of NVIDIA's may write it) the run says to
    pass --hash_indices, and with it tests as the original."""
    data, root, aucs = trained
    nvidia, bare = str(tmp_path / "nvidia"), str(tmp_path / "bare")
    _ok(run_entry_points("dlrm.scripts.convert_checkpoint", [["--checkpoint", str(root / "dot"), "--output", nvidia,
                                                              "--to", "nvidia"]], tmp_path)[0])
    shutil.copytree(nvidia, bare)
    os.remove(os.path.join(bare, "dlrm_checksums.json"))  # NVIDIA's writer writes none
    meta = torch.load(os.path.join(bare, "metadata.pt"), weights_only=True)
    del meta["config"]["hash_indices"]
    torch.save(meta, os.path.join(bare, "metadata.pt"))
    base = ["--mode", "test", "--base_device", "cpu", "--dataset", data, "--test_batch_size", "512"]
    results = _main([[*base, "--load_checkpoint_path", nvidia, "--log_path", str(tmp_path / "nvidia.json")],
                     [*base, "--load_checkpoint_path", bare],
                     [*base, "--load_checkpoint_path", bare, "--hash_indices", "--log_path",
                      str(tmp_path / "bare.json")],
                     [*base, "--load_checkpoint_path", nvidia, "--embedding_dim", "16"]], tmp_path)
    _ok(results[0])
    assert "--hash_indices" in _one_line_error(results[1])
    _ok(results[2])
    assert "--embedding_dim 16" in _one_line_error(results[3])
    for log in ("nvidia.json", "bare.json"):
        assert log_records(str(tmp_path / log), "summary")[0]["auc"] == pytest.approx(aucs["dot"], abs=1e-6)


def test_export_needs_no_model_flag(trained, tmp_path):
    _, root, _ = trained
    out = str(tmp_path / "export")
    result = _ok(run_entry_points("dlrm.scripts.export", [["--checkpoint", str(root / "dcn"), "--output", out,
                                                           "--format", "torchscript", "--check_batch_sizes", "1,8"]],
                                  tmp_path)[0])
    assert "max abs error" in result["stdout"] and os.path.isfile(os.path.join(out, "model.pt"))


@pytest.mark.parametrize("edit", [
    lambda config: config.update(table_sizes=[10**11] + config["table_sizes"][1:]),  # a huge table, no file for it
    lambda config: config.update(embedding_dim=config["embedding_dim"] * 2,  # the bottom MLP still fits the dot
                                 bottom_mlp_sizes=[*config["bottom_mlp_sizes"][:-1], config["embedding_dim"] * 2]),
    lambda config: config.update(table_sizes=config["table_sizes"][:-1]),
])
def test_a_model_config_that_disagrees_with_the_saved_tables_is_refused_before_anything_is_built(tmp_path, edit):
    """meta.json's model_config is what a serving job builds; one edited away from the tables the
    checkpoint saved (a damaged or hand-made meta.json) is a CheckpointError naming the file,
    not a model of its sizes allocated first."""
    import json

    from dlrm.engine.errors import CheckpointError
    from dlrm.training.checkpoint import model_config_of

    ck = str(tmp_path / "ck")
    shutil.copytree(os.path.join(REPO, "tests", "fixtures", "checkpoints", "dlrm_row_wise_2_processes"), ck)
    assert model_config_of(ck)["table_sizes"] == [rows for rows, _ in read_meta(ck)["tables"]]  # as saved: loads
    with open(os.path.join(ck, "meta.json")) as f:
        meta = json.load(f)
    edit(meta["model_config"])
    with open(os.path.join(ck, "meta.json"), "w") as f:
        json.dump(meta, f)
    with pytest.raises(CheckpointError, match=r"meta\.json: model_config's \d+ tables of dimension \d+ disagree"):
        model_config_of(ck)
