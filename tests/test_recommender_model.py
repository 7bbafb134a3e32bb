"""The sparse autoencoder: losses against dense float64 references written from DSSTNE's
definitions, initial weights independent of the item split, item-parallel training on real gloo
process groups equal to one process step by step, checkpoints across process counts, exact
resume, and the sampled-negatives estimate."""

import copy
import dataclasses
import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dlrm.engine.logger import RunLogger
from dlrm.engine.partition import split_bounds
from dlrm.recommender import checkpoint
from dlrm.recommender.csr_dataset import CsrDataset, write_csr
from dlrm.recommender.item_parallel import ItemParallel
from dlrm.recommender.loss import batch_loss, kl_weight_at
from dlrm.recommender.model import NOISE_INPUT_DROPOUT, NOISE_LATENT, SparseAutoencoder, batch_noise
from dlrm.recommender.network import parse_network
from dlrm.recommender.csr_rows import take_rows
from dlrm.recommender.train import TrainConfig, make_optimizer, train
from dlrm.recommender.user_histories import HistoryConfig, generate_user_histories
from test_distributed import free_port
from conftest import spawn

N_ITEMS = 37


def network(error="ScaledMarginalCrossEntropy", output="Sigmoid", hidden=(6, 5), optimizer="Adam", extra=None,
            latent=None, input_dropout=0.0):
    """A small network using every setting; ``latent``: that hidden layer is a VAE's latent."""
    layers = [{"Kind": "Input", "N": "auto", "DataSet": "input", "Sparse": True, "pDropout": input_dropout}]
    for i, n in enumerate(hidden):
        act = "Linear" if i == latent else ["Sigmoid", "Tanh", "Relu"][i % 3]
        layers.append({"Kind": "Hidden", "N": n, "Activation": act, "Sparse": i == 0,
                       "pDropout": 0.2 if i == 1 else 0.0})
    layers.append({"Kind": "Output", "N": "auto", "DataSet": "output", "Activation": output,
                   "WeightInit": {"Scheme": "Gaussian", "Scale": 0.3}})
    spec = {"Kind": "AutoEncoder", "Layers": layers, "ErrorFunction": error, "Denoising": {"p": 0.2},
            "SparsenessPenalty": {"p": 0.3, "beta": 0.5},
            "ScaledMarginalCrossEntropy": {"oneTarget": 0.8, "zeroTarget": 0.05, "oneScale": 2.0, "zeroScale": 0.5},
            "Optimizer": {"Kind": optimizer, "Alpha": 0.05, "Mu": 0.9, "Lambda": 0.001}}
    if latent is not None:
        spec["Variational"] = {"Layer": f"Hidden{latent + 1}", "Beta": 0.5, "AnnealSteps": 3}
    spec.update(extra or {})
    return parse_network(spec).resolve(N_ITEMS, N_ITEMS)


