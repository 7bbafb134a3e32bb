import dataclasses

import pytest
import torch

from dlrm.model.dlrm import DLRM, DLRMConfig

SIZES = [4, 9, 1, 30]


def small_config(**overrides) -> DLRMConfig:
    base = dict(
        num_numerical_features=5,
        table_sizes=SIZES,
        embedding_dim=8,
        bottom_mlp_sizes=[16, 8],
        top_mlp_sizes=[12, 6, 1],
    )
    base.update(overrides)
    return DLRMConfig(**base)


def random_batch(config: DLRMConfig, batch: int, seed: int = 0, id_dtype=torch.int64, hashed=False):
    g = torch.Generator().manual_seed(seed)
    numerical = torch.randn(batch, config.num_numerical_features, generator=g)
    high = 1000 if hashed else None
    columns = [torch.randint(0, high or rows, (batch,), generator=g) for rows in config.table_sizes]
    return numerical, torch.stack(columns, dim=1).to(id_dtype)


def linear(x, layer):
    return x @ layer.weight.double().T + layer.bias.double()


def reference_forward(model: DLRM, numerical: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
    """The whole model rewritten from its weights with plain float64 torch ops."""
    cfg = model.config
    x = numerical.double()
    for layer in model.bottom_mlp.layers:
        x = torch.clamp_min(linear(x, layer), 0.0)
    embedded = []
    for t, rows in enumerate(cfg.table_sizes):
        if cfg.embedding_type == "joint":
            start = sum(cfg.table_sizes[:t])
            table = model.embeddings.weight[start : start + rows]
        else:
            table = model.embeddings.tables[t].weight
        ids = categorical[:, t].long()
        if cfg.hash_indices:
            ids = torch.remainder(ids, rows)
        embedded.append(table.double()[ids])
    if cfg.interaction_op == "dot":
        vectors = [x] + embedded
        terms = [(vectors[i] * vectors[j]).sum(dim=1) for i in range(len(vectors)) for j in range(i)]
        z = torch.cat([x, torch.stack(terms, dim=1)], dim=1)
        z = torch.cat([z, torch.zeros(z.shape[0], (-z.shape[1]) % 8, dtype=z.dtype)], dim=1)
    else:
        z = torch.cat([x] + embedded, dim=1)
    layers = list(model.top_mlp.layers)
    for layer in layers[:-1]:
        z = torch.clamp_min(linear(z, layer), 0.0)
    return linear(z, layers[-1])[:, 0]


VARIANTS = [
    dict(),
    dict(embedding_type="multi_table"),
    dict(interaction_op="cat"),
    dict(interaction_op="cat", embedding_type="multi_table", bottom_mlp_sizes=[16, 11]),
    dict(hash_indices=True),
    dict(hash_indices=True, embedding_type="multi_table"),
]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_forward_matches_hand_written_float64(overrides):
    config = small_config(**overrides)
    torch.manual_seed(0)
    model = DLRM(config)
    numerical, categorical = random_batch(config, 17, hashed=config.hash_indices)
    expected = reference_forward(model, numerical, categorical)
    assert expected.abs().max() > 1e-3  # not a degenerate all-zero comparison

    logits = model(numerical, categorical)
    assert logits.shape == (17,) and logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), expected, rtol=1e-4, atol=1e-5)

    model.double()
    torch.testing.assert_close(model(numerical, categorical), expected, rtol=1e-12, atol=1e-12)


def test_criteo_shapes():
    config = DLRMConfig(num_numerical_features=13, table_sizes=[3] * 26)  # NVIDIA's default MLPs
    torch.manual_seed(0)
    model = DLRM(config)
    assert model.interaction.num_outputs == 480
    assert model.top_mlp.layers[0].in_features == 480
    numerical, categorical = random_batch(config, 4)
    torch.testing.assert_close(model(numerical, categorical).double(), reference_forward(model, numerical, categorical),
                               rtol=1e-4, atol=1e-5)


def test_batch_of_one_gives_shape_one():
    model = DLRM(small_config())
    numerical, categorical = random_batch(model.config, 1)
    assert model(numerical, categorical).shape == (1,)


def test_input_dtypes_are_cast():
    model = DLRM(small_config())
    numerical, categorical = random_batch(model.config, 6)
    numerical = numerical.half()  # storage dtype on disk
    expected = model(numerical.float(), categorical)
    for id_dtype in (torch.int8, torch.int16, torch.int32):
        torch.testing.assert_close(model(numerical, categorical.to(id_dtype)), expected, rtol=0, atol=0)
    torch.testing.assert_close(model(numerical.double(), categorical), expected, rtol=0, atol=0)


def test_embed_dense_forward_seam():
    model = DLRM(small_config())
    numerical, categorical = random_batch(model.config, 8)
    embedded = model.embed(categorical)
    assert embedded.shape == (8, len(SIZES), 8)
    torch.testing.assert_close(model.dense_forward(numerical, embedded), model(numerical, categorical), rtol=0, atol=0)


