"""The sparse autoencoder as torch modules: a bag lookup in, a fully connected hidden stack,
every item scored out; this process's item slice of the two item layers only
(``item_parallel`` explains the split).

Weights follow the network definition: the first hidden layer's incoming weights are the input
table ``[n_input, H1]`` (row i = item i's weights, so a user's pre-activation is the bag sum of
their items' rows, weighted by their values), and the output layer's are ``[n_output, H_last]``
(row i scores item i). Initial weights are drawn in blocks of rows from generators keyed by the
seed, the layer and the block, so a process that owns rows ``[a, b)`` holds exactly the rows that
one process would (``dlrm.nn.init`` does the same for embedding tables).

Losses are DSSTNE's, summed over items and averaged over the batch's users, computed as a dense
term for "every item is a zero target" plus a correction at the user's few target items: the
sparse targets never become a dense ``[B, n_items]`` matrix.

Two additions serve Liang et al.'s Mult-DAE and Mult-VAE (``network.py``'s ``InputNormalization``
and ``Variational``): each user's input row can be L2-normalised before the first layer, and one
hidden layer can be the VAE's latent, emitting a mean and a log-variance (twice its width) and
passing on a reparameterised sample during training, the mean otherwise. Every random draw of
training (dropout masks, the latent's noise) is made for the whole batch from a generator
keyed by the step, so it does not depend on the process count and a resumed run repeats it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dlrm.engine.random_streams import INIT_BLOCK_ROWS, block_generator
from dlrm.recommender.item_parallel import ItemParallel
from dlrm.recommender.network import NetworkConfig

LRELU_SLOPE = 0.01  # DSSTNE's leaky-ReLU slope
_KEY_OUTPUT = 1_000  # generator keys: hidden layer i (incoming weights) is i, the output layer this
# Training-noise keys beside hidden layer i's dropout (key i): the input's dropout, the latent's noise.
NOISE_INPUT_DROPOUT = 10_001
NOISE_LATENT = 10_002
_NORM_EPS = 1e-12  # an empty or all-zero row stays zero


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """An element-wise activation by its canonical name (softmax is handled by the loss and the
    scorer, since it spans the whole catalogue)."""
    table: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": F.relu,
        "lrelu": lambda x: F.leaky_relu(x, LRELU_SLOPE), "elu": F.elu, "selu": F.selu,
        "softplus": F.softplus, "linear": lambda x: x,
    }
    if name not in table:
        raise ValueError(f"activation {name!r} cannot be applied element-wise here")
    return table[name]


def _draw_(block: torch.Tensor, init, fan_in: int, fan_out: int, generator: torch.Generator) -> None:
    """One block of weights by DSSTNE's schemes (``WeightInit.Scheme``), scaled by ``Scale``."""
    scheme, scale = init.scheme, init.scale
    if scheme == "xavier":
        bound = scale * math.sqrt(6.0 / (fan_in + fan_out))
        block.uniform_(-bound, bound, generator=generator)
    elif scheme == "caffexavier":
        bound = scale * math.sqrt(3.0 / fan_out)
        block.uniform_(-bound, bound, generator=generator)
    elif scheme == "gaussian":
        block.normal_(0.0, scale, generator=generator)
    elif scheme == "uniform":
        block.uniform_(-scale, scale, generator=generator)
    elif scheme == "unitball":
        block.uniform_(0.0, scale, generator=generator)
    elif scheme == "constant":
        block.fill_(scale)
    else:
        raise ValueError(f"weight init scheme {scheme!r} is not known")


