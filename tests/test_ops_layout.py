"""Layout, creation and random ops against NumPy: values, shapes, dtypes, errors, gradients."""

from __future__ import annotations

import numpy as np
import pytest

from goblin_dask.ops import Aval, get
from goblin_dask.ops.layout import LayoutIndexError

RNG = np.random.default_rng(99)
X = RNG.standard_normal((2, 3, 4))


def check(op, args, params, want):
    spec = get(op)
    out = np.asarray(spec(*args, **params))
    want = np.asarray(want)
    assert spec.abstract_eval(*args, **params) == Aval(want.shape, want.dtype)
    assert out.dtype == want.dtype
    np.testing.assert_array_equal(out, want)


LAYOUT_CASES = [
    ("transpose", [X], {"axes": (2, 0, 1)}, np.transpose(X, (2, 0, 1))),
    ("transpose", [X], {"axes": None}, X.T),
    ("transpose", [X], {"axes": (-1, 0, 1)}, np.transpose(X, (2, 0, 1))),
    ("transpose", [np.ones((1, 0))], {}, np.ones((0, 1))),
    ("reshape", [X], {"shape": (6, 4)}, X.reshape(6, 4)),
    ("reshape", [X], {"shape": (-1, 2)}, X.reshape(-1, 2)),
    ("reshape", [X], {"shape": (24,)}, X.reshape(24)),
    ("reshape", [np.ones((0, 3))], {"shape": (3, 0)}, np.ones((3, 0))),
    ("reshape", [np.float32(2.5)], {"shape": (1, 1)}, np.full((1, 1), 2.5, np.float32)),
    ("getitem", [X], {"index": (0, slice(None), slice(1, None, 2))}, X[0, :, 1::2]),
    ("getitem", [X], {"index": (Ellipsis, None, -1)}, X[..., None, -1]),
    ("getitem", [X], {"index": (slice(None, None, -1),)}, X[::-1]),
    ("getitem", [X], {"index": (slice(5, 9),)}, X[5:9]),
    ("getitem", [X], {"index": (1, 2, 3)}, X[1, 2, 3]),
    ("getitem", [X], {"index": 1}, X[1]),
    ("concatenate", [X, X[:1]], {"axis": 0}, np.concatenate([X, X[:1]])),
    ("concatenate", [X, X[:, :, :1].astype(np.float32)], {"axis": -1}, np.concatenate([X, X[:, :, :1].astype(np.float32)], axis=-1)),
    ("concatenate", [np.arange(3), np.zeros(0, np.int64)], {}, np.arange(3)),
    ("concatenate", [X], {"axis": 1}, X),
    ("stack", [X, X], {"axis": 0}, np.stack([X, X])),
    ("stack", [X, X, X], {"axis": -1}, np.stack([X, X, X], axis=-1)),
    ("stack", [np.int8(1), np.int8(2)], {}, np.array([1, 2], np.int8)),
    ("astype", [X], {"dtype": "float32"}, X.astype(np.float32)),
    ("astype", [X * 10], {"dtype": "int16"}, (X * 10).astype(np.int16)),
    ("astype", [X > 0], {"dtype": np.dtype("uint8")}, (X > 0).astype(np.uint8)),
    ("broadcast_to", [np.arange(4)], {"shape": (3, 4)}, np.broadcast_to(np.arange(4), (3, 4))),
    ("broadcast_to", [np.ones((3, 1))], {"shape": (2, 3, 5)}, np.ones((2, 3, 5))),
    ("broadcast_to", [np.ones((3, 1))], {"shape": (3, 0)}, np.ones((3, 0))),
    ("broadcast_to", [2.0], {"shape": (2,)}, np.full(2, 2.0)),
    ("squeeze", [np.ones((1, 3, 1))], {"axis": None}, np.ones(3)),
    ("squeeze", [np.ones((1, 3, 1))], {"axis": (-1,)}, np.ones((1, 3))),
    ("squeeze", [np.ones((1, 3, 1))], {"axis": 0}, np.ones((3, 1))),
    ("expand_dims", [X], {"axis": (0, 4)}, np.expand_dims(X, (0, 4))),
    ("expand_dims", [X], {"axis": -1}, X[..., None]),
    ("expand_dims", [np.int32(3)], {"axis": (0, 1)}, np.full((1, 1), 3, np.int32)),
]


@pytest.mark.parametrize("op, args, params, want", LAYOUT_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(LAYOUT_CASES)])
def test_layout_matches_numpy(op, args, params, want):
    check(op, args, params, want)