def test_joint_and_multi_table_agree():
    joint_cfg = small_config()
    multi_cfg = dataclasses.replace(joint_cfg, embedding_type="multi_table")
    # same seed -> same initial model in both layouts
    torch.manual_seed(5)
    joint = DLRM(joint_cfg)
    torch.manual_seed(5)
    multi = DLRM(multi_cfg)
    numerical, categorical = random_batch(joint_cfg, 10)
    torch.testing.assert_close(joint(numerical, categorical), multi(numerical, categorical), rtol=0, atol=0)
    # and loading the same per-table and dense weights into differently seeded models agrees too
    torch.manual_seed(6)
    other = DLRM(multi_cfg)
    for i in range(len(SIZES)):
        other.embeddings.load_table_(i, joint.embeddings.table_weight(i))
    dense = {k: v for k, v in joint.state_dict().items() if not k.startswith("embeddings.")}
    missing, unexpected = other.load_state_dict(dense, strict=False)
    assert unexpected == [] and all(k.startswith("embeddings.") for k in missing)
    torch.testing.assert_close(joint(numerical, categorical), other(numerical, categorical), rtol=0, atol=0)


def test_deterministic_under_manual_seed():
    states = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        states.append(DLRM(small_config()).state_dict())
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not torch.equal(states[0]["top_mlp.layers.0.weight"], states[2]["top_mlp.layers.0.weight"])
    assert not torch.equal(states[0]["embeddings.weight"], states[2]["embeddings.weight"])


@pytest.mark.parametrize("embedding_type", ["joint", "multi_table"])
def test_parameter_split(embedding_type):
    model = DLRM(small_config(embedding_type=embedding_type))
    sparse, dense = model.sparse_parameters(), model.replicated_parameters()
    all_ids = [id(p) for p in model.parameters()]
    split_ids = [id(p) for p in sparse + dense]
    assert sorted(split_ids) == sorted(all_ids)  # every parameter exactly once
    assert len(set(split_ids)) == len(split_ids)
    embedding_ids = {id(p) for p in model.embeddings.parameters()}
    assert {id(p) for p in sparse} == embedding_ids
    assert len(dense) == 2 * (2 + 3)  # weight and bias of every Linear
    assert len(sparse) == (1 if embedding_type == "joint" else len(SIZES))


@pytest.mark.parametrize("embedding_type", ["joint", "multi_table"])
def test_backward_gives_sparse_embedding_and_dense_mlp_gradients(embedding_type):
    model = DLRM(small_config(embedding_type=embedding_type))
    numerical, categorical = random_batch(model.config, 8)
    model(numerical, categorical).sum().backward()
    assert all(p.grad is not None and p.grad.is_sparse for p in model.sparse_parameters())
    assert all(p.grad is not None and not p.grad.is_sparse for p in model.replicated_parameters())


@pytest.mark.parametrize("overrides", [dict(), dict(interaction_op="cat", embedding_type="multi_table")])
def test_autocast_bf16(overrides):
    torch.manual_seed(0)
    model = DLRM(small_config(**overrides))
    numerical, categorical = random_batch(model.config, 32)
    expected = model(numerical, categorical).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(numerical.half(), categorical)
        embedded = model.embed(categorical)
        interaction = model.interaction(model.bottom_mlp(numerical), embedded)
    assert logits.shape == (32,) and logits.dtype == torch.bfloat16
    assert interaction.dtype == (torch.bfloat16 if model.config.interaction_op == "dot" else torch.float32)
    torch.testing.assert_close(logits.float(), expected, rtol=0.05, atol=0.05)
    logits.float().sum().backward()
    for p in model.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(bottom_mlp_sizes=[16, 4]), r"bottom_mlp_sizes\[-1\] \(4\) must equal embedding_dim \(8\)"),
        (dict(top_mlp_sizes=[12, 2]), r"top_mlp_sizes\[-1\] must be 1"),
        (dict(num_numerical_features=0), "num_numerical_features"),
        (dict(table_sizes=[]), "at least 1 embedding table"),
        (dict(table_sizes=[4, 0]), "table_sizes must contain positive integers"),
        (dict(embedding_dim=0, bottom_mlp_sizes=[16, 0]), "embedding_dim"),
        (dict(bottom_mlp_sizes=[]), "bottom_mlp_sizes is empty"),
        (dict(top_mlp_sizes=[0, 1]), "top_mlp_sizes must contain positive integers"),
        (dict(interaction_op="dott"), r"interaction_op must be one of \('dot', 'cuda_dot', 'cat', 'dcn'\), got 'dott'"),
        (dict(embedding_type="joined"), r"embedding_type must be one of \('joint', 'multi_table', 'joint_fused'\)"),
    ],
)
def test_validate_errors(overrides, message):
    config = small_config(**overrides)
    with pytest.raises(ValueError, match=message):
        config.validate()
    with pytest.raises(ValueError, match=message):
        DLRM(config)


def test_validate_accepts_cat_with_any_bottom_width():
    small_config(interaction_op="cat", bottom_mlp_sizes=[16, 3]).validate()
    small_config().validate()
