"""The hidden logistic model that labels synthetic clicks, and the integer hashes it is built on.

    logit = bias + a * linear(x) + b * id_effects(ids) + c * interactions(ids, x)

Per-id quantities (a random effect, a 4-dim vector) come from an integer hash of (table, id)
computed in torch, so no per-id tables are stored and tables with tens of millions of rows cost
no memory; the same ids give the same bits on every device. Ids are drawn from a bounded Zipf
law (``zipf_ids``). ``dlrm.data.synthetic`` turns the model into batches and datasets;
docs/synthetic_data.md describes the model.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dlrm.data.batch import Bags

POOLINGS = ("sum", "mean")

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
# Odd multiplier below 2**31: a 32-bit value times it stays below 2**63, so int64 arithmetic
# never overflows and CPU and CUDA agree bit for bit.
_HASH_MULTIPLIER = 0x45D9F3B
# Id frequencies fall like (id + 1) ** -ZIPF_EXPONENT by default (see `zipf_ids`); at 1.2 the
# inverse CDF takes a fifth power, which a few multiplications compute faster than pow().
ZIPF_EXPONENT = 1.2
_VECTOR_DIM = 4  # dimension of the hidden per-id vectors used by pairwise interactions
_MAX_INTERACTION_TABLES = 8
_MAX_TABLE_PAIRS = 8
_MAX_NUMERICAL_PAIRS = 4
_CALIBRATION_ROWS = 1 << 16


def _splitmix64(x: int) -> int:
    """A well-mixed 64-bit function of a Python int, for deriving seeds and salts."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _derive(*parts: int | str) -> int:
    """A 63-bit seed from a tuple of ints and strings (strings through crc32, stable across runs)."""
    state = 0
    for part in parts:
        value = zlib.crc32(part.encode()) if isinstance(part, str) else int(part)
        state = _splitmix64(state ^ (value & _MASK64))
    return state >> 1


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """Avalanche 32-bit values held in int64, in place (a murmur-style finaliser).

    Products stay below 2**32 * 2**31 = 2**63, so int64 never overflows and every device agrees.
    """
    t = torch.bitwise_right_shift(h, 16)
    h.bitwise_xor_(t).mul_(_HASH_MULTIPLIER).bitwise_and_(_MASK32)
    h.bitwise_xor_(torch.bitwise_right_shift(h, 16, out=t)).mul_(_HASH_MULTIPLIER).bitwise_and_(_MASK32)
    return h.bitwise_xor_(torch.bitwise_right_shift(h, 16, out=t))


def hash_ids(ids: torch.Tensor, salts: torch.Tensor, wide: bool = True) -> torch.Tensor:
    """32-bit hash of (salt, id), elementwise; ids non-negative int64, salts 32-bit int64.

    `wide=False` skips the high 32 bits of the ids (a shortcut for ids known to be < 2**32).

    Only shifts, xors, masks and products below 2**63 are used, so results are identical on
    every device.
    """
    h = _mix32(torch.bitwise_and(ids, _MASK32).bitwise_xor_(salts) if wide else ids ^ salts)
    if wide:
        h = _mix32(h.bitwise_xor_(ids >> 32))
    return h


def zipf_ids(u: torch.Tensor, neg_span: torch.Tensor, max_id: torch.Tensor, exponent: float) -> torch.Tensor:
    """Ids in [0, size) with P(id) proportional to (id + 1) ** -exponent (a bounded, continuous
    Zipf law, floored), from uniforms ``u`` by the inverse CDF; id 0 is the most frequent, as in
    frequency-ranked Criteo ids. ``neg_span = (size + 1) ** (1 - exponent) - 1`` (``log(size + 1)``
    for exponent 1), ``max_id = size - 1``, both in ``u``'s dtype. Overwrites ``u``.

    Skew: 1.2, the default, is this generator's law since it was written (docs/synthetic_data.md);
    NVIDIA's HugeCTR embedding-cache benchmarks draw synthetic ids with exponent 1.1 (and 1.01),
    for which ``zipf_exponent=1.1`` (docs/benchmarks.md, "Tables larger than device memory")."""
    if exponent == 1.0:  # log-uniform: y = (size + 1) ** u
        x = u.mul_(neg_span).exp_().sub_(1.0)
    else:
        base = u.mul_(neg_span).add_(1.0)  # in ((size + 1) ** (1 - exponent), 1] for exponent > 1
        if exponent == 1.2:
            x = base.square().square_().mul_(base).reciprocal_().sub_(1.0)  # base ** -5 - 1, fast
        else:
            x = base.pow_(-1.0 / (exponent - 1.0)).sub_(1.0)
    # Rounding can give x == size for the largest draws; max ids are exact in this dtype.
    return torch.minimum(x, max_id, out=x).long()


