"""The optimizers: one for the embedding tables, one for the dense part, stepped as one.

Embeddings: ``sgd``, ``adagrad`` (one accumulator per weight, torch's sparse-capable Adagrad) or
``rowwise_adagrad`` (one accumulator per row, as FBGEMM, TorchRec and MLPerf DLRMv2 train their
tables: 4 bytes of state per row instead of ``4 * dim``). Each updates only the rows a batch used.
Dense part: ``sgd``, ``adagrad`` or ``adam`` (torch's own).

``CombinedOptimizer`` steps both as one optimizer, so that a GradScaler that finds an fp16
overflow skips the embedding update, the dense update and every optimizer-state update together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

EMBEDDING_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")
# The dense optimizer a run uses when only the embeddings' one is chosen (MLPerf DLRMv2 pairs
# row-wise Adagrad tables with Adagrad MLPs).
DEFAULT_DENSE = {"sgd": "sgd", "adagrad": "adagrad", "rowwise_adagrad": "adagrad"}


@dataclass(frozen=True)
class OptimizerConfig:
    embedding: str = "sgd"
    dense: str | None = None  # None: DEFAULT_DENSE[embedding]
    eps: float = 1e-8  # Adagrad, row-wise Adagrad and Adam
    initial_accumulator_value: float = 0.0  # Adagrad and row-wise Adagrad

    @property
    def dense_optimizer(self) -> str:
        return DEFAULT_DENSE.get(self.embedding, "sgd") if self.dense is None else self.dense

    def validate(self) -> None:
        if self.embedding not in EMBEDDING_OPTIMIZERS:
            raise ValueError(f"`optimizer` must be one of {EMBEDDING_OPTIMIZERS}, got {self.embedding!r}")
        if self.dense_optimizer not in DENSE_OPTIMIZERS:
            raise ValueError(f"`dense_optimizer` must be one of {DENSE_OPTIMIZERS}, got {self.dense!r}")
        if not self.eps > 0:
            raise ValueError(f"`optimizer_eps` must be positive, got {self.eps}")
        if not self.initial_accumulator_value >= 0:
            raise ValueError(f"`initial_accumulator_value` must be >= 0, got {self.initial_accumulator_value}")

    def state_bytes_per_row(self, dim: int) -> int:
        """Optimizer state an embedding row carries besides its weights (fp32)."""
        return {"sgd": 0, "adagrad": 4 * dim, "rowwise_adagrad": 4}[self.embedding]


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per row: for each row ``r`` a step touches (gradient row
    ``g``, duplicates summed), ``sum[r] += mean(g * g)`` and ``w[r] -= lr * g / (sqrt(sum[r]) + eps)``.
    Sparse gradients update only their rows; a dense gradient updates every row."""

    def __init__(self, params: Iterable[Any], lr: float, eps: float = 1e-8, initial_accumulator_value: float = 0.0):
        super().__init__(params, {"lr": lr, "eps": eps, "initial_accumulator_value": initial_accumulator_value})
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"row-wise Adagrad needs [rows, dim] weights, got shape {tuple(p.shape)}")
                # fp32 (FBGEMM's choice) for fp32/fp16/bf16 weights; float64 weights keep float64
                dtype = torch.promote_types(p.dtype, torch.float32)
                self.state[p]["sum"] = torch.full((p.shape[0],), float(group["initial_accumulator_value"]),
                                                  dtype=dtype, device=p.device)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                accumulator = self.state[p]["sum"]
                grad = p.grad
                if grad.is_sparse:
                    grad = grad.coalesce()  # duplicates summed: one update per distinct row
                    rows, values = grad.indices()[0], grad.values().to(accumulator.dtype)
                    accumulator.index_add_(0, rows, values.pow(2).mean(dim=1))
                    step = values / (accumulator[rows].sqrt() + group["eps"]).unsqueeze(1)
                    p.index_add_(0, rows, step.mul_(-group["lr"]).to(p.dtype))
                else:
                    values = grad.to(accumulator.dtype)
                    accumulator.add_(values.pow(2).mean(dim=1))
                    p.sub_((values / (accumulator.sqrt() + group["eps"]).unsqueeze(1) * group["lr"]).to(p.dtype))
        return loss


