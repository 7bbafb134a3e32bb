import math

import pytest
import torch

from dlrm.nn.interactions import CatInteraction, DCNInteraction, DotInteraction, dot_interaction_reference


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


@pytest.mark.parametrize("amp", [False, True])
def test_dot_training_path_matches_reference(amp):
    # With gradients DotInteraction runs DotInteractionTorch: the reference's forward bit for
    # bit, and its gradients up to the rounding of the compute dtype, in the inputs' dtypes.
    bottom, embedded = random_inputs(64, 26, 128, dtype=torch.float32, seed=2)
    module = DotInteraction(27, 128)
    results = []
    for fn in (module, lambda b, e: dot_interaction_reference(b, e, module.triangle_index)):
        b, e = bottom.clone().requires_grad_(True), embedded.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = fn(b * 1.0, e)  # a non-leaf bottom, as the bottom MLP's output
        upstream = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype)
        out.backward(upstream)
        results.append((out, b.grad, e.grad))
    (out, grad_b, grad_e), (ref_out, ref_b, ref_e) = results
    assert out.dtype == ref_out.dtype == (torch.bfloat16 if amp else torch.float32)
    assert torch.equal(out, ref_out)
    assert grad_b.dtype == grad_e.dtype == torch.float32
    tol = {"rtol": 1e-2, "atol": 0.2} if amp else {"rtol": 1e-5, "atol": 1e-4}  # bf16: an ulp of ~20
    torch.testing.assert_close(grad_b, ref_b, **tol)
    torch.testing.assert_close(grad_e, ref_e, **tol)


def test_dot_without_grad_runs_the_reference():
    bottom, embedded = random_inputs(3, 4, 8, dtype=torch.float32)
    module = DotInteraction(5, 8)
    with torch.no_grad():
        out = module(bottom.requires_grad_(True), embedded)
    assert out.grad_fn is None
    assert torch.equal(out, dot_interaction_reference(bottom.detach(), embedded))


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


# --- DCN (DCNv2 low-rank cross layers) ---------------------------------------------------------


def loop_cross_network(bottom, embedded, w_kernels, v_kernels, biases):
    """DCNv2's definition one sample at a time with explicit matrix-vector products, in float64:
    ``x0 = [bottom, e_0, ..., e_{F-1}]``, ``x_{l+1} = x0 * (W_l (V_l x_l) + b_l) + x_l``."""
    rows = []
    for b in range(bottom.shape[0]):
        x0 = torch.cat([bottom[b].double()] + [embedded[b, f].double() for f in range(embedded.shape[1])])
        x = x0
        for w, v, bias in zip(w_kernels, v_kernels, biases):
            low = torch.mv(v.double(), x)  # [r]
            x = x0 * (torch.mv(w.double(), low) + bias.double()) + x
        rows.append(x)
    return torch.stack(rows)


def dcn_with_random_bias(num_embedded, dim, bottom_dim, layers, rank, dtype=torch.float64):
    """A module with non-zero biases (they start at zero), so the bias term is exercised too."""
    torch.manual_seed(5)
    module = DCNInteraction(num_embedded + 1, dim, bottom_dim, num_layers=layers, low_rank_dim=rank).to(dtype)
    with torch.no_grad():
        for bias in module.bias:
            bias.normal_(0.0, 0.3)
    return module


def parameters_of(module):
    return list(module.W_kernels), list(module.V_kernels), list(module.bias)


# (B, F, D, bottom width, layers, rank): one layer, rank 1, rank above K, a bottom wider than D.
DCN_SHAPES = [(3, 1, 4, 4, 1, 1), (5, 3, 7, 7, 3, 5), (2, 4, 3, 9, 2, 40), (4, 26, 8, 16, 3, 16)]


@pytest.mark.parametrize("batch,num_embedded,dim,bottom_dim,layers,rank", DCN_SHAPES)
def test_dcn_matches_per_sample_float64_loop(batch, num_embedded, dim, bottom_dim, layers, rank):
    g = torch.Generator().manual_seed(2)
    bottom = torch.randn(batch, bottom_dim, generator=g, dtype=torch.float64)
    embedded = torch.randn(batch, num_embedded, dim, generator=g, dtype=torch.float64)
    module = dcn_with_random_bias(num_embedded, dim, bottom_dim, layers, rank)
    expected = loop_cross_network(bottom, embedded, *parameters_of(module))
    got = module(bottom, embedded)
    width = bottom_dim + num_embedded * dim
    assert got.shape == expected.shape == (batch, width) and module.num_outputs == width
    assert got.dtype == torch.float64
    assert (expected - torch.cat([bottom, embedded.flatten(1)], 1)).abs().max() > 1e-2  # the layers did something
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # float32 parameters and inputs: the same values to float32 accuracy.
    module32 = module.float()
    got32 = module32(bottom.float(), embedded.float())
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch,num_embedded,dim,bottom_dim,layers,rank", [(3, 2, 3, 5, 2, 3), (2, 1, 2, 2, 1, 1)])
def test_dcn_gradcheck(batch, num_embedded, dim, bottom_dim, layers, rank):
    g = torch.Generator().manual_seed(3)
    bottom = torch.randn(batch, bottom_dim, generator=g, dtype=torch.float64, requires_grad=True)
    embedded = torch.randn(batch, num_embedded, dim, generator=g, dtype=torch.float64, requires_grad=True)
    module = dcn_with_random_bias(num_embedded, dim, bottom_dim, layers, rank)
    assert torch.autograd.gradcheck(module, (bottom, embedded))


