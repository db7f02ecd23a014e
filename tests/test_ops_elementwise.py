"""Elementwise catalog ops against NumPy: values, result dtypes (NEP 50), shapes, errors, kernels, gradients."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from goblin_dask.ops import Aval, catalog
from goblin_dask.ops._samples import computes_on, draw
from goblin_dask.ops.formula import evaluate_formula_numba

ELEMENTWISE = sorted(name for name, spec in catalog().items() if spec.elementwise is not None)
FLOAT_DTYPES = ("float32", "float64")


def spec_of(name):
    return catalog()[name]


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def operands(name, shape, dtype, rng):
    spec = spec_of(name)
    return [draw(spec, i, shape, dtype, rng) for i in range(spec.arity)]


def tolerance(dtype) -> float:
    return 8 * float(np.finfo(dtype).eps) if np.dtype(dtype).kind == "f" else 0.0


def assert_same(got, want, rtol):
    """Same dtype and shape; exact for integral results, NaN/inf in the same places, close elsewhere."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    if want.dtype.kind not in "fc" or rtol == 0:
        np.testing.assert_array_equal(got, want)
        return
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    scale = float(np.abs(want[np.isfinite(want)]).max(initial=1.0))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


# -- independent float64 references for the ops NumPy lacks -------------------------------
_REFERENCE = {
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "erf": np.vectorize(math.erf, otypes=[np.float64]),
    "relu": lambda x: np.where(x > 0, x, 0.0),
}


def reference(name, args):
    args64 = [np.asarray(a, dtype=np.float64) if np.asarray(a).dtype.kind == "f" else a for a in args]
    return _REFERENCE.get(name, spec_of(name).numpy)(*args64)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_numpy_kernel_matches_float64_reference_and_rules(name, dtype):
    spec = spec_of(name)
    if not computes_on(spec, dtype):
        pytest.skip(f"{name} does not compute on {dtype}")
    args = operands(name, (5, 7), dtype, rng_for(name, dtype))
    out = spec.numpy(*args)
    assert spec.abstract_eval(*args) == Aval(out.shape, out.dtype)
    want = reference(name, args)
    rtol = 1e-5 if out.dtype == np.float32 else 1e-12
    assert_same(out, np.asarray(want).astype(out.dtype), rtol if out.dtype.kind in "fc" else 0)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_broadcasting_and_edge_shapes(name):
    spec = spec_of(name)
    rng = rng_for(name, "shapes")
    dtype = "float64" if computes_on(spec, "float64") else "int64"
    cases = [[(3, 1), (1, 4), (4,)], [(1,), (2, 1), ()], [(0, 3), (3,), (1, 3)], [(), (), ()]]
    for shapes in cases:
        args = [draw(spec, i, shapes[i], dtype, rng) for i in range(spec.arity)]
        out = np.asarray(spec.numpy(*args))
        aval = spec.abstract_eval(*args)
        assert aval.shape == out.shape and aval.dtype == out.dtype, (shapes, aval, out.shape, out.dtype)


@pytest.mark.parametrize("name", [n for n in ELEMENTWISE if spec_of(n).arity >= 2])
def test_shape_mismatch_is_a_value_error_naming_op_and_shapes(name):
    spec = spec_of(name)
    dt = np.dtype("float64" if computes_on(spec, "float64") else "int64")
    avals = [Aval((2, 3), dt), Aval((4,), dt)] + [Aval((), dt)] * (spec.arity - 2)
    with pytest.raises(ValueError, match=rf"{name}: shapes \(2, 3\) and \(4,\)"):
        spec.abstract_eval(*avals)


@pytest.mark.parametrize("bad", ["U3", "O", "M8[s]", [("a", "f8")]])
def test_non_numeric_dtypes_are_type_errors(bad):
    for name in ("add", "exp", "sigmoid", "where"):
        spec = spec_of(name)
        with pytest.raises(TypeError, match=rf"{name}: unsupported dtype"):
            spec.abstract_eval(*[Aval((3,), np.dtype(bad))] * spec.arity)


