import pytest
import torch

from dlrm.nn.interactions import CatInteraction, DotInteraction, dot_interaction_reference


def loop_dot_interaction(bottom: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
    """The layout spelled out one sample and one pair at a time (slow, obviously right)."""
    rows = []
    for b in range(bottom.shape[0]):
        vectors = [bottom[b]] + [embedded[b, f] for f in range(embedded.shape[1])]
        pairs = [torch.dot(vectors[i], vectors[j]) for i in range(len(vectors)) for j in range(i)]
        values = torch.cat([bottom[b], torch.stack(pairs)])
        width = values.numel()
        while width % 8:
            width += 1
        rows.append(torch.cat([values, values.new_zeros(width - values.numel())]))
    return torch.stack(rows)


def random_inputs(batch, num_embedded, dim, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    bottom = torch.randn(batch, dim, generator=g, dtype=dtype)
    embedded = torch.randn(batch, num_embedded, dim, generator=g, dtype=dtype)
    return bottom, embedded


# (B, F, D): F=1, the Criteo shape (479 -> 480), widths already a multiple of 8 (no padding),
# and widths needing 1..7 zeros.
SHAPES = [(3, 1, 4), (1, 2, 3), (5, 3, 7), (4, 3, 2), (4, 8, 16), (2, 5, 5), (2, 26, 128)]


@pytest.mark.parametrize("batch,num_embedded,dim", SHAPES)
def test_dot_matches_double_loop(batch, num_embedded, dim):
    bottom, embedded = random_inputs(batch, num_embedded, dim)
    expected = loop_dot_interaction(bottom, embedded)
    module = DotInteraction(num_embedded + 1, dim)
    got = module(bottom, embedded)
    assert got.shape == expected.shape == (batch, module.num_outputs)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # Same result without the precomputed index.
    torch.testing.assert_close(dot_interaction_reference(bottom, embedded), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "num_features,dim,width",
    [(27, 128, 480), (2, 4, 8), (4, 2, 8), (4, 7, 16), (9, 16, 56), (3, 1, 8), (6, 2, 24)],
)
def test_dot_width(num_features, dim, width):
    assert DotInteraction(num_features, dim).num_outputs == width


@pytest.mark.parametrize("batch,num_embedded,dim", [(3, 3, 7), (2, 26, 128), (2, 2, 3)])
def test_dot_padding_is_zero(batch, num_embedded, dim):
    bottom, embedded = random_inputs(batch, num_embedded, dim, dtype=torch.float32)
    out = DotInteraction(num_embedded + 1, dim)(bottom, embedded)
    used = dim + (num_embedded + 1) * num_embedded // 2
    assert used % 8 != 0
    assert out.shape[1] == used + (-used) % 8
    assert torch.all(out[:, used:] == 0)
    assert torch.all(out[:, used - 1] != 0)  # the last interaction term is not padding
    torch.testing.assert_close(out[:, :dim], bottom, rtol=0, atol=0)


def test_dot_triangle_order():
    # Orthogonal-ish vectors with known pairwise products: vector k = (k+1) * e_0 + e_{k+1}, so
    # <v_i, v_j> = (i+1)(j+1) for i != j. The triangle must read (1,0),(2,0),(2,1),(3,0),...
    n, dim = 5, 8
    vectors = torch.zeros(n, dim, dtype=torch.float64)
    for k in range(n):
        vectors[k, 0] = k + 1
        vectors[k, k + 1] = 1
    out = DotInteraction(n, dim)(vectors[:1], vectors[1:].unsqueeze(0))
    expected = [(i + 1) * (j + 1) for i in range(n) for j in range(i)]
    assert out[0, dim : dim + len(expected)].tolist() == expected


@pytest.mark.parametrize("batch,num_embedded,dim", [(2, 1, 3), (3, 3, 2), (2, 4, 5)])
def test_dot_gradcheck(batch, num_embedded, dim):
    bottom, embedded = random_inputs(batch, num_embedded, dim)
    bottom.requires_grad_(True)
    embedded.requires_grad_(True)
    module = DotInteraction(num_embedded + 1, dim)
    assert torch.autograd.gradcheck(module, (bottom, embedded))


@pytest.mark.parametrize("batch,num_embedded,dim", [(3, 5, 7), (2, 26, 16)])
def test_dot_gradients_match_double_loop(batch, num_embedded, dim):
    bottom, embedded = random_inputs(batch, num_embedded, dim, seed=1)
    upstream = torch.randn(batch, DotInteraction(num_embedded + 1, dim).num_outputs, dtype=torch.float64)
    grads = []
    for fn in (DotInteraction(num_embedded + 1, dim), loop_dot_interaction):
        b, e = bottom.clone().requires_grad_(True), embedded.clone().requires_grad_(True)
        (fn(b, e) * upstream).sum().backward()
        grads.append((b.grad, e.grad))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-10)


def test_dot_under_autocast_bf16():
    bottom, embedded = random_inputs(4, 26, 128, dtype=torch.float32)
    module = DotInteraction(27, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(bottom, embedded)
    assert out.dtype == torch.bfloat16
    assert out.shape == (4, 480)
    assert torch.all(out[:, 479:] == 0)
    expected = loop_dot_interaction(bottom.double(), embedded.double())
    # bf16 has 8 bits of mantissa; the products are sums of 128 terms of magnitude ~1.
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=0.5)


def test_dot_rejects_wrong_feature_count():
    bottom, embedded = random_inputs(2, 3, 4)
    with pytest.raises(ValueError, match=r"\[B, 4, D\]"):
        DotInteraction(5, 4)(bottom, embedded)


def test_dot_index_is_not_in_state_dict():
    assert DotInteraction(27, 128).state_dict() == {}


@pytest.mark.parametrize("batch,num_embedded,dim", [(3, 1, 4), (2, 26, 16)])
def test_cat_matches_plain_cat(batch, num_embedded, dim):
    bottom, embedded = random_inputs(batch, num_embedded, dim)
    module = CatInteraction(num_embedded + 1, dim)
    expected = torch.cat([bottom] + [embedded[:, f, :] for f in range(num_embedded)], dim=1)
    out = module(bottom, embedded)
    assert module.num_outputs == dim * (num_embedded + 1) == out.shape[1]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_cat_with_wider_bottom():
    g = torch.Generator().manual_seed(0)
    bottom, embedded = torch.randn(2, 6, generator=g), torch.randn(2, 3, 4, generator=g)
    module = CatInteraction(4, 4, bottom_dim=6)
    out = module(bottom, embedded)
    assert module.num_outputs == 6 + 3 * 4 == out.shape[1]
    torch.testing.assert_close(out[:, 6:10], embedded[:, 0])