@pytest.mark.parametrize(
    "op, shapes, params, error, message",
    [("transpose", [(2, 3)], {"axes": (0,)}, ValueError, "not a permutation"),
     ("transpose", [(2, 3)], {"axes": (0, 0)}, ValueError, "repeated axis"),
     ("reshape", [(2, 3)], {"shape": (4, 2)}, ValueError, r"cannot reshape shape \(2, 3\)"),
     ("reshape", [(2, 3)], {"shape": (-1, -1)}, ValueError, "cannot infer"),
     ("reshape", [(2, 3)], {"shape": (4, -1)}, ValueError, "cannot reshape"),
     ("getitem", [(2, 3)], {"index": (5,)}, LayoutIndexError, r"getitem: .*\(2, 3\)"),
     ("getitem", [(2, 3)], {"index": (0, 0, 0)}, LayoutIndexError, "too many indices"),
     ("getitem", [(2, 3)], {"index": ([0, 1],)}, ValueError, "fancy"),
     ("getitem", [(2, 3)], {"index": (True,)}, ValueError, "fancy"),
     ("getitem", [(2, 3)], {"index": (slice(0, 1.5),)}, ValueError, "slice of ints"),
     ("concatenate", [(2, 3), (2, 4)], {"axis": 0}, ValueError, r"shapes \(2, 3\) and \(2, 4\) differ outside axis 0"),
     ("concatenate", [(), ()], {}, ValueError, "zero-dimensional"),
     ("concatenate", [(2, 3)], {"axis": 2}, ValueError, "out of bounds"),
     ("stack", [(2, 3), (3, 2)], {}, ValueError, "not all equal"),
     ("stack", [], {}, ValueError, "at least one"),
     ("broadcast_to", [(3,)], {"shape": (4,)}, ValueError, r"shape \(3,\) does not broadcast to \(4,\)"),
     ("broadcast_to", [(2, 3)], {"shape": (3,)}, ValueError, "does not broadcast"),
     ("squeeze", [(2, 1)], {"axis": 0}, ValueError, "has size 2, not 1"),
     ("expand_dims", [(2,)], {"axis": (3,)}, ValueError, "out of bounds"),
     ("astype", [(2,)], {"dtype": "U3"}, TypeError, "astype: unsupported dtype"),
     ("astype", [(2,)], {"dtype": "datetime64[s]"}, TypeError, "astype: unsupported dtype")],
)  # fmt: skip
def test_layout_errors(op, shapes, params, error, message):
    with pytest.raises(error, match=message):
        get(op).abstract_eval(*[Aval(s, np.dtype("f8")) for s in shapes], **params)


def test_getitem_out_of_bounds_is_also_an_index_error():
    with pytest.raises(IndexError):
        get("getitem").abstract_eval(Aval((2,), np.dtype("f8")), index=(2,))


def test_unknown_parameters_are_refused():
    with pytest.raises(TypeError, match="unknown parameter"):
        get("transpose").abstract_eval(X, order="F")


@pytest.mark.parametrize(
    "op, args, params",
    [("transpose", [X], {"axes": (1, 2, 0)}), ("reshape", [X], {"shape": (4, -1)}), ("squeeze", [X[:1]], {}),
     ("expand_dims", [X], {"axis": 1}), ("broadcast_to", [X[:1]], {"shape": (5, 3, 4)}),
     ("getitem", [X], {"index": (slice(None), 1, slice(None, None, 2))}), ("concatenate", [X, X[:1]], {"axis": 0}),
     ("stack", [X, X], {"axis": 2}), ("astype", [X], {"dtype": "float32"})],
)  # fmt: skip
def test_layout_vjps_are_adjoints(op, args, params):
    """<g, f(v)> == <vjp(g), v> for these linear maps."""
    spec = get(op)
    vs = [RNG.standard_normal(np.shape(a)) for a in args]
    g = RNG.standard_normal(spec.abstract_eval(*args, **params).shape)
    cts = spec.grad(g, *args, **params)
    lhs = np.sum(g * np.asarray(spec(*vs, **params), dtype=np.float64))
    rhs = sum(np.sum(ct * v) for ct, v in zip(cts, vs))
    assert np.isclose(lhs, rhs, rtol=1e-5)


# -- creation ---------------------------------------------------------------------------


