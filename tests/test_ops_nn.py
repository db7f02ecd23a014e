"""The neural-network ops (goblin_dask/ops/nn.py, goblin_dask/array/nn.py) against torch.nn.functional."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import goblin_dask.array as ga  # noqa: E402
from goblin_dask.array.placement import placement_for  # noqa: E402
from goblin_dask.ops import Exact, Freivalds, Replica, get  # noqa: E402
from goblin_dask.validation.checks import judge  # noqa: E402

TOL = {np.float32: dict(rtol=2e-5, atol=2e-5), np.float64: dict(rtol=1e-11, atol=1e-11)}
DTYPES = [np.float32, np.float64]


def rand(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def T(a):
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a))


def close(got, want, dtype):
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else want
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOL[dtype])


def tampered(result):
    bad = result.copy()
    bad.reshape(-1)[bad.size // 2] += 1.0 + 10 * abs(bad.reshape(-1)[bad.size // 2])
    return bad


def judged(opname, operands, params, torch_result):
    """The lab accepts torch's result and rejects it with one element changed."""
    op = get(opname)
    honest = torch_result.detach().numpy()
    assert judge(op, operands, params, honest)
    assert not judge(op, operands, params, tampered(honest))


# -- softmax, log_softmax, logsumexp ------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_family_matches_torch(dtype, axis):
    rng = np.random.default_rng(1)
    x = rand(rng, 5, 6, 7, dtype=dtype) * 4
    close(get("softmax")(x, axis=axis), F.softmax(T(x), dim=axis), dtype)
    close(get("log_softmax")(x, axis=axis), F.log_softmax(T(x), dim=axis), dtype)
    close(get("logsumexp")(x, axis=axis), torch.logsumexp(T(x), dim=axis), dtype)
    close(get("logsumexp")(x, axis=axis, keepdims=True), torch.logsumexp(T(x), dim=axis, keepdim=True), dtype)
    judged("softmax", (x,), {"axis": axis}, F.softmax(T(x), dim=axis))
    judged("logsumexp", (x,), {"axis": axis}, torch.logsumexp(T(x), dim=axis))


def test_softmax_family_is_stable_and_handles_infinities():
    x = np.array([[1000.0, 1001.0, -np.inf], [-1000.0, -1001.0, -999.0], [-np.inf, 0.0, np.inf]])
    for name, fn in (("softmax", F.softmax), ("log_softmax", F.log_softmax)):
        np.testing.assert_allclose(get(name)(x[:2], axis=-1), fn(T(x[:2]), dim=-1).numpy(), rtol=1e-12)
    np.testing.assert_array_equal(get("logsumexp")(x, axis=-1), torch.logsumexp(T(x), dim=-1).numpy())
    lse = get("logsumexp")(np.full((2, 3), -np.inf), axis=1)
    assert np.all(lse == -np.inf)
    assert get("softmax")(np.zeros((3, 0)), axis=1).shape == (3, 0)


def test_softmax_family_refuses_integers_and_bad_axes():
    with pytest.raises(TypeError, match="softmax: computes on floating dtypes only"):
        get("softmax").abstract_eval(np.zeros((2, 3), np.int64), axis=-1)
    with pytest.raises(ValueError, match=r"log_softmax: axis 2 is out of bounds for shape \(2, 3\)"):
        get("log_softmax").abstract_eval(np.zeros((2, 3)), axis=2)
    with pytest.raises(ValueError, match="logsumexp: axis must be an int"):
        get("logsumexp").abstract_eval(np.zeros((2, 3)), axis=(0, 1))


# -- layer_norm, batch_norm ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, weight, bias", [(1, False, False), (1, True, True), (2, True, False), (3, False, True)])
def test_layer_norm_matches_torch(dtype, k, weight, bias):
    rng = np.random.default_rng(k)
    x = rand(rng, 4, 3, 5, 6, dtype=dtype) * 3 + 1
    shape = x.shape[4 - k:]
    w = rand(rng, *shape, dtype=dtype) if weight else None
    b = rand(rng, *shape, dtype=dtype) if bias else None
    params = {"normalized_ndim": k, "eps": 1e-5, "has_weight": weight, "has_bias": bias}
    operands = (x, *[a for a in (w, b) if a is not None])
    want = F.layer_norm(T(x), shape, T(w), T(b), eps=1e-5)
    close(get("layer_norm")(*operands, **params), want, dtype)
    judged("layer_norm", operands, params, want)


