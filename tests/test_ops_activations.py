"""The activation ops torch programs use, against torch.nn.functional and torch autograd.

gelu, gelu_tanh, silu, softplus, log_sigmoid, mish, leaky_relu (slope an operand: a
number, or an array as in PReLU), elu (alpha an operand) and logaddexp: values in
float32 (within 2e-5) and float64 (tight) on random and edge values (0, -0, tiny,
large +-, +-inf, NaN), with the NumPy kernel and the kernel this process runs (numba where
declared); vjps against autograd; inside fused formulas (the fused numba kernel equals
op by op); and through ga on small chunked arrays (dask's synchronous scheduler).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import goblin_dask.array as ga  # noqa: E402
from goblin_dask.ops import Replica, catalog  # noqa: E402
from goblin_dask.ops.formula import evaluate_formula_numba, evaluate_formula_numpy, program  # noqa: E402

# name -> (torch function of the op's operands, extra operands as Python numbers)
TORCH = {
    "gelu": (F.gelu, ()),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), ()),
    "silu": (F.silu, ()),
    "softplus": (F.softplus, ()),
    "log_sigmoid": (F.logsigmoid, ()),
    "mish": (F.mish, ()),
    "leaky_relu": (F.leaky_relu, (0.2,)),
    "elu": (F.elu, (1.5,)),
}
UNARY = [n for n, (_, extra) in TORCH.items() if not extra]
ACTIVATIONS = sorted(TORCH) + ["logaddexp"]
DTYPES = ("float32", "float64")
RNG = np.random.default_rng(20261204)


def edges(dtype):
    big = 1e30 if dtype == "float32" else 1e300
    v = [0.0, -0.0, 1e-8, -1e-8, 0.5, -0.5, 1.0, -1.0, 19.9, 20.0, 20.5, -20.5, 88.0, -88.0, 100.0, -100.0,
         710.0, -710.0, 1e4, -1e4, big, -big, np.inf, -np.inf, np.nan]  # fmt: skip
    return np.array(v, dtype=dtype)


def values(dtype, n=200):
    return np.concatenate([RNG.standard_normal(n) * 4, edges(dtype)]).astype(dtype)


def tol(dtype):
    return dict(rtol=2e-5, atol=2e-5) if dtype == "float32" else dict(rtol=1e-12, atol=1e-12)


def torch_reference(f, *args, dtype):
    """torch's numbers in ``dtype``; where float32 torch gives NaN but float64 torch a number
    (float32 gelu(+inf) is NaN in torch's vectorized erf path), the float64 number."""
    t = [torch.from_numpy(np.array(a, dtype=dtype)) if isinstance(a, np.ndarray) else a for a in args]
    want = f(*t).numpy()
    t64 = [torch.from_numpy(np.array(a, dtype="float64")) if isinstance(a, np.ndarray) else a for a in args]
    want64 = f(*t64).numpy().astype(dtype)
    quirk = np.isnan(want) & ~np.isnan(want64)
    return np.where(quirk, want64, want)


def assert_matches(got, want, dtype, **kw):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.dtype(dtype) and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, **(kw or tol(dtype)), equal_nan=True)


def kernels(name):
    spec = catalog()[name]
    return {"numpy": spec.numpy, "cpu": spec.kernel("cpu")}


# -- declarations ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_declared_as_replicated_volunteer_elementwise_ops_on_floats(name):
    spec = catalog()[name]
    assert spec.elementwise is not None and spec.verify == Replica() and spec.placement == "volunteer"
    assert callable(spec.grad) and spec.cupy is not None and spec.params == ()
    assert getattr(ga, name).__doc__ == spec.doc
    for dt in ("float32", "float64"):
        assert spec.abstract_eval(*[np.ones(3, dt)] * spec.arity).dtype == dt
        assert spec.abstract_eval(np.ones(3, dt), *[0.5] * (spec.arity - 1)).dtype == dt  # a Python number is weak
    assert spec.abstract_eval(*[np.ones(3, "int64")] * spec.arity).dtype == np.float64
    with pytest.raises(TypeError, match=f"{name}: unsupported dtype"):
        spec.abstract_eval(*[np.ones(3, "complex128")] * spec.arity)


