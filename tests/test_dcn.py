"""``interaction_op="dcn"`` (DCNv2 low-rank cross layers) inside the model: the config, the
initialisation order, training, hybrid parallelism on real gloo process groups, checkpoints,
export, and the command line. The cross layers alone are tested in test_interactions.py."""

import dataclasses
import json
import math
import os
import re
import socket
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dlrm.data.rank_source import RankSource
from dlrm.data.synthetic import SyntheticDataset
from dlrm.distributed.exchange import EmbeddingExchange
from dlrm.engine.collectives import ProcessGroupCollectives
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.training.checkpoint import CheckpointError, TrainState, load_checkpoint, save_checkpoint
from dlrm.training.train import evaluate, make_train_step, train_step
from conftest import log_records, spawn

CPU = torch.device("cpu")
TABLES = [3, 1000, 17, 250, 5, 40]


def dcn_config(tables=TABLES, **overrides) -> DLRMConfig:
    """A small DCN model whose bottom output (12) is wider than the embeddings (8): DCN, like
    cat, does not need them equal. K = 12 + 6 * 8 = 60."""
    base = dict(num_numerical_features=5, table_sizes=list(tables), embedding_dim=8, bottom_mlp_sizes=[16, 12],
                top_mlp_sizes=[32, 16, 1], interaction_op="dcn", dcn_num_layers=2, dcn_low_rank_dim=6)
    base.update(overrides)
    return DLRMConfig(**base)


def random_inputs(config: DLRMConfig, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    numerical = torch.randn(batch, config.num_numerical_features, generator=g)
    categorical = torch.stack([torch.randint(0, rows, (batch,), generator=g) for rows in config.table_sizes], dim=1)
    return numerical, categorical


def perturbed(model: DLRM) -> DLRM:
    """Weights no fresh initialisation gives (non-zero DCN biases included)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def reference_logits(model: DLRM, numerical: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
    """The whole DCN model rewritten from its weights with explicit float64 matmuls."""
    def relu(x):
        return torch.clamp_min(x, 0.0)

    x = numerical.double()
    for layer in model.bottom_mlp.layers:
        x = relu(x @ layer.weight.double().T + layer.bias.double())
    embedded = [model.embeddings.table_weight(t).double()[categorical[:, t].long()]
                for t in range(len(model.config.table_sizes))]
    x0 = torch.cat([x, *embedded], dim=1)
    x = x0
    for layer in range(model.config.dcn_num_layers):
        v = model.interaction.V_kernels[layer].double()  # [r, K]
        w = model.interaction.W_kernels[layer].double()  # [K, r]
        b = model.interaction.bias[layer].double()  # [K]
        x = x0 * ((x @ v.T) @ w.T + b) + x
    layers = list(model.top_mlp.layers)
    for layer in layers[:-1]:
        x = relu(x @ layer.weight.double().T + layer.bias.double())
    return (x @ layers[-1].weight.double().T + layers[-1].bias.double())[:, 0]


# --- config -------------------------------------------------------------------------------------


def test_defaults_are_mlperf_dlrmv2():
    config = DLRMConfig(num_numerical_features=13, table_sizes=[3] * 26)
    assert (config.dcn_num_layers, config.dcn_low_rank_dim) == (3, 512)


@pytest.mark.parametrize("field", ["dcn_num_layers", "dcn_low_rank_dim"])
@pytest.mark.parametrize("value", [0, -2, 2.5, True, "3", None])
@pytest.mark.parametrize("interaction_op", ["dcn", "dot"])
def test_validate_rejects_non_positive_or_non_integer_dcn_sizes(field, value, interaction_op):
    """A wrong type is refused when the config is built (``check_types``), a bad value by the model."""
    with pytest.raises(ValueError, match=f"`{field}`.*(positive integer|must be an integer), got {re.escape(repr(value))}") \
            as info:
        DLRM(dcn_config(interaction_op=interaction_op, bottom_mlp_sizes=[16, 8], **{field: value}))
    assert "--" not in str(info.value)  # library terms, not the script's flags


def test_dcn_accepts_any_bottom_width():
    dcn_config(bottom_mlp_sizes=[16, 3]).validate()
    with pytest.raises(ValueError, match="must equal embedding_dim"):
        dcn_config(interaction_op="dot", bottom_mlp_sizes=[16, 3]).validate()


# --- the model ----------------------------------------------------------------------------------


def test_shapes_and_top_mlp_input():
    torch.manual_seed(0)
    model = DLRM(dcn_config())
    assert model.interaction.num_outputs == 12 + 6 * 8 == model.top_mlp.layers[0].in_features
    assert [tuple(w.shape) for w in model.interaction.W_kernels] == [(60, 6), (60, 6)]
    numerical, categorical = random_inputs(model.config, 7)
    assert model(numerical, categorical).shape == (7,)
    assert model(numerical[:1], categorical[:1]).shape == (1,)


def test_criteo_shape_parameter_count():
    """docs/architecture.md's numbers: K = 128 + 26 * 128 = 3456, 3 layers of rank 512."""
    torch.manual_seed(0)
    model = DLRM(DLRMConfig(num_numerical_features=13, table_sizes=[3] * 26, interaction_op="dcn"))
    assert model.interaction.num_outputs == 3456 == model.top_mlp.layers[0].in_features
    assert sum(p.numel() for p in model.interaction.parameters()) == 10_627_200


@pytest.mark.parametrize("embedding_type", ["joint", "multi_table"])
def test_forward_matches_hand_written_float64(embedding_type):
    torch.manual_seed(0)
    model = perturbed(DLRM(dcn_config(embedding_type=embedding_type)))
    numerical, categorical = random_inputs(model.config, 33)
    expected = reference_logits(model, numerical, categorical)
    assert expected.std() > 0.1
    torch.testing.assert_close(model(numerical, categorical).double(), expected, rtol=1e-4, atol=1e-4)
    model.double()
    torch.testing.assert_close(model(numerical, categorical), expected, rtol=1e-12, atol=1e-12)


def test_autocast_bf16_forward_and_backward():
    torch.manual_seed(0)
    model = DLRM(dcn_config())
    numerical, categorical = random_inputs(model.config, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(numerical, categorical)
    logits.float().sum().backward()
    expected = reference_logits(model, numerical, categorical)
    torch.testing.assert_close(logits.double(), expected, rtol=0.05, atol=0.05)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.interaction.parameters())


def _linear_draws(sizes: list[int]) -> list[torch.Tensor]:
    """NVIDIA's Linear initialisation (docs/architecture.md), drawn in layer order."""
    out = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        out.append(torch.empty(fan_out, fan_in).normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out))))
        out.append(torch.empty(fan_out).normal_(0.0, math.sqrt(1.0 / fan_out)))
    return out