def test_layer_norm_shapes_and_dtypes():
    op = get("layer_norm")
    with pytest.raises(ValueError, match=r"layer_norm: weight of shape \(4,\) does not match the normalized shape \(5,\)"):
        op.abstract_eval(np.zeros((3, 5)), np.zeros(4), normalized_ndim=1, has_weight=True)
    with pytest.raises(ValueError, match="layer_norm: normalized_ndim=3 exceeds"):
        op.abstract_eval(np.zeros((3, 5)), normalized_ndim=3)
    with pytest.raises(TypeError, match="layer_norm: takes 2 operands"):
        op.abstract_eval(np.zeros((3, 5)), has_bias=True)
    mixed = op(np.ones((2, 3), np.float32), np.ones(3), has_weight=True)
    assert mixed.dtype == op.abstract_eval(np.ones((2, 3), np.float32), np.ones(3), has_weight=True).dtype == np.float64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 4), (3, 4, 7), (2, 4, 3, 5)])
@pytest.mark.parametrize("affine", [(False, False), (True, True), (False, True)])
def test_batch_norm_eval_matches_torch(dtype, shape, affine):
    rng = np.random.default_rng(len(shape))
    x = rand(rng, *shape, dtype=dtype)
    c = shape[1]
    mean, var = rand(rng, c, dtype=dtype), (rng.random(c) + 0.5).astype(dtype)
    w = rand(rng, c, dtype=dtype) if affine[0] else None
    b = rand(rng, c, dtype=dtype) if affine[1] else None
    params = {"eps": 1e-3, "has_weight": affine[0], "has_bias": affine[1]}
    operands = (x, mean, var, *[a for a in (w, b) if a is not None])
    want = F.batch_norm(T(x), T(mean), T(var), T(w), T(b), training=False, eps=1e-3)
    close(get("batch_norm")(*operands, **params), want, dtype)
    judged("batch_norm", operands, params, want)


def test_batch_norm_shapes():
    with pytest.raises(ValueError, match=r"batch_norm: running_var of shape \(3,\) does not match the 4 channels of input \(2, 4, 5\)"):
        get("batch_norm").abstract_eval(np.zeros((2, 4, 5)), np.zeros(4), np.zeros(3))
    with pytest.raises(ValueError, match="batch_norm: input must be at least 2-d"):
        get("batch_norm").abstract_eval(np.zeros(4), np.zeros(4), np.zeros(4))


# -- conv2d ------------------------------------------------------------------------------------