def test_dcn_parameter_gradients_match_the_loop():
    g = torch.Generator().manual_seed(4)
    bottom = torch.randn(6, 5, generator=g, dtype=torch.float64)
    embedded = torch.randn(6, 3, 4, generator=g, dtype=torch.float64)
    module = dcn_with_random_bias(3, 4, 5, 3, 6)
    upstream = torch.randn(6, module.num_outputs, generator=g, dtype=torch.float64)
    (module(bottom, embedded) * upstream).sum().backward()
    got = [p.grad.clone() for p in module.parameters()]
    leaves = [p.detach().clone().requires_grad_(True) for p in module.parameters()]
    layers = module.num_layers
    w, v, b = leaves[:layers], leaves[layers : 2 * layers], leaves[2 * layers :]
    (loop_cross_network(bottom, embedded, w, v, b) * upstream).sum().backward()
    for name, a, leaf in zip([n for n, _ in module.named_parameters()], got, leaves):
        torch.testing.assert_close(a, leaf.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_dcn_parameter_shapes_and_count_criteo():
    """MLPerf DLRMv2's interaction: K = 128 + 26 * 128 = 3456, rank 512, 3 layers."""
    module = DCNInteraction(27, 128, 128, num_layers=3, low_rank_dim=512)
    assert module.num_outputs == 3456
    assert [tuple(p.shape) for p in module.W_kernels] == [(3456, 512)] * 3
    assert [tuple(p.shape) for p in module.V_kernels] == [(512, 3456)] * 3
    assert [tuple(p.shape) for p in module.bias] == [(3456,)] * 3
    assert sum(p.numel() for p in module.parameters()) == 3 * (2 * 3456 * 512 + 3456) == 10_627_200
    assert sorted(module.state_dict()) == sorted(
        f"{kind}.{layer}" for kind in ("W_kernels", "V_kernels", "bias") for layer in range(3))


def test_dcn_init_is_xavier_normal_with_zero_bias():
    """TorchRec's initialisation: kernels N(0, sqrt(2 / (fan_in + fan_out))) = sqrt(2 / (K + r)),
    biases 0. Checked on the statistics of the Criteo-sized kernels (1.77M draws each)."""
    torch.manual_seed(0)
    module = DCNInteraction(27, 128, 128, num_layers=2, low_rank_dim=512)
    std = math.sqrt(2.0 / (3456 + 512))
    for kernel in [*module.W_kernels, *module.V_kernels]:
        assert abs(kernel.mean().item()) < 0.01 * std
        assert kernel.std().item() == pytest.approx(std, rel=0.01)
    assert all(torch.equal(b, torch.zeros(3456)) for b in module.bias)


def test_dcn_draws_in_torchrec_order_from_the_global_generator():
    """All W kernels, then all V kernels, each a normal draw of its own shape, and nothing else
    (the next draw after the module is the one a fresh generator would give after those)."""
    torch.manual_seed(7)
    module = DCNInteraction(3, 4, 6, num_layers=2, low_rank_dim=5)
    after = torch.rand(3)
    torch.manual_seed(7)
    std = math.sqrt(2.0 / (14 + 5))
    expected_w = [torch.empty(14, 5).normal_(0.0, std) for _ in range(2)]
    expected_v = [torch.empty(5, 14).normal_(0.0, std) for _ in range(2)]
    for got, want in zip([*module.W_kernels, *module.V_kernels], [*expected_w, *expected_v]):
        assert torch.equal(got.detach(), want)
    assert torch.equal(after, torch.rand(3))


def test_dcn_rejects_wrong_shapes_and_sizes():
    module = DCNInteraction(4, 3, 5, num_layers=1, low_rank_dim=2)
    with pytest.raises(ValueError, match=r"\[B, 3, D\]"):
        module(torch.randn(2, 5), torch.randn(2, 2, 3))
    with pytest.raises(ValueError, match=r"bottom of shape \[B, 5\]"):
        module(torch.randn(2, 3), torch.randn(2, 3, 3))
    for layers, rank in ((0, 2), (1, 0)):
        with pytest.raises(ValueError, match="num_layers >= 1 and low_rank_dim >= 1"):
            DCNInteraction(4, 3, num_layers=layers, low_rank_dim=rank)


def test_dcn_under_autocast_bf16():
    g = torch.Generator().manual_seed(6)
    bottom, embedded = torch.randn(4, 16, generator=g), torch.randn(4, 26, 16, generator=g)
    module = dcn_with_random_bias(26, 16, 16, 3, 32, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(bottom, embedded)
    # The matmuls run in bf16; x0 and the residual sum stay float32 (the float32 embeddings).
    assert out.dtype == torch.float32 and out.shape == (4, 432)
    expected = loop_cross_network(bottom, embedded, *parameters_of(module))
    torch.testing.assert_close(out.double(), expected, rtol=0.05, atol=0.1)
    assert not torch.allclose(out.double(), expected, rtol=1e-6, atol=1e-6)  # bf16 really ran
