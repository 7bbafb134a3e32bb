"""The DLRM model: embeddings and bottom MLP, an interaction, and a top MLP emitting a logit.

``forward`` is ``dense_forward(numerical, exchange(embed(categorical)))``. On one device the
exchange is the identity. Hybrid parallelism keeps this module as is: each process builds only
its own tables (``tables=``), and the exchange is an all-to-all that delivers
``[local batch, F, D]`` to ``dense_forward``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from numbers import Integral

import torch
from torch import nn

from dlrm.data.batch import Bags
from dlrm.data.feature_spec import POOLINGS
from dlrm.engine.config_check import check_types
from dlrm.nn.cached_embedding import CachedEmbedding
from dlrm.nn.embeddings import JointEmbedding, JointFusedEmbedding, MultiTableEmbedding
from dlrm.nn.table_spec import TableShard, TableSpec, table_of
from dlrm.nn.interactions import CatInteraction, DCNInteraction, DotInteraction
from dlrm.nn.mlp import MLP

INTERACTION_OPS = ("dot", "cuda_dot", "cat", "dcn")  # cuda_dot: the fused Triton kernel where it runs, else dot
EMBEDDING_TYPES = ("joint", "multi_table", "joint_fused")
EMBEDDING_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_EMBEDDING_CLASSES = {"joint": JointEmbedding, "multi_table": MultiTableEmbedding, "joint_fused": JointFusedEmbedding}


@dataclass
class DLRMConfig:
    """Everything that fixes the model's shape. Defaults are NVIDIA's Criteo settings."""

    num_numerical_features: int
    table_sizes: list[int]  # rows per embedding table, in global table order
    embedding_dim: int = 128
    bottom_mlp_sizes: list[int] = field(default_factory=lambda: [512, 256, 128])
    top_mlp_sizes: list[int] = field(default_factory=lambda: [1024, 1024, 512, 256, 1])
    interaction_op: str = "dot"  # "dot" | "cuda_dot" (same result, fused kernel) | "cat" | "dcn" (DCNv2)
    # "joint" (one table + offsets) | "multi_table" (one per feature) | "joint_fused" (joint, with
    # a fused gather and an in-place SGD / row-wise Adagrad update kernel instead of sparse gradients)
    embedding_type: str = "joint"
    hash_indices: bool = False  # ids -> id % table_size inside the model
    # interaction_op="dcn" only: cross layers, and the rank r of each layer's K -> r -> K product.
    # Last, so positional construction of the fields above keeps working; saved configs without
    # them (older checkpoints) load with these defaults.
    dcn_num_layers: int = 3
    dcn_low_rank_dim: int = 512
    # Per table, how a multi-hot bag is pooled: "sum" or "mean" (None: all "sum"). One-hot ids
    # are bags of one, where both agree. Last with a default, so older saved configs load.
    poolings: list[str] | None = None
    # How the tables are stored: "fp32", or "fp16" / "bf16" (half the bytes; updated in fp32
    # arithmetic and rounded once per row, see dlrm.kernels.rounding). Last, so older configs load.
    embedding_dtype: str = "fp32"

    def __post_init__(self) -> None:
        check_types(self)  # the shape's bounds: validate()

    @property
    def num_categorical_features(self) -> int:
        return len(self.table_sizes)

    def validate(self) -> None:
        """Raise ValueError naming the offending field and how to fix it."""
        if not _is_positive_int(self.num_numerical_features):
            raise ValueError(
                f"num_numerical_features must be a positive integer (at least 1 numerical feature), "
                f"got {self.num_numerical_features!r}"
            )
        if not self.table_sizes:
            raise ValueError("table_sizes is empty: the model needs at least 1 embedding table")
        _check_positive_list("table_sizes", self.table_sizes)
        if not _is_positive_int(self.embedding_dim):
            raise ValueError(f"embedding_dim must be a positive integer, got {self.embedding_dim!r}")
        _check_positive_list("bottom_mlp_sizes", self.bottom_mlp_sizes)
        _check_positive_list("top_mlp_sizes", self.top_mlp_sizes)
        if self.top_mlp_sizes[-1] != 1:
            raise ValueError(
                f"top_mlp_sizes[-1] must be 1 (the model emits one logit per sample), got "
                f"{self.top_mlp_sizes[-1]}: append 1 to top_mlp_sizes"
            )
        if self.interaction_op not in INTERACTION_OPS:
            raise ValueError(f"interaction_op must be one of {INTERACTION_OPS}, got {self.interaction_op!r}")
        if self.embedding_type not in EMBEDDING_TYPES:
            raise ValueError(f"embedding_type must be one of {EMBEDDING_TYPES}, got {self.embedding_type!r}")
        # Checked whatever the interaction: a bad value is a mistake even where it goes unused.
        for name, meaning in (("dcn_num_layers", "cross layers"), ("dcn_low_rank_dim", "rank of each cross layer")):
            value = getattr(self, name)
            if not _is_positive_int(value):
                raise ValueError(
                    f"`{name}` ({meaning} of interaction_op='dcn') must be a positive integer, got {value!r}"
                )
        self._validate_poolings()
        if self.embedding_dtype not in EMBEDDING_DTYPES:
            raise ValueError(
                f"`embedding_dtype` must be one of {list(EMBEDDING_DTYPES)}, got {self.embedding_dtype!r}"
            )
        if self.interaction_op in ("dot", "cuda_dot") and self.bottom_mlp_sizes[-1] != self.embedding_dim:
            raise ValueError(
                f"bottom_mlp_sizes[-1] ({self.bottom_mlp_sizes[-1]}) must equal embedding_dim "
                f"({self.embedding_dim}) for interaction_op={self.interaction_op!r}: the bottom output is dotted with "
                f"every embedding; make the last bottom layer {self.embedding_dim} wide or set "
                f"embedding_dim={self.bottom_mlp_sizes[-1]}"
            )

    def _validate_poolings(self) -> None:
        if self.poolings is None:
            return
        if isinstance(self.poolings, str) or len(self.poolings) != len(self.table_sizes):
            raise ValueError(
                f"`poolings` must list one pooling per table ({len(self.table_sizes)} tables), got "
                f"{self.poolings!r}: give one of {list(POOLINGS)} for each table, or `poolings=None` for all 'sum'"
            )
        bad = [p for p in self.poolings if p not in POOLINGS]
        if bad:
            raise ValueError(
                f"`poolings` may only hold {list(POOLINGS)}, got {bad} in {list(self.poolings)}: "
                f"set each table's pooling to 'sum' or 'mean'"
            )


def _table_blocks(config: DLRMConfig, tables: Sequence[int | TableShard]) -> list[TableShard]:
    """Every table to build as a block of rows (a whole table: all of them), checked against the config."""
    blocks = []
    for entry in tables:
        table = table_of(entry)
        table = operator.index(table) if isinstance(table, Integral) else table
        if not (isinstance(table, int) and 0 <= table < config.num_categorical_features):
            raise ValueError(f"table index {table!r} out of range for {config.num_categorical_features} tables")
        rows = config.table_sizes[table]
        block = entry if isinstance(entry, TableShard) else TableShard(table, 0, rows)
        if not 0 <= block.start < block.stop <= rows:
            raise ValueError(f"rows [{block.start}, {block.stop}) of table {table} are not a non-empty block of its "
                             f"{rows} rows")
        blocks.append(block)
    return blocks


def _check_host_tables(config: DLRMConfig, blocks: list[TableShard], host_tables: Sequence[int]) -> set[int]:
    """``host_tables`` as a set, each a whole table among ``blocks``."""
    host = set()
    for table in host_tables:
        table = operator.index(table) if isinstance(table, Integral) else table
        block = next((b for b in blocks if b.table == table), None)
        if block is None:
            raise ValueError(f"`host_tables` lists table {table!r}, which is not among the tables built here")
        if block != TableShard(table, 0, config.table_sizes[table]):
            raise ValueError(f"`host_tables` lists table {table}, a row-wise block: only whole tables stay on the host")
        host.add(table)
    return host


def _columns(categorical: torch.Tensor | Bags, columns: list[int]) -> torch.Tensor | Bags:
    """The ids of ``columns`` (positions among the model's tables)."""
    return categorical.select(columns) if isinstance(categorical, Bags) else categorical[:, columns]


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_positive_list(name: str, values: list[int]) -> None:
    if not values:
        raise ValueError(f"{name} is empty: give at least one layer size")
    bad = [v for v in values if not _is_positive_int(v)]
    if bad:
        raise ValueError(f"{name} must contain positive integers only, got {bad} in {list(values)}")


class DLRM(nn.Module):
    """Click-through model: logits ``[B]`` from numerical ``[B, N]`` and categorical ids ``[B, F]``
    (one-hot) or ``Bags`` of ``F`` features (multi-hot, pooled per table by ``config.poolings``)."""

    def __init__(
        self, config: DLRMConfig, device: torch.device | str | None = None,
        tables: Sequence[int | TableShard] | None = None, host_tables: Sequence[int] = (),
        host_cache_rows: int = 0,
    ) -> None:
        """``tables``: the embedding tables to build (all by default), each a global table index
        or a ``TableShard`` (a block of a table's rows, for row-wise sharding). Hybrid parallelism
        builds each process's share; ``embed`` then takes those tables' columns only.
        ``host_tables``: whole tables among them to keep in host memory and look up on the host
        (``host_embeddings``), for a model whose tables do not all fit on ``device``.
        ``host_cache_rows``: with ``joint_fused``, look the host tables up through that many
        rows cached on ``device`` (``dlrm.nn.cached_embedding``) instead of on the host."""
        super().__init__()
        config.validate()
        self.config = config
        blocks = _table_blocks(config, range(config.num_categorical_features) if tables is None else tables)
        host = _check_host_tables(config, blocks, host_tables)
        if host_cache_rows and config.embedding_type != "joint_fused":
            raise ValueError(f"`host_cache_rows` needs embedding_type='joint_fused', got {config.embedding_type!r}")
        # Positions of the device and the host tables among ``blocks`` (the input's columns).
        self._device_columns = [i for i, block in enumerate(blocks) if block.table not in host]
        self._host_columns = [i for i, block in enumerate(blocks) if block.table in host]
        self.embeddings = self._embedding_module([blocks[i] for i in self._device_columns], device)
        # On the host: the same tables, with the same per-table initialisation (the seed is
        # shared, the draws are made on ``device``).
        self.host_embeddings = None if not host else self._embedding_module(
            [blocks[i] for i in self._host_columns], "cpu", init_seed=self.embeddings.init_seed, init_device=device,
            cache=None if not host_cache_rows else {"cache_rows": host_cache_rows, "cache_device": device})
        order = torch.tensor(self._device_columns + self._host_columns, dtype=torch.int64).argsort()
        self.register_buffer("_column_order", order.to(torch.get_default_device() if device is None else device),
                             persistent=False)
        self.bottom_mlp = MLP(config.num_numerical_features, config.bottom_mlp_sizes, relu_last=True, device=device)
        num_features = config.num_categorical_features + 1  # the bottom output is one more feature
        if config.interaction_op in ("dot", "cuda_dot"):
            use_kernel = config.interaction_op == "cuda_dot"
            self.interaction = DotInteraction(num_features, config.embedding_dim, use_kernel=use_kernel)
        elif config.interaction_op == "dcn":
            # Its kernels draw from the global generator here, between the bottom and top MLPs.
            self.interaction = DCNInteraction(
                num_features, config.embedding_dim, config.bottom_mlp_sizes[-1], num_layers=config.dcn_num_layers,
                low_rank_dim=config.dcn_low_rank_dim, device=device,
            )
        else:
            self.interaction = CatInteraction(num_features, config.embedding_dim, config.bottom_mlp_sizes[-1])
        self.interaction.to(torch.get_default_device() if device is None else device)  # its buffers
        self.top_mlp = MLP(self.interaction.num_outputs, config.top_mlp_sizes, relu_last=False, device=device)
        # Between the halves: nothing on one device; hybrid parallelism puts its all-to-all here.
        self.exchange: nn.Module = nn.Identity()

    def _embedding_module(self, blocks: list[TableShard], device: torch.device | str | None,
                          init_seed: int | None = None,
                          init_device: torch.device | str | None = None,
                          cache: dict | None = None) -> JointEmbedding | MultiTableEmbedding:
        config = self.config
        specs = [TableSpec(block.table, config.table_sizes[block.table], block.start, block.stop,
                           "sum" if config.poolings is None else config.poolings[block.table]) for block in blocks]
        make = _EMBEDDING_CLASSES[config.embedding_type] if cache is None else partial(CachedEmbedding, **cache)
        return make(
            specs, config.embedding_dim, hash_indices=config.hash_indices, device=device, init_seed=init_seed,
            init_device=init_device, weight_dtype=EMBEDDING_DTYPES[config.embedding_dtype], empty_ok=True,
        )

    def embedding_modules(self) -> list[JointEmbedding | MultiTableEmbedding]:
        """Every module holding tables: ``embeddings``, and ``host_embeddings`` when some tables
        are kept in host memory (checkpoints and optimizers go through all of them)."""
        return [self.embeddings] + ([self.host_embeddings] if self.host_embeddings is not None else [])

    def forward(self, numerical: torch.Tensor, categorical: torch.Tensor | Bags) -> torch.Tensor:
        return self.dense_forward(numerical, self.exchange(self.embed(categorical)))

    def host_ids(self, categorical: torch.Tensor | Bags) -> torch.Tensor | Bags:
        """The ids of the tables kept in host memory, what ``host_embeddings`` looks up (and
        what its cache fetches ahead for the next batch)."""
        return _columns(categorical, self._host_columns)

    def embed(self, categorical: torch.Tensor | Bags) -> torch.Tensor:
        """Ids ``[B, T]`` (any integer dtype) or ``Bags`` with ``T`` features, for the tables built
        here -> embeddings ``[B, T, D]`` (bags pooled by each table's pooling)."""
        if self.host_embeddings is None:
            return self.embeddings(categorical)
        device = self._column_order.device
        on_device = self.embeddings(_columns(categorical, self._device_columns)) if self._device_columns else None
        # The host tables' ids go to the host and their embeddings come back, in the device
        # part's dtype (cast before the copy: under AMP half the bytes cross the bus).
        host_ids = self.host_ids(categorical)  # a cache looks them up on the device
        on_host = self.host_embeddings(host_ids if isinstance(self.host_embeddings, CachedEmbedding)
                                       else host_ids.to("cpu"))
        on_host = on_host.to(on_device.dtype if on_device is not None else self.embeddings.output_dtype())
        if on_host.device != device:
            on_host = (on_host.pin_memory().to(device, non_blocking=True) if device.type == "cuda"
                       else on_host.to(device))
        if on_device is None:
            return on_host
        return torch.cat([on_device, on_host], dim=1).index_select(1, self._column_order)

    def dense_forward(self, numerical: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """Bottom MLP, interaction with ``embedded`` ``[B, F, D]``, top MLP -> logits ``[B]``."""
        if not torch.is_autocast_enabled(numerical.device.type):
            # Storage dtype (e.g. float16 from disk) -> parameter dtype; autocast casts by itself.
            numerical = numerical.to(next(self.bottom_mlp.parameters()).dtype)
        bottom = self.bottom_mlp(numerical)
        return self.top_mlp(self.interaction(bottom, embedded)).squeeze(1)

    def sparse_parameters(self) -> list[nn.Parameter]:
        """Embedding weights: their gradients are sparse and need a sparse-capable optimizer."""
        return [p for module in self.embedding_modules() for p in module.parameters()]

    def fused_embeddings(self) -> list[JointFusedEmbedding]:
        """Embedding modules that apply their own update, SGD or row-wise Adagrad
        (``embedding_type='joint_fused'``): their weights get no gradient, ``fused_train_step``
        updates them."""
        return [module for module in self.embedding_modules() if isinstance(module, JointFusedEmbedding)]

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Every parameter that is not an embedding weight (the MLPs, the interaction's): every
        process holds them whole and the engine sums their gradients (``dlrm.engine.model_contract``)."""
        sparse = {id(p) for p in self.sparse_parameters()}
        return [p for p in self.parameters() if id(p) not in sparse]
