"""Neural-network operators PyTorch programs use (``torch.nn.functional``'s semantics).

* ``softmax``, ``log_softmax``, ``logsumexp`` over one axis (max-shifted, so stable);
  ``layer_norm`` over the trailing ``normalized_ndim`` axes and ``batch_norm`` in eval
  mode (running statistics, channel axis 1): ``Replica()``, a second volunteer recomputes.
* ``conv2d`` (NCHW input, OIHW weight, optional bias, stride / padding / dilation /
  groups) computed as im2col + one matmul per group (BLAS) and verified by Freivalds
  through that form: ``A`` the (N*Ho*Wo, C*kh*kw) patch matrix, ``B`` the weight as a
  (C*kh*kw, O) matrix (block-diagonal for groups), ``c`` the result moved to
  (N*Ho*Wo, O), ``c0`` the bias.  Checking costs O(N*Ho*Wo*C*kh*kw) against
  O(that x O) to compute.
* ``max_pool2d`` (``Exact()``: the result is bitwise determined, lab-only),
  ``avg_pool2d`` and ``adaptive_avg_pool2d`` (torch's bin rule, ``Replica()``).
* ``scaled_dot_product_attention`` (q, k, v, optional boolean or additive mask, causal
  flag, scale): softmax(q k^T * scale + mask) v in one task, ``Replica()``.

Optional operands follow the required ones in a fixed order, and flags say which are
present (``has_weight``/``has_bias``; conv2d's bias and attention's mask are simply the
last operand), so every call is plain data.  Kernels use array methods and the array's
own module (NumPy, or cupy for cupy arrays), so they run on either.  Floating dtypes only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from goblin_dask.ops._factories import dtype_arg, normalize_axes, result_type
from goblin_dask.ops.registry import register
from goblin_dask.ops.spec import Aval, Cost, Exact, Freivalds, OpSpec, ProductForm, Replica


def _xp(x: Any):
    """The array module of ``x``: cupy for a cupy array, else NumPy (cupy is never imported otherwise)."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def _float_result(opname: str, *avals: Aval) -> np.dtype:
    dt = result_type(*(dtype_arg(opname, a) for a in avals))
    if dt.kind != "f":
        shown = ", ".join(str(a.dtype) for a in avals)
        raise TypeError(f"{opname}: computes on floating dtypes only, got {shown}")
    return dt