def init_rows_(weight: torch.Tensor, init, fan_in: int, fan_out: int, seed: int, key: int, first_row: int,
               total_rows: int) -> None:
    """Rows ``[first_row, first_row + len(weight))`` of a ``[total_rows, width]`` weight matrix
    whose blocks of ``INIT_BLOCK_ROWS`` rows each come from their own generator: the same values
    whichever range a process builds."""
    rows, width = weight.shape
    stop = first_row + rows
    with torch.no_grad():
        for block in range(first_row // INIT_BLOCK_ROWS, -(-stop // INIT_BLOCK_ROWS) if rows else 0):
            lo, hi = block * INIT_BLOCK_ROWS, min((block + 1) * INIT_BLOCK_ROWS, total_rows)
            start, end = max(lo, first_row), min(hi, stop)
            drawn = torch.empty(hi - lo, width, dtype=weight.dtype, device=weight.device)
            _draw_(drawn, init, fan_in, fan_out, block_generator(seed, key, weight.device, block))
            weight[start - first_row:end - first_row].copy_(drawn[start - lo:end - lo])


def local_bags(offsets: torch.Tensor, indices: torch.Tensor, values: torch.Tensor | None, start: int,
               stop: int, n_items: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The part of a CSR batch whose ids fall in ``[start, stop)``, ids made local (``- start``)."""
    if start == 0 and stop == n_items:
        return offsets, indices, values
    keep = (indices >= start) & (indices < stop)
    rows = torch.repeat_interleave(torch.arange(offsets.numel() - 1, device=indices.device), offsets.diff())
    counts = torch.bincount(rows[keep], minlength=offsets.numel() - 1)
    local_offsets = torch.cat([offsets.new_zeros(1), counts.cumsum(0)])
    return local_offsets, indices[keep] - start, None if values is None else values[keep]


class SparseAutoencoder(nn.Module):
    """This process's part of the network: input rows and output rows of its item ranges, the
    whole (replicated) hidden stack. ``forward`` takes the global batch as CSR (every process
    reads the same batch) and returns the logits of all the batch's users for this process's
    output items, ``[B, n_output_local]``. Dropout masks come from a generator shared by all
    processes and cover the whole batch, so the result equals one process's."""

    def __init__(self, config: NetworkConfig, parallel: ItemParallel = ItemParallel(), seed: int = 0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__()
        if config.input.n is None or config.output.n is None:
            raise ValueError("the network's `N` \"auto\" sizes must be resolved from the datasets first "
                             "(NetworkConfig.resolve)")
        if not config.hidden:
            raise ValueError(f"{config.source or 'the network'}: needs at least one Hidden layer between Input and "
                             "Output (the input table is the first hidden layer's weights)")
        if config.output.p_dropout:
            raise ValueError(f"{config.source or 'the network'}: `pDropout` on the Output layer is not supported; "
                             "drop it (dropout applies to inputs and hidden layers)")
        self.config, self.parallel, self.seed = config, parallel, seed
        self.n_input, self.n_output = config.input.n, config.output.n
        self.input_range = parallel.item_range(self.n_input)
        self.output_range = parallel.item_range(self.n_output)
        names = [layer.name for layer in config.hidden]
        self.latent = names.index(config.variational.layer) if config.variational is not None else None
        widths = [layer.n for layer in config.hidden]
        # Incoming weights per hidden layer: the latent's give a mean and a log-variance.
        outs = [2 * n if i == self.latent else n for i, n in enumerate(widths)]
        first = config.hidden[0]
        kw = {"device": device, "dtype": dtype}
        self.input_weight = nn.Parameter(torch.empty(self.input_range[1] - self.input_range[0], outs[0], **kw))
        init_rows_(self.input_weight, first.weight_init, self.n_input, outs[0], seed, 0, self.input_range[0],
                   self.n_input)
        self.input_bias = nn.Parameter(torch.full((outs[0],), first.weight_init.bias, **kw))
        self.hidden = nn.ModuleList()
        for i, (layer, fan_in) in enumerate(zip(config.hidden[1:], widths[:-1]), start=1):
            linear = nn.Linear(fan_in, outs[i], **kw)
            init_rows_(linear.weight, layer.weight_init, fan_in, outs[i], seed, i, 0, outs[i])
            with torch.no_grad():
                linear.bias.fill_(layer.weight_init.bias)
            self.hidden.append(linear)
        out = config.output
        self.output_weight = nn.Parameter(torch.empty(self.output_range[1] - self.output_range[0], widths[-1], **kw))
        init_rows_(self.output_weight, out.weight_init, widths[-1], self.n_output, seed, _KEY_OUTPUT,
                   self.output_range[0], self.n_output)
        self.output_bias = nn.Parameter(torch.full((self.output_weight.shape[0],), out.weight_init.bias, **kw))
        self._activations = [activation(layer.activation) for layer in config.hidden]

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Weights every process holds whole (their gradients are summed across processes)."""
        return [self.input_bias, *self.hidden.parameters()]

    def input_values(self, offsets: torch.Tensor, indices: torch.Tensor, values: torch.Tensor | None,
                     dropout_seed: int | None = None) -> torch.Tensor | None:
        """The weights the input table's rows are summed with: the CSR's values (None: ones),
        L2-normalised per user under ``InputNormalization`` L2, then with the Input layer's
        ``pDropout`` (inverted, each entry kept with probability 1 - p, for the whole batch) when
        ``dropout_seed`` is given. Every process reads the whole batch, so the norms are the whole
        rows' and the masks the same everywhere."""
        p = self.config.input.p_dropout if dropout_seed is not None else 0.0
        if self.config.input_normalization == "none" and p == 0:
            return values
        dtype = self.input_weight.dtype
        v = torch.ones(indices.numel(), dtype=dtype, device=indices.device) if values is None else values.to(dtype)
        if self.config.input_normalization == "l2":
            rows = torch.repeat_interleave(torch.arange(offsets.numel() - 1, device=indices.device), offsets.diff())
            squares = torch.zeros(offsets.numel() - 1, dtype=dtype, device=indices.device).index_add_(0, rows, v * v)
            v = v / squares.sqrt().clamp_min(_NORM_EPS)[rows]
        if p > 0:
            keep = batch_noise(dropout_seed, NOISE_INPUT_DROPOUT, (indices.numel(),), indices.device) >= p
            v = v * keep.to(dtype) / (1.0 - p)
        return v

    def encode(self, offsets: torch.Tensor, indices: torch.Tensor, values: torch.Tensor | None,
               dropout_seed: int | None = None, keep_hidden: list[torch.Tensor] | None = None,
               keep_latent: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Global batch CSR -> every user's last hidden activations ``[B, H_last]``. With
        ``dropout_seed`` (training), the layers' ``pDropout`` apply and the latent passes on a
        sample; ``keep_hidden`` collects each hidden layer's activations of this process's users
        (for the sparseness penalty), ``keep_latent`` the latent's mean and log-variance (for
        the KL term)."""
        batch = offsets.numel() - 1
        values = self.input_values(offsets, indices, values, dropout_seed)
        lo, hi = self.input_range
        bag_offsets, bag_ids, bag_values = local_bags(offsets, indices, values, lo, hi, self.n_input)
        weight = self.input_weight
        if torch.is_autocast_enabled(weight.device.type):  # embedding_bag is not autocast: run it in the compute dtype
            weight = weight.to(torch.get_autocast_dtype(weight.device.type))
            bag_values = None if bag_values is None else bag_values.to(weight.dtype)
        partial = F.embedding_bag(bag_ids, weight, bag_offsets, mode="sum", per_sample_weights=bag_values,
                                  include_last_offset=True)
        users = self.parallel.user_range(batch)
        x = self.parallel.scatter_sum(partial) + self.input_bias
        for i, layer in enumerate(self.config.hidden):
            if i:
                x = self.hidden[i - 1](x)
            if i == self.latent:
                mean, log_var = x.chunk(2, dim=1)
                if keep_latent is not None:
                    keep_latent += [mean, log_var]
                x = mean
                if dropout_seed is not None:  # the reparameterisation trick: mean + sigma * N(0, 1)
                    noise = batch_noise(dropout_seed, NOISE_LATENT, (batch, layer.n), x.device, normal=True)
                    x = mean + torch.exp(0.5 * log_var) * noise[users[0]:users[1]].to(x.dtype)
            x = self._activations[i](x)
            if keep_hidden is not None:
                keep_hidden.append(x)
            if dropout_seed is not None and layer.p_dropout > 0:
                x = _dropout(x, layer.p_dropout, dropout_seed, i, batch, users)
        return self.parallel.gather(x, batch)

    def score(self, hidden: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (pre-activations) of this process's output items ``[B, n_local]``, or of the
        local ``columns`` only (sampled training)."""
        if columns is None:
            return F.linear(hidden, self.output_weight, self.output_bias)
        return F.linear(hidden, self.output_weight[columns], self.output_bias[columns])

    def forward(self, offsets: torch.Tensor, indices: torch.Tensor, values: torch.Tensor | None = None,
                dropout_seed: int | None = None) -> torch.Tensor:
        return self.score(self.encode(offsets, indices, values, dropout_seed))


def batch_noise(seed: int, key: int, shape: tuple[int, ...], device: torch.device, normal: bool = False) -> torch.Tensor:
    """Float32 noise (uniform in [0, 1), or standard normal) for the whole batch from a
    generator keyed by ``(seed, key)``, alike on every process: the caller slices its users'."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + key) % (2**63 - 1))
    draw = torch.randn if normal else torch.rand
    return draw(shape, generator=generator, device=device)


def _dropout(x: torch.Tensor, p: float, seed: int, layer: int, batch: int, users: tuple[int, int]) -> torch.Tensor:
    """Inverted dropout with a mask drawn for the whole batch from a generator every process
    seeds alike, sliced to this process's users: the mask does not depend on the process count."""
    keep = batch_noise(seed, layer, (batch, x.shape[1]), x.device)[users[0]:users[1]] >= p
    return x * keep.to(x.dtype) / (1.0 - p)
