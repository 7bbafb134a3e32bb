"""The recommender as users judge it: on clustered synthetic histories the shipped tuned network
beats popularity and at least matches matrix factorisation on P@10 of a held-out split; no
recommended item is ever one the user has; item-parallel predict on real gloo process groups
returns exactly the one-process lists."""

import copy
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import REPO, spawn
from dlrm.engine.logger import RunLogger
from dlrm.recommender.baselines import fit_baseline
from dlrm.recommender.csr_dataset import CsrDataset, split_holdout, write_csr
from dlrm.recommender.item_parallel import ItemParallel
from dlrm.recommender.model import SparseAutoencoder
from dlrm.recommender.network import parse_network
from dlrm.recommender.predict import evaluate, recommend
from dlrm.recommender.scorer import model_scorer
from dlrm.recommender.train import TrainConfig, make_optimizer, train
from dlrm.recommender.user_histories import HistoryConfig, generate_user_histories
from test_distributed import free_port

TUNED = os.path.join(REPO, "configs", "recommender", "movielens_tuned.json")


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    h = generate_user_histories(HistoryConfig(n_users=4000, n_items=600, n_interactions=200_000), seed=2)
    write_csr(root / "all", h.rows)
    split_holdout(root / "all", root / "input", root / "heldout", fraction=0.2, seed=3)
    return CsrDataset(root / "input"), CsrDataset(root / "heldout")


@pytest.fixture(scope="module")
def trained(split):
    inputs, _ = split
    network = parse_network(TUNED).resolve(inputs.n_features, inputs.n_features)
    model = SparseAutoencoder(network, seed=0)
    train(model, make_optimizer(model, network.optimizer), inputs, inputs,
          TrainConfig(batch_size=128, epochs=4, log_every_steps=0), RunLogger(enabled=False), torch.device("cpu"))
    return model


def test_tuned_network_beats_popularity_and_matches_matrix_factorisation(split, trained):
    inputs, heldout = split
    p_at_10 = {}
    for name in ("popularity", "mf"):
        baseline = fit_baseline(name, inputs.rows())
        p_at_10[name] = evaluate(recommend(lambda csr, b=baseline: b.scores(csr[0], csr[1]), inputs, 10, 1000),
                                 heldout, [10])[0].precision
    p_at_10["model"] = evaluate(recommend(model_scorer(trained), inputs, 10, 1000), heldout, [10])[0].precision
    assert p_at_10["model"] > 1.2 * p_at_10["popularity"], p_at_10
    assert p_at_10["model"] >= p_at_10["mf"], p_at_10


def test_no_recommended_item_is_in_the_users_history(split, trained):
    inputs, _ = split
    for first, values, items in recommend(model_scorer(trained), inputs, 25, 700):
        history = inputs.rows(first, first + items.shape[0])
        for b in range(items.shape[0]):
            seen = set(history.indices[history.offsets[b]:history.offsets[b + 1]].tolist())
            listed = items[b][items[b] >= 0].tolist()
            assert not seen & set(listed) and len(set(listed)) == len(listed) == 25
            assert torch.all(values[b][:-1] >= values[b][1:])


def _predict_worker(rank, world, port, network, state, data, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = SparseAutoencoder(network, ItemParallel.from_process_group(), seed=0, dtype=torch.float64)
        lo, hi = model.output_range
        a, b = model.input_range
        with torch.no_grad():
            model.input_weight.copy_(state["input_weight"][a:b])
            model.output_weight.copy_(state["output_weight"][lo:hi])
            model.output_bias.copy_(state["output_bias"][lo:hi])
            model.input_bias.copy_(state["input_bias"])
            for p, q in zip(model.hidden.parameters(), state["hidden"]):
                p.copy_(q)
        inputs = CsrDataset(data)
        lists = list(recommend(model_scorer(model), inputs, 12, 333, item_start=lo, parallel=model.parallel,
                               stop=1000))
        torch.save([(f, v, i) for f, v, i in lists], os.path.join(out, f"lists{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_item_parallel_predict_equals_one_process(tmp_path, split, trained):
    inputs, _ = split
    one = copy.deepcopy(trained).double()  # float64: the sums' order cannot swap near-ties
    expected = list(recommend(model_scorer(one), inputs, 12, 333, stop=1000))
    state = {"input_weight": one.input_weight.detach(), "output_weight": one.output_weight.detach(),
             "output_bias": one.output_bias.detach(), "input_bias": one.input_bias.detach(),
             "hidden": [p.detach() for p in one.hidden.parameters()]}
    world = 3
    spawn(_predict_worker, args=(world, free_port(), trained.config, state, inputs.path, str(tmp_path)),
          nprocs=world)
    for rank in range(world):
        got = torch.load(tmp_path / f"lists{rank}.pt", weights_only=True)
        assert [f for f, _, _ in got] == [f for f, _, _ in expected]
        for (_, v, i), (_, ev, ei) in zip(got, expected):
            assert torch.equal(i, ei)
            torch.testing.assert_close(v, ev, rtol=1e-5, atol=1e-7)