def _int_param(opname: str, name: str, value: Any, lowest: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < lowest:
        raise ValueError(f"{opname}: {name} must be an int >= {lowest}, got {value!r}")
    return int(value)


def _pair(opname: str, name: str, value: Any, lowest: int) -> tuple[int, int]:
    """An int or a pair of ints (torch's ``_pair``), each >= ``lowest``."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{opname}: {name} must be an int or a pair of ints, got {value!r}")
        return _int_param(opname, name, value[0], lowest), _int_param(opname, name, value[1], lowest)
    v = _int_param(opname, name, value, lowest)
    return v, v


def _eps(opname: str, eps: Any) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)) or not eps >= 0:
        raise ValueError(f"{opname}: eps must be a non-negative number, got {eps!r}")
    return float(eps)


def _axis(opname: str, x: Aval, axis: Any) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise ValueError(f"{opname}: axis must be an int, got {axis!r}")
    return normalize_axes(opname, int(axis), x.shape)[0]


def _shift(x: Any, axis: Any) -> Any:
    """The max over ``axis`` (keepdims), 0 where it is not finite (all -inf, or an inf)."""
    xp = _xp(x)
    m = x.max(axis=axis, keepdims=True)
    return xp.where(xp.isfinite(m), m, xp.zeros((), m.dtype))


def _floats(n: int, rng: np.random.Generator, dtype: Any, *shape: int) -> np.ndarray:
    dt = np.dtype(dtype) if np.dtype(dtype).kind == "f" else np.dtype(np.float64)
    return rng.standard_normal(shape).astype(dt)


def _pass_cost(flops_per_element: float):
    def cost(*avals: Aval, **params: Any) -> Cost:
        arrays = [a for a in avals if isinstance(a, Aval)]
        n = arrays[0].size
        return Cost(flops_per_element * n, float(sum(a.nbytes for a in arrays) + arrays[0].nbytes))

    return cost


# -- softmax, log_softmax, logsumexp ----------------------------------------------------------


def _same_shape(opname: str):
    def rule(x: Aval, *, axis: int = -1) -> tuple[int, ...]:
        if len(x.shape) == 0:
            raise ValueError(f"{opname}: needs an array of at least 1 dimension, got shape {x.shape}")
        _axis(opname, x, axis)
        return x.shape

    return rule


def _softmax(x: Any, *, axis: int = -1) -> Any:
    xp = _xp(x)
    if x.size == 0:
        return x.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        e = xp.exp(x - _shift(x, axis))
        e /= e.sum(axis=axis, keepdims=True)
    return e


def _log_softmax(x: Any, *, axis: int = -1) -> Any:
    xp = _xp(x)
    if x.size == 0:
        return x.copy()
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        z = x - _shift(x, axis)
        z -= xp.log(xp.exp(z).sum(axis=axis, keepdims=True))
    return z


def _softmax_vjp(g: Any, x: Any, *, axis: int = -1) -> tuple:
    y = _softmax(np.asarray(x), axis=axis)
    return (y * (g - (g * y).sum(axis=axis, keepdims=True)),)


def _log_softmax_vjp(g: Any, x: Any, *, axis: int = -1) -> tuple:
    y = _softmax(np.asarray(x), axis=axis)
    return (g - y * np.asarray(g).sum(axis=axis, keepdims=True),)


def _rows(*axes: int):
    return lambda n, rng, dtype: [((_floats(n, rng, dtype, n, n + 1),), {"axis": a}) for a in axes] + [
        ((_floats(n, rng, dtype, 2, n, 3),), {"axis": 1})]


def _float_op(opname: str):
    return lambda x, **_: _float_result(opname, x)


softmax = register(OpSpec(
    name="softmax", doc="exp(x) / sum(exp(x)) over one axis (max-shifted; torch.softmax).",
    shape_rule=_same_shape("softmax"), dtype_rule=_float_op("softmax"), numpy=_softmax, cupy=_softmax,
    cost=_pass_cost(4.0), verify=Replica(), grad=_softmax_vjp, arity=1, params=("axis",), examples=_rows(-1, 0),
))

log_softmax = register(OpSpec(
    name="log_softmax", doc="x - logsumexp(x) over one axis (torch.log_softmax).",
    shape_rule=_same_shape("log_softmax"), dtype_rule=_float_op("log_softmax"), numpy=_log_softmax,
    cupy=_log_softmax, cost=_pass_cost(4.0), verify=Replica(), grad=_log_softmax_vjp, arity=1, params=("axis",),
    examples=_rows(-1, 0),
))


def _lse_shape(x: Aval, *, axis: int = -1, keepdims: bool = False) -> tuple[int, ...]:
    if len(x.shape) == 0:
        raise ValueError(f"logsumexp: needs an array of at least 1 dimension, got shape {x.shape}")
    ax = _axis("logsumexp", x, axis)
    return tuple(1 if d == ax else n for d, n in enumerate(x.shape)) if keepdims else \
        tuple(n for d, n in enumerate(x.shape) if d != ax)


def _logsumexp(x: Any, *, axis: int = -1, keepdims: bool = False) -> Any:
    xp = _xp(x)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = _shift(x, axis) if x.shape[axis] else xp.zeros(_lse_shape(Aval.of(x), axis=axis, keepdims=True), x.dtype)
        out = xp.log(xp.exp(x - m).sum(axis=axis, keepdims=True)) + m
    return out if keepdims else out.squeeze(axis)


def _logsumexp_vjp(g: Any, x: Any, *, axis: int = -1, keepdims: bool = False) -> tuple:
    x = np.asarray(x)
    out = _logsumexp(x, axis=axis, keepdims=True)
    g = np.asarray(g) if keepdims else np.expand_dims(g, axis)
    return (g * np.exp(x - out),)


logsumexp = register(OpSpec(
    name="logsumexp", doc="log(sum(exp(x))) over one axis, max-shifted (torch.logsumexp).",
    shape_rule=_lse_shape, dtype_rule=_float_op("logsumexp"), numpy=_logsumexp, cupy=_logsumexp,
    cost=_pass_cost(3.0), verify=Replica(), grad=_logsumexp_vjp, arity=1, params=("axis", "keepdims"),
    examples=lambda n, rng, dtype: [((_floats(n, rng, dtype, n, n + 1),), {"axis": -1}),
                                    ((_floats(n, rng, dtype, n, n + 1),), {"axis": 0, "keepdims": True})],
))


# -- layer_norm, batch_norm -----------------------------------------------------------------------


def _optional(opname: str, operands: tuple, fixed: int, has_weight: bool, has_bias: bool) -> tuple:
    """(weight or None, bias or None) from the operands after the ``fixed`` required ones."""
    want = fixed + bool(has_weight) + bool(has_bias)
    if len(operands) != want:
        raise TypeError(f"{opname}: takes {want} operands with has_weight={has_weight}, has_bias={has_bias}, "
                        f"got {len(operands)}")
    rest = list(operands[fixed:])
    return (rest.pop(0) if has_weight else None), (rest.pop(0) if has_bias else None)


def _ln_check(x: Aval, *affine: Aval, normalized_ndim: int = 1, eps: float = 1e-5, has_weight: bool = False,
              has_bias: bool = False) -> tuple[int, ...]:
    k = _int_param("layer_norm", "normalized_ndim", normalized_ndim, 1)
    if k > len(x.shape):
        raise ValueError(f"layer_norm: normalized_ndim={k} exceeds the {len(x.shape)} axes of shape {x.shape}")
    _eps("layer_norm", eps)
    normalized = x.shape[len(x.shape) - k:]
    for name, a in zip(("weight", "bias"), _optional("layer_norm", (x, *affine), 1, has_weight, has_bias)):
        if a is not None and a.shape != normalized:
            raise ValueError(f"layer_norm: {name} of shape {a.shape} does not match the normalized shape {normalized} "
                             f"of input {x.shape}")
    return x.shape


def _layer_norm(x: Any, *affine: Any, normalized_ndim: int = 1, eps: float = 1e-5, has_weight: bool = False,
                has_bias: bool = False) -> Any:
    xp = _xp(x)
    w, b = _optional("layer_norm", (x, *affine), 1, has_weight, has_bias)
    axes = tuple(range(x.ndim - normalized_ndim, x.ndim))
    if x.size == 0:
        return x.astype(_float_result("layer_norm", *map(Aval.of, (x, *affine))))
    xc = x - x.mean(axis=axes, keepdims=True)
    var = (xc * xc).mean(axis=axes, keepdims=True)
    y = xc * (1 / xp.sqrt(var + float(eps)))
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


def _layer_norm_vjp(g: Any, x: Any, *affine: Any, normalized_ndim: int = 1, eps: float = 1e-5,
                    has_weight: bool = False, has_bias: bool = False) -> tuple:
    x, g = np.asarray(x), np.asarray(g)
    w, b = _optional("layer_norm", (x, *affine), 1, has_weight, has_bias)
    axes = tuple(range(x.ndim - normalized_ndim, x.ndim))
    lead = tuple(range(x.ndim - normalized_ndim))
    xc = x - x.mean(axis=axes, keepdims=True)
    rstd = 1 / np.sqrt((xc * xc).mean(axis=axes, keepdims=True) + eps)
    xhat = xc * rstd
    gh = g * w if w is not None else g
    gx = rstd * (gh - gh.mean(axis=axes, keepdims=True) - xhat * (gh * xhat).mean(axis=axes, keepdims=True))
    out = [gx]
    if w is not None:
        out.append((g * xhat).sum(axis=lead))
    if b is not None:
        out.append(g.sum(axis=lead))
    return tuple(out)


layer_norm = register(OpSpec(
    name="layer_norm", doc="Normalize over the trailing normalized_ndim axes, then weight and bias (F.layer_norm).",
    shape_rule=_ln_check, dtype_rule=lambda *a, **p: _float_result("layer_norm", *a), numpy=_layer_norm,
    cupy=_layer_norm, cost=_pass_cost(8.0), verify=Replica(), grad=_layer_norm_vjp,
    params=("normalized_ndim", "eps", "has_weight", "has_bias"),
    examples=lambda n, rng, dtype: [
        ((_floats(n, rng, dtype, n, n + 1),), {}),
        ((_floats(n, rng, dtype, 2, n, 3), _floats(n, rng, dtype, n, 3), _floats(n, rng, dtype, n, 3)),
         {"normalized_ndim": 2, "has_weight": True, "has_bias": True, "eps": 1e-3}),
    ],
))


def _bn_check(x: Aval, mean: Aval, var: Aval, *affine: Aval, eps: float = 1e-5, has_weight: bool = False,
              has_bias: bool = False) -> tuple[int, ...]:
    if len(x.shape) < 2:
        raise ValueError(f"batch_norm: input must be at least 2-d (N, C, ...), got shape {x.shape}")
    _eps("batch_norm", eps)
    c = x.shape[1]
    w, b = _optional("batch_norm", (x, mean, var, *affine), 3, has_weight, has_bias)
    for name, a in (("running_mean", mean), ("running_var", var), ("weight", w), ("bias", b)):
        if a is not None and a.shape != (c,):
            raise ValueError(f"batch_norm: {name} of shape {a.shape} does not match the {c} channels of input {x.shape}")
    return x.shape


def _channel(a: Any, ndim: int) -> Any:
    return a.reshape((1, -1) + (1,) * (ndim - 2))


def _batch_norm(x: Any, mean: Any, var: Any, *affine: Any, eps: float = 1e-5, has_weight: bool = False,
                has_bias: bool = False) -> Any:
    xp = _xp(x)
    w, b = _optional("batch_norm", (x, mean, var, *affine), 3, has_weight, has_bias)
    scale = 1 / xp.sqrt(var + float(eps))
    if w is not None:
        scale = scale * w
    y = (x - _channel(mean, x.ndim)) * _channel(scale, x.ndim)
    if b is not None:
        y = y + _channel(b, x.ndim)
    dt = _float_result("batch_norm", *map(Aval.of, (x, mean, var, *affine)))
    return y.astype(dt, copy=False)


def _batch_norm_vjp(g: Any, x: Any, mean: Any, var: Any, *affine: Any, eps: float = 1e-5, has_weight: bool = False,
                    has_bias: bool = False) -> tuple:
    x, g = np.asarray(x), np.asarray(g)
    w, b = _optional("batch_norm", (x, mean, var, *affine), 3, has_weight, has_bias)
    other = (0,) + tuple(range(2, x.ndim))
    rstd = 1 / np.sqrt(var + eps)
    wv = w if w is not None else np.ones_like(rstd)
    xc = x - _channel(mean, x.ndim)
    gx = g * _channel(rstd * wv, x.ndim)
    out = [gx, -gx.sum(axis=other), (g * xc).sum(axis=other) * wv * (-0.5) * rstd ** 3]
    if w is not None:
        out.append((g * xc).sum(axis=other) * rstd)
    if b is not None:
        out.append(g.sum(axis=other))
    return tuple(out)


batch_norm = register(OpSpec(
    name="batch_norm", doc="Eval-mode batch norm: running mean and variance, weight and bias over channel axis 1.",
    shape_rule=_bn_check, dtype_rule=lambda *a, **p: _float_result("batch_norm", *a), numpy=_batch_norm,
    cupy=_batch_norm, cost=_pass_cost(4.0), verify=Replica(), grad=_batch_norm_vjp,
    params=("eps", "has_weight", "has_bias"),
    examples=lambda n, rng, dtype: [
        ((_floats(n, rng, dtype, 2, n, 3, 3), _floats(n, rng, dtype, n), np.abs(_floats(n, rng, dtype, n)) + 0.5,
          _floats(n, rng, dtype, n), _floats(n, rng, dtype, n)), {"has_weight": True, "has_bias": True}),
        ((_floats(n, rng, dtype, n, 3), _floats(n, rng, dtype, 3), np.abs(_floats(n, rng, dtype, 3)) + 0.5), {}),
    ],
))


# -- conv2d ----------------------------------------------------------------------------------


def _conv_geometry(x: Aval, w: Aval, *bias: Aval, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
                   groups: int = 1) -> tuple:
    """((N, C, H, W), (O, Cg, kh, kw), (sh, sw), (ph, pw), (dh, dw), groups, (Ho, Wo)), or ValueError."""
    if len(x.shape) != 4 or len(w.shape) != 4:
        raise ValueError(f"conv2d: input must be (N, C, H, W) and weight (O, C/groups, kh, kw), got shapes "
                         f"{x.shape} and {w.shape}")
    if len(bias) > 1:
        raise TypeError(f"conv2d: takes 2 or 3 operands (input, weight[, bias]), got {2 + len(bias)}")
    s, p, d = _pair("conv2d", "stride", stride, 1), _pair("conv2d", "padding", padding, 0), \
        _pair("conv2d", "dilation", dilation, 1)
    g = _int_param("conv2d", "groups", groups, 1)
    (n, c, h, wd), (o, cg, kh, kw) = x.shape, w.shape
    if c != cg * g or o % g:
        raise ValueError(f"conv2d: input {x.shape} and weight {w.shape} do not fit groups={g} "
                         f"(need C == weight.shape[1] * groups and O divisible by groups)")
    if bias and bias[0].shape != (o,):
        raise ValueError(f"conv2d: bias of shape {bias[0].shape} does not match the {o} output channels of weight {w.shape}")
    ho = (h + 2 * p[0] - d[0] * (kh - 1) - 1) // s[0] + 1
    wo = (wd + 2 * p[1] - d[1] * (kw - 1) - 1) // s[1] + 1
    if ho < 1 or wo < 1 or kh < 1 or kw < 1:
        raise ValueError(f"conv2d: kernel {w.shape[2:]} (dilation {d}) is larger than input {x.shape[2:]} padded by {p}")
    return (n, c, h, wd), (o, cg, kh, kw), s, p, d, g, (ho, wo)


def _conv_shape(x: Aval, w: Aval, *bias: Aval, **params: Any) -> tuple[int, ...]:
    (n, *_), (o, *_), *_, (ho, wo) = _conv_geometry(x, w, *bias, **params)
    return (n, o, ho, wo)


def _patches(x: Any, kh: int, kw: int, s: tuple, p: tuple, d: tuple, out: tuple) -> Any:
    """im2col: the (N*Ho*Wo, C*kh*kw) matrix of input patches (C major, then kh, kw)."""
    xp = _xp(x)
    n, c, h, w = x.shape
    ho, wo = out
    if p[0] or p[1]:
        padded = xp.zeros((n, c, h + 2 * p[0], w + 2 * p[1]), x.dtype)
        padded[:, :, p[0]:p[0] + h, p[1]:p[1] + w] = x
    else:
        padded = x
    cols = xp.empty((n, ho, wo, c, kh, kw), x.dtype)
    for i in range(kh):
        for j in range(kw):
            window = padded[:, :, i * d[0]: i * d[0] + s[0] * (ho - 1) + 1: s[0],
                            j * d[1]: j * d[1] + s[1] * (wo - 1) + 1: s[1]]
            cols[:, :, :, :, i, j] = window.transpose(0, 2, 3, 1)
    return cols.reshape(n * ho * wo, c * kh * kw)


def _conv2d(x: Any, w: Any, *bias: Any, stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1) -> Any:
    xp = _xp(x)
    (n, c, _, _), (o, cg, kh, kw), s, p, d, g, (ho, wo) = _conv_geometry(
        Aval.of(x), Aval.of(w), *map(Aval.of, bias), stride=stride, padding=padding, dilation=dilation, groups=groups)
    a = _patches(x, kh, kw, s, p, d, (ho, wo))
    wm = w.reshape(o, cg * kh * kw)
    if g == 1:
        out = a @ wm.T
    else:
        og, kk = o // g, cg * kh * kw
        out = xp.empty((a.shape[0], o), np.result_type(a.dtype, wm.dtype))
        for k in range(g):
            out[:, k * og:(k + 1) * og] = a[:, k * kk:(k + 1) * kk] @ wm[k * og:(k + 1) * og].T
    if bias:
        out = out + bias[0]
    return xp.ascontiguousarray(out.reshape(n, ho, wo, o).transpose(0, 3, 1, 2))


def _conv_form(result: Any, x: Any, w: Any, *bias: Any, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
               groups: int = 1) -> ProductForm:
    """result (as (N*Ho*Wo, O)) == patches @ weight matrix (block-diagonal for groups) + bias."""
    (n, c, _, _), (o, cg, kh, kw), s, p, d, g, (ho, wo) = _conv_geometry(
        Aval.of(x), Aval.of(w), *map(Aval.of, bias), stride=stride, padding=padding, dilation=dilation, groups=groups)
    xp = _xp(x)
    a = _patches(x, kh, kw, s, p, d, (ho, wo))
    wm = w.reshape(o, cg * kh * kw).T
    if g == 1:
        b = wm
    else:
        og, kk = o // g, cg * kh * kw
        b = xp.zeros((c * kh * kw, o), w.dtype)
        for k in range(g):
            b[k * kk:(k + 1) * kk, k * og:(k + 1) * og] = wm[:, k * og:(k + 1) * og]
    c_mat = result.transpose(0, 2, 3, 1).reshape(n * ho * wo, o)
    return ProductForm(c_mat, a, b, bias[0][None, :] if bias else None)


def _conv_cost(x: Aval, w: Aval, *bias: Aval, **params: Any) -> Cost:
    (n, *_), (o, cg, kh, kw), *_, (ho, wo) = _conv_geometry(x, w, *bias, **params)
    out = n * o * ho * wo
    itemsize = _float_result("conv2d", x, w, *bias).itemsize
    return Cost(2.0 * out * cg * kh * kw + (out if bias else 0),
                float(x.nbytes + w.nbytes + sum(b.nbytes for b in bias) + out * itemsize))


def _conv_vjp(g: Any, x: Any, w: Any, *bias: Any, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
              groups: int = 1) -> tuple:
    """Cotangents of input (col2im of g @ W), weight (patches^T @ g) and bias (sum of g)."""
    x, w, g = np.asarray(x), np.asarray(w), np.asarray(g)
    (n, c, h, wd), (o, cg, kh, kw), s, p, d, grp, (ho, wo) = _conv_geometry(
        Aval.of(x), Aval.of(w), *map(Aval.of, bias), stride=stride, padding=padding, dilation=dilation, groups=groups)
    a = _patches(x, kh, kw, s, p, d, (ho, wo))
    g2 = g.transpose(0, 2, 3, 1).reshape(n * ho * wo, o)
    wm = w.reshape(o, cg * kh * kw)
    og, kk = o // grp, cg * kh * kw
    ga = np.empty_like(a, dtype=np.result_type(g2, wm))
    gw = np.empty(wm.shape, np.result_type(g2, a))
    for k in range(grp):
        rows, cols = slice(k * og, (k + 1) * og), slice(k * kk, (k + 1) * kk)
        ga[:, cols] = g2[:, rows] @ wm[rows]
        gw[rows] = g2[:, rows].T @ a[:, cols]
    ga = ga.reshape(n, ho, wo, c, kh, kw)
    gx = np.zeros((n, c, h + 2 * p[0], wd + 2 * p[1]), ga.dtype)
    for i in range(kh):
        for j in range(kw):
            gx[:, :, i * d[0]: i * d[0] + s[0] * (ho - 1) + 1: s[0],
               j * d[1]: j * d[1] + s[1] * (wo - 1) + 1: s[1]] += ga[:, :, :, :, i, j].transpose(0, 3, 1, 2)
    out = (gx[:, :, p[0]:p[0] + h, p[1]:p[1] + wd], gw.reshape(w.shape))
    return out + ((g.sum(axis=(0, 2, 3)),) if bias else ())


def _conv_examples(n: int, rng: np.random.Generator, dtype: Any) -> list:
    f = lambda *shape: _floats(n, rng, dtype, *shape)  # noqa: E731
    return [
        ((f(2, 3, n + 2, n + 3), f(n, 3, 3, 3), f(n)), {"padding": 1}),
        ((f(2, 4, n + 3, n + 2), f(4, 2, 2, 3)), {"stride": (2, 1), "dilation": (1, 2), "groups": 2, "padding": (0, 1)}),
        ((f(1, n, 5, 5), f(3, n, 1, 1)), {}),
    ]


conv2d = register(OpSpec(
    name="conv2d", doc="2-d convolution (cross-correlation) of NCHW input with OIHW weight, im2col + matmul (F.conv2d).",
    shape_rule=_conv_shape, dtype_rule=lambda *a, **p: _float_result("conv2d", *a), numpy=_conv2d, cupy=_conv2d,
    cost=_conv_cost, verify=Freivalds(form=_conv_form), grad=_conv_vjp,
    params=("stride", "padding", "dilation", "groups"), examples=_conv_examples,
))


# -- pooling -----------------------------------------------------------------------------------


def _pool_len(opname: str, length: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    span = d * (k - 1) + 1
    if 2 * p > k:
        raise ValueError(f"{opname}: padding {p} should be at most half the kernel size {k}")
    num = length + 2 * p - span
    if num < 0:
        raise ValueError(f"{opname}: kernel {k} (dilation {d}) is larger than the input length {length} padded by {p}")
    if ceil:
        out = -(-num // s) + 1
        if (out - 1) * s >= length + p:  # the last window must start inside the input or its left padding
            out -= 1
        return out
    return num // s + 1


def _pool_geometry(opname: str, x: Aval, kernel_size: Any, stride: Any, padding: Any, dilation: Any,
                   ceil_mode: bool) -> tuple:
    if len(x.shape) not in (3, 4):
        raise ValueError(f"{opname}: input must be (N, C, H, W) or (C, H, W), got shape {x.shape}")
    k = _pair(opname, "kernel_size", kernel_size, 1)
    s = k if stride is None else _pair(opname, "stride", stride, 1)
    p, d = _pair(opname, "padding", padding, 0), _pair(opname, "dilation", dilation, 1)
    out = tuple(_pool_len(opname, x.shape[-2 + i], k[i], s[i], p[i], d[i], bool(ceil_mode)) for i in range(2))
    return k, s, p, d, out


def _windows(x: Any, fill: float, k: tuple, s: tuple, p: tuple, d: tuple, out: tuple):
    """Every window offset's (…, Ho, Wo) slice of ``x`` padded with ``fill`` (ceil mode's overhang too)."""
    xp = _xp(x)
    h, w = x.shape[-2:]
    need = [max((out[i] - 1) * s[i] + d[i] * (k[i] - 1) + 1, (h, w)[i] + 2 * p[i]) for i in range(2)]
    padded = xp.full(x.shape[:-2] + tuple(need), fill, x.dtype)
    padded[..., p[0]:p[0] + h, p[1]:p[1] + w] = x
    for i in range(k[0]):
        for j in range(k[1]):
            yield padded[..., i * d[0]: i * d[0] + s[0] * (out[0] - 1) + 1: s[0],
                         j * d[1]: j * d[1] + s[1] * (out[1] - 1) + 1: s[1]]


def _max_pool_shape(x: Aval, *, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                    ceil_mode: bool = False) -> tuple[int, ...]:
    *_, out = _pool_geometry("max_pool2d", x, kernel_size, stride, padding, dilation, ceil_mode)
    return x.shape[:-2] + out


def _max_pool2d(x: Any, *, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                ceil_mode: bool = False) -> Any:
    xp = _xp(x)
    k, s, p, d, out = _pool_geometry("max_pool2d", Aval.of(x), kernel_size, stride, padding, dilation, ceil_mode)
    result = None
    for window in _windows(x, -np.inf, k, s, p, d, out):
        result = window.copy() if result is None else xp.maximum(result, window, out=result)
    return result


def _pool_examples(*param_sets: dict):
    return lambda n, rng, dtype: [((_floats(n, rng, dtype, 2, 3, n + 3, n + 2),), dict(p)) for p in param_sets]


max_pool2d = register(OpSpec(
    name="max_pool2d", doc="Largest value of each (dilated) window of the last two axes (F.max_pool2d).",
    shape_rule=_max_pool_shape, dtype_rule=_float_op("max_pool2d"), numpy=_max_pool2d, cupy=_max_pool2d,
    cost=_pass_cost(1.0), verify=Exact(), arity=1, params=("kernel_size", "stride", "padding", "dilation", "ceil_mode"),
    examples=_pool_examples({"kernel_size": 2}, {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True},
                            {"kernel_size": (2, 3), "dilation": (2, 1)}),
))


def _avg_pool_shape(x: Aval, *, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                    count_include_pad: bool = True, divisor_override: Any = None) -> tuple[int, ...]:
    *_, out = _pool_geometry("avg_pool2d", x, kernel_size, stride, padding, 1, ceil_mode)
    if divisor_override is not None:
        _int_param("avg_pool2d", "divisor_override", divisor_override, 1)
    return x.shape[:-2] + out


def _avg_pool2d(x: Any, *, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                count_include_pad: bool = True, divisor_override: Any = None) -> Any:
    xp = _xp(x)
    k, s, p, d, out = _pool_geometry("avg_pool2d", Aval.of(x), kernel_size, stride, padding, 1, ceil_mode)
    total = None
    for window in _windows(x, 0.0, k, s, p, d, out):
        total = window.copy() if total is None else xp.add(total, window, out=total)
    if divisor_override is not None:
        return total / x.dtype.type(divisor_override)
    h, w = x.shape[-2:]
    # the divisor: window sums of an indicator of the padded input (count_include_pad) or of the input alone
    ind = xp.ones((h + 2 * p[0], w + 2 * p[1]) if count_include_pad else (h, w), x.dtype)
    counts = None
    for window in _windows(ind, 0.0, k, s, (0, 0) if count_include_pad else p, d, out):
        counts = window.copy() if counts is None else xp.add(counts, window, out=counts)
    return total / counts


avg_pool2d = register(OpSpec(
    name="avg_pool2d", doc="Mean of each window of the last two axes (F.avg_pool2d).",
    shape_rule=_avg_pool_shape, dtype_rule=_float_op("avg_pool2d"), numpy=_avg_pool2d, cupy=_avg_pool2d,
    cost=_pass_cost(1.0), verify=Replica(), arity=1,
    params=("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"),
    examples=_pool_examples({"kernel_size": 2}, {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True},
                            {"kernel_size": (2, 3), "padding": 1, "count_include_pad": False}),
))


def _adaptive_size(x: Aval, output_size: Any) -> tuple[int, int]:
    if len(x.shape) not in (3, 4):
        raise ValueError(f"adaptive_avg_pool2d: input must be (N, C, H, W) or (C, H, W), got shape {x.shape}")
    size = output_size if isinstance(output_size, (tuple, list)) else (output_size, output_size)
    if len(size) != 2:
        raise ValueError(f"adaptive_avg_pool2d: output_size must be an int or a pair, got {output_size!r}")
    out = tuple(x.shape[-2 + i] if v is None else _int_param("adaptive_avg_pool2d", "output_size", v, 1)
                for i, v in enumerate(size))
    if 0 in x.shape[-2:]:
        raise ValueError(f"adaptive_avg_pool2d: empty spatial axes in shape {x.shape}")
    return out


def _adaptive_avg_pool2d(x: Any, *, output_size: Any) -> Any:
    """torch's bins: output i averages [floor(i L / n), ceil((i + 1) L / n)); one axis at a time."""
    xp = _xp(x)
    out = _adaptive_size(Aval.of(x), output_size)
    for axis in (-2, -1):
        length, n = x.shape[axis], out[axis]
        if length % n == 0:
            x = x.reshape(x.shape[:x.ndim + axis] + (n, length // n) + x.shape[x.ndim + axis + 1:]).mean(
                axis=axis if axis == -1 else -2)
            continue
        parts = []
        for i in range(n):
            lo, hi = (i * length) // n, -(-((i + 1) * length) // n)
            index = (slice(None),) * (x.ndim + axis) + (slice(lo, hi),)
            parts.append(x[index].mean(axis=axis, keepdims=True))
        x = xp.concatenate(parts, axis=axis)
    return x


adaptive_avg_pool2d = register(OpSpec(
    name="adaptive_avg_pool2d", doc="Mean over torch's adaptive bins of the last two axes (F.adaptive_avg_pool2d).",
    shape_rule=lambda x, *, output_size: x.shape[:-2] + _adaptive_size(x, output_size),
    dtype_rule=_float_op("adaptive_avg_pool2d"), numpy=_adaptive_avg_pool2d, cupy=_adaptive_avg_pool2d,
    cost=_pass_cost(1.0), verify=Replica(), arity=1, params=("output_size",),
    examples=lambda n, rng, dtype: [((_floats(n, rng, dtype, 2, 3, 2 * n, n + 3),), {"output_size": (n, 3)}),
                                    ((_floats(n, rng, dtype, 3, n + 2, 5),), {"output_size": (None, 1)})],
))


# -- scaled dot-product attention -----------------------------------------------------------------


def _sdpa_shape(q: Aval, k: Aval, v: Aval, *mask: Aval, causal: bool = False, scale: Any = None) -> tuple[int, ...]:
    name = "scaled_dot_product_attention"
    if len(mask) > 1:
        raise TypeError(f"{name}: takes 3 or 4 operands (q, k, v[, mask]), got {3 + len(mask)}")
    if min(len(q.shape), len(k.shape), len(v.shape)) < 2:
        raise ValueError(f"{name}: q, k, v must be at least 2-d, got shapes {q.shape}, {k.shape}, {v.shape}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"{name}: shapes q {q.shape}, k {k.shape}, v {v.shape} do not fit (q (..., L, E), "
                         f"k (..., S, E), v (..., S, Ev))")
    try:
        batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        if mask:
            np.broadcast_shapes(mask[0].shape, tuple(batch) + (q.shape[-2], k.shape[-2]))
    except ValueError:
        raise ValueError(f"{name}: batch dimensions of q {q.shape}, k {k.shape}, v {v.shape}"
                         f"{' and mask ' + str(mask[0].shape) if mask else ''} do not broadcast") from None
    if causal and mask:
        raise ValueError(f"{name}: give either a mask or causal=True, not both")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating))):
        raise ValueError(f"{name}: scale must be a number or None, got {scale!r}")
    return tuple(batch) + (q.shape[-2], v.shape[-1])


