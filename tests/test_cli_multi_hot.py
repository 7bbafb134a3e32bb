"""Multi-hot data and the MLPerf DLRMv2 preset, run as a user runs them."""

import json

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from dlrm.data.batch import Bags
from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.sources import DataConfig, load_feature_spec, make_source, table_sizes
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.training.checkpoint import load_checkpoint
from conftest import log_records

# MLPerf Training DLRM-DCNv2 (torchrec_dlrm's multi_hot_sizes and num_embeddings_per_feature),
# written out again here rather than imported, so a typo in the library's copy shows.
MLPERF_SIZES = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
MLPERF_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
               11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
FAST = ["--base_device", "cpu", "--print_freq", "50", "--warmup_steps", "0", "--decay_steps", "0"]


def test_prepare_mlperf_dlrmv2_writes_its_bag_sizes_and_capped_tables(cli, tmp_path):
    out = str(tmp_path / "dv2")
    cli("dlrm.scripts.prepare_synthetic_dataset", "--synthetic_dataset_dir", out, "--preset", "mlperf_dlrmv2",
        "--max_table_size", "1000", "--synthetic_dataset_num_entries", "512", "--num_test_entries", "0",
        "--num_validation_entries", "0", "--batch_size", "256")
    spec = FeatureSpec.from_yaml(f"{out}/feature_spec.yaml")
    assert [spec.bag_size(n) for n in spec.categorical_names] == MLPERF_SIZES
    assert table_sizes(spec, None) == [min(r, 1000) for r in MLPERF_ROWS]
    reader = SplitBinaryReader(spec, "train", batch_size=512)
    bags = reader.read_batch(0).categorical
    assert isinstance(bags, Bags) and bags.num_features == 26
    lengths = bags.lengths()
    for f, size in enumerate(MLPERF_SIZES):
        assert int(lengths[f].max()) <= size  # fixed bags of `size`, padding removed on read
    for f, rows in enumerate(MLPERF_ROWS):
        ids = bags.values[bags.offsets[f * 512]:bags.offsets[(f + 1) * 512]]
        assert ids.numel() > 0 and 0 <= int(ids.min()) and int(ids.max()) < min(rows, 1000)


def test_mlperf_preset_builds_its_shape_prints_the_plan_and_trains_on_cpu(cli, tmp_path):
    log, ckpt = str(tmp_path / "log.json"), str(tmp_path / "ckpt")
    out = cli("dlrm.scripts.main", "--preset", "mlperf_dlrmv2", "--max_table_size", "2000", "--hash_indices",
              "--dcn_low_rank_dim", "64",  # a flag on the command line wins over the preset
              "--synthetic_dataset_num_entries", "2048", "--synthetic_dataset_num_test_entries", "1024",
              "--batch_size", "256", "--test_batch_size", "1024", "--max_steps", "6", "--log_path", log,
              "--save_checkpoint_path", ckpt, *FAST).stdout
    assert "Embedding placement: 26 tables on 1 rank" in out
    flags = log_records(log, "flags")[0]
    assert flags["interaction_op"] == "dcn" and flags["dcn_num_layers"] == 3 and flags["dcn_low_rank_dim"] == 64
    assert flags["optimizer"] == "rowwise_adagrad" and flags["dense_optimizer"] == "adagrad" and flags["lr"] == 0.005
    assert flags["synthetic_multi_hot_sizes"] == ["mlperf"]
    assert log_records(log, "summary")[-1]["steps"] == 6
    model = DLRM(json_config(ckpt))
    load_checkpoint(ckpt, model)
    assert model.config.embedding_dim == 128 and model.config.bottom_mlp_sizes == [512, 256, 128]
    assert model.config.top_mlp_sizes == [1024, 1024, 512, 256, 1]
    assert model.config.table_sizes == [min(r, 2000) for r in MLPERF_ROWS]


def json_config(ckpt):
    meta = json.load(open(f"{ckpt}/meta.json"))
    return DLRMConfig(**meta["model_config"])