@pytest.mark.parametrize("interaction_op,embedding_type", [("dot", "joint"), ("cat", "multi_table"),
                                                           ("dcn", "joint"), ("dcn", "multi_table")])
def test_dense_weights_follow_the_documented_draw_order(interaction_op, embedding_type):
    """After ``torch.manual_seed``: one draw for the embeddings' seed, then the bottom MLP, then
    (dcn only) the W kernels and the V kernels, then the top MLP, and nothing else. For dot and
    cat this is the order of the code before DCN existed, so their weights are unchanged."""
    bottom = [16, 8] if interaction_op == "dot" else [16, 12]
    config = dcn_config(interaction_op=interaction_op, embedding_type=embedding_type, bottom_mlp_sizes=bottom)
    torch.manual_seed(123)
    model = DLRM(config)
    next_draw = torch.rand(4)

    torch.manual_seed(123)
    embedding_seed = int(torch.randint(0, 2**62, ()))
    expected = _linear_draws([5, *bottom])
    width = model.interaction.num_outputs
    if interaction_op == "dcn":
        std = math.sqrt(2.0 / (width + 6))
        expected += [torch.empty(width, 6).normal_(0.0, std) for _ in range(2)]  # W_0, W_1
        expected += [torch.empty(6, width).normal_(0.0, std) for _ in range(2)]  # V_0, V_1
        expected += [torch.zeros(width), torch.zeros(width)]  # biases: no draw
    expected += _linear_draws([width, 32, 16, 1])
    assert model.embeddings.init_seed == embedding_seed
    names = [n for n, _ in model.named_parameters() if not n.startswith("embeddings.")]
    got = [p.detach() for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    if interaction_op == "dcn":  # named_parameters lists W, V, bias: the order above
        assert names[4:10] == ["interaction.W_kernels.0", "interaction.W_kernels.1", "interaction.V_kernels.0",
                               "interaction.V_kernels.1", "interaction.bias.0", "interaction.bias.1"]
    assert len(got) == len(expected)
    for name, a, b in zip(names, got, expected):
        assert torch.equal(a, b), name
    assert torch.equal(next_draw, torch.rand(4))


def test_dcn_leaves_the_embeddings_and_bottom_mlp_of_the_same_seed_unchanged():
    models = {}
    for op in ("cat", "dcn"):
        torch.manual_seed(9)
        models[op] = DLRM(dcn_config(interaction_op=op))
    for t in range(len(TABLES)):
        assert torch.equal(models["cat"].embeddings.table_weight(t), models["dcn"].embeddings.table_weight(t))
    for a, b in zip(models["cat"].bottom_mlp.parameters(), models["dcn"].bottom_mlp.parameters()):
        assert torch.equal(a, b)


def test_every_hybrid_parallel_shard_gets_the_same_dense_weights():
    torch.manual_seed(4)
    full = DLRM(dcn_config())
    dense = {k: v for k, v in full.state_dict().items() if not k.startswith("embeddings.")}
    for tables in ([1, 4], [0], [], [5, 2, 3]):
        torch.manual_seed(4)
        shard = DLRM(dcn_config(), tables=tables)
        for name, value in shard.state_dict().items():
            if not name.startswith("embeddings."):
                assert torch.equal(value, dense[name]), (tables, name)
        for i, t in enumerate(tables):
            assert torch.equal(shard.embeddings.table_weight(i), full.embeddings.table_weight(t))


def test_replicated_parameters_hold_the_cross_layers():
    model = DLRM(dcn_config())
    dense = {id(p) for p in model.replicated_parameters()}
    assert all(id(p) in dense for p in model.interaction.parameters())
    assert not dense & {id(p) for p in model.sparse_parameters()}


def test_a_few_sgd_steps_learn():
    """40 SGD steps on synthetic data whose labels come from a hidden model: the training loss
    falls and the test AUC rises well above that of the initial weights."""
    torch.manual_seed(0)
    model = DLRM(dcn_config())
    precision = Precision("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data = SyntheticDataset(5, TABLES, 40 * 256, 256, seed=3, split="train")
    test = SyntheticDataset(5, TABLES, 4096, 1024, seed=3, split="test")
    before = evaluate(model, test, CPU, precision)
    w0 = model.interaction.W_kernels[0].detach().clone()
    losses = [float(train_step(model, data.read_batch(i), optimizer, precision.grad_scaler(), precision))
              for i in range(40)]
    after = evaluate(model, test, CPU, precision)
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.1
    assert after.loss < before.loss - 0.05
    assert after.auc > max(0.65, before.auc + 0.1)
    assert not torch.equal(model.interaction.W_kernels[0], w0)  # the cross layers were trained


# --- hybrid parallelism on gloo -----------------------------------------------------------------

STEPS, BATCH, LR = 5, 250, 0.5  # 250 does not divide by 3: uneven local batches


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, plan: list[list[int]], out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DLRM(dcn_config(), tables=plan[rank]).double()
    model.exchange = EmbeddingExchange(plan, rank)
    collectives = ProcessGroupCollectives(CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    precision = Precision("cpu")
    data = RankSource(lambda *args: SyntheticDataset(5, TABLES, STEPS * BATCH, BATCH, seed=11, split="train"),
                      plan[rank], rank, world)
    step = make_train_step(model, optimizer, precision.grad_scaler(), precision, collectives)
    losses, dense = [], []
    for i in range(STEPS):
        losses.append(float(collectives.sum(step(data.read_batch(i)))))
        dense.append({k: v.clone() for k, v in model.state_dict().items() if not k.startswith("embeddings.")})
    torch.save({"losses": losses, "dense": dense,
                "tables": {t: model.embeddings.table_weight(i).clone() for i, t in enumerate(plan[rank])}},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # tear down together: gloo can abort a process whose peers vanish mid-teardown
    dist.destroy_process_group()
    os._exit(0)  # skip finalization, where gloo's threads can abort


@pytest.mark.parametrize("plan", [[[1, 4], [0, 2, 3, 5]], [[1], [3, 0], [2, 4, 5]]], ids=["world2", "world3"])
def test_hybrid_parallel_steps_equal_single_process_steps(tmp_path, plan):
    """float64: a 2- and a 3-process run (tables split between processes, the cross layers
    replicated and all-reduced) equal the single-process run step by step, every loss and every
    dense weight after every step, and the tables at the end."""
    world = len(plan)
    spawn(_worker, args=(world, _free_port(), plan, str(tmp_path)), nprocs=world)
    torch.manual_seed(0)
    reference = DLRM(dcn_config()).double()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    precision = Precision("cpu")
    data = SyntheticDataset(5, TABLES, STEPS * BATCH, BATCH, seed=11, split="train")
    ref_losses, ref_dense = [], []
    for i in range(STEPS):
        ref_losses.append(float(train_step(reference, data.read_batch(i), optimizer, precision.grad_scaler(),
                                           precision)))
        ref_dense.append({k: v.clone() for k, v in reference.state_dict().items() if not k.startswith("embeddings.")})
    assert ref_losses[-1] < ref_losses[0]
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-10, atol=0)
        for step, (got, want) in enumerate(zip(result["dense"], ref_dense)):
            assert sorted(got) == sorted(want)
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-13, msg=f"{name} step {step}")
    held = {t: w for r in results for t, w in r["tables"].items()}
    assert sorted(held) == list(range(len(TABLES)))
    for t, weight in held.items():
        torch.testing.assert_close(weight, reference.embeddings.table_weight(t), rtol=1e-10, atol=1e-13)


# --- checkpoints --------------------------------------------------------------------------------


def test_checkpoint_round_trips_the_dcn_config_and_weights(tmp_path):
    from dlrm.inference.export import build_inference_model

    torch.manual_seed(0)
    model = perturbed(DLRM(dcn_config(dcn_num_layers=3, dcn_low_rank_dim=5)))
    save_checkpoint(str(tmp_path / "ckpt"), model, None, None, TrainState(step=2))
    with open(tmp_path / "ckpt" / "meta.json") as f:
        saved = json.load(f)["model_config"]
    assert (saved["interaction_op"], saved["dcn_num_layers"], saved["dcn_low_rank_dim"]) == ("dcn", 3, 5)
    loaded = build_inference_model(str(tmp_path / "ckpt"))
    assert loaded.config == model.config
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_a_checkpoint_saved_before_dcn_existed_still_loads(tmp_path):
    """meta.json of older checkpoints has no ``dcn_*`` entries: the defaults fill them in."""
    from dlrm.inference.export import build_inference_model

    torch.manual_seed(0)
    model = perturbed(DLRM(dcn_config(interaction_op="dot", bottom_mlp_sizes=[16, 8])))
    path = tmp_path / "ckpt"
    save_checkpoint(str(path), model, None, None, TrainState(step=2))
    meta = json.loads((path / "meta.json").read_text())
    for key in ("dcn_num_layers", "dcn_low_rank_dim"):
        del meta["model_config"][key]
    (path / "meta.json").write_text(json.dumps(meta))
    loaded = build_inference_model(str(path))
    assert (loaded.config.dcn_num_layers, loaded.config.dcn_low_rank_dim) == (3, 512)
    assert loaded.config == dataclasses.replace(model.config, dcn_num_layers=3, dcn_low_rank_dim=512)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


@pytest.mark.parametrize(
    "other,needle",
    [
        (dict(interaction_op="dot", bottom_mlp_sizes=[16, 8]), r"unexpected \['interaction\.V_kernels\.0'"),
        (dict(interaction_op="cat"), r"unexpected \['interaction\.V_kernels\.0'"),
        (dict(dcn_num_layers=3), r"missing \['interaction\.V_kernels\.2'"),
        (dict(dcn_low_rank_dim=7), r"interaction\.W_kernels\.0 has shape \[60, 6\] in the checkpoint but \[60, 7\]"),
    ],
    ids=["into-dot", "into-cat", "more-layers", "other-rank"],
)
def test_a_dcn_checkpoint_refuses_to_load_into_another_model(tmp_path, other, needle):
    torch.manual_seed(0)
    save_checkpoint(str(tmp_path / "ckpt"), DLRM(dcn_config()), None, None, TrainState())
    target = DLRM(dcn_config(**other))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=needle) as info:
        load_checkpoint(str(tmp_path / "ckpt"), target)
    assert "`interaction_op`" in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # nothing half-loaded


# --- export -------------------------------------------------------------------------------------


def test_onnx_and_torchscript_files_match_eager(tmp_path):
    """The checkpoint -> inference model -> files path, run as a server runs them (ONNX Runtime,
    torch.jit.load), against the eager model's sigmoid at several batch sizes."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from dlrm.inference.export import build_inference_model, export_onnx, export_torchscript

    torch.manual_seed(0)
    model = perturbed(DLRM(dcn_config())).eval()
    save_checkpoint(str(tmp_path / "ckpt"), model, None, None, TrainState())
    loaded = build_inference_model(str(tmp_path / "ckpt"))
    export_onnx(loaded, str(tmp_path / "model.onnx"))
    export_torchscript(loaded, str(tmp_path / "model.pt"))
    ops = [node.op_type for node in onnx.load(str(tmp_path / "model.onnx")).graph.node]
    assert not set(ops) & {"Loop", "Scan", "If"}, ops
    # One matmul per Linear: 2 bottom, 2 per cross layer (V then W), 3 top.
    assert ops.count("Gemm") + ops.count("MatMul") == 2 + 2 * 2 + 3, ops
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.load's deprecation notice
        scripted = torch.jit.load(str(tmp_path / "model.pt"))
    for batch_size in (1, 64, 1000):
        numerical, categorical = random_inputs(model.config, batch_size, seed=batch_size)
        with torch.no_grad():
            want = torch.sigmoid(model(numerical, categorical)).numpy()
            from_script = scripted(numerical, categorical).numpy()
        from_onnx = session.run(["click_probability"], {"numerical": numerical.numpy(),
                                                        "categorical": categorical.numpy()})[0]
        for got in (from_onnx, from_script):
            assert got.shape == (batch_size, 1) and got.dtype == np.float32
            np.testing.assert_allclose(got[:, 0], want, rtol=1e-5, atol=1e-6)
    assert want.std() > 0.05  # probabilities that vary: a constant output would not pass


# --- command line -------------------------------------------------------------------------------

SMALL = ["--embedding_dim", "8", "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "32,16,1"]
SYNTHETIC = ["--base_device", "cpu", "--synthetic_dataset_table_sizes", "30,300,4,1000,70",
             "--synthetic_dataset_numerical_features", "4", "--synthetic_dataset_num_entries", "8192",
             "--synthetic_dataset_num_test_entries", "2048", "--batch_size", "256", "--test_batch_size", "1024",
             "--lr", "0.5", "--warmup_steps", "4", "--decay_start_step", "0", "--decay_steps", "0",
             "--print_freq", "16"]
DCN = ["--interaction_op", "dcn", "--dcn_num_layers", "2", "--dcn_low_rank_dim", "16"]


def test_help_lists_the_dcn_flags(cli):
    out = cli("dlrm.scripts.main", "--help").stdout
    assert "--dcn_num_layers" in out and "--dcn_low_rank_dim" in out
    assert "--interaction_op=auto (auto|cuda_dot|dot|cat|dcn)" in out


def test_cli_trains_tests_and_refuses_the_checkpoint_in_a_dot_model(cli, tmp_path):
    from dlrm.inference.export import build_inference_model

    ckpt, log, test_log = str(tmp_path / "ckpt"), str(tmp_path / "log.json"), str(tmp_path / "test.json")
    out = cli("dlrm.scripts.main", *SYNTHETIC, *SMALL, *DCN, "--save_checkpoint_path", ckpt, "--log_path", log).stdout
    assert "Epoch:[0/1] [32/32]" in out
    (flags_record,) = log_records(log, "flags")
    assert (flags_record["interaction_op"], flags_record["dcn_num_layers"], flags_record["dcn_low_rank_dim"]) == (
        "dcn", 2, 16)
    (summary,) = log_records(log, "summary")
    assert summary["steps"] == 32 and summary["best_auc"] > 0.6
    model = build_inference_model(ckpt)  # the checkpoint describes the model the flags asked for
    assert (model.config.interaction_op, model.config.dcn_num_layers, model.config.dcn_low_rank_dim) == ("dcn", 2, 16)
    assert [tuple(w.shape) for w in model.interaction.W_kernels] == [(8 + 5 * 8, 16)] * 2

    # --mode test with the same flags loads it and reproduces the last evaluation.
    cli("dlrm.scripts.main", "--mode", "test", *SYNTHETIC, *SMALL, *DCN, "--load_checkpoint_path", ckpt,
        "--log_path", test_log)
    (test_summary,) = log_records(test_log, "summary")
    assert test_summary["auc"] == pytest.approx(log_records(log, "eval")[-1]["auc"], abs=1e-6)

    # The same checkpoint into a dot model: a one-line error naming the flag, no traceback.
    proc = cli("dlrm.scripts.main", "--mode", "test", *SYNTHETIC, *SMALL, "--interaction_op", "dot",
               "--load_checkpoint_path", ckpt, "--log_path", os.devnull, check=False)
    assert proc.returncode == 2
    assert "--interaction_op dot contradicts the checkpoint" in proc.stderr and "saved with dcn" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag", ["--dcn_num_layers", "--dcn_low_rank_dim"])
def test_cli_rejects_a_non_positive_dcn_size(cli, flag):
    proc = cli("dlrm.scripts.main", *SYNTHETIC, *SMALL, "--interaction_op", "dcn", flag, "0",
               "--log_path", os.devnull, check=False)
    assert proc.returncode == 2
    assert f"{flag} (" in proc.stderr and "must be a positive integer, got 0" in proc.stderr
    assert "`" not in proc.stderr and "Traceback" not in proc.stderr