def test_dtype_kind_refusals_name_the_op():
    with pytest.raises(TypeError, match="bitwise_and: unsupported dtype"):
        spec_of("bitwise_and").abstract_eval(np.zeros(3), np.zeros(3))
    with pytest.raises(TypeError, match="relu: unsupported dtype"):
        spec_of("relu").abstract_eval(np.zeros(3, dtype=bool))
    with pytest.raises(TypeError, match="negative: unsupported dtype"):
        spec_of("negative").abstract_eval(np.zeros(3, dtype=bool))


@pytest.mark.parametrize(
    "args, want",
    [
        ((np.ones(3, np.float32), 2.0), np.float32),  # Python float is weak
        ((np.ones(3, np.float32), np.float64(2.0)), np.float64),  # NumPy scalar is not
        ((np.ones(3, np.int8), 3), np.int8),
        ((np.ones(3, np.int8), 2.5), np.float64),
        ((np.ones(3, np.uint8), np.ones(3, np.int8)), np.int16),
        ((np.ones(3, bool), 1), np.int64),
    ],
)
def test_nep50_result_types(args, want):
    for name in ("add", "multiply", "maximum"):
        spec = spec_of(name)
        assert spec.abstract_eval(*args).dtype == want == spec.numpy(*args).dtype


def test_integer_inputs_to_float_ops_follow_numpy():
    for dtype, want in (("int8", np.float16), ("int16", np.float32), ("int64", np.float64)):
        x = np.arange(1, 4, dtype=dtype)
        for name in ("exp", "sqrt", "sigmoid", "erf"):
            out = spec_of(name)(x)
            assert spec_of(name).abstract_eval(x).dtype == out.dtype == want, (name, dtype)


# -- kernels ----------------------------------------------------------------------------------

NUMBA_OPS = sorted(name for name in ELEMENTWISE if spec_of(name).numba is not None)


def test_numba_kernels_are_declared_where_numba_wins():
    assert NUMBA_OPS == ["erf", "gelu", "leaky_relu", "relu", "sigmoid", "silu", "where"]


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int8"])
@pytest.mark.parametrize("name", NUMBA_OPS)
def test_numba_kernel_matches_numpy_kernel(name, dtype):
    spec = spec_of(name)
    if not computes_on(spec, dtype):
        pytest.skip(f"{name} does not compute on {dtype}")
    args = operands(name, (6, 5), dtype, rng_for(name, dtype, "numba"))
    got, want = spec.numba(*args), spec.numpy(*args)
    assert_same(got, want, tolerance(np.asarray(want).dtype))
    ref = np.asarray(reference(name, args)).astype(want.dtype)
    assert_same(want, ref, 4 * tolerance(want.dtype))


def _fused_dtypes(spec):
    dtypes = ["float32", "float64", "int64"]
    if computes_on(spec, "uint8") and not computes_on(spec, "float64"):
        dtypes += ["uint8", "bool"]
    return [d for d in dtypes if computes_on(spec, d)]


FUSED_CASES = [(n, d) for n in ELEMENTWISE for d in _fused_dtypes(spec_of(n))]


@pytest.mark.parametrize("name, dtype", FUSED_CASES)
def test_fused_numba_code_of_every_op_matches_numpy(name, dtype):
    """The scalar code each op contributes to fused formula kernels gives NumPy's numbers."""
    spec = spec_of(name)
    args = operands(name, (4, 6), dtype, rng_for(name, dtype, "fused"))
    expr = f"{name}({', '.join(f'x{i}' for i in range(spec.arity))})"
    want = spec.numpy(*args)
    assert_same(evaluate_formula_numba(*args, expr=expr), want, tolerance(np.asarray(want).dtype))


_I64 = np.iinfo(np.int64)
_SPECIAL_FLOATS = np.array([-np.inf, -2.5, -1.0, -0.0, 0.0, 0.5, 1.0, 3.0, np.inf, np.nan])


