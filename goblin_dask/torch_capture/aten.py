"""The table: one row per core-ATen operator, a small function emitting ``ga`` calls.

A row is ``Row(fn, needs)``: ``fn(ga, *args, **kwargs)`` gets the ``goblin_dask.array``
module and the operator's arguments (tensors as ga Arrays, Python scalars, lists) and
returns a ga Array (or a tuple, for operators with several results); ``needs`` names the
``ga`` functions it calls.  ``fn`` looks each of them up on ``ga`` when called
(``getattr``), so a ga function added later (``ga.softmax``, ``ga.conv2d``, ``ga.take``)
makes its rows work without touching this file; until it is there, :func:`missing` says
which names a row still lacks and capture refuses the operator with its place in the model.

No torch here: a saved graph is interpreted with numpy, dask and this table alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
import secrets
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class Row:
    fn: Callable[..., Any]
    needs: tuple[str, ...]
    #: argument positions where a model constant (a buffer, a lifted tensor) comes as its NumPy
    #: array rather than a ga array (``take``'s indices must be concrete); "all": every argument
    #: stays as it is (an identity row passes a constant on unread)
    concrete: tuple[int, ...] | str = ()


TABLE: dict[str, Row] = {}


class NotComputed:
    """A result of an operator that its row does not compute (the indices of max_pool2d, the saved statistics
    of a norm: what torch keeps for backward).  Reading one is refused: a captured operator gives torch's
    numbers or is refused, never a stand-in of the wrong shape."""

    def __init__(self, target: str, index: int, what: str):
        self.target, self.index, self.what = target, index, what

    def refusal(self) -> str:
        return f"its result {self.index} ({self.what}) is not computed by goblin-dask: only its first result is"

    def __repr__(self) -> str:
        return f"<not computed: {self.target}[{self.index}]>"


#: Operators whose rows compute their first result only: target -> what the others are.  Capture refuses a
#: graph that reads any of the others (:func:`partial_refusal`), naming the operator and its place.
FIRST_RESULT_ONLY = {
    "aten.max_pool2d_with_indices.default": "the indices of return_indices=True",
    "aten.native_layer_norm.default": "the mean and rstd torch saves for backward",
    "aten._native_batch_norm_legit_no_training.default": "the statistics torch saves for backward",
    "aten._native_batch_norm_legit.no_stats": "the statistics torch saves for backward",
}


def _not_computed(target: str, n: int) -> tuple:
    return tuple(NotComputed(target, i, FIRST_RESULT_ONLY[target]) for i in range(1, n))


def partial_refusal(target: str, index: Any) -> str | None:
    """Why reading result ``index`` of ``target`` is refused, or None when its row computes it."""
    if target in FIRST_RESULT_ONLY and index != 0:
        return NotComputed(target, index, FIRST_RESULT_ONLY[target]).refusal()
    return None


def row(*targets: str, needs: tuple[str, ...] | str = (), concrete: tuple[int, ...] | str = ()) -> Callable:
    needs = (needs,) if isinstance(needs, str) else tuple(needs)

    def deco(fn: Callable) -> Callable:
        for t in targets:
            TABLE[t] = Row(fn, needs, concrete)
        return fn

    return deco


def missing(target: str, ga: Any) -> tuple[str, ...] | None:
    """None: no row for ``target``; else the ``ga`` names its row needs that ga lacks (empty: supported)."""
    r = TABLE.get(target)
    if r is None:
        return None
    return tuple(n for n in r.needs if not hasattr(ga, n))


def _axes(dims: Any, ndim: int) -> tuple[int, ...] | None:
    if dims is None:
        return None
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:  # aten: an empty dim list reduces over every axis
        return None
    return tuple(d % ndim if ndim else 0 for d in dims)


def _ndim(x: Any) -> int:
    return getattr(x, "ndim", 0)


# -- elementwise, one argument ------------------------------------------------------------------

_UNARY = {
    "abs": "absolute", "neg": "negative", "exp": "exp", "expm1": "expm1", "log": "log", "log1p": "log1p",
    "log2": "log2", "log10": "log10", "sqrt": "sqrt", "reciprocal": "reciprocal", "sin": "sin", "cos": "cos",
    "tan": "tan", "asin": "arcsin", "acos": "arccos", "atan": "arctan", "sinh": "sinh", "cosh": "cosh",
    "tanh": "tanh", "floor": "floor", "ceil": "ceil", "round": "rint", "trunc": "trunc", "sign": "sign",
    "logical_not": "logical_not", "bitwise_not": "invert", "isnan": "isnan", "isinf": "isinf",
    "sigmoid": "sigmoid", "relu": "relu", "erf": "erf",
    # activations the catalog is gaining (ga.<name> once it is there)
    "silu": "silu", "mish": "mish", "hardswish": "hardswish", "hardsigmoid": "hardsigmoid",
}


def _unary(name: str) -> Callable:
    return lambda ga, x: getattr(ga, name)(x)


for _aten, _ga in _UNARY.items():
    row(f"aten.{_aten}.default", needs=_ga)(_unary(_ga))
row("aten.isfinite.default", needs="isfinite")(_unary("isfinite"))


@row("aten.rsqrt.default", needs=("sqrt", "reciprocal"))
def _rsqrt(ga, x):
    return ga.reciprocal(ga.sqrt(x))


@row("aten.square.default", needs="square")
def _square(ga, x):
    return ga.square(x)


# -- elementwise, two arguments (Tensor and Scalar variants) ------------------------------------

_BINARY = {
    "mul": "multiply", "maximum": "maximum", "minimum": "minimum", "atan2": "arctan2", "eq": "equal",
    "ne": "not_equal", "lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal",
    "logical_and": "logical_and", "logical_or": "logical_or", "logical_xor": "logical_xor",
    "bitwise_and": "bitwise_and", "bitwise_or": "bitwise_or", "bitwise_xor": "bitwise_xor",
    "remainder": "remainder", "hypot": "hypot", "fmod": "fmod",
}


def _binary(name: str) -> Callable:
    def binary(ga, x, y):
        if not isinstance(x, ga.Array) and not isinstance(y, ga.Array):  # two numbers (a backward's constants)
            return getattr(np, name)(x, y)
        return getattr(ga, name)(x, y)

    return binary


for _aten, _ga in _BINARY.items():
    row(f"aten.{_aten}.Tensor", f"aten.{_aten}.Scalar", f"aten.{_aten}.default",
        needs=_ga)(_binary(_ga))


for _aten, _ga in {"__lshift__": "left_shift", "__rshift__": "right_shift", "bitwise_left_shift": "left_shift",
                   "bitwise_right_shift": "right_shift"}.items():
    row(f"aten.{_aten}.Scalar", f"aten.{_aten}.Tensor", f"aten.{_aten}.Tensor_Scalar", needs=_ga)(_binary(_ga))


@row("aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor", "aten.pow.Scalar", needs="power")
def _pow(ga, x, y):
    if isinstance(y, (int, float)) and y == 2:
        return ga.multiply(x, x)
    return ga.power(x, y)


@row("aten.add.Tensor", "aten.add.Scalar", needs=("add", "multiply"))
def _add(ga, x, y, alpha=1):
    return ga.add(x, y if alpha == 1 else ga.multiply(y, alpha) if not isinstance(y, (int, float)) else y * alpha)


@row("aten.sub.Tensor", "aten.sub.Scalar", needs=("subtract", "multiply"))
def _sub(ga, x, y, alpha=1):
    return ga.subtract(x, y if alpha == 1 else ga.multiply(y, alpha) if not isinstance(y, (int, float)) else y * alpha)


@row("aten.rsub.Scalar", "aten.rsub.Tensor", needs=("subtract", "multiply"))
def _rsub(ga, x, y, alpha=1):
    return ga.subtract(y, x if alpha == 1 else ga.multiply(x, alpha))


@row("aten.div.Tensor", "aten.div.Scalar", needs="divide")
def _div(ga, x, y):
    return ga.divide(x, y)


@row("aten.div.Tensor_mode", "aten.div.Scalar_mode", needs=("divide", "floor_divide", "trunc"))
def _div_mode(ga, x, y, rounding_mode=None):
    if rounding_mode is None:
        return ga.divide(x, y)
    if rounding_mode == "floor":
        return ga.floor_divide(x, y)
    return ga.trunc(ga.divide(x, y))


@row("aten.where.self", needs="where")
def _where(ga, c, x, y):
    return ga.where(c, x, y)


@row("aten.clamp.default", "aten.clamp.Tensor", needs="clip")
def _clamp(ga, x, min=None, max=None):
    return ga.clip(x, min, max)


@row("aten.clamp_min.default", needs="maximum")
def _clamp_min(ga, x, lo):
    return ga.maximum(x, lo)


@row("aten.clamp_max.default", needs="minimum")
def _clamp_max(ga, x, hi):
    return ga.minimum(x, hi)


# -- activations the catalog is gaining ----------------------------------------------------------

@row("aten.gelu.default", needs=("gelu", "gelu_tanh"))
def _gelu(ga, x, approximate="none"):
    return ga.gelu_tanh(x) if approximate == "tanh" else ga.gelu(x)


@row("aten.leaky_relu.default", needs="leaky_relu")
def _leaky_relu(ga, x, negative_slope=0.01):
    return ga.leaky_relu(x, negative_slope)


@row("aten.elu.default", needs=("elu", "multiply"))
def _elu(ga, x, alpha=1.0, scale=1.0, input_scale=1.0):
    if input_scale != 1:
        x = ga.multiply(x, input_scale)
    y = ga.elu(x, alpha)
    return y if scale == 1 else ga.multiply(y, scale)


@row("aten.softplus.default", needs="softplus")
def _softplus(ga, x, beta=1, threshold=20):
    if beta != 1 or threshold != 20:
        raise NotImplementedError(f"softplus with beta={beta}, threshold={threshold} (only the defaults are mapped)")
    return ga.softplus(x)


# -- products ------------------------------------------------------------------------------------

@row("aten.mm.default", "aten.bmm.default", "aten.matmul.default", needs="matmul")
def _mm(ga, a, b):
    return ga.matmul(a, b)


@row("aten.addmm.default", needs=("matmul", "add", "multiply"))
def _addmm(ga, bias, a, b, beta=1, alpha=1):
    if alpha == 1 and beta == 1:  # a linear layer: the bias folded into the product's blocks
        from goblin_dask.array.linalg import matmul_add

        return matmul_add(a, b, bias)
    p = ga.matmul(a, b)
    if alpha != 1:
        p = ga.multiply(p, alpha)
    if beta == 0:
        return p
    return ga.add(p, bias if beta == 1 else ga.multiply(bias, beta))


@row("aten.baddbmm.default", needs=("matmul", "add", "multiply"))
def _baddbmm(ga, bias, a, b, beta=1, alpha=1):
    return _addmm(ga, bias, a, b, beta=beta, alpha=alpha)


# -- layout --------------------------------------------------------------------------------------

@row("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", needs="reshape")
def _view(ga, x, shape):
    return ga.reshape(x, tuple(int(s) for s in shape))


@row("aten.permute.default", needs="transpose")
def _permute(ga, x, dims):
    return ga.transpose(x, tuple(d % x.ndim for d in dims))


@row("aten.t.default", needs="transpose")
def _t(ga, x):
    return x if x.ndim < 2 else ga.transpose(x)


@row("aten.transpose.int", needs="swapaxes")
def _transpose(ga, x, d0, d1):
    return ga.swapaxes(x, d0, d1)


@row("aten.unsqueeze.default", needs="expand_dims")
def _unsqueeze(ga, x, dim):
    return ga.expand_dims(x, dim % (x.ndim + 1))


@row("aten.squeeze.dims", "aten.squeeze.dim", "aten.squeeze.default", needs="squeeze")
def _squeeze(ga, x, dims=None):
    if dims is None:
        return ga.squeeze(x)
    axes = tuple(d for d in _axes(dims, x.ndim) or () if x.shape[d] == 1)
    return ga.squeeze(x, axes) if axes else x


@row("aten.expand.default", needs="broadcast_to")
def _expand(ga, x, shape):
    lead = len(shape) - x.ndim
    full = tuple(x.shape[i - lead] if int(s) == -1 else int(s) for i, s in enumerate(shape))
    return x if full == tuple(x.shape) else ga.broadcast_to(x, full)


@row("aten.cat.default", needs="concatenate")
def _cat(ga, tensors, dim=0):
    tensors = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]  # aten skips empty 1-d inputs
    return tensors[0] if len(tensors) == 1 else ga.concatenate(tensors, axis=dim)


@row("aten.stack.default", needs="stack")
def _stack(ga, tensors, dim=0):
    return ga.stack(tensors, axis=dim)


@row("aten.slice.Tensor", needs="getitem")
def _slice(ga, x, dim=0, start=None, end=None, step=1):
    dim %= x.ndim
    n = x.shape[dim]
    s = slice(start, end, step).indices(n)
    if s == (0, n, 1):
        return x
    index = (slice(None),) * dim + (slice(*s),)
    return ga.getitem(x, index)


@row("aten.select.int", needs="getitem")
def _select(ga, x, dim, index):
    dim %= x.ndim
    return ga.getitem(x, (slice(None),) * dim + (int(index),))


@row("aten.index.Tensor", needs="take", concrete=(1,))
def _index(ga, x, indices):
    given = [(d, i) for d, i in enumerate(indices) if i is not None]
    if len(given) != 1:
        raise NotImplementedError("indexing with more than one index tensor (only one axis at a time is mapped)")
    (axis, idx), = given
    return ga.take(x, idx, axis=axis)


@row("aten.embedding.default", needs=("take", "gather"), concrete=(1,))
def _embedding(ga, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if not isinstance(indices, ga.Array):  # NumPy inputs or model constants: rows taken at the lab's data
        return ga.take(weight, indices, axis=0)
    # ids computed in the graph (``pos(arange(t))``): row i of the result gathers weight[ids[i], :]
    flat = ga.reshape(indices, (-1,))
    rows = ga.gather(weight, ga.broadcast_to(ga.reshape(flat, (flat.shape[0], 1)), (flat.shape[0], weight.shape[1])), 0)
    return ga.reshape(rows, (*indices.shape, weight.shape[1]))


@row("aten.index_select.default", needs="take", concrete=(2,))
def _index_select(ga, x, dim, index):
    return ga.take(x, index, axis=dim % x.ndim)


@row("aten.gather.default", needs="gather")
def _gather(ga, x, dim, index, sparse_grad=False):
    return ga.gather(x, index, dim % max(x.ndim, 1))


@row("aten.tril.default", needs="tril")
def _tril(ga, x, diagonal=0):
    return ga.tril(x, diagonal)


@row("aten.triu.default", needs="triu")
def _triu(ga, x, diagonal=0):
    return ga.triu(x, diagonal)


@row("aten.masked_fill.Scalar", "aten.masked_fill.Tensor", needs="where")
def _masked_fill(ga, x, mask, value):
    if not hasattr(value, "chunks"):  # a number: filled in x's dtype, as torch does
        value = np.asarray(value, dtype=x.dtype)[()]
    return ga.where(mask, value, x)


@row("aten.split_with_sizes.default", needs="getitem")
def _split_with_sizes(ga, x, sizes, dim=0):
    dim %= x.ndim
    out, start = [], 0
    for n in sizes:
        out.append(ga.getitem(x, (slice(None),) * dim + (slice(start, start + int(n)),)))
        start += int(n)
    return tuple(out)


@row("aten.split.Tensor", needs="getitem")
def _split(ga, x, split_size, dim=0):
    n = x.shape[dim % x.ndim]
    return _split_with_sizes(ga, x, [min(split_size, n - s) for s in range(0, n, split_size)], dim)


@row("aten.unbind.int", needs="getitem")
def _unbind(ga, x, dim=0):
    dim %= x.ndim
    return tuple(ga.getitem(x, (slice(None),) * dim + (i,)) for i in range(x.shape[dim]))


@row("aten.constant_pad_nd.default", needs="pad")
def _pad(ga, x, pad, value=0):
    widths = [(0, 0)] * x.ndim
    for i in range(len(pad) // 2):  # aten: (last axis before, after, second to last ...)
        widths[x.ndim - 1 - i] = (int(pad[2 * i]), int(pad[2 * i + 1]))
    if any(a < 0 or b < 0 for a, b in widths):
        raise NotImplementedError("negative padding (a crop)")
    return ga.pad(x, tuple(widths), constant_values=value)


@row("aten.clone.default", "aten.alias.default", "aten.detach.default", "aten.contiguous.default",
     "aten.lift_fresh_copy.default", concrete="all")
def _same(ga, x, **_ignored):
    return x


@row("aten._to_copy.default", "aten.to.dtype", needs="astype")
def _to_copy(ga, x, dtype=None, **_ignored):
    return x if dtype is None else ga.astype(x, dtype)


# -- reductions ----------------------------------------------------------------------------------

@row("aten.sum.dim_IntList", "aten.sum.default", needs=("sum", "astype"))
def _sum(ga, x, dim=None, keepdim=False, dtype=None):
    y = ga.sum(x, axis=_axes(dim, x.ndim), keepdims=keepdim)
    return y if dtype is None else ga.astype(y, dtype)


@row("aten.mean.dim", "aten.mean.default", needs="mean")
def _mean(ga, x, dim=None, keepdim=False, dtype=None):
    return ga.mean(x, axis=_axes(dim, x.ndim), keepdims=keepdim, dtype=dtype)


@row("aten.prod.dim_int", "aten.prod.default", needs="prod")
def _prod(ga, x, dim=None, keepdim=False, dtype=None):
    return ga.prod(x, axis=_axes(dim, x.ndim), keepdims=keepdim, dtype=dtype)


@row("aten.amax.default", needs="max")
def _amax(ga, x, dim=(), keepdim=False):
    return ga.max(x, axis=_axes(dim, x.ndim), keepdims=keepdim)


@row("aten.amin.default", needs="min")
def _amin(ga, x, dim=(), keepdim=False):
    return ga.min(x, axis=_axes(dim, x.ndim), keepdims=keepdim)


@row("aten.max.dim", needs=("max", "argmax"))
def _max_dim(ga, x, dim, keepdim=False):
    return ga.max(x, axis=dim % x.ndim, keepdims=keepdim), ga.argmax(x, axis=dim % x.ndim, keepdims=keepdim)


@row("aten.min.dim", needs=("min", "argmin"))
def _min_dim(ga, x, dim, keepdim=False):
    return ga.min(x, axis=dim % x.ndim, keepdims=keepdim), ga.argmin(x, axis=dim % x.ndim, keepdims=keepdim)


@row("aten.max.default", needs="max")
def _max_all(ga, x):
    return ga.max(x)


@row("aten.min.default", needs="min")
def _min_all(ga, x):
    return ga.min(x)


@row("aten.argmax.default", needs="argmax")
def _argmax(ga, x, dim=None, keepdim=False):
    return ga.argmax(x, axis=None if dim is None else dim % x.ndim, keepdims=keepdim)


@row("aten.argmin.default", needs="argmin")
def _argmin(ga, x, dim=None, keepdim=False):
    return ga.argmin(x, axis=None if dim is None else dim % x.ndim, keepdims=keepdim)


@row("aten.var.correction", "aten.var.dim", needs="var")
def _var(ga, x, dim=None, unbiased=None, keepdim=False, correction=None):
    ddof = correction if correction is not None else (1 if unbiased in (None, True) else 0)
    return ga.var(x, axis=_axes(dim, x.ndim), ddof=ddof, keepdims=keepdim)


@row("aten.any.dim", "aten.any.dims", "aten.any.default", needs="any")
def _any(ga, x, dim=None, keepdim=False):
    return ga.any(x, axis=_axes(dim, x.ndim), keepdims=keepdim)


@row("aten.all.dim", "aten.all.dims", "aten.all.default", needs="all")
def _all(ga, x, dim=None, keepdim=False):
    return ga.all(x, axis=_axes(dim, x.ndim), keepdims=keepdim)


@row("aten.cumsum.default", needs="cumsum")
def _cumsum(ga, x, dim, dtype=None):
    return ga.cumsum(x, axis=dim % x.ndim, dtype=dtype)


@row("aten.cumprod.default", needs="cumprod")
def _cumprod(ga, x, dim, dtype=None):
    return ga.cumprod(x, axis=dim % x.ndim, dtype=dtype)


@row("aten.logsumexp.default", needs="logsumexp")
def _logsumexp(ga, x, dim, keepdim=False):
    axes = _axes(dim, x.ndim)
    if axes is None or len(axes) != 1:
        raise NotImplementedError("logsumexp over more than one axis (ga.logsumexp takes one)")
    return ga.logsumexp(x, axis=axes[0], keepdims=keepdim)


# -- order statistics (the catalog's sort, argsort, topk, argtopk, quantile) ---------------------
#
# Indices are always the stable order: equal values in ascending index order, NaN largest (last
# ascending, first descending), as torch's ``stable=True``.  torch leaves the tie order of its other
# calls (non-stable sort, topk, median, kthvalue) unspecified; the stable order is one it allows, and
# the one the lab's exact recomputation of these lab-only ops can check.  ``topk(sorted=False)`` gives
# the sorted order, which torch's unspecified order allows too.

def _index_dtype(ga, i):
    return i if i.dtype == np.int64 else ga.astype(i, np.int64)  # torch's indices are int64


def _at(ga, x, axis, i, keepdim):
    """Position ``i`` along ``axis``: the axis dropped, or kept with length 1."""
    return ga.getitem(x, (slice(None),) * axis + ((slice(i, i + 1),) if keepdim else (i,)))


def _unordered(ga, x):
    """A 0-d tensor (torch orders it as one element): itself, at index 0."""
    return x, ga.zeros((), dtype="int64")


def _ordered(ga, x, axis, descending):
    """``x`` sorted along ``axis`` and the indices that sort it, both in the stable order."""
    n = x.shape[axis]
    if descending and n > 1:  # the n largest, descending: NaN first, equal values in index order
        return ga.topk(x, n, axis=axis), _index_dtype(ga, ga.argtopk(x, n, axis=axis))
    return ga.sort(x, axis=axis), _index_dtype(ga, ga.argsort(x, axis=axis))


@row("aten.sort.default", "aten.sort.stable", needs=("sort", "argsort", "topk", "argtopk", "astype", "zeros"))
def _sort(ga, x, dim=-1, descending=False, stable=None):
    if x.ndim == 0:
        return _unordered(ga, x)
    return _ordered(ga, x, dim % x.ndim, descending)


@row("aten.argsort.default", "aten.argsort.stable", needs=("sort", "argsort", "topk", "argtopk", "astype", "zeros"))
def _argsort(ga, x, dim=-1, descending=False, stable=None):
    return _sort(ga, x, dim, descending)[1]


@row("aten.topk.default", needs=("topk", "argtopk", "astype", "getitem", "zeros"))
def _topk(ga, x, k, dim=-1, largest=True, sorted=True):
    if x.ndim == 0:
        return _unordered(ga, x)
    axis = dim % x.ndim
    if k == 0:  # torch: empty results
        empty = ga.getitem(x, (slice(None),) * axis + (slice(0, 0),))
        return empty, ga.astype(empty, np.int64)
    k = int(k) if largest else -int(k)  # the catalog's k < 0: the -k smallest, ascending
    return ga.topk(x, k, axis=axis), _index_dtype(ga, ga.argtopk(x, k, axis=axis))


@row("aten.kthvalue.default", needs=("topk", "argtopk", "astype", "getitem", "zeros"))
def _kthvalue(ga, x, k, dim=-1, keepdim=False):
    """The k-th smallest (1-based) and its index: the last of the catalog's ``k`` smallest."""
    if x.ndim == 0:
        return _unordered(ga, x)
    axis = dim % x.ndim
    values, indices = ga.topk(x, -int(k), axis=axis), ga.argtopk(x, -int(k), axis=axis)
    return _at(ga, values, axis, int(k) - 1, keepdim), _index_dtype(ga, _at(ga, indices, axis, int(k) - 1, keepdim))