# -- values against torch.nn.functional ------------------------------------------------------


@pytest.mark.parametrize("kernel", ["numpy", "cpu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(TORCH))
def test_values_match_torch_functional(name, dtype, kernel):
    f, extra = TORCH[name]
    x = values(dtype)
    want = torch_reference(f, x, *extra, dtype=dtype)
    with np.errstate(all="ignore"):
        got = kernels(name)[kernel](x, *extra)
    if name == "softplus" and dtype == "float64":
        # torch returns x itself above its threshold 20; the exact value differs by log1p(exp(-x)) < 2.1e-9
        above = x > 20
        np.testing.assert_allclose(got[above], want[above], rtol=0, atol=2.1e-9)
        got, want = got[~above], want[~above]
    assert_matches(got, want, dtype)


@pytest.mark.parametrize("kernel", ["numpy", "cpu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_logaddexp_matches_torch_on_every_pair_of_edge_values(dtype, kernel):
    e = edges(dtype)
    x, y = np.repeat(e, e.size), np.tile(e, e.size)
    x, y = np.concatenate([x, values(dtype)]), np.concatenate([y, values(dtype)[::-1]])
    with np.errstate(all="ignore"):
        got = kernels("logaddexp")[kernel](x, y)
    assert_matches(got, torch_reference(torch.logaddexp, x, y, dtype=dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slope", [0.0, 0.01, 0.2, -0.5, 1.0])
def test_leaky_relu_and_elu_parameters(dtype, slope):
    x = values(dtype)
    alpha = abs(slope) + 0.5
    with np.errstate(all="ignore"):  # -inf * 0 is NaN, in torch too
        for kernel in kernels("leaky_relu").values():
            assert_matches(kernel(x, slope), torch_reference(F.leaky_relu, x, slope, dtype=dtype), dtype)
        for kernel in kernels("elu").values():
            assert_matches(kernel(x, alpha), torch_reference(F.elu, x, alpha, dtype=dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_leaky_relu_with_an_array_slope_is_prelu(dtype):
    x = (RNG.standard_normal((4, 3, 5)) * 3).astype(dtype)
    w = np.array([0.25, -0.1, 0.0], dtype=dtype)
    want = F.prelu(torch.from_numpy(x), torch.from_numpy(w)).numpy()
    for kernel in kernels("leaky_relu").values():
        assert_matches(kernel(x, w.reshape(1, 3, 1)), want, dtype)


def test_signed_zeros_and_infinities_follow_torch():
    x = np.array([-0.0, 0.0, -np.inf, np.inf])
    assert np.signbit(catalog()["leaky_relu"](x, 0.01)).tolist() == [True, False, True, False]
    assert np.signbit(catalog()["elu"](x, 1.0)).tolist() == [True, False, True, False]
    np.testing.assert_array_equal(catalog()["elu"](x, 2.0), [-0.0, 0.0, -2.0, np.inf])
    np.testing.assert_array_equal(catalog()["softplus"](x)[2:], [0.0, np.inf])
    np.testing.assert_array_equal(catalog()["log_sigmoid"](x)[2:], [-np.inf, 0.0])
    for name in ("gelu", "gelu_tanh"):
        assert catalog()[name](np.float32(np.inf)) == np.inf  # torch's float64 value (its float32 gelu gives NaN)


# -- gradients against torch autograd ---------------------------------------------------------


def autograd(f, *args):
    ts = [torch.tensor(a, dtype=torch.float64, requires_grad=True) if isinstance(a, np.ndarray) else a for a in args]
    out = f(*ts)
    g = torch.from_numpy(RNG.standard_normal(tuple(out.shape)))
    out.backward(g)
    return g.numpy(), [t.grad.numpy() if isinstance(t, torch.Tensor) else None for t in ts]


@pytest.mark.parametrize("name", sorted(TORCH))
def test_vjp_matches_torch_autograd(name):
    f, extra = TORCH[name]
    x = np.concatenate([RNG.standard_normal(50) * 4, [-30.0, -19.0, 19.0, 21.0, 30.0, 0.5, -0.5]])
    g, (want, *_) = autograd(f, x, *extra)
    got = catalog()[name].grad(g, x, *extra)
    assert got[0].shape == x.shape
    if name == "softplus":  # above its threshold 20 torch's gradient is 1, sigmoid(x) differs by < 2.1e-9
        above = x > 20
        np.testing.assert_allclose(got[0][above], want[above], rtol=2.1e-9)
        got, want, x = [got[0][~above]], want[~above], x[~above]
    np.testing.assert_allclose(got[0], want, rtol=1e-10, atol=1e-12)


def test_logaddexp_vjp_matches_torch_autograd():
    x, y = RNG.standard_normal((3, 4)) * 5, RNG.standard_normal((4,)) * 5  # y broadcast: its cotangent is summed
    g, (wx, wy) = autograd(torch.logaddexp, x, y)
    gx, gy = catalog()["logaddexp"].grad(g, x, y)
    np.testing.assert_allclose(gx, wx, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gy, wy, rtol=1e-10, atol=1e-12)


def test_prelu_weight_gradient_matches_torch_autograd():
    x = RNG.standard_normal((4, 3, 5)) * 3
    w = np.array([0.25, -0.1, 0.02])
    g, (wx, ww) = autograd(F.prelu, x, w)
    gx, gw = catalog()["leaky_relu"].grad(g, x, w.reshape(1, 3, 1))
    np.testing.assert_allclose(gx, wx, rtol=1e-12)
    np.testing.assert_allclose(gw.reshape(3), ww, rtol=1e-10)


# -- fused formulas ------------------------------------------------------------------------------

EXPR = ("gelu(x0) * silu(x1) + leaky_relu(x0, 0.2) - elu(x1, 1.5) + softplus(x0) * log_sigmoid(x1)"
        " + mish(x0) + logaddexp(x0, x1) + gelu_tanh(x1)")


def torch_expr(a, b):
    return (F.gelu(a) * F.silu(b) + F.leaky_relu(a, 0.2) - F.elu(b, 1.5) + F.softplus(a) * F.logsigmoid(b)
            + F.mish(a) + torch.logaddexp(a, b) + F.gelu(b, approximate="tanh"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_each_op_alone_as_a_fused_kernel_equals_its_numpy_kernel_on_edge_values(name, dtype):
    spec = catalog()[name]
    x = values(dtype)
    args = [x, x[::-1].copy()] if name == "logaddexp" else [x, *TORCH[name][1]]
    expr = f"{name}({', '.join(f'x{i}' for i in range(spec.arity))})"
    assert program(expr, spec.arity).numba_ufunc(tuple(np.dtype(dtype) for _ in args)) is not None  # really fused
    with np.errstate(all="ignore"):
        want = spec.numpy(*args)
        got = evaluate_formula_numba(*args, expr=expr)
    eps = float(np.finfo(dtype).eps)
    assert_matches(got, want, dtype, rtol=8 * eps, atol=8 * eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_formula_of_activations_equals_op_by_op_and_torch(dtype):
    a = (RNG.standard_normal((30, 7)) * 4).astype(dtype)
    b = (RNG.standard_normal((30, 7)) * 4).astype(dtype)
    expr = program(EXPR, 2).expr
    want = evaluate_formula_numpy(a, b, expr=expr)
    fused = evaluate_formula_numba(a, b, expr=expr)
    eps = float(np.finfo(dtype).eps)
    assert_matches(fused, want, dtype, rtol=16 * eps, atol=16 * eps * float(np.abs(want).max()))
    ref = torch_expr(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    assert_matches(fused, ref, dtype, rtol=1e-4 if dtype == "float32" else 1e-11, atol=1e-4 if dtype == "float32" else 1e-11)


def test_formula_vjp_matches_torch_autograd():
    a, b = RNG.standard_normal((5, 6)) * 3, RNG.standard_normal((5, 6)) * 3
    g, (wa, wb) = autograd(torch_expr, a, b)
    ga_, gb = program(EXPR, 2).vjp(g, (a, b))
    np.testing.assert_allclose(ga_, wa, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(gb, wb, rtol=1e-9, atol=1e-11)


# -- through ga on chunked arrays -----------------------------------------------------------------


def ev(x):
    return np.asarray(x.compute(scheduler="sync"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(TORCH))
def test_ga_functions_on_chunked_arrays_match_torch(name, dtype):
    f, extra = TORCH[name]
    a = (RNG.standard_normal((9, 7)) * 4).astype(dtype)
    a[0, :4] = [np.inf, -np.inf, np.nan, 0.0]
    x = ga.from_array(a, chunks=(4, 3))
    with np.errstate(all="ignore"):
        got = ev(getattr(ga, name)(x, *extra))
    assert_matches(got, torch_reference(f, a, *extra, dtype=dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ga_defaults_match_torch_defaults(dtype):
    a = (RNG.standard_normal((6, 5)) * 4).astype(dtype)
    x = ga.from_array(a, chunks=(4, 2))
    assert_matches(ev(ga.leaky_relu(x)), torch_reference(F.leaky_relu, a, dtype=dtype), dtype)  # 0.01
    assert_matches(ev(ga.elu(x)), torch_reference(F.elu, a, dtype=dtype), dtype)  # alpha 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_ga_logaddexp_prelu_and_numpy_dispatch_on_chunked_arrays(dtype):
    a = (RNG.standard_normal((8, 6)) * 4).astype(dtype)
    b = (RNG.standard_normal((6,)) * 4).astype(dtype)
    x, y = ga.from_array(a, chunks=(3, 4)), ga.from_array(b, chunks=4)
    want = torch_reference(torch.logaddexp, a, np.broadcast_to(b, a.shape), dtype=dtype)
    assert_matches(ev(ga.logaddexp(x, y)), want, dtype)
    assert_matches(ev(np.logaddexp(x, y)), want, dtype)  # NumPy's ufunc dispatch
    w = np.array([0.25, -0.1, 0.0, 0.5, 0.01, 1.0], dtype=dtype)
    prelu = F.prelu(torch.from_numpy(a.reshape(8, 6, 1)), torch.from_numpy(w)).numpy().reshape(8, 6)
    assert_matches(ev(ga.leaky_relu(x, ga.from_array(w, chunks=4))), prelu, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ga_formula_of_activations_on_chunked_arrays(dtype):
    a = (RNG.standard_normal((9, 7)) * 4).astype(dtype)
    b = (RNG.standard_normal((7,)) * 4).astype(dtype)
    x, y = ga.from_array(a, chunks=(4, 3)), ga.from_array(b, chunks=3)
    text = EXPR.replace("x0", "p").replace("x1", "q")
    got = ev(ga.formula(text, p=x, q=y))
    ref = torch_expr(torch.from_numpy(a), torch.from_numpy(np.broadcast_to(b, a.shape).copy())).numpy()
    assert_matches(got, ref, dtype, rtol=1e-4 if dtype == "float32" else 1e-11, atol=1e-4 if dtype == "float32" else 1e-11)
    op_by_op = ev(ga.gelu(x) * ga.silu(y) + ga.leaky_relu(x, 0.2) - ga.elu(y, 1.5) + ga.softplus(x) * ga.log_sigmoid(y)
                  + ga.mish(x) + ga.logaddexp(x, y) + ga.gelu_tanh(y))
    eps = float(np.finfo(dtype).eps)
    assert_matches(got, op_by_op, dtype, rtol=16 * eps, atol=16 * eps * float(np.abs(op_by_op).max()))
