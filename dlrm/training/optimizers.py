"""The optimizers: one for the embedding tables, one for the dense part, stepped as one.

Embeddings: ``sgd``, ``adagrad`` (one accumulator per weight, torch's sparse-capable Adagrad),
``rowwise_adagrad`` (one accumulator per row, as FBGEMM, TorchRec and MLPerf DLRMv2 train their
tables: 4 bytes of state per row instead of ``4 * dim``) or ``adam`` (``torch.optim.SparseAdam``'s
lazy rule: both moments of a row move only when a batch uses it; NVIDIA's
``--Adam_embedding_optimizer``). Each updates only the rows a batch used.
Dense part: ``sgd``, ``adagrad`` or ``adam`` (torch's own).

``freeze_dense`` / ``freeze_embeddings`` (NVIDIA's ``--freeze_mlps`` / ``--freeze_embeddings``):
the gradients are still computed, but that part's update is never applied, its optimizer state
included.

fp16/bf16 tables (``embedding_dtype``) train with ``sgd`` or ``rowwise_adagrad``: a row's
gradients are summed in fp32, the new row is computed in fp32 from the upcast old one and
rounded once (``dlrm.kernels.rounding``; stochastically for bf16 with ``stochastic_rounding``,
the draw keyed by the embedding group's ``rounding_step``, which checkpoints keep). ``adagrad``
and ``adam`` are refused for them: their fp32 state per weight would take two (four) times the
table's own bytes.

``CombinedOptimizer`` steps both as one optimizer, so that a GradScaler that finds an fp16
overflow skips the embedding update, the dense update and every optimizer-state update together.

``joint_fused`` tables update themselves inside their kernels (``fused_train_step``): they are in
no param group and never stepped here. What this module keeps for them is their optimizer
*state*: with ``rowwise_adagrad`` a ``RowWiseAdagrad`` that holds the fused weights and is never
stepped (``CombinedOptimizer.fused``), so the accumulator has exactly the format, dtype and
initial value of the non-fused path's and checkpoints find it through ``embedding_state``
(``table_<i>_optimizer.pt``) whatever the layout. The dense part of a fused step is applied by
``device_dense_step_``: torch's SGD or Adagrad rule on the torch optimizer's own state tensors,
written with device-side ops only (no host sync, CUDA-graph capturable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import math

import torch

from dlrm.engine.config_check import check_types
from dlrm.kernels.rounding import HALF_DTYPES, round_to

EMBEDDING_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")
# The dense optimizer a run uses when only the embeddings' one is chosen (MLPerf DLRMv2 pairs
# row-wise Adagrad tables with Adagrad MLPs).
DEFAULT_DENSE = {"sgd": "sgd", "adagrad": "adagrad", "rowwise_adagrad": "adagrad", "adam": "adam"}
# What ``embedding_type=joint_fused`` trains with: the tables' rules its kernels implement, and
# the dense rules ``device_dense_step_`` writes out with device-side ops.
FUSED_EMBEDDING_OPTIMIZERS = ("sgd", "rowwise_adagrad")
FUSED_DENSE_OPTIMIZERS = ("sgd", "adagrad")


@dataclass(frozen=True)
class OptimizerConfig:
    embedding: str = "sgd"
    dense: str | None = None  # None: DEFAULT_DENSE[embedding]
    eps: float = 1e-8  # Adagrad, row-wise Adagrad and Adam
    initial_accumulator_value: float = 0.0  # Adagrad and row-wise Adagrad
    stochastic_rounding: bool = True  # bf16 tables: round updated rows stochastically (else to nearest)
    freeze_dense: bool = False  # gradients computed, the dense part never updated (NVIDIA's --freeze_mlps)
    freeze_embeddings: bool = False  # the same for the embedding tables (NVIDIA's --freeze_embeddings)

    def __post_init__(self) -> None:
        # named as dlrm.scripts.main's flags, as validate() names them; the choices and bounds: validate()
        check_types(self, names={"embedding": "optimizer", "dense": "dense_optimizer", "eps": "optimizer_eps",
                                 "freeze_dense": "freeze_mlps"})

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

    def validate_fused(self) -> None:
        """Refuses the optimizers ``embedding_type=joint_fused`` cannot train with."""
        if self.embedding in FUSED_EMBEDDING_OPTIMIZERS and self.dense_optimizer in FUSED_DENSE_OPTIMIZERS:
            return
        raise ValueError(
            f"`embedding_type=joint_fused` updates its tables with `optimizer=sgd` or `optimizer=rowwise_adagrad` "
            f"and its dense part with `dense_optimizer=sgd` or `dense_optimizer=adagrad`; got "
            f"`optimizer={self.embedding}` and `dense_optimizer={self.dense_optimizer}`: choose those, or use "
            "`embedding_type=joint` for the others"
        )

    def validate_table_dtype(self, dtype: torch.dtype) -> None:
        """Refuses ``adagrad`` and ``adam`` for fp16/bf16 tables (see the module docstring)."""
        if self.embedding in ("adagrad", "adam") and dtype in HALF_DTYPES:
            what = "an fp32 accumulator per weight, twice" if self.embedding == "adagrad" else \
                "two fp32 moments per weight, four times"
            raise ValueError(
                f"`optimizer={self.embedding}` keeps {what} the bytes of {dtype} tables: use "
                "`optimizer=rowwise_adagrad` (4 bytes a row) or `optimizer=sgd` with half-precision tables, or "
                "`embedding_dtype=fp32`"
            )

    def dense_state_bytes(self) -> int:
        """Optimizer state per dense weight (fp32): Adagrad's accumulator, Adam's two moments."""
        return {"sgd": 0, "adagrad": 4, "adam": 8}[self.dense_optimizer]

    def state_bytes_per_row(self, dim: int) -> int:
        """Optimizer state an embedding row carries besides its weights (fp32)."""
        return {"sgd": 0, "adagrad": 4 * dim, "rowwise_adagrad": 4, "adam": 8 * dim}[self.embedding]


def _summed_gradient(p: torch.nn.Parameter, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(rows, g)``: the rows a gradient touches (None: all of them, a dense gradient) and their
    gradients with duplicates summed, in ``dtype`` (cast first, so half gradients sum in fp32)."""
    if not p.grad.is_sparse:
        return None, p.grad.to(dtype)
    grad = p.grad.to(dtype).coalesce()
    return grad.indices()[0], grad.values()


