"""Factories for catalog declarations, playing the role of JAX's ``unop``/``naryop``.

One line declares an elementwise op: the factory supplies the broadcasting shape rule,
the dtype rule (NumPy's own loop resolution, so NEP 50 result types come for free),
the cost, the cupy kernel and, for the few ops where numba beats NumPy, a lazily
compiled numba kernel.  The rules shared by the other op modules live here too.

Dtype arguments: rules and kernels describe an operand by a *dtype argument*, an
``np.dtype`` for arrays and NumPy scalars, or the Python type ``int``/``float``/
``complex`` for a Python scalar, which NEP 50 treats as "weak" (it takes the other
operands' precision).  That is exactly what ``np.ufunc.resolve_dtypes`` accepts.

Gradient slot convention: ``grad`` is None, a marker string ("linear", "bilinear"),
or a vjp ``grad(g, *operands, **params) -> tuple`` of cotangents, one per operand
(None where the op is not differentiable in that operand), in NumPy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence, Union

import numpy as np

from goblin_dask.ops.registry import register
from goblin_dask.ops.spec import Aval, Elementwise, OpSpec, Replica, Verification, elementwise_cost

#: Dtype kinds the catalog computes on: bool, signed/unsigned int, float, complex.
NUMERIC_KINDS = "biufc"
_WEAK_TYPE = {"i": int, "f": float, "c": complex}
_WEAK_VALUE = {int: 0, float: 0.0, complex: 0j}

#: Grammar of a dtype parameter written as text (``OpSpec.text_params``).
DTYPE_TEXT = r"bool|u?int(8|16|32|64)|float(16|32|64)|complex(64|128)"

DtypeArg = Union[np.dtype, type]
#: A loop: the dtypes an elementwise op computes in, inputs first, the output last.
Loop = tuple


def check_dtype(opname: str, dtype: Any) -> np.dtype:
    """``dtype`` as an np.dtype, or TypeError when the catalog does not compute on it."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{opname}: unsupported dtype {dtype!r}") from None
    if dt.kind not in NUMERIC_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise TypeError(f"{opname}: unsupported dtype {dt} (numeric and boolean dtypes only)")
    return dt


def dtype_arg(opname: str, x: Any) -> DtypeArg:
    """How NumPy's promotion sees operand ``x`` (an Aval, array, NumPy or Python scalar)."""
    if type(x) in (int, float, complex):
        return type(x)
    if type(x) is bool:
        return np.dtype(bool)
    if isinstance(x, Aval):
        dt = check_dtype(opname, x.dtype)
        return _WEAK_TYPE.get(dt.kind, dt) if x.weak else dt
    return check_dtype(opname, x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)


def is_weak(arg: DtypeArg) -> bool:
    return isinstance(arg, type)


def concrete(arg: DtypeArg) -> np.dtype:
    """The dtype a weak Python scalar has on its own (int64, float64, complex128)."""
    return np.dtype(arg)


def weak_of(dtype: np.dtype) -> DtypeArg:
    """The weak type of a result computed only from Python scalars (bool stays strong)."""
    return _WEAK_TYPE.get(dtype.kind, dtype)


def result_type(*args: DtypeArg) -> np.dtype:
    """np.result_type with NEP 50's weak Python scalars."""
    return np.result_type(*(_WEAK_VALUE[a] if is_weak(a) else a for a in args))


def describe(args: Sequence[DtypeArg]) -> str:
    return ", ".join(a.__name__ if is_weak(a) else str(a) for a in args)


def ufunc_loop(ufunc: np.ufunc) -> Callable[..., Loop]:
    """The loop NumPy itself picks for ``ufunc`` on these dtype arguments."""

    def loop(*args: DtypeArg) -> Loop:
        return ufunc.resolve_dtypes(tuple(args) + (None,) * ufunc.nout)

    return loop


def same_kind_loop(kinds: str, like: np.ufunc | None = None) -> Callable[..., Loop]:
    """Loop for ops outside NumPy's ufuncs: ``like``'s loop (or the promoted dtype), within ``kinds``."""

    def loop(*args: DtypeArg) -> Loop:
        if like is not None:
            dtypes = like.resolve_dtypes(tuple(args) + (None,))
        else:
            dt = result_type(*args)
            dtypes = (dt,) * (len(args) + 1)
        if any(d.kind not in kinds for d in dtypes):
            raise TypeError(f"computes on dtype kinds {kinds!r}")
        return tuple(dtypes)

    return loop


def where_loop(cond: DtypeArg, x: DtypeArg, y: DtypeArg) -> Loop:
    dt = result_type(x, y)
    return (np.dtype(bool), dt, dt, dt)