CREATION_CASES = [
    ("zeros", {"shape": (2, 3)}, np.zeros((2, 3))),
    ("zeros", {"shape": (0,), "dtype": "int8"}, np.zeros(0, np.int8)),
    ("ones", {"shape": 4, "dtype": "float32"}, np.ones(4, np.float32)),
    ("ones", {"shape": ()}, np.ones(())),
    ("full", {"shape": (2, 2), "fill_value": 7}, np.full((2, 2), 7)),
    ("full", {"shape": (2,), "fill_value": 0.5, "dtype": "float32"}, np.full(2, 0.5, np.float32)),
    ("full", {"shape": (1,), "fill_value": True}, np.full(1, True)),
    ("arange", {"start": 0, "stop": 10, "step": 3}, np.arange(0, 10, 3)),
    ("arange", {"start": 5}, np.arange(5)),
    ("arange", {"start": 1.0, "stop": 2.0, "step": 0.1}, np.arange(1.0, 2.0, 0.1)),
    ("arange", {"start": 10, "stop": 0, "step": -3, "dtype": "float32"}, np.arange(10, 0, -3, dtype=np.float32)),
    ("arange", {"start": 3, "stop": 1}, np.arange(3, 1)),
    ("arange", {"start": 0, "stop": 1, "step": 0.25, "dtype": "float64"}, np.arange(0, 1, 0.25)),
    ("eye", {"n": 3}, np.eye(3)),
    ("eye", {"n": 2, "m": 4, "k": 1, "dtype": "int32"}, np.eye(2, 4, 1, dtype=np.int32)),
    ("eye", {"n": 3, "k": -2}, np.eye(3, k=-2)),
    ("eye", {"n": 0}, np.eye(0)),
]


@pytest.mark.parametrize("op, params, want", CREATION_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CREATION_CASES)])
def test_creation_matches_numpy(op, params, want):
    check(op, [], params, want)


@pytest.mark.parametrize(
    "op, params, error",
    [("zeros", {"shape": (-1, 2)}, ValueError), ("zeros", {"shape": (2.5,)}, ValueError), ("zeros", {"dtype": "U1"}, TypeError),
     ("full", {"shape": (2,), "fill_value": "x"}, TypeError), ("arange", {"start": 0, "stop": 3, "step": 0}, ValueError),
     ("arange", {"start": "a", "stop": 3}, TypeError), ("eye", {"n": -1}, ValueError), ("eye", {"n": 2, "k": 0.5}, ValueError)],
)  # fmt: skip
def test_creation_errors(op, params, error):
    with pytest.raises(error, match=op):
        get(op).abstract_eval(**params)


def test_creation_cost_is_one_write_per_element():
    cost = get("zeros").cost_of(shape=(10, 10), dtype="float32")
    assert cost.flops == 100 and cost.bytes == 400


# -- random -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_random_is_deterministic_from_the_seed_and_matches_the_generator(dtype):
    normal, uniform = get("random_standard_normal"), get("random_uniform")
    a = normal(shape=(50, 4), dtype=dtype, seed=3)
    np.testing.assert_array_equal(a, normal(shape=(50, 4), dtype=dtype, seed=3))
    np.testing.assert_array_equal(a, np.random.Generator(np.random.PCG64(3)).standard_normal((50, 4), dtype=dtype))
    assert not np.array_equal(a, normal(shape=(50, 4), dtype=dtype, seed=4))
    u = uniform(shape=(1000,), low=-2.0, high=5.0, dtype=dtype, seed=(3, 1))
    assert u.dtype == dtype and u.min() >= -2.0 and u.max() < 5.0 and 1.0 < u.mean() < 2.0
    np.testing.assert_array_equal(u, uniform(shape=(1000,), low=-2.0, high=5.0, dtype=dtype, seed=(3, 1)))
    assert not np.array_equal(u, uniform(shape=(1000,), low=-2.0, high=5.0, dtype=dtype, seed=(3, 2)))
    assert normal.abstract_eval(shape=(50, 4), dtype=dtype, seed=3) == Aval((50, 4), np.dtype(dtype))


def test_random_uniform_float64_is_generator_uniform():
    want = np.random.Generator(np.random.PCG64(11)).uniform(1.0, 3.0, size=(20,))
    np.testing.assert_array_equal(get("random_uniform")(shape=(20,), low=1.0, high=3.0, seed=11), want)


@pytest.mark.parametrize(
    "params, error",
    [({"shape": (2,), "seed": -1}, ValueError), ({"shape": (2,), "seed": 1.5}, ValueError), ({"shape": (2,)}, ValueError),
     ({"shape": (2,), "seed": 1, "dtype": "int32"}, TypeError), ({"shape": (2,), "seed": ()}, ValueError)],
)  # fmt: skip
def test_random_errors(params, error):
    with pytest.raises(error, match="random_standard_normal"):
        get("random_standard_normal").abstract_eval(**params)