def _write_rows_(p: torch.nn.Parameter, rows: torch.Tensor | None, new: torch.Tensor,
                 rounding_step: int | None) -> None:
    """Rows ``rows`` of ``p`` (all with None) := ``new`` (fp32), rounded once into ``p``'s dtype."""
    new = round_to(new, p.dtype, rounding_step)
    if rows is None:
        p.copy_(new)
    else:
        p.index_copy_(0, rows, new)


class _EmbeddingOptimizer(torch.optim.Optimizer):
    """What the embedding rules share: the step over every parameter with a gradient, which
    ``_update_`` (the rule) applies, ``rounding_step`` in each group (counts the steps, keys the
    stochastic rounding draws; a hyperparameter, so checkpoints keep it) and the choice of
    rounding for half tables."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], stochastic_rounding: bool):
        super().__init__(params, {**defaults, "rounding_step": 0})
        self.stochastic_rounding = stochastic_rounding

    def _rounding(self, group: dict[str, Any]) -> int | None:
        return group["rounding_step"] if self.stochastic_rounding else None

    def _update_(self, p: torch.nn.Parameter, group: dict[str, Any]) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update_(p, group)
            group["rounding_step"] += 1
        return loss


class EmbeddingSGD(_EmbeddingOptimizer):
    """Plain SGD on the rows a (sparse) gradient touches: ``w[r] -= lr * g[r]``. fp32 tables step
    exactly as ``torch.optim.SGD`` does; fp16/bf16 tables sum ``g`` in fp32 and round once."""

    def __init__(self, params: Iterable[Any], lr: float, stochastic_rounding: bool = True):
        super().__init__(params, {"lr": lr}, stochastic_rounding)

    def _update_(self, p: torch.nn.Parameter, group: dict[str, Any]) -> None:
        if p.dtype not in HALF_DTYPES:
            p.add_(p.grad, alpha=-group["lr"])
            return
        rows, g = _summed_gradient(p, torch.float32)
        old = p if rows is None else p.index_select(0, rows)
        _write_rows_(p, rows, old.float() - group["lr"] * g, self._rounding(group))


class RowWiseAdagrad(_EmbeddingOptimizer):
    """Adagrad with one accumulator per row: for each row ``r`` a step touches (gradient row
    ``g``, duplicates summed), ``sum[r] += mean(g * g)`` and ``w[r] -= lr * g / (sqrt(sum[r]) + eps)``.
    Sparse gradients update only their rows; a dense gradient updates every row. fp16/bf16 rows
    are computed in fp32 and rounded once."""

    def __init__(self, params: Iterable[Any], lr: float, eps: float = 1e-8, initial_accumulator_value: float = 0.0,
                 stochastic_rounding: bool = True):
        super().__init__(params, {"lr": lr, "eps": eps, "initial_accumulator_value": initial_accumulator_value},
                         stochastic_rounding)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"row-wise Adagrad needs [rows, dim] weights, got shape {tuple(p.shape)}")
                # fp32 (FBGEMM's choice) for fp32/fp16/bf16 weights; float64 weights keep float64
                dtype = torch.promote_types(p.dtype, torch.float32)
                self.state[p]["sum"] = torch.full((p.shape[0],), float(group["initial_accumulator_value"]),
                                                  dtype=dtype, device=p.device)

    def _update_(self, p: torch.nn.Parameter, group: dict[str, Any]) -> None:
        accumulator = self.state[p]["sum"]
        if p.dtype in HALF_DTYPES:  # duplicates summed in fp32, one rounding per row
            rows, values = _summed_gradient(p, accumulator.dtype)
            mean_sq = values.pow(2).mean(dim=1)
            if rows is None:
                old, sums = p, accumulator.add_(mean_sq)
            else:
                old, sums = p.index_select(0, rows), accumulator.index_add_(0, rows, mean_sq)[rows]
            step = values / (sums.sqrt() + group["eps"]).unsqueeze(1) * group["lr"]
            _write_rows_(p, rows, old.float() - step, self._rounding(group))
        elif p.grad.is_sparse:
            grad = p.grad.coalesce()  # duplicates summed: one update per distinct row
            rows, values = grad.indices()[0], grad.values().to(accumulator.dtype)
            accumulator.index_add_(0, rows, values.pow(2).mean(dim=1))
            step = values / (accumulator[rows].sqrt() + group["eps"]).unsqueeze(1)
            p.index_add_(0, rows, step.mul_(-group["lr"]).to(p.dtype))
        else:
            values = p.grad.to(accumulator.dtype)
            accumulator.add_(values.pow(2).mean(dim=1))
            p.sub_((values / (accumulator.sqrt() + group["eps"]).unsqueeze(1) * group["lr"]).to(p.dtype))


class EmbeddingAdam(_EmbeddingOptimizer):
    """Adam on the rows a (sparse) gradient touches, the rule of ``torch.optim.SparseAdam``: for
    each row ``r`` a step touches (gradient row ``g``, duplicates summed), ``m[r] = b1 m[r] + (1 - b1) g``,
    ``v[r] = b2 v[r] + (1 - b2) g * g`` and ``w[r] -= lr * sqrt(1 - b2**t) / (1 - b1**t) * m[r] / (sqrt(v[r]) + eps)``,
    ``t`` counting the steps of the weight. Rows a batch did not use keep their moments ("lazy"
    Adam). A dense gradient updates every row. Unlike ``SparseAdam`` the state exists from the
    start, with ``step`` a 0-dim CPU tensor, so checkpoints save and load it per table before
    the first step as after it. fp32/float64 tables only (``validate_table_dtype``)."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps}, stochastic_rounding=False)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype in HALF_DTYPES:
                    raise ValueError(f"Adam tables keep fp32 moments: {p.dtype} tables take `optimizer=sgd` or "
                                     "`optimizer=rowwise_adagrad`")
                self.state[p]["step"] = torch.zeros((), dtype=torch.float32)
                self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update_(self, p: torch.nn.Parameter, group: dict[str, Any]) -> None:
        state = self.state[p]
        state["step"] += 1
        t = float(state["step"])
        beta1, beta2 = group["betas"]
        step_size = group["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if not p.grad.is_sparse:
            g = p.grad
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-step_size)
            return
        grad = p.grad.coalesce()  # duplicates summed: one update per distinct row
        rows, g = grad.indices()[0], grad.values()
        m_rows = m.index_select(0, rows).mul_(beta1).add_(g, alpha=1 - beta1)
        v_rows = v.index_select(0, rows).mul_(beta2).addcmul_(g, g, value=1 - beta2)
        m.index_copy_(0, rows, m_rows)
        v.index_copy_(0, rows, v_rows)
        p.index_add_(0, rows, m_rows.div_(v_rows.sqrt_().add_(group["eps"])).mul_(-step_size))