def test_mlperf_tables_that_fit_no_device_stop_before_any_work(cli, tmp_path):
    proc = cli("dlrm.scripts.main", "--preset", "mlperf_dlrmv2", "--device_memory_gb", "4",
               "--log_path", str(tmp_path / "log.json"), *FAST, check=False)
    assert proc.returncode == 2
    assert "40,000,000 rows" in proc.stderr and "GiB" in proc.stderr and "--max_table_size" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_multi_hot_synthetic_data_is_learned(cli, tmp_path, pooling):
    """Bags of 1-4 ids whose labels come from a hidden model: the test AUC (checked with
    sklearn on the saved model's predictions) clears 0.7 within 300 steps on a CPU."""
    log, ckpt = str(tmp_path / "log.json"), str(tmp_path / "ckpt")
    tables = ["200", "50", "1000", "7", "300"]
    cli("dlrm.scripts.main", "--synthetic_dataset_table_sizes", ",".join(tables),
        "--synthetic_multi_hot_sizes", "3,1,4,2,2", "--synthetic_pooling", pooling,
        "--synthetic_dataset_numerical_features", "4", "--synthetic_dataset_num_entries", "76800",
        "--synthetic_dataset_num_test_entries", "8192", "--batch_size", "256", "--test_batch_size", "8192",
        "--embedding_dim", "16", "--bottom_mlp_sizes", "32,16", "--top_mlp_sizes", "64,32,1",
        "--optimizer", "rowwise_adagrad", "--lr", "0.05", "--max_steps", "300", "--log_path", log,
        "--save_checkpoint_path", ckpt, *FAST)
    auc = log_records(log, "eval")[-1]["auc"]
    assert auc > 0.7, auc
    # the logged AUC is sklearn's on the model's own predictions of the test split
    cfg = DataConfig(dataset_type="synthetic", synthetic_num_entries=76800, synthetic_num_test_entries=8192,
                     synthetic_table_sizes=[int(t) for t in tables], synthetic_num_numerical=4,
                     synthetic_bag_sizes=[3, 1, 4, 2, 2], synthetic_pooling=pooling)
    spec = load_feature_spec(cfg)
    model = DLRM(json_config(ckpt))
    load_checkpoint(ckpt, model)
    model.eval()
    labels, scores = [], []
    with torch.no_grad():
        source = make_source(cfg, spec, "test", 8192, torch.device("cpu"), seed=12345)  # the run's --seed
        for batch in map(source.read_batch, range(len(source))):
            scores.append(torch.sigmoid(model(batch.numerical.float(), batch.categorical)).numpy())
            labels.append(batch.label.numpy())
    assert roc_auc_score(np.concatenate(labels), np.concatenate(scores)) == pytest.approx(auc, abs=1e-4)


@pytest.mark.gpu
def test_cuda_graphs_train_on_multi_hot_data(cli, tmp_path):
    """On CUDA (a CPU run goes without CUDA graphs): multi-hot batches are padded to a static
    length and the captured step replays (dlrm.training.cuda_graphs, tests/test_multi_hot_graphs.py);
    the test split's bags take the eager forward. The run equals the same run without graphs, up
    to the order of the GPU's atomic adds."""
    evals = {}
    for graphs in (True, False):
        log = str(tmp_path / f"log_{graphs}.json")
        proc = cli("dlrm.scripts.main", "--synthetic_multi_hot_sizes", "2,3", "--synthetic_dataset_table_sizes",
                   "10,20", "--embedding_type", "joint_fused", *(["--cuda_graphs"] if graphs else []),
                   "--optimizer", "rowwise_adagrad", "--lr", "0.05", "--synthetic_dataset_num_entries", "8192",
                   "--synthetic_dataset_num_test_entries", "2048", "--batch_size", "512", "--test_batch_size",
                   "1024", "--max_steps", "12", "--log_path", log, *FAST, "--base_device", "cuda")
        assert "one-hot data" not in proc.stderr, proc.stderr
        assert log_records(log, "summary")[-1]["steps"] == 12
        evals[graphs] = log_records(log, "eval")[-1]
    assert 0.0 < evals[True]["auc"] <= 1.0
    assert evals[True]["auc"] == pytest.approx(evals[False]["auc"], abs=1e-4)
    assert evals[True]["loss"] == pytest.approx(evals[False]["loss"], rel=1e-4)
