"""Fused embedding kernels (gather in the compute dtype, deduplicating in-place SGD update) and
``JointFusedEmbedding``.

The kernels are checked against independent references: ``weight[rows]`` in torch for the
gather, a float64 ``index_add`` for the update, and for the module the sparse-gradient path
(``JointEmbedding`` + ``torch.optim.SGD``). Without CUDA the kernels run in Triton's
interpreter on CPU tensors (tests/conftest.py); ``gpu`` tests repeat the checks at Criteo sizes.
"""

import pytest
import torch

from dlrm.kernels import backend
from dlrm.kernels.embedding import (
    UPDATE_TILE,
    UPDATE_TILES,
    _sgd_update_triton,
    gather,
    gather_reference,
    sgd_update,
    sgd_update_reference,
    supports_gather,
    supports_update,
)
from dlrm.nn.embeddings import JointEmbedding, JointFusedEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
needs_triton = pytest.mark.skipif(not backend.triton_installed(), reason="needs Triton")


def scalars(lr: float, grad_scale: float = 1.0, skip: bool = False, device=DEVICE):
    """The 0-dim device tensors the update takes."""
    return (torch.tensor(lr, device=device), torch.tensor(grad_scale, device=device),
            torch.tensor(skip, device=device))


def expected_update(weight, rows, grad, lr, grad_scale=1.0):
    """The update in float64: every occurrence of a row adds its gradient."""
    return weight.double().index_add(0, rows, grad.double(), alpha=-lr * grad_scale)