def _embedding_optimizer(name: str, params: list[torch.nn.Parameter], lr: float, cfg: OptimizerConfig):
    groups = [{"params": params, "name": "embeddings"}]
    if name == "sgd":
        return EmbeddingSGD(groups, lr=lr, stochastic_rounding=cfg.stochastic_rounding)
    if name == "adagrad":  # torch's Adagrad takes sparse gradients and updates only their rows
        for p in params:
            cfg.validate_table_dtype(p.dtype)
        return torch.optim.Adagrad(groups, lr=lr, eps=cfg.eps, initial_accumulator_value=cfg.initial_accumulator_value)
    if name == "adam":
        for p in params:
            cfg.validate_table_dtype(p.dtype)
        return EmbeddingAdam(groups, lr=lr, eps=cfg.eps)
    return RowWiseAdagrad(groups, lr=lr, eps=cfg.eps, initial_accumulator_value=cfg.initial_accumulator_value,
                          stochastic_rounding=cfg.stochastic_rounding)


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
    embedding part holds other tables (checkpoints store that state per table).

    ``fused`` holds the state of ``joint_fused`` tables (a ``RowWiseAdagrad`` with
    ``rowwise_adagrad``, else None). It is in no param group and never stepped: those tables
    update themselves in ``fused_train_step``, which reads and writes this state in place."""

    def __init__(self, dense: torch.optim.Optimizer, embeddings: torch.optim.Optimizer, config: OptimizerConfig,
                 fused: RowWiseAdagrad | None = None):
        self.dense, self.embeddings, self.config, self.fused = dense, embeddings, config, fused

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
        if not self.config.freeze_dense:
            self.dense.step()
        if not self.config.freeze_embeddings:
            self.embeddings.step()

    def embedding_state(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """The embedding optimizer's state tensors of ``param``, a fused table's included (empty
        for SGD): what checkpoints save and load per table."""
        if self.fused is not None and param in self.fused.state:
            return self.fused.state[param]
        return self.embeddings.state.get(param, {})

    def fused_rowwise_state(self, param: torch.nn.Parameter) -> tuple[torch.Tensor | None, float]:
        """``(accumulator [rows], eps)`` of a ``joint_fused`` weight under ``rowwise_adagrad``;
        ``(None, eps)`` under SGD, whose tables keep no state."""
        if self.fused is None:
            return None, self.config.eps
        return self.fused.state[param]["sum"], self.fused.param_groups[0]["eps"]

    def take_rounding_step(self) -> int | None:
        """For ``joint_fused`` tables, which the embedding optimizer never steps: this step's
        stochastic rounding key (None: round to nearest), counted in the embedding group's
        ``rounding_step`` as the stepped optimizers count theirs."""
        if not self.config.stochastic_rounding:
            return None
        group = self.embeddings.param_groups[0]
        step = group.setdefault("rounding_step", 0)
        group["rounding_step"] = step + 1
        return step

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
    """The run's optimizer. ``joint_fused`` embeddings update themselves (``fused_train_step``),
    so their weights are in no group; they train with ``sgd`` or ``rowwise_adagrad`` (whose
    accumulators ``CombinedOptimizer.fused`` holds) and a ``sgd`` or ``adagrad`` dense part."""
    config.validate()
    fused_params = [p for module in model.fused_embeddings() for p in module.parameters()]
    if fused_params:
        config.validate_fused()
    fused = {id(p) for p in fused_params}
    embedding_params = [p for p in model.sparse_parameters() if id(p) not in fused]
    fused_state = None
    if fused_params and config.embedding == "rowwise_adagrad":
        fused_state = RowWiseAdagrad([{"params": fused_params, "name": "fused_embeddings"}], lr=lr, eps=config.eps,
                                     initial_accumulator_value=config.initial_accumulator_value,
                                     stochastic_rounding=config.stochastic_rounding)
    return CombinedOptimizer(
        _dense_optimizer(config.dense_optimizer, model.replicated_parameters(), lr, config),
        _embedding_optimizer(config.embedding, embedding_params, lr, config),
        config,
        fused_state,
    )


@torch.no_grad()
def device_dense_step_(optimizer: torch.optim.Optimizer, lr: torch.Tensor, skip: torch.Tensor | None = None) -> None:
    """The dense optimizer's step with device-side ops only (no host sync; CUDA-graph capturable):
    what ``fused_train_step`` applies after unscaling the gradients. ``lr`` is a 0-dim float32
    tensor on the weights' device (it replaces the groups' lr); ``skip`` (0-dim bool, or None)
    leaves every weight and every state tensor bit-identical when true.

    ``sgd``: ``p -= lr * g``. ``adagrad``: torch's Adagrad rule on the torch optimizer's own state
    (``sum += g * g; p -= lr * g / (sqrt(sum) + eps)``; ``step`` counts the updates not skipped),
    so its ``state_dict`` is the one ``train_step`` would have written; the count is moved to the
    weights' device once, so that it advances inside a CUDA graph too. ``optimizer`` is a
    ``CombinedOptimizer`` (its dense part steps) or a plain SGD/Adagrad."""
    dense = getattr(optimizer, "dense", optimizer)
    for group in dense.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        grads = [p.grad for p in params]
        if isinstance(dense, torch.optim.SGD) and not (group["momentum"] or group["weight_decay"]):
            _sgd_on_device_(params, grads, lr, skip)
        elif isinstance(dense, torch.optim.Adagrad) and not (group["lr_decay"] or group["weight_decay"]
                                                             or group["maximize"]):
            _adagrad_on_device_(dense, group, params, grads, lr, skip)
        else:
            raise ValueError(f"the fused training step applies plain `dense_optimizer=sgd` or `adagrad` (no momentum, "
                             f"weight decay or lr decay), got {type(dense).__name__}: use `embedding_type=joint`")


def _sgd_on_device_(params, grads, lr, skip) -> None:
    if skip is None:
        torch._foreach_add_(params, torch._foreach_mul(grads, lr.neg()))
        return
    for p, g in zip(params, grads):
        p.sub_(torch.where(skip, 0.0, g * lr))  # where, not 0 * g: g may hold inf/NaN


def _adagrad_on_device_(dense: torch.optim.Adagrad, group: dict[str, Any], params, grads, lr, skip) -> None:
    sums, steps = [], []
    for p in params:
        state = dense.state[p]
        if "sum" not in state:  # torch versions that create the state lazily: create it in their format
            state["step"] = torch.tensor(0.0)
            state["sum"] = torch.full_like(p, group["initial_accumulator_value"], memory_format=torch.preserve_format)
        if state["step"].device != p.device:
            state["step"] = state["step"].to(p.device)
        sums.append(state["sum"])
        steps.append(state["step"])
    if skip is None:
        torch._foreach_add_(steps, 1)
        torch._foreach_addcmul_(sums, grads, grads, value=1)
        numerators = torch._foreach_mul(grads, lr.neg())
    else:
        for step in steps:
            step.add_(skip.logical_not().to(step.dtype))
        # A skipped step keeps the old sums (g may hold inf/NaN) and adds -0.0 to every weight,
        # which leaves any float, -0.0 included, bit-identical.
        new_sums = torch._foreach_addcmul(sums, grads, grads, value=1)
        torch._foreach_copy_(sums, [torch.where(skip, s, n) for s, n in zip(sums, new_sums)])
        numerators = [torch.where(skip, -0.0, g * lr.neg()) for g in grads]
    std = torch._foreach_sqrt(sums)
    torch._foreach_add_(std, group["eps"])
    torch._foreach_addcdiv_(params, numerators, std)