def _embedding_optimizer(name: str, params: list[torch.nn.Parameter], lr: float, cfg: OptimizerConfig):
    groups = [{"params": params, "name": "embeddings"}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if name == "adagrad":  # torch's Adagrad takes sparse gradients and updates only their rows
        return torch.optim.Adagrad(groups, lr=lr, eps=cfg.eps, initial_accumulator_value=cfg.initial_accumulator_value)
    return RowWiseAdagrad(groups, lr=lr, eps=cfg.eps, initial_accumulator_value=cfg.initial_accumulator_value)


def _dense_optimizer(name: str, params: list[torch.nn.Parameter], lr: float, cfg: OptimizerConfig):
    groups = [{"params": params, "name": "dense"}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(groups, lr=lr, eps=cfg.eps, initial_accumulator_value=cfg.initial_accumulator_value)
    return torch.optim.Adam(groups, lr=lr, eps=cfg.eps)


class CombinedOptimizer:
    """The dense and the embedding optimizer as one: ``param_groups`` lists both (dense first:
    the LR schedule and the GradScaler see every group), ``step`` steps both, and the state dict
    keeps them apart, because the dense part is the same on every process while each process's
    embedding part holds other tables (checkpoints store that state per table)."""

    def __init__(self, dense: torch.optim.Optimizer, embeddings: torch.optim.Optimizer, config: OptimizerConfig):
        self.dense, self.embeddings, self.config = dense, embeddings, config

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.dense.param_groups + self.embeddings.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none=set_to_none)
        self.embeddings.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ValueError("CombinedOptimizer.step takes no closure")
        self.dense.step()
        self.embeddings.step()

    def embedding_state(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """The embedding optimizer's state tensors of ``param`` (empty for SGD)."""
        return self.embeddings.state.get(param, {})

    def state_dict(self) -> dict[str, Any]:
        """Dense state in full; the embeddings' hyperparameters only (their state goes per table)."""
        embeddings = self.embeddings.state_dict()
        return {"format": "combined", "dense_optimizer": self.config.dense_optimizer,
                "embedding_optimizer": self.config.embedding, "dense": self.dense.state_dict(),
                "embedding_param_groups": [{k: v for k, v in g.items() if k != "params"}
                                           for g in embeddings["param_groups"]]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Loads what ``state_dict`` wrote (the embeddings' per-table state is loaded apart)."""
        self.dense.load_state_dict(saved["dense"])
        for group, saved_group in zip(self.embeddings.param_groups, saved["embedding_param_groups"]):
            group.update(saved_group)


def make_optimizer(model: torch.nn.Module, lr: float, config: OptimizerConfig = OptimizerConfig()) -> CombinedOptimizer:
    """The run's optimizer. ``joint_fused`` embeddings update themselves (``fused_train_step``,
    plain SGD), so their weights are in no group and they take ``sgd`` only."""
    config.validate()
    fused = {id(p) for module in model.fused_embeddings() for p in module.parameters()}
    if fused and (config.embedding != "sgd" or config.dense_optimizer != "sgd"):
        raise ValueError(
            f"`embedding_type=joint_fused` updates with SGD inside its kernels; got `optimizer={config.embedding}` "
            f"and `dense_optimizer={config.dense_optimizer}`: use `embedding_type=joint` for other optimizers"
        )
    embedding_params = [p for p in model.sparse_parameters() if id(p) not in fused]
    return CombinedOptimizer(
        _dense_optimizer(config.dense_optimizer, model.dense_parameters(), lr, config),
        _embedding_optimizer(config.embedding, embedding_params, lr, config),
        config,
    )