def assert_gather_equal(out, expected, weight_dtype):
    """Exact, except that Triton's interpreter truncates when it narrows to bf16 (the GPU
    and torch round to nearest even): there it may differ by one bf16 ulp."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    narrowing_to_bf16 = out.dtype == torch.bfloat16 and weight_dtype != torch.bfloat16
    if narrowing_to_bf16 and out.device.type == "cpu":
        torch.testing.assert_close(out.float(), expected.float(), rtol=2.0**-7, atol=0.0)
    else:
        assert torch.equal(out, expected)


# ----------------------------------------------------------------------------- gather


@needs_triton
@pytest.mark.parametrize("weight_dtype", FLOATS)
@pytest.mark.parametrize("out_dtype", FLOATS)
@pytest.mark.parametrize("dim,n", [(1, 1), (16, 37), (64, 5), (128, 64), (256, 3), (37, 129)])
def test_gather_matches_reference(weight_dtype, out_dtype, dim, n):
    g = torch.Generator().manual_seed(dim * 1000 + n)
    weight = torch.randn(50, dim, generator=g).to(weight_dtype).to(DEVICE)
    rows = torch.randint(0, 50, (n,), generator=g).to(DEVICE)
    assert supports_gather(weight, rows, out_dtype)
    out = gather(weight, rows, out_dtype)
    assert_gather_equal(out, weight[rows].to(out_dtype), weight_dtype)


@needs_triton
def test_gather_of_views_with_row_stride_and_offset():
    big = torch.randn(40, 24, device=DEVICE)
    rows = torch.tensor([0, 3, 3, 9, 1], device=DEVICE)
    for weight in (big[::2], big[7:30]):  # row stride 48; storage offset 7 rows
        assert supports_gather(weight, rows, torch.float16)
        assert torch.equal(gather(weight, rows, torch.float16), weight[rows].half())


@needs_triton
def test_gather_no_ids():
    weight = torch.randn(5, 8, device=DEVICE)
    out = gather(weight, torch.zeros(0, dtype=torch.int64, device=DEVICE), torch.bfloat16)
    assert out.shape == (0, 8) and out.dtype == torch.bfloat16


@needs_triton
def test_gather_kernel_reads_zeros_for_out_of_range_ids():
    """The data layer checks ids; the kernel must still never read outside the table."""
    weight = torch.randn(6, 16, device=DEVICE)
    rows = torch.tensor([2, 6, -1, 1_000_000, 5], device=DEVICE)
    assert supports_gather(weight, rows, torch.float32)
    out = gather(weight, rows, torch.float32)
    assert torch.equal(out[[0, 4]], weight[[2, 5]])
    assert torch.all(out[1:4] == 0)


# ----------------------------------------------------------------------------- sgd_update


def zipf_rows(n: int, num_rows: int, hot_fraction: float, g: torch.Generator) -> torch.Tensor:
    """Ids with a heavy tail (P(k) ~ 1/(k+1)) plus one hot id 0 in ``hot_fraction`` of them."""
    rows = (num_rows ** torch.rand(n, generator=g, dtype=torch.float64)).long() - 1
    rows[torch.rand(n, generator=g) < hot_fraction] = 0
    return rows.clamp_(0, num_rows - 1)


def id_pattern(kind: str, n: int, num_rows: int, g: torch.Generator) -> torch.Tensor:
    if kind == "hot":  # one id in most positions, runs across many tiles and programs
        return zipf_rows(n, num_rows, 0.7, g)
    if kind == "all_same":
        return torch.full((n,), num_rows // 2, dtype=torch.int64)
    if kind == "all_distinct":
        return torch.randperm(num_rows, generator=g)[:n]
    return torch.randint(0, num_rows, (n,), generator=g)  # "random": some duplicates


def assert_update_matches(weight0, weight, rows, grad, lr, grad_scale, atol=1e-5):
    expected = expected_update(weight0, rows, grad, lr, grad_scale)
    torch.testing.assert_close(weight.double(), expected, rtol=1e-5, atol=atol)
    untouched = torch.ones(weight0.shape[0], dtype=torch.bool, device=weight0.device)
    untouched[rows] = False
    assert torch.equal(weight[untouched], weight0[untouched])  # bit for bit


# The interpreter runs a program's segmented scan one element at a time, so an update costs
# about (sorted positions, rounded up to whole programs) x (columns, rounded up to a block).
# Small programs (2 tiles of 16: a run carried from tile to tile and shared between programs)
# keep every case below to a few dozen ids; test_sgd_update_default_program_shape runs the
# public function with its own program shape.
SMALL_TILE, SMALL_TILES = 16, 2
SMALL_SPAN = SMALL_TILE * SMALL_TILES


def small_program_update(weight, rows, grad, lr, grad_scale, skip):
    """``sgd_update``'s kernel path, with programs of ``SMALL_SPAN`` sorted positions."""
    assert supports_update(weight, rows, grad, lr, grad_scale, skip)
    _sgd_update_triton(weight, rows, grad, lr, grad_scale, skip, tile=SMALL_TILE, tiles=SMALL_TILES)


