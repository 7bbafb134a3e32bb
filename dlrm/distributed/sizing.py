"""How many processes (GPUs, Spark tasks) a model needs, and the memory of each: the sizing
formula a cluster is planned with before any data moves.

Per process, for ``N`` processes and a global batch ``B``:

    tables      the planner's fullest rank: rows x dim x bytes per weight, plus optimizer state
    dense       MLP (and DCN) parameters x (weight + gradient + optimizer state), replicated
    activations ceil(B / N) samples x compute bytes x (4 F D + 2 (sum of MLP widths + interaction width))
                (the F embeddings of a sample, the exchange's send and receive buffers, and the
                gradients of each; the MLP activations and their gradients): an estimate

and ``N`` fits when ``tables <= 0.9 x device memory - dense - activations`` on every rank. One
process with tables in host memory caches their rows in what its device has left
(``device_reserve_bytes``: the dense part and the activations; ``host_table_cache_rows=auto``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dlrm.distributed.plan import Plan, PlanError
from dlrm.distributed.planner import plan_tables
from dlrm.model.dlrm import DLRM, DLRMConfig

USABLE_FRACTION = 0.9  # of a device's memory; the rest is the framework's and the allocator's


@dataclass(frozen=True)
class Sizing:
    processes: int
    table_bytes: int  # the fullest rank's tables and their optimizer state
    dense_bytes: int
    activation_bytes: int
    plan: Plan | None  # None when the tables do not fit this many processes

    @property
    def total_bytes(self) -> int:
        return self.table_bytes + self.dense_bytes + self.activation_bytes


def dense_parameters(config: DLRMConfig) -> int:
    """Parameters outside the embedding tables (built on the meta device: nothing allocated)."""
    return sum(p.numel() for p in DLRM(config, tables=[], device="meta").parameters())


def activation_bytes_per_sample(config: DLRMConfig, compute_bytes: int) -> int:
    model = DLRM(config, tables=[], device="meta")
    widths = sum(config.bottom_mlp_sizes) + model.interaction.num_outputs + sum(config.top_mlp_sizes)
    features = config.num_categorical_features
    return compute_bytes * (4 * features * config.embedding_dim + 2 * widths)


def size_processes(
    config: DLRMConfig,
    batch_size: int,
    device_bytes: int,
    process_counts: list[int],
    state_bytes_per_row: int = 0,
    bytes_per_value: int = 4,
    dense_state_bytes: int = 0,
    compute_bytes: int = 4,
) -> list[Sizing]:
    """The sizing of each process count: tables placed by the planner (whole, or split row-wise
    when a table fits no process), in what each process has left after its dense part and its
    activations. ``dense_state_bytes`` is the dense optimizer's state per parameter (Adagrad: 4)."""
    dense = dense_bytes(config, dense_state_bytes)
    per_sample = activation_bytes_per_sample(config, compute_bytes)
    out = []
    for n in process_counts:
        activations = math.ceil(batch_size / n) * per_sample
        capacity = int(USABLE_FRACTION * device_bytes) - dense - activations
        try:
            if capacity <= 0:
                raise PlanError("no memory left for tables")
            plan = plan_tables(config.table_sizes, config.embedding_dim, n, capacity,
                               state_bytes_per_row=state_bytes_per_row, bytes_per_value=bytes_per_value)
            tables = max(plan.rank_bytes(r) for r in range(n))
        except PlanError:
            plan, tables = None, sum(config.table_sizes) * (config.embedding_dim * bytes_per_value
                                                             + state_bytes_per_row) // n
        out.append(Sizing(n, tables, dense, activations, plan))
    return out


def format_sizing(sizings: list[Sizing], device_bytes: int) -> str:
    gib = 2**30
    lines = [f"Sizing for devices of {device_bytes / gib:.1f} GiB ({USABLE_FRACTION:.0%} usable), per process:",
             f"{'processes':>9}  {'fits':>4}  {'tables GiB':>10}  {'dense GiB':>9}  {'activations GiB':>15}  "
             f"{'total GiB':>9}"]
    for s in sizings:
        tables = f"{s.table_bytes / gib:.2f}" + ("" if s.plan else "*")
        lines.append(f"{s.processes:>9}  {'yes' if s.plan else 'no':>4}  {tables:>10}  {s.dense_bytes / gib:>9.2f}  "
                     f"{s.activation_bytes / gib:>15.2f}  {s.total_bytes / gib:>9.2f}")
    if any(s.plan is None for s in sizings):
        lines.append("* no placement fits: the tables' bytes evenly divided, for scale")
    return "\n".join(lines)


def dense_bytes(config: DLRMConfig, dense_state_bytes: int = 0, training: bool = True) -> int:
    """Device bytes of the dense part: fp32 weights, and when training their gradients and the
    optimizer's state (``dense_state_bytes`` per weight)."""
    return dense_parameters(config) * (4 + (4 + dense_state_bytes if training else 0))


def device_reserve_bytes(config: DLRMConfig, batch_size: int, dense_state_bytes: int = 0, compute_bytes: int = 4,
                         training: bool = True) -> int:
    """What one process's device needs besides its tables for a batch of ``batch_size``: the
    dense part (``dense_bytes``) and the activations (the module docstring's estimate). The
    device cache of host tables is sized in what is left (``host_table_cache_rows=auto``)."""
    return dense_bytes(config, dense_state_bytes, training) + batch_size * activation_bytes_per_sample(
        config, compute_bytes)