CONVS = [
    # (N, C, H, W), (O, C/g, kh, kw), bias, params
    ((2, 3, 9, 8), (4, 3, 3, 3), True, {}),
    ((2, 3, 9, 8), (4, 3, 3, 3), False, {"padding": 1}),
    ((1, 2, 10, 11), (5, 2, 3, 2), True, {"stride": 2, "padding": (1, 0)}),
    ((2, 2, 11, 10), (3, 2, 3, 3), True, {"dilation": 2, "padding": 2, "stride": (1, 3)}),
    ((3, 6, 5, 5), (2, 6, 1, 1), True, {}),
    ((1, 4, 7, 7), (8, 1, 3, 3), False, {"groups": 4, "padding": 1}),
    ((2, 4, 8, 6), (6, 2, 2, 3), True, {"groups": 2, "stride": (2, 1), "dilation": (1, 2)}),
    ((1, 3, 3, 3), (2, 3, 3, 3), True, {}),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xs, ws, has_bias, params", CONVS)
def test_conv2d_matches_torch_and_is_freivalds_checked(dtype, xs, ws, has_bias, params):
    rng = np.random.default_rng(sum(xs) + sum(ws))
    x, w = rand(rng, *xs, dtype=dtype), rand(rng, *ws, dtype=dtype)
    b = rand(rng, ws[0], dtype=dtype) if has_bias else None
    operands = (x, w) + ((b,) if has_bias else ())
    want = F.conv2d(T(x), T(w), T(b), **params)
    got = get("conv2d")(*operands, **params)
    assert got.flags.c_contiguous
    close(got, want, dtype)
    judged("conv2d", operands, params, want)
    form = get("conv2d").verify.form(want.numpy(), *operands, **params)
    n, o, ho, wo = want.shape
    assert form.a.shape == (n * ho * wo, xs[1] * ws[2] * ws[3]) and form.b.shape == (xs[1] * ws[2] * ws[3], o)
    assert form.c.shape == (n * ho * wo, o)


def test_conv2d_declaration_cost_and_placement():
    op = get("conv2d")
    assert isinstance(op.verify, Freivalds)
    x, w = np.zeros((8, 16, 32, 32), np.float32), np.zeros((32, 16, 3, 3), np.float32)
    cost = op.cost_of(x, w, stride=1, padding=1)
    assert cost.flops == 2 * 8 * 32 * 32 * 32 * 16 * 3 * 3
    assert placement_for(op, x, w, padding=1) == "volunteer"
    assert get("max_pool2d").placement == "lab" and isinstance(get("max_pool2d").verify, Exact)
    assert isinstance(get("softmax").verify, Replica)


def test_conv2d_shape_errors_name_the_op_and_shapes():
    op = get("conv2d")
    with pytest.raises(ValueError, match=r"conv2d: input \(1, 3, 5, 5\) and weight \(2, 2, 3, 3\) do not fit groups=1"):
        op.abstract_eval(np.zeros((1, 3, 5, 5)), np.zeros((2, 2, 3, 3)))
    with pytest.raises(ValueError, match=r"conv2d: kernel \(7, 7\)"):
        op.abstract_eval(np.zeros((1, 3, 5, 5)), np.zeros((2, 3, 7, 7)))
    with pytest.raises(ValueError, match=r"conv2d: bias of shape \(3,\) does not match the 2 output channels"):
        op.abstract_eval(np.zeros((1, 3, 5, 5)), np.zeros((2, 3, 3, 3)), np.zeros(3))
    with pytest.raises(ValueError, match="conv2d: stride must be an int >= 1"):
        op.abstract_eval(np.zeros((1, 3, 5, 5)), np.zeros((2, 3, 3, 3)), stride=0)
    with pytest.raises(TypeError, match="conv2d: computes on floating dtypes only"):
        op.abstract_eval(np.zeros((1, 3, 5, 5), np.int64), np.zeros((2, 3, 3, 3), np.int64))


# -- pooling -----------------------------------------------------------------------------------

MAX_POOLS = [
    {"kernel_size": 2},
    {"kernel_size": 3, "stride": 2, "padding": 1},
    {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True},
    {"kernel_size": (2, 3), "stride": (1, 2), "dilation": (2, 1)},
    {"kernel_size": 1},
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", MAX_POOLS)
def test_max_pool2d_matches_torch(dtype, params):
    x = rand(np.random.default_rng(3), 2, 3, 9, 10, dtype=dtype)
    want = F.max_pool2d(T(x), **params)
    np.testing.assert_array_equal(get("max_pool2d")(x, **params), want.numpy())
    judged("max_pool2d", (x,), params, want)
    x3 = x[0]
    np.testing.assert_array_equal(get("max_pool2d")(x3, **params), F.max_pool2d(T(x3), **params).numpy())


AVG_POOLS = [
    {"kernel_size": 2},
    {"kernel_size": 3, "stride": 2, "padding": 1},
    {"kernel_size": 3, "stride": 2, "padding": 1, "count_include_pad": False},
    {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True},
    {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True, "count_include_pad": False},
    {"kernel_size": (2, 3), "stride": (3, 1), "divisor_override": 5},
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", AVG_POOLS)
def test_avg_pool2d_matches_torch(dtype, params):
    x = rand(np.random.default_rng(4), 2, 3, 10, 9, dtype=dtype)
    want = F.avg_pool2d(T(x), **params)
    close(get("avg_pool2d")(x, **params), want, dtype)
    judged("avg_pool2d", (x,), params, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [(3, 3), (1, 1), (4, 3), (5, 7), 2, (None, 2), (9, 10)])
def test_adaptive_avg_pool2d_matches_torch_bins(dtype, size):
    x = rand(np.random.default_rng(5), 2, 3, 9, 10, dtype=dtype)
    want = F.adaptive_avg_pool2d(T(x), size)
    close(get("adaptive_avg_pool2d")(x, output_size=size), want, dtype)
    judged("adaptive_avg_pool2d", (x,), {"output_size": size}, want)


def test_pool_shape_errors():
    with pytest.raises(ValueError, match="max_pool2d: padding 2 should be at most half the kernel size 3"):
        get("max_pool2d").abstract_eval(np.zeros((1, 1, 5, 5)), kernel_size=3, padding=2)
    with pytest.raises(ValueError, match="avg_pool2d: kernel 6 .* is larger than the input length 5"):
        get("avg_pool2d").abstract_eval(np.zeros((1, 1, 5, 5)), kernel_size=6)
    with pytest.raises(ValueError, match=r"adaptive_avg_pool2d: input must be \(N, C, H, W\) or \(C, H, W\), got shape \(5, 5\)"):
        get("adaptive_avg_pool2d").abstract_eval(np.zeros((5, 5)), output_size=2)


# -- scaled dot-product attention -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["plain", "causal", "bool", "float", "scale", "broadcast"])
def test_scaled_dot_product_attention_matches_torch(dtype, case):
    rng = np.random.default_rng(6)
    q, k, v = rand(rng, 2, 3, 5, 8, dtype=dtype), rand(rng, 2, 3, 6, 8, dtype=dtype), rand(rng, 2, 3, 6, 4, dtype=dtype)
    mask, params, kw = None, {}, {}
    if case == "causal":
        k, v = k[:, :, :5], v[:, :, :5]
        params, kw = {"causal": True}, {"is_causal": True}
    elif case == "bool":
        mask = rng.random((5, 6)) < 0.7
        mask[:, 0] = True
    elif case == "float":
        mask = rand(rng, 3, 5, 6, dtype=dtype)
    elif case == "scale":
        params, kw = {"scale": 0.3}, {"scale": 0.3}
    elif case == "broadcast":
        k, v = k[:1], v[:1]
    operands = (q, k, v) + (() if mask is None else (mask,))
    want = F.scaled_dot_product_attention(T(q), T(k), T(v), attn_mask=T(mask), **kw)
    close(get("scaled_dot_product_attention")(*operands, **params), want, dtype)
    judged("scaled_dot_product_attention", operands, params, want)


def test_attention_shape_errors():
    op = get("scaled_dot_product_attention")
    with pytest.raises(ValueError, match=r"scaled_dot_product_attention: shapes q \(2, 4\), k \(3, 5\)"):
        op.abstract_eval(np.zeros((2, 4)), np.zeros((3, 5)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match="either a mask or causal=True"):
        op.abstract_eval(np.zeros((2, 4)), np.zeros((3, 4)), np.zeros((3, 2)), np.ones((2, 3), bool), causal=True)


# -- gradients against torch autograd ----------------------------------------------------------------

def _autograd(fn, *arrays):
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = fn(*ts)
    g = torch.from_numpy(np.random.default_rng(9).standard_normal(tuple(out.shape)))
    out.backward(g)
    return g.numpy(), [t.grad.numpy() for t in ts]


def _check_vjp(opname, params, fn, *arrays):
    g, want = _autograd(fn, *arrays)
    got = get(opname).grad(g, *arrays, **params)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)


def test_softmax_family_vjps_match_autograd():
    x = rand(np.random.default_rng(10), 4, 5, 3)
    for axis in (-1, 1):
        _check_vjp("softmax", {"axis": axis}, lambda t: F.softmax(t, dim=axis), x)
        _check_vjp("log_softmax", {"axis": axis}, lambda t: F.log_softmax(t, dim=axis), x)
        _check_vjp("logsumexp", {"axis": axis}, lambda t: torch.logsumexp(t, dim=axis), x)
        _check_vjp("logsumexp", {"axis": axis, "keepdims": True}, lambda t: torch.logsumexp(t, dim=axis, keepdim=True), x)


def test_norm_vjps_match_autograd():
    rng = np.random.default_rng(11)
    x, w, b = rand(rng, 3, 4, 5), rand(rng, 4, 5), rand(rng, 4, 5)
    _check_vjp("layer_norm", {"normalized_ndim": 2, "has_weight": True, "has_bias": True},
               lambda t, tw, tb: F.layer_norm(t, (4, 5), tw, tb), x, w, b)
    _check_vjp("layer_norm", {}, lambda t: F.layer_norm(t, (5,)), x)
    xb, m, v, bw, bb = rand(rng, 2, 4, 3, 3), rand(rng, 4), rng.random(4) + 0.5, rand(rng, 4), rand(rng, 4)
    _check_vjp("batch_norm", {"has_weight": True, "has_bias": True, "eps": 1e-5},
               lambda t, tm, tv, tw, tb: _bn_formula(t, tm, tv, tw, tb), xb, m, v, bw, bb)
    # torch's own batch_norm differentiates the input, weight and bias (not the running statistics)
    g, want = _autograd(lambda t, tw, tb: F.batch_norm(t, torch.tensor(m), torch.tensor(v), tw, tb), xb, bw, bb)
    got = get("batch_norm").grad(g, xb, m, v, bw, bb, has_weight=True, has_bias=True, eps=1e-5)
    for a, b_ in zip((got[0], got[3], got[4]), want):
        np.testing.assert_allclose(a, b_, rtol=1e-9, atol=1e-9)


def _bn_formula(t, tm, tv, tw, tb):
    c = (1, -1, 1, 1)
    return (t - tm.reshape(c)) / torch.sqrt(tv.reshape(c) + 1e-5) * tw.reshape(c) + tb.reshape(c)


@pytest.mark.parametrize("xs, ws, has_bias, params", CONVS)
def test_conv2d_vjp_matches_autograd(xs, ws, has_bias, params):
    rng = np.random.default_rng(12)
    arrays = [rand(rng, *xs), rand(rng, *ws)] + ([rand(rng, ws[0])] if has_bias else [])
    _check_vjp("conv2d", params, lambda *ts: F.conv2d(*ts, **params), *arrays)


# -- the catalog's own examples ---------------------------------------------------------------------

NN_OPS = ["softmax", "log_softmax", "logsumexp", "layer_norm", "batch_norm", "conv2d", "max_pool2d", "avg_pool2d",
          "adaptive_avg_pool2d", "scaled_dot_product_attention"]


@pytest.mark.parametrize("name", NN_OPS)
def test_examples_run_in_float32_with_the_declared_dtype(name):
    from goblin_dask.ops._samples import example_calls

    op = get(name)
    for args, params in example_calls(name, 5, np.random.default_rng(0), "float32"):
        out = op(*args, **params)
        assert (out.shape, out.dtype) == op.abstract_eval(*args, **params)
        assert judge(op, args, params, out) and not judge(op, args, params, tampered(out))


# -- ga functions on chunked arrays ---------------------------------------------------------------------

def test_ga_softmax_family_and_norms_on_chunked_arrays():
    rng = np.random.default_rng(13)
    x = rand(rng, 6, 7, 5)
    gx = ga.from_array(x, chunks=(2, 3, 2))
    s = ga.softmax(gx, axis=1)
    assert s.numblocks == (3, 1, 3)
    close(s.compute(), F.softmax(T(x), dim=1), np.float64)
    close(ga.log_softmax(gx).compute(), F.log_softmax(T(x), dim=-1), np.float64)
    close(ga.logsumexp(gx, axis=0).compute(), torch.logsumexp(T(x), dim=0), np.float64)
    close(ga.logsumexp(gx, axis=-1, keepdims=True).compute(), torch.logsumexp(T(x), dim=-1, keepdim=True), np.float64)
    w, b = rand(rng, 7, 5), rand(rng, 7, 5)
    close(ga.layer_norm(gx, (7, 5), w, b).compute(), F.layer_norm(T(x), (7, 5), T(w), T(b)), np.float64)
    close(ga.layer_norm(gx, 5, bias=b[0]).compute(), F.layer_norm(T(x), (5,), None, T(b[0])), np.float64)
    xi = rand(rng, 4, 6, 5, 5)
    gxi = ga.from_array(xi, chunks=(2, 4, 3, 3))
    m, v, bw = rand(rng, 6), rng.random(6) + 0.5, rand(rng, 6)
    bn = ga.batch_norm(gxi, m, v, bw)
    assert bn.numblocks == gxi.numblocks
    close(bn.compute(), F.batch_norm(T(xi), T(m), T(v), T(bw)), np.float64)
    with pytest.raises(ValueError, match="eval mode"):
        ga.batch_norm(gxi, m, v, training=True)
    with pytest.raises(ValueError, match="layer_norm: normalized_shape"):
        ga.layer_norm(gx, (3, 5))


def test_ga_conv2d_is_blocked_over_batch_and_output_channels():
    rng = np.random.default_rng(14)
    x, w, b = rand(rng, 4, 6, 9, 9, dtype=np.float32), rand(rng, 8, 6, 3, 3, dtype=np.float32), rand(rng, 8, dtype=np.float32)
    gx, gw = ga.from_array(x, chunks=(2, 4, 5, 5)), ga.from_array(w, chunks=(3, 6, 3, 3))
    out = ga.conv2d(gx, gw, b, stride=2, padding=1)
    assert out.numblocks == (2, 3, 1, 1) and out.dtype == np.float32
    close(out.compute(), F.conv2d(T(x), T(w), T(b), stride=2, padding=1), np.float32)
    wg = rand(rng, 6, 3, 2, 2)
    grouped = ga.conv2d(ga.from_array(x.astype(np.float64), chunks=(1, 6, 9, 9)), wg, groups=2, dilation=2)
    close(grouped.compute(), F.conv2d(T(x.astype(np.float64)), T(wg), groups=2, dilation=2), np.float64)
    with pytest.raises(ValueError, match="conv2d: input"):
        ga.conv2d(gx, rand(rng, 2, 5, 3, 3))


def test_ga_pools_and_attention_on_chunked_arrays():
    rng = np.random.default_rng(15)
    x = rand(rng, 4, 6, 9, 10)
    gx = ga.from_array(x, chunks=(2, 4, 5, 5))
    mp = ga.max_pool2d(gx, 3, stride=2, padding=1)
    assert mp.numblocks == (2, 2, 1, 1)
    np.testing.assert_array_equal(mp.compute(), F.max_pool2d(T(x), 3, stride=2, padding=1).numpy())
    close(ga.avg_pool2d(gx, 2, ceil_mode=True).compute(), F.avg_pool2d(T(x), 2, ceil_mode=True), np.float64)
    close(ga.adaptive_avg_pool2d(gx, (4, 3)).compute(), F.adaptive_avg_pool2d(T(x), (4, 3)), np.float64)
    q, k, v = rand(rng, 4, 5, 8), rand(rng, 4, 6, 8), rand(rng, 4, 6, 3)
    att = ga.scaled_dot_product_attention(ga.from_array(q, chunks=(2, 2, 4)), k, v)
    assert att.numblocks == (2, 1, 1)
    close(att.compute(), F.scaled_dot_product_attention(T(q), T(k), T(v)), np.float64)
    mask = rand(rng, 4, 5, 6)
    close(ga.scaled_dot_product_attention(q, k, v, attn_mask=mask).compute(),
          F.scaled_dot_product_attention(T(q), T(k), T(v), attn_mask=T(mask)), np.float64)
    qc = rand(rng, 4, 6, 8)
    close(ga.scaled_dot_product_attention(ga.from_array(qc, chunks=(1, 3, 8)), k, v, is_causal=True).compute(),
          F.scaled_dot_product_attention(T(qc), T(k), T(v), is_causal=True), np.float64)


def test_ga_ops_are_reachable_through_the_catalog_hook():
    x = ga.from_array(rand(np.random.default_rng(16), 4, 6), chunks=(2, 3))
    np.testing.assert_allclose(x._catalog("softmax", x, axis=1).compute(), ga.softmax(x, axis=1).compute())