# torch's median is the lower of the two middle values for an even count (numpy's averages them): the catalog's
# quantile at 0.5 with method="lower", NaN wherever the slice holds one (nanmedian: of the values that are not NaN)

@row("aten.median.default", needs="quantile")
def _median_all(ga, x):
    return ga.quantile(x, 0.5, method="lower")


@row("aten.nanmedian.default", needs="nanquantile")
def _nanmedian_all(ga, x):
    return ga.nanquantile(x, 0.5, method="lower")


_MEDIAN_INDEX_NEEDS = ("sort", "argsort", "topk", "argtopk", "astype", "zeros", "getitem", "isnan", "any", "argmax",
                       "where", "sum", "logical_not", "subtract", "floor_divide", "maximum", "gather", "squeeze")


@row("aten.median.dim", needs=("quantile",) + _MEDIAN_INDEX_NEEDS)
def _median_dim(ga, x, dim, keepdim=False):
    """Values and indices: the element at rank (n - 1) // 2 of the stable order; where the slice holds a NaN, NaN
    at the first NaN's index (torch's)."""
    if x.ndim == 0:
        return _unordered(ga, x)
    axis = dim % x.ndim
    values = ga.quantile(x, 0.5, axis=axis, keepdims=keepdim, method="lower")
    index = _at(ga, _ordered(ga, x, axis, False)[1], axis, (x.shape[axis] - 1) // 2, keepdim)
    if np.dtype(x.dtype).kind == "f":
        nan = ga.isnan(x)
        first = _index_dtype(ga, ga.argmax(nan, axis=axis, keepdims=keepdim))
        index = ga.where(ga.any(nan, axis=axis, keepdims=keepdim), first, index)
    return values, index


@row("aten.nanmedian.dim", needs=("nanquantile",) + _MEDIAN_INDEX_NEEDS)
def _nanmedian_dim(ga, x, dim, keepdim=False):
    """Values and indices: the element at rank (m - 1) // 2 of the stable order, m the slice's values that are not
    NaN (NaN sorts last); an all-NaN slice gives NaN at index 0."""
    if x.ndim == 0:
        return _unordered(ga, x)
    axis = dim % x.ndim
    values = ga.nanquantile(x, 0.5, axis=axis, keepdims=keepdim, method="lower")
    order = _ordered(ga, x, axis, False)[1]
    if np.dtype(x.dtype).kind != "f":
        return values, _at(ga, order, axis, (x.shape[axis] - 1) // 2, keepdim)
    counted = ga.sum(ga.logical_not(ga.isnan(x)), axis=axis, keepdims=True)
    rank = ga.maximum(ga.floor_divide(ga.subtract(counted, 1), 2), 0)
    index = ga.gather(order, _index_dtype(ga, rank), axis)
    return values, index if keepdim else ga.squeeze(index, axis)


# torch.quantile and torch.nanquantile: the catalog's quantile (a Replica op: it may run on volunteers), kept whole
# at export (:data:`KEEP_WHOLE`; decomposed, it is a sort, which only the lab may run).  torch computes the ranks
# q * (n - 1) in the input's dtype, so q goes to NumPy in it too; torch's interpolations are NumPy's methods of the
# same names.  'lower', 'higher', 'nearest' and 'midpoint' give torch's values exactly; 'linear' (the default)
# within one rounding of the slice's largest value (torch's lerp is a fused multiply-add, NumPy's two operations).

TORCH_INTERPOLATIONS = ("linear", "lower", "higher", "midpoint", "nearest")


def _quantile_row(skipna: bool) -> Callable:
    name = "nanquantile" if skipna else "quantile"

    def fn(ga, x, q, dim=None, keepdim=False, interpolation="linear"):
        if interpolation not in TORCH_INTERPOLATIONS:
            raise NotImplementedError(f"torch.{name}(interpolation={interpolation!r}): torch's are "
                                      f"{', '.join(TORCH_INTERPOLATIONS)}")
        if isinstance(q, ga.Array):
            raise NotImplementedError(f"torch.{name} with q computed by the model: give q as a number or a "
                                      "tensor the model holds (a buffer or a constant), so it is known at capture")
        levels = np.asarray(q, dtype=x.dtype)  # torch's q: a tensor of the input's dtype, or a float made one
        axis = None if dim is None else dim % max(x.ndim, 1)
        return getattr(ga, name)(x, levels, axis=axis, keepdims=keepdim, method=interpolation)

    return fn


for _target, _skipna in (("aten.quantile.scalar", False), ("aten.quantile.default", False),
                         ("aten.nanquantile.scalar", True), ("aten.nanquantile.default", True)):
    row(_target, needs="nanquantile" if _skipna else "quantile", concrete=(1,))(_quantile_row(_skipna))

#: Composite operators (torch decomposes them at export) whose rows map them whole, so export keeps them.
KEEP_WHOLE = ("aten.quantile.scalar", "aten.quantile.default", "aten.nanquantile.scalar", "aten.nanquantile.default")


# -- nn (ga.softmax, ga.layer_norm ... once array/nn.py is there) --------------------------------

@row("aten._softmax.default", needs="softmax")
def _softmax(ga, x, dim, half_to_float=False):
    return ga.softmax(x, axis=dim % x.ndim)


@row("aten._log_softmax.default", needs="log_softmax")
def _log_softmax(ga, x, dim, half_to_float=False):
    return ga.log_softmax(x, axis=dim % x.ndim)


@row("aten.native_layer_norm.default", needs="layer_norm")
def _layer_norm(ga, x, normalized_shape, weight=None, bias=None, eps=1e-5):
    y = ga.layer_norm(x, tuple(normalized_shape), weight, bias, eps=eps)
    return (y, *_not_computed("aten.native_layer_norm.default", 3))  # mean and rstd: for backward


@row("aten._native_batch_norm_legit_no_training.default", needs="batch_norm")
def _batch_norm(ga, x, weight, bias, running_mean, running_var, momentum, eps):
    return (ga.batch_norm(x, running_mean, running_var, weight, bias, eps=eps),
            *_not_computed("aten._native_batch_norm_legit_no_training.default", 3))


@row("aten._native_batch_norm_legit.no_stats", needs=("batch_norm", "mean", "var"))
def _batch_norm_batch_stats(ga, x, weight, bias, training, momentum, eps):
    """Batch norm with the batch's own statistics (a BatchNorm with ``track_running_stats=False``): each channel's
    mean and biased variance over the batch and spatial axes.  It mixes rows: never run on slices of the batch."""
    axes = (0, *range(2, x.ndim))
    mean, var = ga.mean(x, axis=axes), ga.var(x, axis=axes)
    return (ga.batch_norm(x, mean, var, weight, bias, eps=eps),
            *_not_computed("aten._native_batch_norm_legit.no_stats", 3))


_SPATIAL_DIMS = "only 1-d and 2-d convolutions are mapped (Conv1d, Conv2d, ConvTranspose1d, ConvTranspose2d)"


def _height_one(ga, x, weight, *pairs):
    """A 1-d convolution's operands as a 2-d one's of height 1 (NCL -> NC1L, OIK -> OI1K): the same sums, term for
    term, so ``conv2d``'s numbers and its Freivalds check carry over exactly."""
    return (ga.expand_dims(x, 2), ga.expand_dims(weight, 2), *(((0 if p == "padding" else 1, *v) for p, v in pairs)))


@row("aten.convolution.default", needs=("conv2d", "expand_dims", "squeeze", "getitem", "pad", "reshape", "transpose"))
def _convolution(ga, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if x.ndim not in (3, 4):
        raise NotImplementedError(f"{_SPATIAL_DIMS}; this one has {x.ndim - 2} spatial dimensions")
    stride, padding, dilation, output_padding = (tuple(v) for v in (stride, padding, dilation, output_padding))
    one_d = x.ndim == 3
    if one_d:
        x, weight, stride, padding, dilation, output_padding = _height_one(
            ga, x, weight, ("stride", stride), ("padding", padding), ("dilation", dilation),
            ("padding", output_padding))
    if transposed:
        y = _conv_transpose2d(ga, x, weight, bias, stride, padding, dilation, output_padding, groups)
    else:
        y = ga.conv2d(x, weight, bias, stride=stride, padding=padding, dilation=dilation, groups=groups)
    return ga.squeeze(y, 2) if one_d else y


def _conv_transpose2d(ga, x, weight, bias, stride, padding, dilation, output_padding, groups):
    """A transposed convolution (the input-gradient of a convolution) as a convolution, so volunteers compute it
    and Freivalds checks it: the input dilated by the stride and padded by ``dilation * (k - 1) - padding`` (plus
    ``output_padding`` after), against the flipped weight with its in and out channels swapped per group."""
    cin, cout_g, kh, kw = weight.shape
    g = _dilate(ga, _dilate(ga, x, 2, stride[0]), 3, stride[1])
    widths, crop, same = [(0, 0), (0, 0)], [slice(None), slice(None)], []
    for k, p, d, op in zip((kh, kw), padding, dilation, output_padding):
        lo, hi = d * (k - 1) - p, d * (k - 1) - p + op
        both = max(min(lo, hi), 0)  # conv2d's own (symmetric) padding: no padded copy on the lab
        same.append(both)
        widths.append((max(lo, 0) - both, max(hi, 0) - both))
        crop.append(slice(max(-lo, 0), None if hi >= 0 else hi))
    if any(c != slice(None) for c in crop):
        g = ga.getitem(g, tuple(crop))
    if any(w != (0, 0) for w in widths):
        g = ga.pad(g, tuple(widths), constant_values=0)
    w = ga.getitem(weight, (slice(None), slice(None), slice(None, None, -1), slice(None, None, -1)))
    if groups == 1:
        w = ga.transpose(w, (1, 0, 2, 3))
    else:
        w = ga.reshape(w, (groups, cin // groups, cout_g, kh, kw))
        w = ga.reshape(ga.transpose(w, (0, 2, 1, 3, 4)), (groups * cout_g, cin // groups, kh, kw))
    return ga.conv2d(g, w, bias, padding=tuple(same), dilation=dilation, groups=groups)


@row("aten.max_pool2d_with_indices.default", needs="max_pool2d")
def _max_pool2d(ga, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    y = ga.max_pool2d(x, list(kernel_size), stride=list(stride) or None, padding=padding, dilation=dilation,
                      ceil_mode=ceil_mode)
    return (y, *_not_computed("aten.max_pool2d_with_indices.default", 2))  # the indices: refused when read


@row("aten.avg_pool2d.default", needs="avg_pool2d")
def _avg_pool2d(ga, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    return ga.avg_pool2d(x, list(kernel_size), stride=list(stride) or None, padding=padding, ceil_mode=ceil_mode,
                         count_include_pad=count_include_pad, divisor_override=divisor_override)


@row("aten._adaptive_avg_pool2d.default", needs="adaptive_avg_pool2d")
def _adaptive_avg_pool2d(ga, x, output_size):
    return ga.adaptive_avg_pool2d(x, list(output_size))


# -- backward operators (the joint forward+backward graphs of goblin_dask.training) -------------

@row("aten.var_mean.correction", needs=("var", "mean"))
def _var_mean(ga, x, dim=None, correction=None, keepdim=False):
    axes = _axes(dim, x.ndim)
    ddof = 1 if correction is None else correction
    return ga.var(x, axis=axes, ddof=ddof, keepdims=keepdim), ga.mean(x, axis=axes, keepdims=keepdim)


@row("aten.scatter.value", needs=("arange", "reshape", "equal", "where"))
def _scatter_value(ga, x, dim, index, value):
    """One index per position along ``dim`` (nll_loss's backward writes a one-hot): where(iota == index, value, x)."""
    dim %= x.ndim
    if index.ndim != x.ndim or index.shape[dim] != 1 or any(
            index.shape[d] != x.shape[d] for d in range(x.ndim) if d != dim):
        raise NotImplementedError(f"scatter of index shape {tuple(index.shape)} into {tuple(x.shape)} along {dim} "
                                  "(only one index per position along dim is mapped)")
    iota = ga.reshape(ga.arange(x.shape[dim], dtype=index.dtype), tuple(x.shape[d] if d == dim else 1
                                                                          for d in range(x.ndim)))
    return ga.where(ga.equal(iota, index), np.asarray(value, dtype=x.dtype)[()], x)


def _scatter_hits(ga, what: str, x, dim: int, index, src):
    """``(hit, spread_src)`` of a scatter along ``dim``, or None when ``index`` is empty: ``hit`` (..., m, n, ...)
    says index i of each slice lands on position j (an m x n comparison per slice), ``spread_src`` is ``src`` with
    the same new axis after ``dim``."""
    if x.ndim == 0 or index.ndim != x.ndim or tuple(src.shape) != tuple(index.shape) or any(
            index.shape[d] != x.shape[d] for d in range(x.ndim) if d != dim):
        raise NotImplementedError(f"{what} of index shape {tuple(index.shape)} (src {tuple(src.shape)}) into "
                                  f"{tuple(x.shape)} along {dim} (only index and src of x's shape but along dim "
                                  "are mapped)")
    n, m = x.shape[dim], index.shape[dim]
    if m == 0:
        return None
    after = lambda shape: tuple(shape[:dim + 1]) + (1,) + tuple(shape[dim + 1:])  # noqa: E731  a new axis after dim
    iota = ga.reshape(ga.arange(n, dtype=index.dtype), (1,) * (dim + 1) + (n,) + (1,) * (x.ndim - dim - 1))
    return ga.equal(ga.reshape(index, after(index.shape)), iota), ga.reshape(src, after(src.shape))


@row("aten.scatter.src", needs=("arange", "reshape", "equal", "where", "max", "any"))
def _scatter_src(ga, x, dim, index, src):
    """``x`` with ``src`` written at ``index`` along ``dim``: the backward of sort, topk, kthvalue and median (their
    indices, distinct in each slice).  Position j takes the ``src`` value whose index is j, or keeps ``x``'s; where
    several name j (torch then picks one of them, unspecified which), the largest of them."""
    dim %= max(x.ndim, 1)
    found = _scatter_hits(ga, "scatter", x, dim, index, src)
    if found is None:
        return x
    hit, spread = found
    dt = np.dtype(src.dtype)
    lowest = -np.inf if dt.kind == "f" else np.iinfo(dt).min if dt.kind in "iu" else False
    written = ga.max(ga.where(hit, spread, np.asarray(lowest, dtype=dt)[()]), axis=dim)
    return ga.where(ga.any(hit, axis=dim), written, x)


@row("aten.scatter_add.default", needs=("arange", "reshape", "equal", "where", "sum", "add"))
def _scatter_add(ga, x, dim, index, src):
    """``x`` plus ``src`` added at ``index`` along ``dim``, several at one position all added: the backward of
    quantile (each level's gradient to the two values it lies between, one position when they coincide).  The hits
    summed in the catalog's order, where torch adds them one after another (so within a rounding of torch where
    several land on one position, exactly where one does)."""
    dim %= max(x.ndim, 1)
    found = _scatter_hits(ga, "scatter_add", x, dim, index, src)
    if found is None:
        return x
    hit, spread = found
    return ga.add(x, ga.sum(ga.where(hit, spread, np.asarray(0, dtype=np.dtype(src.dtype))[()]), axis=dim))


@row("aten.index_put.default", needs=("one_hot", "reshape", "transpose", "matmul", "add"))
def _index_put(ga, x, indices, values, accumulate=False):
    """``x[idx] += values`` along axis 0 (an embedding's backward) as ``x + one_hot(idx).T @ values``: a product."""
    given = [i for i in indices if i is not None]
    if not accumulate or len(indices) != 1 or len(given) != 1:
        raise NotImplementedError("index_put is mapped only with accumulate=True and one index tensor on axis 0")
    idx = given[0]
    if not hasattr(idx, "chunks"):
        idx = ga.from_array(np.asarray(idx))
    flat = ga.reshape(idx, (-1,))
    rows = ga.reshape(values, (flat.shape[0], -1)) if values.ndim != 2 else values
    hot = ga.one_hot(flat, x.shape[0], dtype=x.dtype)
    return ga.add(x, ga.reshape(ga.matmul(ga.transpose(hot), rows), tuple(x.shape)))


@row("aten.slice_scatter.default", needs=("getitem", "concatenate"))
def _slice_scatter(ga, x, src, dim=0, start=None, end=None, step=1):
    dim %= x.ndim
    s, e, st = slice(start, end, step).indices(x.shape[dim])
    if st != 1:
        raise NotImplementedError(f"slice_scatter with step {st} (only step 1 is mapped)")
    pieces = [ga.getitem(x, (slice(None),) * dim + (slice(0, s),)) if s > 0 else None, src,
              ga.getitem(x, (slice(None),) * dim + (slice(e, None),)) if e < x.shape[dim] else None]
    pieces = [p for p in pieces if p is not None]
    return pieces[0] if len(pieces) == 1 else ga.concatenate(pieces, axis=dim)


@row("aten.copy_.default", "aten.copy.default", needs=("broadcast_to", "astype"))
def _copy(ga, dst, src, non_blocking=False):
    """Functionally: the new value (a functionalized graph copies updated buffers into its inputs last)."""
    if not hasattr(src, "chunks"):
        src = ga.full(tuple(dst.shape), src, dtype=dst.dtype)
    if tuple(src.shape) != tuple(dst.shape):
        src = ga.broadcast_to(src, tuple(dst.shape))
    return src if src.dtype == dst.dtype else ga.astype(src, dst.dtype)


@row("aten.empty.memory_format", "aten.zeros.default", "aten.new_zeros.default", needs="zeros")
def _empty(ga, *args, dtype=None, **_ignored):
    size = args[-1]  # new_zeros(x, size): the size is last
    return ga.zeros(tuple(int(s) for s in size), dtype=dtype or "float32")


@row("aten.empty_permuted.default", needs="zeros")
def _empty_permuted(ga, size, physical_layout, dtype=None, **_ignored):
    """An uninitialised tensor of shape ``size`` whose memory runs in ``physical_layout``'s order (quantile's
    backward makes one to scatter into): nothing may read it before writing, so zeros; a layout is no concern of
    an array."""
    return ga.zeros(tuple(int(s) for s in size), dtype=dtype or "float32")


def _dilate(ga, g, axis, s):
    """Zeros between the entries of ``g`` along ``axis`` (stride ``s``): a strided convolution's gradient input."""
    if s == 1:
        return g
    n = g.shape[axis]
    g = ga.expand_dims(g, axis + 1)
    widths = [(0, 0)] * g.ndim
    widths[axis + 1] = (0, s - 1)
    g = ga.pad(g, tuple(widths), constant_values=0)
    g = ga.reshape(g, tuple(g.shape[:axis]) + (n * s,) + tuple(g.shape[axis + 2:]))
    return ga.getitem(g, (slice(None),) * axis + (slice(0, (n - 1) * s + 1),))


@row("aten.convolution_backward.default", needs=("conv2d", "transpose", "getitem", "pad", "expand_dims", "reshape",
                                                 "sum", "squeeze"))
def _convolution_backward(ga, grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
                          groups, output_mask):
    """A 1-d or 2-d convolution's gradients (a 1-d one as a 2-d one of height 1)."""
    if transposed or groups != 1 or x.ndim not in (3, 4):
        raise NotImplementedError("convolution_backward is mapped for 1-d and 2-d, non-transposed, groups=1 "
                                  "convolutions (train a ConvTranspose or grouped layer in torch, or capture it for "
                                  "inference)")
    if x.ndim == 4:
        return _conv2d_backward(ga, grad, x, weight, bias_sizes, tuple(stride), tuple(padding), tuple(dilation),
                                output_mask)
    x, weight, stride, padding, dilation = _height_one(ga, x, weight, ("stride", tuple(stride)),
                                                       ("padding", tuple(padding)), ("dilation", tuple(dilation)))
    gi, gw, gb = _conv2d_backward(ga, ga.expand_dims(grad, 2), x, weight, bias_sizes, stride, padding, dilation,
                                  output_mask)
    return (None if gi is None else ga.squeeze(gi, 2)), (None if gw is None else ga.squeeze(gw, 2)), gb


def _conv2d_backward(ga, grad, x, weight, bias_sizes, stride, padding, dilation, output_mask):
    """A 2-d convolution's gradients as convolutions (so volunteers compute them and Freivalds checks them):
    input: the transposed convolution of the gradient (the last ``r`` rows a strided forward reached past its
    last window, as output padding); weight: the input (channels as batch) against the gradient (as the
    weight), stride and dilation swapped."""
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    kh, kw = weight.shape[2], weight.shape[3]
    gi = gw = gb = None
    if output_mask[0]:
        rest = tuple(x.shape[a] + 2 * p - d * (k - 1) - 1 - (grad.shape[a] - 1) * s
                     for a, k, s, p, d in ((2, kh, sh, ph, dh), (3, kw, sw, pw, dw)))
        gi = _conv_transpose2d(ga, grad, weight, None, stride, padding, dilation, rest, 1)
    if output_mask[1]:
        w = ga.conv2d(ga.transpose(x, (1, 0, 2, 3)), ga.transpose(grad, (1, 0, 2, 3)), None, stride=(dh, dw),
                      padding=(ph, pw), dilation=(sh, sw))
        if w.shape[2] != kh or w.shape[3] != kw:
            w = ga.getitem(w, (slice(None), slice(None), slice(0, kh), slice(0, kw)))
        gw = ga.transpose(w, (1, 0, 2, 3))
    if output_mask[2] and bias_sizes is not None:
        gb = ga.sum(grad, axis=(0, 2, 3))
    return gi, gw, gb


# -- creation ------------------------------------------------------------------------------------

@row("aten.full.default", needs="full")
def _full(ga, size, fill_value, dtype=None, **_ignored):
    return ga.full(tuple(int(s) for s in size), fill_value, dtype=dtype)


@row("aten.full_like.default", needs="full_like")
def _full_like(ga, x, fill_value, dtype=None, **_ignored):
    return ga.full_like(x, fill_value, dtype=dtype)


@row("aten.arange.default", "aten.arange.start", "aten.arange.start_step", needs="arange")
def _arange(ga, *args, dtype=None, **_ignored):
    start, end, step = (0, args[0], 1) if len(args) == 1 else (tuple(args) + (1,))[:3]
    if dtype is None:  # torch: int64 for integers, its default float32 otherwise
        dtype = "int64" if all(isinstance(v, (int, np.integer)) for v in (start, end, step)) else "float32"
    return ga.arange(start, end, step, dtype=dtype)


# -- seeded randomness (dropout) -------------------------------------------------------------------

#: ``[seed tuple, counter]`` while :func:`random_seed` is active: the k-th random operator of a pass draws
#: from ``(*seed, k)`` (then ``ga.random`` appends each block's index), so the same pass built twice
#: (a replica, a validator, a resumed run) gives the same masks and different passes different ones
_SEED: contextvars.ContextVar = contextvars.ContextVar("goblin_capture_random_seed", default=None)


@contextlib.contextmanager
def random_seed(seed: Any):
    """Within this block, the random operators of a captured graph draw from ``seed`` (a non-negative int or
    a tuple of them): the k-th one from ``PCG64((*seed, k, *block index))``.  Outside it, each draws a fresh seed."""
    parts = tuple(int(s) for s in (seed if isinstance(seed, (tuple, list)) else (seed,)))
    if any(p < 0 for p in parts):
        raise ValueError(f"random_seed: non-negative ints, got {seed!r}")
    token = _SEED.set([parts, 0])
    try:
        yield
    finally:
        _SEED.reset(token)


def next_seed() -> tuple[int, ...]:
    """The seed of the next random operator (see :func:`random_seed`)."""
    state = _SEED.get()
    if state is None:
        return (secrets.randbits(62),)
    state[1] += 1
    return (*state[0], state[1] - 1)


@row("aten.bernoulli.p", needs="random")
def _bernoulli(ga, x, p=0.5, generator=None, **_ignored):
    """``torch.bernoulli(x, p)`` (dropout's mask): ``uniform[0, 1) < p`` from a seeded ``random_uniform``
    block per block of ``x`` (no data travels; replicas agree).  Not torch's generator: its numbers differ."""
    if generator is not None:
        raise ValueError("bernoulli with an explicit torch generator: the grid draws from its own seeds")
    dtype = np.dtype(getattr(x, "dtype", np.float32))
    rdtype = dtype if dtype in (np.float32, np.float64) else np.dtype(np.float64)
    chunks = x.chunks if isinstance(x, ga.Array) else "auto"
    u = ga.random.random(tuple(np.shape(x)), dtype=rdtype, chunks=chunks, seed=next_seed())
    return ga.astype(u < rdtype.type(p), dtype)


@row("aten.scalar_tensor.default")
def _scalar_tensor(ga, value, dtype=None, **_ignored):
    return np.asarray(value, dtype=dtype)[()]  # a 0-d constant: a NumPy scalar operand


# -- the integer arithmetic of symbolic sizes (``aten.sym_size.int``, Python operators) ----------

@row("aten.sym_size.int")
def _sym_size(ga, x, dim):
    return int(x.shape[dim])


for _name, _fn in {"mul": operator.mul, "add": operator.add, "sub": operator.sub,
                   "floordiv": operator.floordiv, "mod": operator.mod, "neg": operator.neg}.items():
    row(f"_operator.{_name}")((lambda f: lambda ga, *a: f(*a))(_fn))


@row("_operator.getitem")
def _getitem(ga, x, i):
    r = x[i]
    if isinstance(r, NotComputed):  # a saved graph read a result its operator's row does not compute
        raise NotImplementedError(f"{r.target}: {r.refusal()}")
    return r


#: operators that only assert metadata in an exported graph: skipped, as torch skips them at run time
SKIP = frozenset({"aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
                  "aten.sym_constrain_range_for_size.default", "aten._assert_async.msg"})