def clip_loop(x: DtypeArg, lo: DtypeArg, hi: DtypeArg) -> Loop:
    dt = result_type(x, lo, hi)
    if dt.kind == "c":
        raise TypeError("clip is not defined for complex numbers")
    return (dt,) * 4


def loop_of(spec: OpSpec, args: Sequence[Any]) -> Loop:
    """The loop ``spec`` computes ``args`` in; TypeError naming the op and dtypes otherwise."""
    dargs = tuple(dtype_arg(spec.name, a) for a in args)
    try:
        return tuple(np.dtype(d) for d in spec.elementwise.loop(*dargs))
    except TypeError as e:
        raise TypeError(f"{spec.name}: unsupported dtype(s) ({describe(dargs)}): {e}") from None


def broadcast_shape(opname: str, *avals: Aval) -> tuple[int, ...]:
    """NumPy broadcasting of the operands' shapes, or ValueError naming the op and the shapes."""
    shapes = [a.shape for a in avals]
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(f"{opname}: shapes {' and '.join(map(str, shapes))} do not broadcast") from None


def normalize_axes(opname: str, axes: Any, shape: tuple[int, ...], ndim: int | None = None) -> tuple[int, ...]:
    """Axes as non-negative ints for an ``ndim``-d result (default: ``shape``'s); ValueError if bad or repeated."""
    ndim = len(shape) if ndim is None else ndim
    axes = (axes,) if isinstance(axes, (int, np.integer)) else axes
    if not isinstance(axes, (tuple, list)) or not all(isinstance(a, (int, np.integer)) and type(a) is not bool for a in axes):
        raise ValueError(f"{opname}: axes must be ints, got {axes!r}")
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"{opname}: axis {a} is out of bounds for shape {shape} ({ndim} axes)")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{opname}: repeated axis in {tuple(axes)} for shape {shape}")
    return tuple(out)


def shape_param(opname: str, shape: Any, *, allow_unknown: bool = False) -> tuple[int, ...]:
    """A shape param as a tuple of non-negative ints (an int means 1-d; -1 allowed if ``allow_unknown``)."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else shape
    lowest = -1 if allow_unknown else 0
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(n, (int, np.integer)) and type(n) is not bool and n >= lowest for n in shape
    ):
        raise ValueError(f"{opname}: shape must be a tuple of non-negative ints, got {shape!r}")
    return tuple(int(n) for n in shape)


def numeric_result(opname: str) -> Callable[..., np.dtype]:
    """dtype rule of ops whose result is the operands' promoted dtype (products, stacking)."""

    def rule(*avals: Aval, **params: Any) -> np.dtype:
        return result_type(*(dtype_arg(opname, a) for a in avals))

    return rule


# -- elementwise ops --------------------------------------------------------------


@dataclass(frozen=True)
class Scalar:
    """How one element is computed, for the fused numba and CUDA code generators.

    Each side is a format template over the operand expressions ``{0}, {1}, ...`` or a
    function ``loop -> template`` where the code depends on the dtypes computed in.
    ``kinds``: dtype kinds the generated code handles (others evaluate op by op).
    """

    numba: str | Callable[[Loop], str]
    cuda: str | Callable[[Loop], str]
    kinds: str = "biuf"

    def code(self, side: str, loop: Loop) -> str:
        template = getattr(self, side)
        return template(loop) if callable(template) else template


def call(name: str, cuda: str | None = None, kinds: str = "biuf") -> Scalar:
    """A function with the same meaning on both sides: ``np.<name>`` in numba, ``<cuda>`` in CUDA."""
    args = {1: "{0}", 2: "{0}, {1}"}[_arity_of(name)]
    return Scalar(f"np.{name}({args})", f"{cuda or name}({args})", kinds)


def infix(symbol: str, cuda: str | None = None, kinds: str = "biuf") -> Scalar:
    return Scalar(f"({{0}} {symbol} {{1}})", f"({{0}} {cuda or symbol} {{1}})", kinds)


def helper(name: str, *extra: str, kinds: str = "biuf") -> Scalar:
    """A helper of the same name in ``_numba_scalars`` (numba) and the CUDA preamble."""
    nargs = _arity_of(name)
    args = ", ".join([f"{{{i}}}" for i in range(nargs)] + list(extra))
    return Scalar(f"_s.{name}({args})", f"goblin_{name}({args})", kinds)


def _arity_of(name: str) -> int:
    ufunc = getattr(np, name, None)
    return ufunc.nin if isinstance(ufunc, np.ufunc) else 1


