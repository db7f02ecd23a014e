"""Products against NumPy float64 references: matmul, matmul_accumulate, tensordot, einsum."""

from __future__ import annotations

import numpy as np
import pytest

from goblin_dask.ops import Aval, get
from goblin_dask.ops.spec import Freivalds

RNG = np.random.default_rng(1234)


def rand(shape, dtype="float64"):
    if np.dtype(dtype).kind in "iu":
        return RNG.integers(-5, 6, size=shape).astype(dtype)
    return RNG.standard_normal(shape).astype(dtype)


def check(op, args, want, **params):
    """Kernel (and abstract rules) against a float64 NumPy reference."""
    spec = get(op)
    out = spec(*args, **params)
    assert spec.abstract_eval(*args, **params) == Aval(np.shape(out), np.asarray(out).dtype)
    want = np.asarray(want)
    assert np.asarray(out).dtype == np.result_type(*args)
    rtol = 1e-5 if np.asarray(out).dtype == np.float32 else 1e-12
    np.testing.assert_allclose(np.asarray(out, dtype=np.float64), want, rtol=rtol, atol=rtol * max(1.0, np.abs(want).max(initial=0)))
    # the Freivalds form: result == a @ b (+ c0)
    form = spec.verify.form(out, *args, **params)
    if form is not None:
        c, a, b, c0 = form.c, form.a, form.b, form.c0
        np.testing.assert_allclose(np.asarray(c, np.float64), np.asarray(a, np.float64) @ np.asarray(b, np.float64) + (0 if c0 is None else c0), rtol=1e-4, atol=1e-4)
    return out


def f64(*xs):
    return [np.asarray(x, dtype=np.float64) for x in xs]


MATMUL_SHAPES = [
    ((3, 4), (4, 5)), ((1, 1), (1, 1)), ((4,), (4, 3)), ((3, 4), (4,)), ((5,), (5,)),
    ((2, 3, 4), (4, 2)), ((2, 1, 3, 4), (5, 4, 6)), ((0, 4), (4, 3)), ((3, 0), (0, 2)), ((7, 1), (1, 9)),
]  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
@pytest.mark.parametrize("sa, sb", MATMUL_SHAPES)
def test_matmul(sa, sb, dtype):
    a, b = rand(sa, dtype), rand(sb, dtype)
    check("matmul", [a, b], np.matmul(*f64(a, b)))


def test_matmul_mixed_dtypes_promote():
    a, b = rand((3, 4), "float32"), rand((4, 2), "float64")
    assert get("matmul").abstract_eval(a, b).dtype == np.float64 == get("matmul")(a, b).dtype


@pytest.mark.parametrize(
    "sa, sb, message",
    [((3, 4), (5, 6), r"matmul: shapes \(3, 4\) and \(5, 6\) are not aligned"),
     ((), (3,), "at least 1-d"),
     ((2, 3, 4), (3, 4, 5), "batch dimensions")],
)  # fmt: skip
def test_matmul_shape_errors_name_both_shapes(sa, sb, message):
    with pytest.raises(ValueError, match=message):
        get("matmul").abstract_eval(Aval(sa, np.dtype("f8")), Aval(sb, np.dtype("f8")))


def test_matmul_refuses_non_numeric():
    with pytest.raises(TypeError, match="matmul: unsupported dtype"):
        get("matmul").abstract_eval(Aval((2, 2), np.dtype("U2")), Aval((2, 2), np.dtype("f8")))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("sc, sa, sb", [((3, 5), (3, 4), (4, 5)), ((5,), (3, 4), (4, 5)), ((1, 1), (1, 2), (2, 1)), ((2, 3, 5), (2, 3, 4), (4, 5)), ((0, 2), (0, 3), (3, 2))])
def test_matmul_accumulate(sc, sa, sb, dtype):
    c, a, b = rand(sc, dtype), rand(sa, dtype), rand(sb, dtype)
    check("matmul_accumulate", [c, a, b], np.add(*f64(c), np.matmul(*f64(a, b))))


def test_matmul_accumulate_widens_like_numpy():
    c, a, b = rand((2, 2), "float64"), rand((2, 3), "float32"), rand((3, 2), "float32")
    out = get("matmul_accumulate")(c, a, b)
    assert out.dtype == np.float64 == get("matmul_accumulate").abstract_eval(c, a, b).dtype
    np.testing.assert_allclose(out, c + a @ b, rtol=1e-6)


def test_matmul_accumulate_refuses_a_bigger_accumulator():
    with pytest.raises(ValueError, match=r"accumulator of shape \(4, 3, 5\)"):
        get("matmul_accumulate").abstract_eval(Aval((4, 3, 5), np.dtype("f8")), Aval((3, 4), np.dtype("f8")), Aval((4, 5), np.dtype("f8")))


