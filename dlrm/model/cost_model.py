"""Bytes moved and FLOPs of one step, counted from a model config: the floor a measured figure
is read against (docs/benchmarks.md, "Roofline").

The count is the minimum traffic of each part, not what a given kernel does:

- embeddings: every looked-up row read once (``lookups * D`` values in the table's dtype), the
  pooled ``[B, F, D]`` written once in the compute dtype; training adds the pooled gradient read
  once and every distinct row read and written once by the update (``unique_rows``, all lookups
  when not given), with the row-wise Adagrad accumulator (4 bytes a row) read and written too.
  FLOPs: one add per looked-up value to pool, and per distinct row 2 FLOPs a value for SGD (scale
  and subtract; the gradient sums are one add per looked-up value) or 4 for row-wise Adagrad;
- a Linear layer ``in -> out``: ``2 * B * in * out`` FLOPs forward, twice that backward (input
  and weight gradients); bytes: its weights read, its input read and output written forward;
  backward reads the weights, the input and the output gradient, writes the input gradient and
  the weight gradient, and SGD reads weights and gradients and writes the weights;
- dot interaction: the Gram matrix ``[B, n, n]`` of ``n = F + 1`` vectors, ``2 * B * n * n * D``
  FLOPs forward, twice that backward; bytes: ``[B, n, D]`` in and the padded output out
  (backward: the output gradient in, ``[B, n, D]`` out);
- DCNv2 (``L`` layers of rank ``r`` over ``K`` values): ``4 * B * K * r + 3 * B * K`` FLOPs a layer
  forward, the matmuls twice that backward;
- all-to-all (``world_size > 1``): the ``[B, F, D]`` lookups in the compute dtype, the share
  ``(P - 1) / P`` leaving each rank, forward and backward;
- cached host tables: PCIe bytes of the rows fetched (``miss_rate`` of the distinct rows) and the
  as many rows written back (in steady state each fetch evicts a row), with their accumulators.

Activation dtypes: ``compute_bytes`` (2 under bf16/fp16 AMP, 4 in fp32); weights of the dense
layers are fp32 (4 bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dlrm.model.dlrm import DLRMConfig

# NVIDIA H100 SXM5 80GB, from NVIDIA's H100 Tensor Core GPU datasheet: HBM3 bandwidth, dense
# (without sparsity) tensor-core peaks, and PCIe Gen5 x16 per direction (128 GB/s both ways).
H100_SXM = {"hbm_bytes_per_s": 3.35e12, "bf16_flops": 989.4e12, "fp16_flops": 989.4e12, "tf32_flops": 494.7e12,
            "fp32_flops": 66.9e12, "pcie_bytes_per_s": 64e9}


@dataclass
class StepCost:
    """Bytes (device memory), FLOPs and interconnect bytes of one step, by part."""

    hbm_bytes: dict[str, float] = field(default_factory=dict)
    flops: dict[str, float] = field(default_factory=dict)
    pcie_bytes: float = 0.0
    network_bytes: float = 0.0  # all-to-all, per rank

    @property
    def total_bytes(self) -> float:
        return sum(self.hbm_bytes.values())

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    def floor_seconds(self, peak_flops: float, hbm_bytes_per_s: float, pcie_bytes_per_s: float = 0.0) -> float:
        """The roofline floor: the slowest of memory, compute and (when given) PCIe alone."""
        pcie = self.pcie_bytes / pcie_bytes_per_s if pcie_bytes_per_s else 0.0
        return max(self.total_bytes / hbm_bytes_per_s, self.total_flops / peak_flops, pcie)


def step_cost(config: DLRMConfig, batch_size: int, training: bool = True, bag_sizes: Sequence[int] | None = None,
              compute_bytes: int = 2, table_bytes: int = 4, optimizer: str = "sgd",
              unique_rows: float | None = None, world_size: int = 1, miss_rate: float = 0.0) -> StepCost:
    """The cost of one step of ``batch_size`` samples (one process's share of the dense part is
    ``batch_size / world_size``; the tables' lookups cover the global batch). ``bag_sizes``: ids
    per sample of each table (None: one-hot). ``optimizer``: ``"sgd"`` or ``"rowwise_adagrad"``
    for the tables (the dense part counts SGD). ``miss_rate``: share of the distinct rows a
    device cache fetches from host tables each step (0: every table on the device)."""
    if optimizer not in ("sgd", "rowwise_adagrad"):
        raise ValueError(f"`optimizer` must be 'sgd' or 'rowwise_adagrad', got {optimizer!r}")
    cost = StepCost()
    b, d, f = batch_size, config.embedding_dim, config.num_categorical_features
    lookups = b * (sum(bag_sizes) if bag_sizes is not None else f)
    unique = lookups if unique_rows is None else unique_rows
    state = 4 if optimizer == "rowwise_adagrad" else 0
    cost.hbm_bytes["embedding gather"] = lookups * d * table_bytes + b * f * d * compute_bytes
    cost.flops["embedding gather"] = (lookups - b * f) * d  # pooling adds (none for one-hot)
    if training:
        cost.hbm_bytes["embedding update"] = b * f * d * compute_bytes + unique * (2 * d * table_bytes + 2 * state)
        cost.flops["embedding update"] = lookups * d + unique * d * (4 if state else 2)
    cost.pcie_bytes = 2 * miss_rate * unique * (d * table_bytes + state)
    if world_size > 1:
        cost.network_bytes = (2 if training else 1) * b * f * d * compute_bytes * (world_size - 1) / world_size

    local = b / world_size
    top_in = _interaction(cost, config, local, training, compute_bytes)
    for name, sizes, width in (("bottom MLP", config.bottom_mlp_sizes, config.num_numerical_features),
                               ("top MLP", config.top_mlp_sizes, top_in)):
        flops = moved = 0.0
        for out in sizes:
            flops += 2 * local * width * out * (3 if training else 1)
            params = (width * out + out) * 4
            acts = local * (width + out) * compute_bytes
            moved += params + acts if not training else 5 * params + acts + local * (out + 2 * width) * compute_bytes
            width = out
        cost.flops[name], cost.hbm_bytes[name] = flops, moved
    return cost


def _interaction(cost: StepCost, config: DLRMConfig, b: float, training: bool, cb: int) -> int:
    """Adds the interaction's cost; returns its output width (the top MLP's input)."""
    d, n = config.embedding_dim, config.num_categorical_features + 1
    if config.interaction_op in ("dot", "cuda_dot"):
        out = d + n * (n - 1) // 2
        out += -out % 8
        cost.flops["interaction"] = 2 * b * n * n * d * (3 if training else 1)
        cost.hbm_bytes["interaction"] = b * (n * d + out) * cb * (2 if training else 1)
        return out
    k = config.bottom_mlp_sizes[-1] + (n - 1) * d
    if config.interaction_op == "cat":
        cost.flops["interaction"] = 0.0
        cost.hbm_bytes["interaction"] = 2 * b * k * cb * (2 if training else 1)
        return k
    layers, r = config.dcn_num_layers, config.dcn_low_rank_dim
    matmul = 4 * b * k * r
    cost.flops["interaction"] = layers * (matmul * (3 if training else 1) + 3 * b * k * (2 if training else 1))
    params = layers * (2 * k * r + k) * 4
    # per layer: x0 and x_l read, x_{l+1} written (fp32), and the [B, r] middle written and read
    acts = layers * b * (3 * k * 4 + 2 * r * cb)
    cost.hbm_bytes["interaction"] = (5 * params + 2 * acts) if training else (params + acts)
    return k