def matrices(n: int, rng: np.random.Generator, dtype: Any, count: int = 2) -> list[np.ndarray]:
    """``count`` standard-normal n x n operands in ``dtype``, for ops' example calls."""
    return [rng.standard_normal((n, n)).astype(dtype) for _ in range(count)]


def unbroadcast(g: Any, shape: tuple[int, ...]) -> Any:
    """Sum a broadcast cotangent back down to an operand's shape."""
    g = np.asarray(g)
    if g.shape == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(i + lead for i, n in enumerate(shape) if n == 1 and g.shape[i + lead] != 1)
    return g.sum(axis=axes, keepdims=True).reshape(shape) if axes else g.reshape(shape)


def vjp(*partials: Callable[..., Any] | None) -> Callable[..., tuple]:
    """vjp of an elementwise op from its partial derivatives, one per operand (None: not differentiable)."""

    def grad(g: Any, *xs: Any) -> tuple:
        return tuple(
            None if d is None else unbroadcast(g * d(*xs), np.shape(x)) for d, x in zip(partials, xs)
        )

    return grad


def elementwise_op(
    name: str,
    doc: str,
    *,
    numpy: Callable[..., Any],
    loop: Callable[..., Loop],
    scalar: Scalar,
    arity: int,
    flops: float = 1.0,
    verify: Verification = Replica(),
    grad: Any = None,
    numba_loops: Sequence[Loop] = (),
    cupy: Callable[..., Any] | None = None,
    domain: tuple | None = None,
    operator: Callable[..., Any] | None = None,
    aliases: tuple[str, ...] = (),
    compare: Callable[..., bool] | None = None,
) -> OpSpec:
    """Declare and register an elementwise op.

    ``numba_loops``: the loops (input dtypes) a fused numba kernel is compiled for, only
    for ops where numba beats NumPy (measured: numpy's SIMD transcendentals are 4-20x
    faster than numba's libm calls, so those keep NumPy).  ``domain``: the input range
    (one ``(lo, hi)`` per operand) where the op is defined, for tests and benchmarks.  ``compare``: the
    replica comparison, where the generic block rule is too wide (:func:`same_per_element`).
    """
    from goblin_dask.ops.kernels import FusedKernel, cupy_fused, cupy_ufunc

    expr = f"{name}({', '.join(f'x{i}' for i in range(arity))})"
    spec = OpSpec(
        name=name,
        doc=doc,
        shape_rule=partial(broadcast_shape, name),
        dtype_rule=lambda *avals: loop_of(spec, avals)[-1],
        numpy=numpy,
        numba=FusedKernel(expr, numba_loops, fallback=numpy) if numba_loops else None,
        cupy=cupy or (cupy_ufunc(numpy) if isinstance(numpy, np.ufunc) else cupy_fused(expr)),
        cost=partial(elementwise_cost, flops_per_element=flops),
        verify=verify,
        grad=grad,
        arity=arity,
        operator=operator,
        aliases=aliases,
        elementwise=Elementwise(loop, scalar, domain, flops),
        compare=compare,
    )
    return register(spec)


def same_per_element(got: Any, want: Any, operands: tuple = (), params: dict | None = None) -> bool:
    """The replica comparison of a pointwise op that every honest kernel computes to a few units in the last
    place of each element (IEEE's correctly rounded arithmetic and square root, the libm exponentials,
    logarithms and hyperbolics: CUDA documents 1-3 ulp, NumPy's SIMD loops under 4): each element within 64 of
    its own ulps, plus the smallest normal number (a kernel that flushes subnormals to zero).  The generic rule
    measures every element against the block's largest, which lets an entry far below it move anywhere in that
    band (an ``exp`` of 1e-13 beside one of 148 could turn negative)."""
    from goblin_dask.validation.checks import same_result

    got, want = np.asarray(got), np.asarray(want)
    if not same_result(got, want, operands):  # shape, dtype, NaN and inf, the block rule
        return False
    if want.dtype.kind not in "fc":
        return True
    fin = np.isfinite(want)
    g, w = got[fin].astype(np.complex128 if want.dtype.kind == "c" else np.float64), want[fin].astype(
        np.complex128 if want.dtype.kind == "c" else np.float64)
    info = np.finfo(want.dtype)
    return bool(np.all(np.abs(g - w) <= 64 * float(info.eps) * np.abs(w) + float(info.tiny)))


def ufunc_op(ufunc: np.ufunc, doc: str, scalar: Scalar, **kw: Any) -> OpSpec:
    """An op that *is* a NumPy ufunc (JAX's ``standard_unop``/``standard_naryop``)."""
    return elementwise_op(ufunc.__name__, doc, numpy=ufunc, loop=ufunc_loop(ufunc), scalar=scalar, arity=ufunc.nin, **kw)