def random_batch(batch=9, seed=0, values=True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 7, (batch,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    rows = [torch.randperm(N_ITEMS, generator=g)[:n] for n in lengths.tolist()]
    indices = torch.cat(rows)
    vals = torch.rand(indices.numel(), generator=g, dtype=torch.float64) + 0.5 if values else None
    return offsets, indices, vals


def dense_reference_loss(model, inputs, targets, seed=None, kl_weight=0.0):
    """DSSTNE's definitions over a dense float64 target matrix, from a forward written plainly.
    With ``seed`` (training), the noise the model draws from it, applied by hand: input and
    hidden dropout masks, the latent's standard normal draw; and the KL term of a latent."""
    cfg = model.config
    offsets, indices, values = inputs
    batch = offsets.numel() - 1
    x = torch.zeros(batch, N_ITEMS, dtype=torch.float64)
    keep = torch.ones(batch, N_ITEMS, dtype=torch.float64)
    p_in = cfg.input.p_dropout if seed is not None else 0.0
    u = batch_noise(seed, NOISE_INPUT_DROPOUT, (indices.numel(),), torch.device("cpu")) if p_in else None
    for b in range(batch):
        for j in range(offsets[b], offsets[b + 1]):  # the batch's items are distinct in a row
            x[b, indices[j]] += 1.0 if values is None else values[j]
            if p_in:
                keep[b, indices[j]] = float(u[j] >= p_in) / (1 - p_in)
    if cfg.input_normalization == "l2":
        x = x / torch.sqrt((x * x).sum(1, keepdim=True)).clamp_min(1e-12)
    x = x * keep  # Liang et al.: normalise, then drop out
    h = x @ model.input_weight + model.input_bias
    acts = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu, "linear": lambda v: v}
    kept = []
    kl = 0.0
    for i, layer in enumerate(cfg.hidden):
        if i:
            h = h @ model.hidden[i - 1].weight.T + model.hidden[i - 1].bias
        if cfg.variational is not None and layer.name == cfg.variational.layer:
            n = layer.n
            mean, log_var = h[:, :n], h[:, n:]
            kl = 0.5 * (mean ** 2 + torch.exp(log_var) - 1 - log_var).sum() / batch
            h = mean
            if seed is not None:
                eps = batch_noise(seed, NOISE_LATENT, (batch, n), torch.device("cpu"), normal=True).double()
                h = mean + torch.exp(log_var / 2) * eps
        h = acts[layer.activation](h)
        kept.append(h)
        if seed is not None and layer.p_dropout:
            mask = batch_noise(seed, i, (batch, layer.n), torch.device("cpu")) >= layer.p_dropout
            h = h * mask.double() / (1 - layer.p_dropout)
    z = h @ model.output_weight.T + model.output_bias
    t = torch.zeros(batch, N_ITEMS, dtype=torch.float64)
    o, ind, val = targets
    for b in range(batch):
        for j in range(o[b], o[b + 1]):
            t[b, ind[j]] = 1.0 if val is None else val[j]
    y = torch.softmax(z, 1) if cfg.output.activation == "softmax" else {"sigmoid": torch.sigmoid, "linear": lambda v: v}[
        cfg.output.activation](z)
    if cfg.error_function == "crossentropy":
        per = -t * torch.log(y) if cfg.output.activation == "softmax" else -t * torch.log(y) - (1 - t) * torch.log(1 - y)
    elif cfg.error_function == "scaledmarginalcrossentropy":
        pos = t > 0
        per = torch.where(pos, -cfg.one_scale * torch.log(y) * (y < cfg.one_target),
                          -cfg.zero_scale * torch.log(1 - y) * (y > cfg.zero_target))
    elif cfg.error_function == "l2":
        per = 0.5 * (y - t) ** 2
    else:
        per = (y - t).abs()
    loss = per.sum() / batch
    p = cfg.sparseness_p
    for layer, a in zip(cfg.hidden, kept):
        if layer.sparse or layer.sparseness_penalty:
            rho = a.mean(0)
            loss = loss + cfg.sparseness_beta * (p * torch.log(p / rho) + (1 - p) * torch.log((1 - p) / (1 - rho))).sum()
    return loss + kl_weight * kl


def assert_loss_and_gradients_equal(model, got, want):
    """The sparse loss and its gradients against the dense float64 reference's."""
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    got.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want.backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("error,output", [("ScaledMarginalCrossEntropy", "Sigmoid"), ("CrossEntropy", "Sigmoid"),
                                          ("CrossEntropy", "SoftMax"), ("SMCE", "SoftMax"), ("L2", "Sigmoid"),
                                          ("L1", "Sigmoid"), ("L2", "Linear")])
def test_sparse_loss_equals_dense_reference(error, output):
    model = SparseAutoencoder(network(error, output), seed=3, dtype=torch.float64)
    inputs, targets = random_batch(seed=1), random_batch(seed=2, values=error in ("L2", "L1"))
    got = batch_loss(model, inputs, targets)
    want = dense_reference_loss(model, inputs, targets)
    assert_loss_and_gradients_equal(model, got, want)


@pytest.mark.parametrize("seed", [None, 11])  # inference (no noise; a latent's mean), training (noise from the seed)
@pytest.mark.parametrize("latent", [None, 1])
def test_multinomial_loss_equals_dense_reference(latent, seed):
    """The multinomial likelihood (SoftMax + CrossEntropy) with L2-normalised input and input
    dropout (Mult-DAE); with a latent (Mult-VAE), the reparameterised forward with the model's
    noise and the weighted KL term."""
    cfg = network("CrossEntropy", "SoftMax", hidden=(6, 4, 5), latent=latent, input_dropout=0.3,
                  extra={"InputNormalization": "L2"})
    model = SparseAutoencoder(cfg, seed=3, dtype=torch.float64)
    if latent is not None:  # the latent's weights give a mean and a log-variance
        assert model.hidden[0].weight.shape == (2 * 4, 6)
    inputs, targets = random_batch(seed=1), random_batch(seed=2, values=False)
    got = batch_loss(model, inputs, targets, dropout_seed=seed, kl_weight=0.3)
    want = dense_reference_loss(model, inputs, targets, seed=seed, kl_weight=0.3)
    assert_loss_and_gradients_equal(model, got, want)


def test_kl_weight_rises_linearly_to_beta():
    vae = network(hidden=(6, 4), latent=1).variational
    assert [kl_weight_at(vae, s) for s in (0, 1, 3, 10)] == [0.0, 0.5 / 3, 0.5, 0.5]
    assert kl_weight_at(None, 7) == 0.0
    assert kl_weight_at(dataclasses.replace(vae, anneal_steps=0), 0) == 0.5


def test_initial_rows_do_not_depend_on_the_item_split():
    cfg = network()
    whole = SparseAutoencoder(cfg, seed=5)
    for world in (2, 3, 5):
        bounds = split_bounds(N_ITEMS, world)
        for rank in range(world):
            part = SparseAutoencoder(cfg, ItemParallel(rank, world), seed=5)
            assert torch.equal(part.input_weight, whole.input_weight[bounds[rank]:bounds[rank + 1]])
            assert torch.equal(part.output_weight, whole.output_weight[bounds[rank]:bounds[rank + 1]])
            assert all(torch.equal(a, b) for a, b in zip(part.hidden.parameters(), whole.hidden.parameters()))
    assert not torch.equal(whole.input_weight, SparseAutoencoder(cfg, seed=6).input_weight)


@pytest.fixture(scope="module")
def histories(tmp_path_factory):
    root = tmp_path_factory.mktemp("histories")
    h = generate_user_histories(HistoryConfig(n_users=103, n_items=N_ITEMS, n_interactions=900, min_length=3,
                                              n_clusters=4), seed=1)
    write_csr(root / "all", h.rows)
    return str(root / "all")


STEPS, BATCH = 5, 25  # 25 users: uneven shares on 2 and 3 processes; 103 users: a short last batch


def run_training(model, data, steps=STEPS, checkpoint_path=None, optimizer=None, state=None, device="cpu"):
    optimizer = optimizer or make_optimizer(model, model.config.optimizer)
    dataset = CsrDataset(data)
    cfg = TrainConfig(batch_size=BATCH, epochs=2, seed=7, shuffle=True, max_steps=steps, log_every_steps=1,
                      save_checkpoint_path=checkpoint_path)
    losses = []

    class Capture(RunLogger):
        def record(self, kind, **values):
            if kind == "train":
                losses.append(values["loss"])

    train(model, optimizer, dataset, dataset, cfg, Capture(enabled=False), torch.device(device), state)
    return losses, optimizer


NETWORKS = {
    "dsstne": network,
    # Liang et al.'s Mult-VAE: multinomial likelihood over every process's items, L2-normalised
    # input with dropout, a latent with its noise and the annealed KL term (3 steps to beta).
    "mult_vae": lambda: network("CrossEntropy", "SoftMax", hidden=(6, 4, 5), latent=1, input_dropout=0.3,
                                extra={"InputNormalization": "L2"}),
}


def _worker(rank, world, port, data, out, ckpt, name):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = SparseAutoencoder(NETWORKS[name](), ItemParallel.from_process_group(), seed=3, dtype=torch.float64)
        losses, _ = run_training(model, data, checkpoint_path=ckpt)
        torch.save({"losses": losses, "input": model.input_weight.detach(), "output": model.output_weight.detach(),
                    "bias": model.output_bias.detach(), "hidden": [p.detach() for p in model.hidden.parameters()],
                    "input_bias": model.input_bias.detach()}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(NETWORKS))
@pytest.mark.parametrize("world", [3])  # uneven user and item shares
def test_item_parallel_training_equals_one_process(tmp_path, histories, world, name):
    torch.manual_seed(0)
    reference = SparseAutoencoder(NETWORKS[name](), seed=3, dtype=torch.float64)
    ref_losses, ref_optimizer = run_training(reference, histories, checkpoint_path=str(tmp_path / "one"))
    ckpt = str(tmp_path / "many")
    spawn(_worker, args=(world, free_port(), histories, str(tmp_path), ckpt, name), nprocs=world)
    bounds = split_bounds(N_ITEMS, world)
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        np.testing.assert_allclose(got["losses"], ref_losses, rtol=1e-10)
        sl = slice(bounds[rank], bounds[rank + 1])
        torch.testing.assert_close(got["input"], reference.input_weight.detach()[sl], rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(got["output"], reference.output_weight.detach()[sl], rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(got["bias"], reference.output_bias.detach()[sl], rtol=1e-9, atol=1e-11)
        for a, b in zip(got["hidden"], reference.hidden.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-9, atol=1e-11)
    # The checkpoint written by `world` processes loads on one, weights and optimizer state alike,
    # and training on from it equals training on from the one-process checkpoint.
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    assert meta["world_size"] == world and sum(n.startswith("output_rows_") for n in meta["files"]) == world
    continued = []
    for path in (ckpt, str(tmp_path / "one")):
        model = SparseAutoencoder(NETWORKS[name](), seed=3, dtype=torch.float64)
        optimizer = make_optimizer(model, model.config.optimizer)
        state = checkpoint.load(path, model, optimizer)
        assert (state.step, state.epoch, state.samples) == (STEPS, 1, 103)  # one epoch: 4 x 25 + 3
        losses, _ = run_training(model, histories, steps=3, optimizer=optimizer, state=state)
        continued.append((losses, model.output_weight.detach().clone()))
    np.testing.assert_allclose(continued[0][0], continued[1][0], rtol=1e-10)
    torch.testing.assert_close(continued[0][1], continued[1][1], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_resume_equals_an_uninterrupted_run(tmp_path, histories, name):
    whole = SparseAutoencoder(NETWORKS[name](), seed=3, dtype=torch.float64)
    whole_losses, _ = run_training(whole, histories, steps=7)
    first = SparseAutoencoder(NETWORKS[name](), seed=3, dtype=torch.float64)
    losses, _ = run_training(first, histories, steps=3, checkpoint_path=str(tmp_path / "ck"))
    second = SparseAutoencoder(NETWORKS[name](), seed=9, dtype=torch.float64)  # other weights: from the file
    optimizer = make_optimizer(second, second.config.optimizer)
    state = checkpoint.load(str(tmp_path / "ck"), second, optimizer)
    more, _ = run_training(second, histories, steps=4, optimizer=optimizer, state=state)
    assert losses + more == whole_losses  # float64, same order of operations: bit for bit
    for a, b in zip(second.parameters(), whole.parameters()):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_training_on_cuda_equals_the_cpu(histories):
    """The same float64 weights trained on a GPU follow the CPU step by step (no dropout or
    denoising: their masks come from each device's own generator)."""
    cfg = network(hidden=(6,), extra={"Denoising": {"p": 0.0}})
    cpu = SparseAutoencoder(cfg, seed=3, dtype=torch.float64)
    gpu = copy.deepcopy(cpu).to("cuda")
    cpu_losses, _ = run_training(cpu, histories)
    gpu_losses, _ = run_training(gpu, histories, device="cuda")
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-9)
    for a, b in zip(gpu.parameters(), cpu.parameters()):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-8, atol=1e-10)


def test_checkpoint_of_another_network_is_refused(tmp_path, histories):
    model = SparseAutoencoder(network(), seed=3)
    run_training(model, histories, steps=1, checkpoint_path=str(tmp_path / "ck"))
    other = SparseAutoencoder(network(hidden=(8,)), seed=3)
    with pytest.raises(ValueError, match=r"hidden layers \[6, 5\].*this model has .*\[8\]"):
        checkpoint.load(str(tmp_path / "ck"), other)
    with pytest.raises(ValueError, match="with no latent, this model has the latent 'Hidden2'"):
        checkpoint.load(str(tmp_path / "ck"), SparseAutoencoder(network(latent=1), seed=3))
    with open(tmp_path / "ck" / "output_rows_0_37.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="output_rows_0_37.pt: checksum"):
        checkpoint.load(str(tmp_path / "ck"), SparseAutoencoder(network(), seed=3))


def test_sampled_negatives_estimate_the_full_loss_without_bias():
    cfg = network("CrossEntropy", extra={"SparsenessPenalty": {"p": 0.0, "beta": 0.0}})
    model = SparseAutoencoder(cfg, seed=3, dtype=torch.float64)
    inputs, targets = random_batch(seed=1), random_batch(seed=2, values=False)
    with torch.no_grad():
        full = float(batch_loss(model, inputs, targets))
        draws = np.array([float(batch_loss(model, inputs, targets, negatives=8, sample_seed=s)) for s in range(200)])
    assert abs(draws.mean() - full) < 4 * draws.std() / np.sqrt(len(draws))
    assert draws.std() > 0  # a real sample, not the full sum


def test_rows_taken_in_any_order_match_the_dataset(histories):
    dataset = CsrDataset(histories)
    ids = np.array([5, 0, 102, 5, 17])
    offsets, indices, _ = take_rows(dataset, ids)
    for j, s in enumerate(ids):
        assert indices[offsets[j]:offsets[j + 1]].tolist() == dataset.rows(int(s), int(s) + 1).indices.tolist()