@pytest.mark.parametrize(
    "name, args",
    [
        ("floor_divide", (np.array([7, -7, 7, -7, 0, _I64.min, 5]), np.array([2, 2, -2, 0, 0, -1, -1]))),
        ("remainder", (np.array([7, -7, 7, -7, 0, _I64.min, 5]), np.array([2, 2, -2, 0, 0, -1, -1]))),
        ("floor_divide", (np.array([7, 0, 200], np.uint8), np.array([0, 0, 3], np.uint8))),
        ("remainder", (np.array([7, 0, 200], np.uint8), np.array([0, 0, 3], np.uint8))),
        ("left_shift", (np.array([1, -1, 3, 1, 1], np.int8), np.array([7, 3, 8, 9, 100], np.int8))),
        ("right_shift", (np.array([-128, -1, 64, 5, -5], np.int8), np.array([7, 3, 8, 9, 100], np.int8))),
        ("left_shift", (np.array([1, 2**63 + 1], np.uint64), np.array([63, 64], np.uint64))),
        ("power", (np.array([3, -3, 2, 0, 7], np.int64), np.array([3, 5, 62, 0, 40], np.int64))),
        ("floor_divide", (np.repeat(_SPECIAL_FLOATS, 10), np.tile(_SPECIAL_FLOATS, 10))),
        ("remainder", (np.repeat(_SPECIAL_FLOATS, 10), np.tile(_SPECIAL_FLOATS, 10))),
        ("maximum", (np.repeat(_SPECIAL_FLOATS, 10), np.tile(_SPECIAL_FLOATS, 10))),
        ("minimum", (np.repeat(_SPECIAL_FLOATS, 10), np.tile(_SPECIAL_FLOATS, 10))),
        ("sign", (_SPECIAL_FLOATS,)),
        ("relu", (_SPECIAL_FLOATS,)),
        ("sigmoid", (np.array([-1000.0, -50.0, 0.0, 50.0, 1000.0, np.nan]),)),
        ("clip", (_SPECIAL_FLOATS, -1.0, np.nan)),
        ("clip", (_SPECIAL_FLOATS, np.float64(2.0), -1.0)),
        ("absolute", (np.array([-0.0, -np.inf, -3.0]),)),
        ("absolute", (np.array([_I64.min, -3, 4]),)),
        ("isnan", (_SPECIAL_FLOATS,)),
        ("isfinite", (np.arange(3),)),
        ("invert", (np.array([True, False]),)),
        ("invert", (np.array([0, -1, 5], np.int16),)),
    ],
)
def test_fused_code_keeps_numpy_semantics_on_special_values(name, args):
    expr = f"{name}({', '.join(f'x{i}' for i in range(len(args)))})"
    with np.errstate(all="ignore"):
        want = spec_of(name).numpy(*args)
        got = evaluate_formula_numba(*args, expr=expr)
    assert_same(got, want, tolerance(np.asarray(want).dtype))
    if np.asarray(want).dtype.kind == "f" and name != "clip":  # clip keeps x or takes lo on -0.0 == 0.0
        numbers = ~np.isnan(want)
        np.testing.assert_array_equal(np.signbit(got)[numbers], np.signbit(want)[numbers])


def test_kernels_run_numpy_for_dtypes_they_were_not_compiled_for():
    x16 = np.linspace(-2, 2, 5).astype(np.float16)
    assert spec_of("sigmoid").numba(x16).dtype == np.float16
    c = np.array([True, False])
    assert spec_of("where").numba(c, np.array([1, 2], np.uint16), 3).dtype == np.uint16


def test_every_elementwise_op_has_a_cupy_kernel():
    assert all(spec_of(n).cupy is not None for n in ELEMENTWISE)


# -- gradients ---------------------------------------------------------------------------------

GRAD_OPS = [n for n in ELEMENTWISE if callable(spec_of(n).grad)]


@pytest.mark.parametrize("name", GRAD_OPS)
def test_vjp_matches_finite_differences(name):
    spec = spec_of(name)
    rng = rng_for(name, "grad")
    shapes = [(3, 4), (4,), (3, 1)][: spec.arity]
    args = [draw(spec, i, shapes[i], "float64", rng) for i in range(spec.arity)]
    g = rng.standard_normal(spec.abstract_eval(*args).shape)
    cotangents = spec.grad(g, *args)
    h = 1e-6
    for i, ct in enumerate(cotangents):
        if ct is None:
            continue
        v = rng.standard_normal(np.shape(args[i]))
        plus = list(args)
        minus = list(args)
        plus[i], minus[i] = args[i] + h * v, args[i] - h * v
        numeric = np.sum(g * (spec.numpy(*plus) - spec.numpy(*minus))) / (2 * h)
        assert np.shape(ct) == np.shape(args[i])
        assert np.isclose(np.sum(ct * v), numeric, rtol=1e-4, atol=1e-6), (name, i)