def _sdpa_dtype(q: Aval, k: Aval, v: Aval, *mask: Aval, **params: Any) -> np.dtype:
    name = "scaled_dot_product_attention"
    dt = _float_result(name, q, k, v)
    if mask and mask[0].dtype.kind not in "bf":
        raise TypeError(f"{name}: mask must be boolean (True: attend) or floating (added), got {mask[0].dtype}")
    return dt


def _sdpa(q: Any, k: Any, v: Any, *mask: Any, causal: bool = False, scale: Any = None) -> Any:
    xp = _xp(q)
    dt = _sdpa_dtype(*map(Aval.of, (q, k, v, *mask)))
    factor = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    s = (q @ xp.swapaxes(k, -1, -2)) * factor
    s = s.astype(dt, copy=False)
    if causal:
        keep = xp.tril(xp.ones((q.shape[-2], k.shape[-2]), dtype=bool))
        s = xp.where(keep, s, -np.inf)
    elif mask:
        m = mask[0]
        s = xp.where(m, s, -np.inf) if m.dtype.kind == "b" else s + m.astype(dt, copy=False)
    p = _softmax(s, axis=-1)
    return (p @ v).astype(dt, copy=False)


def _sdpa_cost(q: Aval, k: Aval, v: Aval, *mask: Aval, **params: Any) -> Cost:
    out = _sdpa_shape(q, k, v, *mask, **params)
    scores = math.prod(out[:-1]) * k.shape[-2]
    itemsize = _float_result("scaled_dot_product_attention", q, k, v).itemsize
    return Cost(2.0 * scores * (q.shape[-1] + v.shape[-1]) + 5.0 * scores,
                float(q.nbytes + k.nbytes + v.nbytes + sum(m.nbytes for m in mask) + math.prod(out) * itemsize))


def _sdpa_examples(n: int, rng: np.random.Generator, dtype: Any) -> list:
    f = lambda *shape: _floats(n, rng, dtype, *shape)  # noqa: E731
    return [
        ((f(2, n, 4), f(2, n + 1, 4), f(2, n + 1, 3)), {}),
        ((f(2, n, 4), f(2, n, 4), f(2, n, 5)), {"causal": True}),
        ((f(n, 4), f(n + 2, 4), f(n + 2, 3), rng.random((n, n + 2)) < 0.8), {"scale": 0.5}),
    ]


scaled_dot_product_attention = register(OpSpec(
    name="scaled_dot_product_attention", doc="softmax(q k^T * scale + mask) v, with a causal option (F.scaled_dot_product_attention).",
    shape_rule=_sdpa_shape, dtype_rule=_sdpa_dtype, numpy=_sdpa, cupy=_sdpa, cost=_sdpa_cost, verify=Replica(),
    params=("causal", "scale"), examples=_sdpa_examples,
))