@pytest.mark.parametrize(
    "sa, sb, axes",
    [((3, 4), (4, 5), 1), ((2, 3, 4), (3, 4, 5), 2), ((3, 4), (5, 6), 0), ((4, 3), (4, 5), ((0,), (0,))),
     ((2, 3, 4), (4, 2, 3), ((1, 0), (2, 1))), ((1, 4), (4, 1), ((-1,), (0,))), ((0, 3), (3, 2), 1)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_tensordot(sa, sb, axes, dtype):
    a, b = rand(sa, dtype), rand(sb, dtype)
    check("tensordot", [a, b], np.tensordot(*f64(a, b), axes=axes), axes=axes)


@pytest.mark.parametrize("axes, message", [(((0,), (0,)), "do not match on axes"), (((0, 0), (0, 1)), "repeated axis"),
                                           (((0,), (0, 1)), "cannot contract"), (3, "cannot contract"), (((5,), (0,)), "out of bounds")])  # fmt: skip
def test_tensordot_errors(axes, message):
    with pytest.raises(ValueError, match=f"tensordot: .*{message}"):
        get("tensordot").abstract_eval(Aval((3, 4), np.dtype("f8")), Aval((4, 5), np.dtype("f8")), axes=axes)


EINSUMS = [
    ("ij,jk->ik", [(3, 4), (4, 5)]), ("ij,kj->ik", [(3, 4), (5, 4)]), ("ji,jk->ki", [(4, 3), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]), ("bij,jk->bik", [(2, 3, 4), (4, 5)]), ("ij,ij->ij", [(3, 4), (3, 4)]),
    ("ij,ij->", [(3, 4), (3, 4)]), ("i,j->ij", [(3,), (4,)]), ("ijk,jl->li", [(2, 3, 4), (3, 5)]),
    ("ij,jk->ik", [(1, 1), (1, 1)]), ("ij,jk->ik", [(0, 2), (2, 3)]), ("ij->ji", [(3, 4)]), ("ij->i", [(3, 4)]),
    ("ijk->kij", [(2, 3, 4)]),
]  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
@pytest.mark.parametrize("subscripts, shapes", EINSUMS)
def test_einsum(subscripts, shapes, dtype):
    args = [rand(s, dtype) for s in shapes]
    check("einsum", args, np.einsum(subscripts, *f64(*args)), subscripts=subscripts)


@pytest.mark.parametrize(
    "subscripts, shapes, message",
    [("ij,jk", [(3, 4), (4, 5)], "explicit '->'"), ("...ij,jk->ik", [(3, 4), (4, 5)], "ellipsis"),
     ("ii,ij->ij", [(3, 3), (3, 4)], "repeated index"), ("ij,jk->ik", [(3, 4), (5, 6)], r"index 'j' has sizes 4 and 5"),
     ("ij,jk->iz", [(3, 4), (4, 5)], "appear in no operand"), ("ij,jk,kl->il", [(2, 2)] * 3, "1 or 2 supported"),
     ("ijk,jk->ik", [(3, 4), (4, 5)], "has shape")],
)  # fmt: skip
def test_einsum_errors(subscripts, shapes, message):
    with pytest.raises(ValueError, match=f"einsum: .*{message}"):
        get("einsum").abstract_eval(*[Aval(s, np.dtype("f8")) for s in shapes], subscripts=subscripts)


def test_costs_count_multiply_adds():
    a, b = Aval((30, 40), np.dtype("f8")), Aval((40, 50), np.dtype("f8"))
    assert get("matmul").cost_of(a, b).flops == 2 * 30 * 40 * 50
    assert get("tensordot").cost_of(a, b, axes=1).flops == 2 * 30 * 40 * 50
    assert get("einsum").cost_of(a, b, subscripts="ij,jk->ik").flops == 2 * 30 * 40 * 50
    assert get("matmul").cost_of(a, b).bytes == (30 * 40 + 40 * 50 + 30 * 50) * 8


def test_product_kernels_are_freivalds_checked_and_have_gpu_kernels():
    for name in ("matmul", "matmul_accumulate", "tensordot", "einsum"):
        assert isinstance(get(name).verify, Freivalds) and get(name).cupy is not None


def test_single_operand_einsum_has_no_product_form_and_falls_back_to_replicas():
    verify = get("einsum").verify
    assert verify.form(np.ones(2), np.ones((2, 2)), subscripts="ij->i") is None
    assert verify.otherwise.method == "replica"


@pytest.mark.parametrize(
    "op, shapes, params",
    [("matmul", [(3, 4), (4, 2)], {}), ("matmul", [(4,), (2, 4, 3)], {}), ("matmul", [(2, 3, 4), (4,)], {}),
     ("matmul_accumulate", [(2,), (3, 4), (4, 2)], {}), ("tensordot", [(2, 3, 4), (4, 3)], {"axes": ((1, 2), (1, 0))}),
     ("einsum", [(2, 3, 4), (4, 5)], {"subscripts": "bij,jk->bk"}), ("einsum", [(3, 4)], {"subscripts": "ij->j"})],
)  # fmt: skip
def test_vjp_matches_finite_differences(op, shapes, params):
    spec = get(op)
    args = [rand(s) for s in shapes]
    g = rand(spec.abstract_eval(*args, **params).shape)
    h = 1e-6
    for i, ct in enumerate(spec.grad(g, *args, **params)):
        v = rand(shapes[i])
        plus, minus = list(args), list(args)
        plus[i], minus[i] = args[i] + h * v, args[i] - h * v
        numeric = np.sum(g * (spec(*plus, **params) - spec(*minus, **params))) / (2 * h)
        assert np.shape(ct) == shapes[i]
        assert np.isclose(np.sum(ct * v), numeric, rtol=1e-6, atol=1e-8)