def run_spans(rows: torch.Tensor, span: int) -> list[tuple[int, int]]:
    """``(first program, last program)`` of every run of equal ids in sorted order."""
    sorted_rows = torch.sort(rows.cpu()).values
    _, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    ends = torch.cumsum(counts, 0)
    return [(int(e - c) // span, int(e - 1) // span) for e, c in zip(ends, counts)]


UPDATES = [
    pytest.param(small_program_update, marks=needs_triton, id="kernel"),
    pytest.param(sgd_update_reference, id="reference"),
]


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("kind,n,num_rows", [("hot", 120, 30), ("all_same", 70, 9), ("all_distinct", 64, 64),
                                             ("random", 41, 30)])
@pytest.mark.parametrize("dim", [1, 16, 33, 128])
def test_sgd_update_matches_float64(update, kind, n, num_rows, dim):
    g = torch.Generator().manual_seed(n + dim)
    weight0 = torch.randn(num_rows, dim, generator=g).to(DEVICE)
    rows = id_pattern(kind, n, num_rows, g).to(DEVICE)
    grad = torch.randn(n, dim, generator=g).to(DEVICE)
    lr, scale, skip = scalars(0.1, 0.5)
    assert n > SMALL_SPAN  # more than one program
    spans = run_spans(rows, SMALL_SPAN)
    if kind in ("hot", "all_same"):  # a run covers a whole program and shares both its ends
        assert any(last - first >= 2 for first, last in spans)
    if kind == "random":  # some duplicates
        assert len(spans) < n
    weight = weight0.clone()
    update(weight, rows, grad, lr, scale, skip)
    assert_update_matches(weight0, weight, rows, grad, 0.1, 0.5)


@needs_triton
def test_sgd_update_default_program_shape():
    """The public function at its own program shape: a hot run shared by two programs."""
    g = torch.Generator().manual_seed(11)
    weight0 = torch.randn(30, 16, generator=g).to(DEVICE)
    rows = zipf_rows(300, 30, 0.9, g).to(DEVICE)
    grad = torch.randn(300, 16, generator=g).to(DEVICE)
    args = scalars(0.1, 0.5)
    assert supports_update(weight0, rows, grad, *args)
    assert any(last > first for first, last in run_spans(rows, UPDATE_TILE * UPDATE_TILES))
    weight = weight0.clone()
    sgd_update(weight, rows, grad, *args)
    assert_update_matches(weight0, weight, rows, grad, 0.1, 0.5)


@needs_triton
@pytest.mark.parametrize("tile,tiles", [(16, 1), (16, 2), (32, 3)])
def test_sgd_update_runs_shared_by_many_programs(tile, tiles):
    """Small programs, so a hot run crosses many of them (atomics) and others cross tiles
    inside one program (carried partial sums)."""
    g = torch.Generator().manual_seed(tile * tiles)
    weight0 = torch.randn(40, 12, generator=g).to(DEVICE)
    rows = zipf_rows(300, 40, 0.6, g).to(DEVICE)
    grad = torch.randn(300, 12, generator=g).to(DEVICE)
    spans = run_spans(rows, tile * tiles)
    assert max(last - first for first, last in spans) >= 2  # the hot run: whole programs inside it
    assert sum(last > first for first, last in run_spans(rows, tile)) >= 2  # and another run crosses a tile
    weight = weight0.clone()
    _sgd_update_triton(weight, rows, grad, *scalars(0.05, 2.0), tile=tile, tiles=tiles)
    assert_update_matches(weight0, weight, rows, grad, 0.05, 2.0)


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_sgd_update_half_gradients_accumulate_in_fp32(update, grad_dtype):
    g = torch.Generator().manual_seed(5)
    weight0 = torch.randn(20, 16, generator=g).to(DEVICE)
    rows = zipf_rows(150, 20, 0.8, g).to(DEVICE)
    grad = torch.randn(150, 16, generator=g).to(grad_dtype).to(DEVICE)
    # Summing the hot row's ~120 values in half precision would be off by far more than atol.
    hot = grad[rows == 0].cpu()
    half_sum = torch.zeros(16, dtype=grad_dtype)
    for value in hot:
        half_sum += value
    assert len(hot) > 100
    assert (0.01 * (half_sum.double() - hot.double().sum(0))).abs().max() > 1e-5
    weight = weight0.clone()
    update(weight, rows, grad, *scalars(0.01, 1.0))
    assert_update_matches(weight0, weight, rows, grad, 0.01, 1.0, atol=2e-6)


@pytest.mark.parametrize("update", UPDATES)
def test_sgd_update_skip_leaves_weight_bit_identical(update):
    g = torch.Generator().manual_seed(6)
    weight0 = torch.randn(30, 16, generator=g).to(DEVICE)
    weight0[3] = -0.0  # a signed zero must keep its sign
    rows = torch.tensor([3, 3, 7, 0, 29, 7, 3], device=DEVICE)
    grad = torch.randn(7, 16, generator=g).to(DEVICE)
    grad[1, 2] = float("nan")
    grad[4, 0] = float("inf")
    weight = weight0.clone()
    update(weight, rows, grad, *scalars(0.1, 1.0, skip=True))
    assert torch.equal(weight.view(torch.int32), weight0.view(torch.int32))


@pytest.mark.parametrize("update", UPDATES)
def test_sgd_update_nonfinite_gradient_stays_in_its_row(update):
    """An inf in one row's gradient must not leak into rows summed beside it."""
    g = torch.Generator().manual_seed(7)
    weight0 = torch.randn(10, 16, generator=g).to(DEVICE)
    rows = torch.tensor([1, 2, 2, 5, 1, 8], device=DEVICE)
    grad = torch.randn(6, 16, generator=g).to(DEVICE)
    grad[3, 4] = float("inf")  # row 5
    weight = weight0.clone()
    update(weight, rows, grad, *scalars(0.1))
    assert weight[5, 4] == float("-inf")
    finite = torch.tensor([1, 2, 8], device=DEVICE)
    expected = expected_update(weight0, rows, grad, 0.1)
    torch.testing.assert_close(weight[finite].double(), expected[finite], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("update", UPDATES)
def test_sgd_update_no_ids(update):
    weight = torch.randn(4, 16, device=DEVICE)
    before = weight.clone()
    update(weight, torch.zeros(0, dtype=torch.int64, device=DEVICE), torch.zeros(0, 16, device=DEVICE), *scalars(1.0))
    assert torch.equal(weight, before)


# ----------------------------------------------------------------------------- fallbacks


def fallback_case(dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(8)
    weight = torch.randn(12, 16, generator=g).to(dtype).to(device)
    rows = torch.tensor([1, 1, 4, 11, 1, 0], device=device)
    grad = torch.randn(6, 16, generator=g).to(device)
    return weight, rows, grad, scalars(0.3, 0.5, device=device)


def assert_reference_taken(weight, rows, grad, scalar_args, out_dtype):
    """``supports_*`` refuse, and the public functions return the reference's results."""
    assert not supports_gather(weight, rows, out_dtype)
    assert not supports_update(weight, rows, grad, *scalar_args)
    assert torch.equal(gather(weight, rows, out_dtype), gather_reference(weight, rows, out_dtype))
    updated, expected = weight.clone(), weight.clone()
    sgd_update(updated, rows, grad, *scalar_args)
    sgd_update_reference(expected, rows, grad, *scalar_args)
    assert torch.equal(updated, expected)
    assert_update_matches(weight, updated, rows, grad, 0.3, 0.5)


def test_fallback_float64_weight():
    weight, rows, grad, scalar_args = fallback_case(torch.float64, DEVICE)
    assert_reference_taken(weight, rows, grad, scalar_args, torch.float64)


def test_fallback_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert_reference_taken(*fallback_case(), torch.float16)


def test_fallback_without_triton(monkeypatch):
    monkeypatch.setattr(backend, "triton_installed", lambda: False)
    weight, rows, grad, scalar_args = fallback_case(device=DEVICE)
    assert_reference_taken(weight, rows, grad, scalar_args, torch.bfloat16)


def test_fallback_unsupported_layouts():
    weight, rows, grad, scalar_args = fallback_case(device=DEVICE)
    assert not supports_gather(weight.t(), rows)  # columns not contiguous
    assert not supports_gather(weight, rows.int())
    assert not supports_update(weight.half(), rows, grad, *scalar_args)
    assert not supports_update(weight, rows, torch.randn(6, 32, device=DEVICE)[:, ::2], *scalar_args)
    assert not supports_update(weight, rows[:-1], grad, *scalar_args)
    int_rows = rows.int()
    updated, expected = weight.clone(), weight.clone()
    sgd_update(updated, int_rows, grad, *scalar_args)
    sgd_update_reference(expected, rows, grad, *scalar_args)
    assert torch.equal(updated, expected)
    assert torch.equal(gather(weight.t().contiguous().t(), int_rows, torch.float32), weight[rows])


# ----------------------------------------------------------------------------- module

SIZES = [3, 7, 1, 12, 5]
DIM = 8


def random_ids(batch: int, seed: int, sizes=SIZES) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, rows, (batch,), generator=g) for rows in sizes], dim=1).to(DEVICE)


def module_pair(**kwargs) -> tuple[JointEmbedding, JointFusedEmbedding]:
    joint = JointEmbedding(SIZES, DIM, device=DEVICE, init_seed=3, **kwargs)
    fused = JointFusedEmbedding(SIZES, DIM, device=DEVICE, init_seed=3, **kwargs)
    assert torch.equal(joint.weight, fused.weight)  # same init from the same seed
    return joint, fused


def test_fused_forward_equals_joint_and_keeps_checkpoint_layout():
    joint, fused = module_pair()
    ids = random_ids(17, seed=1)
    assert torch.equal(fused(ids), joint(ids))
    assert set(fused.state_dict()) == {"weight"}
    other = JointFusedEmbedding(SIZES, DIM, device=DEVICE, init_seed=99)
    other.load_state_dict(joint.state_dict())
    for i in range(len(SIZES)):
        assert torch.equal(other.table_weight(i), joint.table_weight(i))


def test_fused_forward_in_autocast_dtype():
    joint, fused = module_pair()
    ids = random_ids(9, seed=2)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = fused(ids)
    assert out.dtype == torch.bfloat16 and out.shape == (9, len(SIZES), DIM)
    assert_gather_equal(out, joint(ids).to(torch.bfloat16), torch.float32)
    assert fused(ids).dtype == torch.float32  # autocast off again
    fused.double()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        assert fused(ids).dtype == torch.float64  # as autocast, which leaves float64 alone


class TinyModel(torch.nn.Module):
    """Embeddings -> a linear head -> a logit, enough for gradients that mix rows."""

    def __init__(self, embeddings: torch.nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings
        torch.manual_seed(0)
        self.head = torch.nn.Linear(len(SIZES) * DIM, 1, device=DEVICE)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embeddings(ids).flatten(1).float()).squeeze(1)


def bce(model: TinyModel, ids: torch.Tensor, seed: int) -> torch.Tensor:
    labels = torch.randint(0, 2, (ids.shape[0],), generator=torch.Generator().manual_seed(seed)).float()
    return torch.nn.functional.binary_cross_entropy_with_logits(model(ids), labels.to(DEVICE))


@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
def test_fused_sgd_steps_equal_sparse_sgd(loss_scale):
    """What the training step does (with fp16 loss scaling: ``loss * scale`` backward, update
    with ``grad_scale = 1 / scale``) equals torch's SGD on the sparse gradient."""
    joint, fused = module_pair()
    reference, model = TinyModel(joint), TinyModel(fused)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt_head = torch.optim.SGD(model.head.parameters(), lr=0.5)
    for step in range(2):  # the second step's gradients come from the weights the first one moved
        ids = random_ids(32, seed=10 + step)  # small tables: many duplicate rows per batch
        opt_ref.zero_grad()
        bce(reference, ids, step).backward()
        opt_ref.step()
        opt_head.zero_grad()
        (bce(model, ids, step) * loss_scale).backward()
        assert fused.weight.grad is None and fused.has_pending_update
        for p in model.head.parameters():
            p.grad /= loss_scale
        fused.apply_update_(0.5, 1.0 / loss_scale, skip=fused.pending_nonfinite())
        opt_head.step()
        assert not fused.has_pending_update
    torch.testing.assert_close(fused.weight, joint.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.head.weight, reference.head.weight, rtol=1e-5, atol=1e-6)
    assert not torch.equal(fused.weight, JointEmbedding(SIZES, DIM, device=DEVICE, init_seed=3).weight)


def test_pending_accumulates_across_forwards():
    joint, fused = module_pair()
    first, second = random_ids(8, seed=20), random_ids(8, seed=21)
    upstream = torch.randn(2, 8, len(SIZES), DIM, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    for ids, up in zip((first, second), upstream):
        (joint(ids) * up).sum().backward()  # sparse gradients add up in joint.weight.grad
        (fused(ids) * up).sum().backward()
    assert fused.weight.grad is None
    assert len(fused._pending) == 2
    torch.optim.SGD(joint.parameters(), lr=0.25).step()
    fused.apply_update_(torch.tensor(0.25, device=DEVICE))  # two updates, one per queued item
    torch.testing.assert_close(fused.weight, joint.weight, rtol=1e-5, atol=1e-6)


def test_skip_discard_and_nonfinite_flag():
    _, fused = module_pair()
    before = fused.weight.detach().clone()
    ids = random_ids(6, seed=30)
    fused(ids).sum().backward()
    flag = fused.pending_nonfinite()
    assert flag.shape == () and flag.dtype == torch.bool and flag.device == fused.weight.device
    assert not flag
    (fused(ids) * float("inf")).sum().backward()
    assert fused.pending_nonfinite()
    fused.apply_update_(1.0, skip=fused.pending_nonfinite())  # skipped: nothing moves
    assert torch.equal(fused.weight, before) and not fused.has_pending_update
    fused(ids).sum().backward()
    fused.discard_pending_()
    assert not fused.has_pending_update and not fused.pending_nonfinite()
    fused.apply_update_(1.0)
    assert torch.equal(fused.weight, before)
    with torch.no_grad():
        fused(ids)
    assert not fused.has_pending_update  # no graph, no queued update


def test_fused_hash_indices():
    joint, fused = module_pair(hash_indices=True)
    ids = torch.tensor([[3, 7, 5, 12, 4], [100, -1, 2, 25, 1_000_003], [0, 13, 1, 11, -6]], device=DEVICE)
    assert torch.equal(fused(ids), joint(ids))
    for model in (joint, fused):
        (model(ids) ** 2).sum().backward()
    torch.optim.SGD(joint.parameters(), lr=0.1).step()
    fused.apply_update_(0.1)
    torch.testing.assert_close(fused.weight, joint.weight, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- GPU, Criteo sizes

CRITEO_N = 65536 * 26
CRITEO_ROWS = 1_000_000


def criteo_case(grad_dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    rows = zipf_rows(CRITEO_N, CRITEO_ROWS, 0.3, g).cuda()
    weight = torch.rand(CRITEO_ROWS, 128, device="cuda") - 0.5
    grad = torch.randn(CRITEO_N, 128, device="cuda").to(grad_dtype)
    return weight, rows, grad


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", FLOATS)
def test_gpu_gather_criteo_sizes(out_dtype):
    weight, rows, _ = criteo_case()
    assert supports_gather(weight, rows, out_dtype)
    assert torch.equal(gather(weight, rows, out_dtype), weight[rows].to(out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", FLOATS)
def test_gpu_sgd_update_criteo_sizes(grad_dtype):
    weight0, rows, grad = criteo_case(grad_dtype)
    weight = weight0.clone()
    args = scalars(0.01, 0.5)
    assert supports_update(weight, rows, grad, *args)
    sgd_update(weight, rows, grad, *args)
    assert_update_matches(weight0, weight, rows, grad, 0.01, 0.5, atol=1e-4)
    sgd_update(weight, rows, grad, *scalars(0.01, 0.5, skip=True))
    assert_update_matches(weight0, weight, rows, grad, 0.01, 0.5, atol=1e-4)


@pytest.mark.gpu
def test_gpu_sgd_update_in_cuda_graph():
    """No host sync and static shapes: the whole update can be captured and replayed."""
    weight0, rows, grad = criteo_case(torch.bfloat16)
    weight = weight0.clone()
    lr, scale, skip = scalars(0.01, 1.0)
    sgd_update(weight, rows, grad, lr, scale, torch.tensor(True, device="cuda"))  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sgd_update(weight, rows, grad, lr, scale, skip)
    weight.copy_(weight0)
    graph.replay()
    assert_update_matches(weight0, weight, rows, grad, 0.01, 1.0, atol=1e-4)
    weight.copy_(weight0)
    skip.fill_(True)  # read inside the kernel at replay time
    graph.replay()
    assert torch.equal(weight, weight0)