def _span_power(exponent: float) -> float:
    """1 - exponent; -1/5 exactly for the default (1 - 1.2 is not -0.2 in binary)."""
    return -1.0 / 5 if exponent == 1.2 else 1.0 - exponent


@dataclass
class _Layout:
    """Which features the hidden model's interaction terms pair up."""

    table_pairs: list[tuple[int, int, float]]  # (table a, table b, sign)
    numerical_pairs: list[int]  # tables whose vector meets a projection of the numerical part
    vector_tables: list[int]  # tables that need a hidden vector (union of the above)


class HiddenModel:
    """The random logistic model that labels synthetic samples.

    It depends only on (num_numerical, table_sizes, seed). Scales and bias are calibrated once,
    on a fixed CPU sample, so that the logit has a set spread and the positive rate a set value
    whatever the feature layout; this makes the Bayes-optimal AUC about the same for 1 table or 26.
    """

    def __init__(
        self,
        num_numerical: int,
        table_sizes: Sequence[int],
        seed: int = 12345,
        logit_std: float = 1.4,
        positive_rate: float = 0.3,
        weights: tuple[float, float, float] = (0.3, 0.4, 0.3),
        bag_sizes: Sequence[int] | None = None,
        pooling: str | Sequence[str] = "sum",
        zipf_exponent: float = ZIPF_EXPONENT,
    ) -> None:
        if not zipf_exponent > 0:
            raise ValueError(f"`zipf_exponent` must be positive, got {zipf_exponent!r}")
        self.zipf_exponent = float(zipf_exponent)
        self.num_numerical = num_numerical
        self.table_sizes = [int(s) for s in table_sizes]
        if any(s < 1 for s in self.table_sizes):
            raise ValueError(f"table sizes must be >= 1, got {self.table_sizes}")
        self.bag_sizes, self.poolings = _bag_config(bag_sizes, pooling, len(self.table_sizes))
        self.seed = seed
        num_tables = len(self.table_sizes)
        gen = torch.Generator().manual_seed(_derive(seed, "hidden model"))

        # Numerical features: counts ~ floor(lognormal), missing -> 0, then log1p (Criteo-like).
        self.num_missing = 0.05 + 0.35 * torch.rand(num_numerical, generator=gen)
        self.num_mu = 4.0 * torch.rand(num_numerical, generator=gen)
        self.num_sigma = 0.5 + 1.5 * torch.rand(num_numerical, generator=gen)
        self.linear = torch.randn(num_numerical, generator=gen)

        # Per-table importance of the id effects (some tables matter more than others).
        self.table_weight = torch.exp(0.7 * torch.randn(num_tables, generator=gen))
        self.salts = torch.tensor(
            [_derive(seed, "salt", t) & _MASK32 for t in range(num_tables)], dtype=torch.int64
        )
        self.vector_salts = torch.tensor(
            [_derive(seed, "vector salt", t) & _MASK32 for t in range(num_tables)], dtype=torch.int64
        )

        order = torch.randperm(num_tables, generator=gen).tolist()
        chosen = order[: min(num_tables, _MAX_INTERACTION_TABLES)]
        candidates = [(a, b) for i, a in enumerate(chosen) for b in chosen[i + 1 :]]
        picks = torch.randperm(len(candidates), generator=gen)[:_MAX_TABLE_PAIRS].tolist()
        signs = torch.randint(0, 2, (len(picks),), generator=gen).mul(2).sub(1).tolist()
        numerical_pairs = chosen[:_MAX_NUMERICAL_PAIRS] if num_numerical > 0 else []
        table_pairs = [(*candidates[p], float(s)) for p, s in zip(picks, signs)]
        used = sorted({t for a, b, _ in table_pairs for t in (a, b)} | set(numerical_pairs))
        self.layout = _Layout(table_pairs, numerical_pairs, used)
        # Maps standardised numerical features to one 4-dim vector per numerical pair: [N, Q*4].
        self.projection = torch.randn(
            num_numerical, len(numerical_pairs) * _VECTOR_DIM, generator=gen
        ) / math.sqrt(max(num_numerical, 1))

        self._device_cache: dict[str, dict[str, torch.Tensor]] = {}
        self._calibrate(logit_std, positive_rate, weights)

    def _calibrate(self, logit_std: float, positive_rate: float, weights: tuple[float, float, float]) -> None:
        """Fix feature standardisation, part scales and bias on a fixed CPU sample."""
        self.num_mean = torch.zeros(self.num_numerical)
        self.num_std = torch.ones(self.num_numerical)
        self.part_scale = torch.zeros(3)
        self.bias = 0.0
        gen = torch.Generator().manual_seed(_derive(self.seed, "calibration"))
        if self.bag_sizes is None:
            numerical, categorical = self.sample_features(_CALIBRATION_ROWS, gen)
        else:  # about as many ids as the one-hot sample (at least 8192 rows): bags cost per id
            rows = len(self.table_sizes) * _CALIBRATION_ROWS // max(sum(self.bag_sizes), 1)
            numerical, categorical = self.sample_bags(min(_CALIBRATION_ROWS, max(rows, 8192)), gen)
        if self.num_numerical:
            self.num_mean = numerical.float().mean(0)
            self.num_std = numerical.float().std(0).clamp_min(1e-3)
        self._device_cache.clear()  # constants changed
        parts = self._parts(numerical, categorical) if self.bag_sizes is None else self._bag_parts(numerical, categorical)
        stds = parts.std(1)
        present = stds > 1e-6  # e.g. no interactions when every table has one row
        w = torch.where(present, torch.tensor(weights, dtype=torch.float32), 0.0)
        if w.sum() > 0:
            self.part_scale = (w / w.sum()).sqrt() / stds.clamp_min(1e-6)
            self.part_scale *= logit_std / (self.part_scale @ parts).std().clamp_min(1e-6)
        self._device_cache.clear()
        self.bias = self._bias_for_rate(self.part_scale @ parts, positive_rate)

    # ----------------------------------------------------------------------------------------
    # Sampling

    def sample_features(
        self, rows: int, gen: torch.Generator, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw (numerical float16 [rows, N], categorical int64 [rows, F]) with `gen`."""
        c = self._constants(device)
        # Categorical: a continuous Zipf (bounded Pareto) law on [1, size + 1) by inverse CDF,
        # floored and shifted to [0, size): id 0 is the most frequent, like frequency-ranked ids.
        u = torch.rand(rows, len(self.table_sizes), generator=gen, device=device, dtype=c["max_id"].dtype)
        categorical = zipf_ids(u, c["neg_zipf_span"], c["max_id"], self.zipf_exponent)
        # Numerical: log1p of floor(lognormal) counts, with missing values as 0 (Criteo-like).
        g = torch.randn(rows, self.num_numerical, generator=gen, device=device)
        missing = torch.rand(rows, self.num_numerical, generator=gen, device=device) < c["num_missing"]
        counts = g.mul_(c["num_sigma"]).add_(c["num_mu"]).exp_().floor_()
        numerical = counts.log1p_().masked_fill_(missing, 0.0).to(torch.float16)
        return numerical, categorical

    def sample_bags(
        self, rows: int, gen: torch.Generator, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, Bags]:
        """Draw (numerical float16 [rows, N], int64 ``Bags`` of ``bag_sizes[t]`` ids per sample of
        table t) with `gen`: each id from the table's Zipf law, independently, so a bag may repeat
        an id (as a user's history repeats an item). Needs ``bag_sizes``."""
        if self.bag_sizes is None:
            raise ValueError("sample_bags needs a hidden model built with `bag_sizes`")
        c = self._constants(device)
        values = []
        for t, size in enumerate(self.bag_sizes):  # feature-major: table t's bags are contiguous
            u = torch.rand(rows * size, generator=gen, device=device, dtype=c["max_id"].dtype)
            values.append(zipf_ids(u, c["neg_zipf_span"][t], c["max_id"][t], self.zipf_exponent))
        g = torch.randn(rows, self.num_numerical, generator=gen, device=device)
        missing = torch.rand(rows, self.num_numerical, generator=gen, device=device) < c["num_missing"]
        counts = g.mul_(c["num_sigma"]).add_(c["num_mu"]).exp_().floor_()
        numerical = counts.log1p_().masked_fill_(missing, 0.0).to(torch.float16)
        lengths = c["bag_sizes"].repeat_interleave(rows)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        return numerical, Bags(torch.cat(values), offsets, len(self.bag_sizes))

    # ----------------------------------------------------------------------------------------
    # The model

    def logit(self, numerical: torch.Tensor, categorical: torch.Tensor | Bags) -> torch.Tensor:
        """The true logit (float32 [B]) of each sample, on the device of the inputs."""
        c = self._constants(numerical.device)
        if isinstance(categorical, Bags):
            return c["part_scale"] @ self._bag_parts(numerical, categorical) + self.bias
        return c["part_scale"] @ self._parts(numerical, categorical) + self.bias

    def _bag_parts(self, numerical: torch.Tensor, bags: Bags) -> torch.Tensor:
        """``_parts`` for bags: each table's per-id effects and vectors pooled over the bag,

            pool(bag) = sum(bag) / sqrt(bag_size)  (sum pooling)   or   sum(bag) / len(bag)  (mean),

        with bag_size the table's configured size (1 without ``bag_sizes``, so bags of one give
        the one-hot logit). The sum is scaled so that a table's share of the logit does not grow
        with its bag size; a sum-pooled embedding bag learns the constant scale."""
        c = self._constants(numerical.device)
        rows = numerical.shape[0]
        if bags.num_features != len(self.table_sizes) or bags.batch_size != rows:
            raise ValueError(f"bags of {bags.num_features} features for {bags.batch_size} samples, expected "
                             f"{len(self.table_sizes)} features for {rows} samples")
        x = (numerical.float() - c["num_mean"]) / c["num_std"]
        linear = x @ c["linear"]
        wide = max(self.table_sizes, default=1) > 2**32
        bounds = bags.offsets[:: max(rows, 1)].tolist() if rows else [0] * (bags.num_features + 1)
        slot = {t: i for i, t in enumerate(self.layout.vector_tables)}
        effects = torch.zeros(len(self.table_sizes), rows, device=numerical.device)
        vectors = torch.zeros(rows, len(slot) * _VECTOR_DIM, device=numerical.device)
        for t in range(len(self.table_sizes)):
            ids = bags.values[bounds[t]:bounds[t + 1]].long()
            ends = bags.offsets[t * rows:(t + 1) * rows + 1] - bounds[t]  # [rows + 1] into ids
            h = hash_ids(ids, c["salts"][t], wide=wide)
            effects[t] = self._pool(h.float().sub_(2**31), ends, t)
            if t in slot:
                hv = _mix32(h.bitwise_xor_(c["vector_salts"][slot[t]]))
                bytes_ = hv.unsqueeze(-1).bitwise_right_shift(c["byte_shifts"]).bitwise_and_(0xFF)
                v = bytes_.float().sub_(127.5).mul_(1 / 73.9)  # [nnz, 4], mean 0, var 1
                vectors[:, slot[t] * _VECTOR_DIM:(slot[t] + 1) * _VECTOR_DIM] = self._pool(v, ends, t)
        id_effects = c["table_weight"] @ effects
        interactions = torch.zeros(rows, device=numerical.device)
        if slot:
            interactions = (vectors * (vectors @ c["pair_matrix"] + x @ c["numerical_matrix"])).sum(1)
        return torch.stack([linear, id_effects, interactions])

    def _pool(self, x: torch.Tensor, ends: torch.Tensor, table: int) -> torch.Tensor:
        """Pool per-id values ``x`` ([nnz] or [nnz, k]) over the bags bounded by ``ends``.

        Bags all of the table's size (generated data) are a reshape and a sum; others (padded or
        variable bags read from disk) take differences of a float64 prefix sum. Both are
        deterministic on every device (no atomics)."""
        size = self.bag_sizes[table] if self.bag_sizes is not None else 1
        mean = self.poolings is not None and self.poolings[table] == "mean"
        rows = ends.shape[0] - 1
        lengths = ends[1:] - ends[:-1]
        if x.shape[0] == rows * size and bool((lengths == size).all()):
            sums = x.view(rows, size, *x.shape[1:]).sum(1)
            return sums.div_(size if mean else math.sqrt(size))
        prefix = torch.cat([x.new_zeros((1, *x.shape[1:]), dtype=torch.float64), x.double().cumsum(0)])
        sums = prefix[ends[1:]] - prefix[ends[:-1]]
        if mean:
            counts = lengths.clamp_min(1).to(torch.float64)
            return (sums / (counts.unsqueeze(-1) if sums.dim() > 1 else counts)).float()
        return (sums / math.sqrt(size)).float()

    def _parts(self, numerical: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        """[3, B] float32: linear numerical part, id effects, interactions (unnormalised)."""
        c = self._constants(numerical.device)
        rows = numerical.shape[0]
        x = (numerical.float() - c["num_mean"]) / c["num_std"]
        linear = x @ c["linear"]

        # One 32-bit hash per (table, id); as a centred uniform it is that id's random effect.
        h = hash_ids(categorical.long(), c["salts"], wide=max(self.table_sizes, default=1) > 2**32)
        id_effects = h.float().sub_(2**31) @ c["table_weight"]

        interactions = torch.zeros(rows, device=numerical.device)
        if self.layout.vector_tables:
            # A second hash gives 4 bytes per (table, id): the id's hidden vector.
            hv = _mix32(h.index_select(1, c["vector_tables"]).bitwise_xor_(c["vector_salts"]))
            bytes_ = hv.unsqueeze(-1).bitwise_right_shift(c["byte_shifts"]).bitwise_and_(0xFF)
            v = bytes_.view(rows, -1).float().sub_(127.5).mul_(1 / 73.9)  # [B, T*4], mean 0, var 1
            # All pair terms as one quadratic form: sum_p sign_p <v_a, v_b> + sum_q <v_t, P_q x>
            # = v . (v @ pair_matrix + x @ numerical_matrix), with block matrices built once.
            interactions = (v * (v @ c["pair_matrix"] + x @ c["numerical_matrix"])).sum(1)
        return torch.stack([linear, id_effects, interactions])

    def _constants(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The model's small tensors on `device`, copied once per device."""
        key = str(torch.device(device))
        if key not in self._device_cache:
            sizes = torch.tensor(self.table_sizes, dtype=torch.float64)
            # Ids are drawn in float32, exact enough below 2**24 rows; larger tables need float64
            # to reach every id.
            dtype = torch.float64 if max(self.table_sizes, default=1) > 2**24 else torch.float32
            tensors = {
                "neg_zipf_span": ((sizes + 1.0).log() if self.zipf_exponent == 1.0
                                  else (sizes + 1.0).pow(_span_power(self.zipf_exponent)) - 1.0).to(dtype),
                "max_id": (sizes - 1.0).to(dtype),  # exact in that dtype
                "num_missing": self.num_missing,
                "num_mu": self.num_mu,
                "num_sigma": self.num_sigma,
                "num_mean": self.num_mean,
                "num_std": self.num_std,
                "linear": self.linear,
                "table_weight": self.table_weight,
                "salts": self.salts,
                "vector_salts": self.vector_salts[self.layout.vector_tables],
                "vector_tables": torch.tensor(self.layout.vector_tables, dtype=torch.int64),
                "byte_shifts": torch.arange(0, 8 * _VECTOR_DIM, 8),
                "pair_matrix": self._pair_matrix(),
                "numerical_matrix": self._numerical_matrix(),
                "part_scale": self.part_scale,
            }
            if self.bag_sizes is not None:
                tensors["bag_sizes"] = torch.tensor(self.bag_sizes, dtype=torch.int64)
            self._device_cache[key] = {k: v.to(device) for k, v in tensors.items()}
        return self._device_cache[key]

    def _pair_matrix(self) -> torch.Tensor:
        """[T*4, T*4]: sign_p * I_4 in the block (slot a, slot b) of every table pair p."""
        slot = {t: i for i, t in enumerate(self.layout.vector_tables)}
        signs = torch.zeros(len(slot), len(slot))
        for a, b, sign in self.layout.table_pairs:
            signs[slot[a], slot[b]] += sign
        return torch.kron(signs, torch.eye(_VECTOR_DIM))

    def _numerical_matrix(self) -> torch.Tensor:
        """[N, T*4]: projection q in the columns of the vector it meets."""
        slot = {t: i for i, t in enumerate(self.layout.vector_tables)}
        out = torch.zeros(self.num_numerical, len(slot) * _VECTOR_DIM)
        for q, t in enumerate(self.layout.numerical_pairs):
            d = _VECTOR_DIM
            out[:, slot[t] * d : (slot[t] + 1) * d] += self.projection[:, q * d : (q + 1) * d]
        return out

    @staticmethod
    def _bias_for_rate(logits: torch.Tensor, rate: float) -> float:
        """The bias b with mean(sigmoid(logits + b)) == rate, by bisection."""
        lo, hi = -30.0, 30.0
        for _ in range(40):  # brackets the bias to 60 / 2**40
            mid = (lo + hi) / 2
            if torch.sigmoid(logits + mid).mean().item() < rate:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2


def _bag_config(
    bag_sizes: Sequence[int] | None, pooling: str | Sequence[str], tables: int
) -> tuple[list[int] | None, list[str] | None]:
    """Checked (bag sizes, poolings) per table, or (None, None) for one-hot data."""
    if bag_sizes is None:
        return None, None
    sizes = [int(b) for b in bag_sizes]
    if len(sizes) != tables or any(b < 1 for b in sizes):
        raise ValueError(f"`bag_sizes` needs one size >= 1 per table ({tables}), got {list(bag_sizes)}")
    poolings = [pooling] * tables if isinstance(pooling, str) else list(pooling)
    if len(poolings) != tables or any(p not in POOLINGS for p in poolings):
        raise ValueError(f"`pooling` must be one of {list(POOLINGS)}, or a list of them with one per table; got {pooling!r}")
    return sizes, poolings
