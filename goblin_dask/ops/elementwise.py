"""Elementwise operations: one line each, NumPy's broadcasting and result dtypes.

Most are NumPy ufuncs, whose SIMD loops are already the fastest CPU kernel (measured
4-20x faster than numba's scalar libm calls for exp/log/sin/tanh...), so they get no
standalone numba kernel; they still fuse into one numba kernel inside a formula.  numba
kernels are declared where they win: ``where`` (3.6x), ``sigmoid`` (1.5x over a stable
NumPy version), ``erf`` (NumPy has none) and ``relu``; of the activations (1M elements),
``gelu`` (6x: NumPy has no erf), ``leaky_relu`` (10x) and ``silu`` (1.3x).  gelu_tanh,
softplus, log_sigmoid, mish and elu are 2-15x faster in NumPy's SIMD loops.
"""

from __future__ import annotations

import math
import operator

import numpy as np

from goblin_dask.ops._factories import (
    Scalar,
    call,
    clip_loop,
    dtype_arg,
    elementwise_op,
    helper,
    infix,
    same_kind_loop,
    same_per_element,
    ufunc_op,
    vjp,
    where_loop,
)
from goblin_dask.ops.spec import Exact

# -- dtype-dependent scalar code ---------------------------------------------------

_CTYPES = {
    "bool": "bool", "int8": "signed char", "int16": "short", "int32": "int", "int64": "long long",
    "uint8": "unsigned char", "uint16": "unsigned short", "uint32": "unsigned int",
    "uint64": "unsigned long long", "float32": "float", "float64": "double",
}  # fmt: skip


def ctype(dtype: np.dtype) -> str:
    """The CUDA C type of a dtype the generated kernels compute in."""
    return _CTYPES[dtype.name]


def _on_kind(float_code: Scalar, int_code: Scalar, uint_code: Scalar | None = None) -> Scalar:
    """Scalar code that depends on the kind of the loop's first input dtype."""

    def pick(side: str):
        def template(loop) -> str:
            kind = loop[0].kind
            code = float_code if kind == "f" else (uint_code or int_code) if kind == "u" else int_code
            return code.code(side, loop)

        return template

    return Scalar(pick("numba"), pick("cuda"))


def _bits(name: str) -> Scalar:
    """Shifts: NumPy defines shifts by >= the bit width (0, or -1 for negative right shifts)."""
    return Scalar(
        lambda loop: f"_s.{name}({{0}}, {{1}}, {loop[0].itemsize * 8})",
        lambda loop: f"goblin_{name}({{0}}, {{1}}, {loop[0].itemsize * 8})",
        kinds="biu",
    )


_IDENTITY = Scalar("{0}", "{0}")
_FALSE, _TRUE = Scalar("False", "false"), Scalar("True", "true")


def _rounding(name: str) -> Scalar:
    """floor/ceil/rint/trunc: the identity on integers (NumPy keeps their dtype)."""
    return _on_kind(call(name), _IDENTITY)


def _float_test(name: str, on_int: Scalar) -> Scalar:
    """isnan/isinf/isfinite: a constant on integers (CUDA has no integer overloads)."""
    return Scalar(call(name).numba, _on_kind(call(name), on_int).cuda)


_ABS = Scalar("abs({0})", lambda loop: "fabs({0})" if loop[0].kind == "f" else "({0} < 0 ? -{0} : {0})")
_POWER = _on_kind(
    Scalar("({0} ** {1})", "pow({0}, {1})"),
    Scalar(lambda loop: f"_s.power_int({{0}}, {{1}}, np.{loop[0].name}(1))", "goblin_power_int({0}, {1})"),
)
_FLOOR_DIVIDE = _on_kind(
    Scalar("({0} // {1})", "goblin_floor_divide_float({0}, {1})"),
    Scalar("_s.floor_divide_int({0}, {1})", "goblin_floor_divide_int({0}, {1})"),
    Scalar("_s.floor_divide_uint({0}, {1})", "goblin_floor_divide_int({0}, {1})"),
)
_REMAINDER = _on_kind(
    Scalar("({0} % {1})", "goblin_remainder_float({0}, {1})"),
    Scalar("_s.remainder_int({0}, {1})", "goblin_remainder_int({0}, {1})"),
    Scalar("_s.remainder_uint({0}, {1})", "goblin_remainder_int({0}, {1})"),
)
_RELU = Scalar(
    lambda loop: f"_s.maximum({{0}}, np.{loop[0].name}(0))",
    lambda loop: f"goblin_maximum({{0}}, ({ctype(loop[0])})0)",
    kinds="iuf",
)


def _invert_code(side: str):
    return lambda loop: {"numba": "(not {0})", "cuda": "(!{0})"}[side] if loop[0].kind == "b" else "(~{0})"


# -- NumPy kernels of the ops NumPy lacks --------------------------------------------

_FLOAT_LOOP = same_kind_loop("f", like=np.exp)
_REAL_LOOP = same_kind_loop("iuf")


def _sigmoid(x):
    """1 / (1 + exp(-x)), without overflow for large negative x."""
    x = np.asarray(x, dtype=_FLOAT_LOOP(_arg(x))[0])
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _relu(x):
    dt = _REAL_LOOP(_arg(x))[0]
    return np.maximum(np.asarray(x, dtype=dt), dt.type(0))


_ERF = np.frompyfunc(math.erf, 1, 1)


def _erf(x):
    dt = _FLOAT_LOOP(_arg(x))[0]
    return np.asarray(_ERF(np.asarray(x, dtype=np.float64))).astype(dt)


def _arg(x):
    return dtype_arg("elementwise", x)


# -- activations (torch.nn.functional's numbers; see tests/test_ops_activations.py) ----------

_FLOAT_LOOP2 = same_kind_loop("f", like=np.logaddexp)  # (x, parameter): both in their promoted float dtype
_SQRT1_2 = 1 / math.sqrt(2)
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_GELU_KAPPA = 0.044715


def _floats(*xs):
    """The operands as arrays in the float dtype the op computes in."""
    loop = (_FLOAT_LOOP if len(xs) == 1 else _FLOAT_LOOP2)(*map(_arg, xs))
    return [np.asarray(x, dtype=d) for x, d in zip(xs, loop)]


def _gelu(x):
    """x * (1 + erf(x / sqrt(2))) / 2, torch's approximate="none"."""
    (x,) = _floats(x)
    return x * (x.dtype.type(0.5) * (1 + _erf(x * x.dtype.type(_SQRT1_2))))


def _gelu_tanh_parts(x):
    t = x.dtype.type
    with np.errstate(over="ignore"):  # x**3 overflows to +-inf first; tanh takes it to +-1
        return np.tanh(t(_SQRT_2_OVER_PI) * (x + t(_GELU_KAPPA) * (x * x * x)))


def _gelu_tanh(x):
    """torch's approximate="tanh": x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x**3))) / 2."""
    (x,) = _floats(x)
    return x.dtype.type(0.5) * x * (1 + _gelu_tanh_parts(x))


def _softplus(x):
    (x,) = _floats(x)
    return np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0)


def _log_sigmoid(x):
    (x,) = _floats(x)
    return np.minimum(x, 0) - np.log1p(np.exp(-np.abs(x)))


def _silu(x):
    (x,) = _floats(x)
    return x * _sigmoid(x)


def _mish(x):
    (x,) = _floats(x)
    return x * np.tanh(_softplus(x))


def _leaky_relu(x, slope):
    x, slope = _floats(x, slope)
    with np.errstate(invalid="ignore"):  # inf * 0 where the other branch is taken
        return np.where(x > 0, x, x * slope)


def _elu(x, alpha):
    x, alpha = _floats(x, alpha)
    return np.where(x > 0, x, alpha * np.expm1(np.where(x > 0, 0, x)))  # keeps -0.0; no overflow


def _d_gelu(x):
    return 0.5 * (1 + _erf(x * _SQRT1_2)) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _d_gelu_tanh(x):
    th = _gelu_tanh_parts(np.asarray(x, dtype=_FLOAT_LOOP(_arg(x))[0]))
    return 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * _SQRT_2_OVER_PI * (1 + 3 * _GELU_KAPPA * x * x)


def _d_mish(x):
    th = np.tanh(_softplus(x))
    return th + x * _sigmoid(x) * (1 - th * th)


_F = ("float32", "float64")
_FI = ("int32", "int64", "float32", "float64")
_POS, _UNIT, _NONZERO = ((0.1, 5.0),), ((-0.95, 0.95),), ((0.5, 3.0),)
_zero = vjp(lambda x: 0.0)
_RECIPROCAL = Scalar(lambda loop: f"(np.{loop[0].name}(1) / {{0}})", "(1 / {0})", kinds="f")
_INVERT = Scalar(_invert_code("numba"), _invert_code("cuda"), kinds="biu")
_AND = Scalar("(({0} != 0) & ({1} != 0))", "(({0} != 0) && ({1} != 0))")
_OR = Scalar("(({0} != 0) | ({1} != 0))", "(({0} != 0) || ({1} != 0))")
_XOR = Scalar("(({0} != 0) != ({1} != 0))", "(({0} != 0) != ({1} != 0))")
_WHERE = Scalar("({1} if {0} else {2})", "(({0}) ? ({1}) : ({2}))")
_CLIP = Scalar("_s.minimum(_s.maximum({0}, {1}), {2})", "goblin_minimum(goblin_maximum({0}, {1}), {2})")
_INTEGRAL = ((-30, 30), (1, 7))
_SHIFTS = ((-100, 100), (0, 8))

# fmt: off
# -- unary ---------------------------------------------------------------------------
negative = ufunc_op(np.negative, "Numerical negative, -x.", Scalar("(-{0})", "(-{0})"), grad=vjp(lambda x: -1.0), operator=operator.neg, compare=same_per_element)
positive = ufunc_op(np.positive, "Numerical positive, +x (a copy).", Scalar("(+{0})", "(+{0})"), grad=vjp(lambda x: 1.0), operator=operator.pos, compare=same_per_element)
absolute = ufunc_op(np.absolute, "Absolute value |x|.", _ABS, grad=vjp(np.sign), operator=operator.abs, aliases=('abs',), compare=same_per_element)
exp = ufunc_op(np.exp, "Exponential e**x.", call("exp"), flops=20, grad=vjp(np.exp), compare=same_per_element)
expm1 = ufunc_op(np.expm1, "e**x - 1, accurate for small x.", call("expm1"), flops=20, grad=vjp(np.exp), compare=same_per_element)
log = ufunc_op(np.log, "Natural logarithm.", call("log"), flops=20, grad=vjp(lambda x: 1 / x), domain=_POS, compare=same_per_element)
log1p = ufunc_op(np.log1p, "log(1 + x), accurate for small x.", call("log1p"), flops=20, grad=vjp(lambda x: 1 / (1 + x)), domain=_POS, compare=same_per_element)
log2 = ufunc_op(np.log2, "Base-2 logarithm.", call("log2"), flops=20, grad=vjp(lambda x: 1 / (x * math.log(2))), domain=_POS, compare=same_per_element)
log10 = ufunc_op(np.log10, "Base-10 logarithm.", call("log10"), flops=20, grad=vjp(lambda x: 1 / (x * math.log(10))), domain=_POS, compare=same_per_element)
sqrt = ufunc_op(np.sqrt, "Non-negative square root.", call("sqrt"), flops=4, grad=vjp(lambda x: 0.5 / np.sqrt(x)), domain=_POS, compare=same_per_element)
square = ufunc_op(np.square, "x * x.", Scalar("({0} * {0})", "({0} * {0})"), grad=vjp(lambda x: 2 * x), compare=same_per_element)
reciprocal = ufunc_op(np.reciprocal, "1 / x.", _RECIPROCAL, flops=4, grad=vjp(lambda x: -1 / x**2), domain=_NONZERO, compare=same_per_element)
sin = ufunc_op(np.sin, "Sine (radians).", call("sin"), flops=20, grad=vjp(np.cos))
cos = ufunc_op(np.cos, "Cosine (radians).", call("cos"), flops=20, grad=vjp(lambda x: -np.sin(x)))
tan = ufunc_op(np.tan, "Tangent (radians).", call("tan"), flops=20, grad=vjp(lambda x: 1 + np.tan(x) ** 2), domain=((-1.2, 1.2),))
arcsin = ufunc_op(np.arcsin, "Inverse sine.", call("arcsin", "asin"), flops=20, grad=vjp(lambda x: 1 / np.sqrt(1 - x**2)), domain=_UNIT)
arccos = ufunc_op(np.arccos, "Inverse cosine.", call("arccos", "acos"), flops=20, grad=vjp(lambda x: -1 / np.sqrt(1 - x**2)), domain=_UNIT)
arctan = ufunc_op(np.arctan, "Inverse tangent.", call("arctan", "atan"), flops=20, grad=vjp(lambda x: 1 / (1 + x**2)))
sinh = ufunc_op(np.sinh, "Hyperbolic sine.", call("sinh"), flops=20, grad=vjp(np.cosh), compare=same_per_element)
cosh = ufunc_op(np.cosh, "Hyperbolic cosine.", call("cosh"), flops=20, grad=vjp(np.sinh), compare=same_per_element)
tanh = ufunc_op(np.tanh, "Hyperbolic tangent.", call("tanh"), flops=20, grad=vjp(lambda x: 1 - np.tanh(x) ** 2), compare=same_per_element)
floor = ufunc_op(np.floor, "Largest integer <= x.", _rounding("floor"), grad=_zero, compare=same_per_element)
ceil = ufunc_op(np.ceil, "Smallest integer >= x.", _rounding("ceil"), grad=_zero, compare=same_per_element)
rint = ufunc_op(np.rint, "Round to the nearest integer, ties to even.", _rounding("rint"), grad=_zero, compare=same_per_element)
trunc = ufunc_op(np.trunc, "Round towards zero.", _rounding("trunc"), grad=_zero, compare=same_per_element)
sign = ufunc_op(np.sign, "-1, 0 or 1 by the sign of x (NaN stays NaN).", helper("sign"), grad=_zero, compare=same_per_element)
logical_not = ufunc_op(np.logical_not, "Truth value of NOT x.", Scalar("(not {0})", "(!{0})"), verify=Exact())
invert = ufunc_op(np.invert, "Bitwise NOT (logical NOT on booleans).", _INVERT, verify=Exact(), operator=operator.invert, aliases=('bitwise_not',))
isnan = ufunc_op(np.isnan, "True where x is NaN.", _float_test("isnan", _FALSE), verify=Exact())
isinf = ufunc_op(np.isinf, "True where x is +inf or -inf.", _float_test("isinf", _FALSE), verify=Exact())
isfinite = ufunc_op(np.isfinite, "True where x is neither infinite nor NaN.", _float_test("isfinite", _TRUE), verify=Exact())

sigmoid = elementwise_op(
    "sigmoid", "Logistic function 1 / (1 + exp(-x)), overflow-free.", numpy=_sigmoid, loop=_FLOAT_LOOP,
    scalar=helper("sigmoid", kinds="f"), arity=1, flops=25, numba_loops=[(d,) for d in _F],
    grad=vjp(lambda x: _sigmoid(x) * (1 - _sigmoid(x))),
)
relu = elementwise_op(
    "relu", "Rectified linear unit max(x, 0) (NaN stays NaN).", numpy=_relu, loop=_REAL_LOOP,
    scalar=_RELU, arity=1, numba_loops=[(d,) for d in _FI], grad=vjp(lambda x: x > 0),
)
erf = elementwise_op(
    "erf", "Gauss error function.", numpy=_erf, loop=_FLOAT_LOOP, scalar=Scalar("math.erf({0})", "erf({0})", kinds="f"),
    arity=1, flops=25, numba_loops=[(d,) for d in _F], grad=vjp(lambda x: 2 / math.sqrt(math.pi) * np.exp(-(x**2))),
)

gelu = elementwise_op(
    "gelu", "Gaussian error linear unit x * (1 + erf(x / sqrt(2))) / 2 (exact; torch's default).", numpy=_gelu,
    loop=_FLOAT_LOOP, scalar=helper("gelu", kinds="f"), arity=1, flops=30, numba_loops=[(d,) for d in _F], grad=vjp(_d_gelu),
)
gelu_tanh = elementwise_op(
    "gelu_tanh", "GELU's tanh approximation x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x**3))) / 2.", numpy=_gelu_tanh,
    loop=_FLOAT_LOOP, scalar=helper("gelu_tanh", kinds="f"), arity=1, flops=30, grad=vjp(_d_gelu_tanh),
)
silu = elementwise_op(
    "silu", "Sigmoid linear unit (swish) x * sigmoid(x).", numpy=_silu, loop=_FLOAT_LOOP,
    scalar=helper("silu", kinds="f"), arity=1, flops=26, numba_loops=[(d,) for d in _F],
    grad=vjp(lambda x: _sigmoid(x) * (1 + x * (1 - _sigmoid(x)))),
)
softplus = elementwise_op(
    "softplus", "log(1 + exp(x)), overflow-free: log1p(exp(-|x|)) + max(x, 0).", numpy=_softplus, loop=_FLOAT_LOOP,
    scalar=helper("softplus", kinds="f"), arity=1, flops=40, grad=vjp(_sigmoid),
)
log_sigmoid = elementwise_op(
    "log_sigmoid", "log(sigmoid(x)), overflow-free: min(x, 0) - log1p(exp(-|x|)).", numpy=_log_sigmoid,
    loop=_FLOAT_LOOP, scalar=helper("log_sigmoid", kinds="f"), arity=1, flops=40, grad=vjp(lambda x: _sigmoid(-x)),
)
mish = elementwise_op(
    "mish", "Mish activation x * tanh(softplus(x)).", numpy=_mish, loop=_FLOAT_LOOP,
    scalar=helper("mish", kinds="f"), arity=1, flops=60, grad=vjp(_d_mish),
)
leaky_relu = elementwise_op(
    "leaky_relu", "x where x > 0, else slope * x (slope: a number, or an array as in PReLU).", numpy=_leaky_relu,
    loop=_FLOAT_LOOP2, scalar=Scalar("_s.leaky_relu({0}, {1})", "goblin_leaky_relu({0}, {1})", kinds="f"), arity=2,
    flops=2, domain=((-3.0, 3.0), (0.0, 0.3)), numba_loops=[(d, d) for d in _F],
    grad=vjp(lambda x, s: np.where(x > 0, 1.0, s), lambda x, s: np.where(x > 0, 0.0, x)),
)
elu = elementwise_op(
    "elu", "Exponential linear unit: x where x > 0, else alpha * (exp(x) - 1).", numpy=_elu, loop=_FLOAT_LOOP2,
    scalar=Scalar("_s.elu({0}, {1})", "goblin_elu({0}, {1})", kinds="f"), arity=2, flops=20,
    domain=((-3.0, 3.0), (0.5, 2.0)),
    grad=vjp(lambda x, a: np.where(x > 0, 1.0, a * np.exp(np.minimum(x, 0))),
             lambda x, a: np.where(x > 0, 0.0, np.expm1(np.minimum(x, 0)))),
)

# -- binary ----------------------------------------------------------------------------
add = ufunc_op(np.add, "Sum x + y.", infix("+"), grad=vjp(lambda x, y: 1.0, lambda x, y: 1.0), operator=operator.add, compare=same_per_element)
subtract = ufunc_op(np.subtract, "Difference x - y.", infix("-"), grad=vjp(lambda x, y: 1.0, lambda x, y: -1.0), operator=operator.sub, compare=same_per_element)
multiply = ufunc_op(np.multiply, "Product x * y.", infix("*"), grad=vjp(lambda x, y: y, lambda x, y: x), operator=operator.mul, compare=same_per_element)
divide = ufunc_op(np.divide, "True division x / y.", infix("/"), flops=4, grad=vjp(lambda x, y: 1 / y, lambda x, y: -x / y**2), domain=((-3, 3), (0.5, 3)), operator=operator.truediv, aliases=('true_divide',), compare=same_per_element)
floor_divide = ufunc_op(np.floor_divide, "Floor of x / y (0 for integer division by zero).", _FLOOR_DIVIDE, flops=4, grad=vjp(lambda x, y: 0.0, lambda x, y: 0.0), domain=_INTEGRAL, operator=operator.floordiv)
remainder = ufunc_op(np.remainder, "x - floor(x / y) * y, with the sign of y.", _REMAINDER, flops=4, grad=vjp(lambda x, y: 1.0, lambda x, y: -np.floor(x / y)), domain=_INTEGRAL, operator=operator.mod, aliases=('mod',))
power = ufunc_op(np.power, "x ** y.", _POWER, flops=30, grad=vjp(lambda x, y: y * x ** (y - 1), lambda x, y: np.log(x) * x**y), domain=((0.5, 3), (0, 4)), operator=operator.pow, aliases=('pow',))
maximum = ufunc_op(np.maximum, "Elementwise maximum, propagating NaN.", helper("maximum"), grad=vjp(lambda x, y: x > y, lambda x, y: x <= y), compare=same_per_element)
minimum = ufunc_op(np.minimum, "Elementwise minimum, propagating NaN.", helper("minimum"), grad=vjp(lambda x, y: x < y, lambda x, y: x >= y), compare=same_per_element)
arctan2 = ufunc_op(np.arctan2, "Angle of the point (x2, x1) in radians, in the right quadrant.", call("arctan2", "atan2", kinds="f"), flops=25,
                   grad=vjp(lambda y, x: x / (x**2 + y**2), lambda y, x: -y / (x**2 + y**2)))
hypot = ufunc_op(np.hypot, "sqrt(x**2 + y**2) without overflow.", call("hypot", kinds="f"), flops=10,
                 grad=vjp(lambda x, y: x / np.hypot(x, y), lambda x, y: y / np.hypot(x, y)), compare=same_per_element)
logaddexp = ufunc_op(np.logaddexp, "log(exp(x) + exp(y)) without overflow.", helper("logaddexp", kinds="f"), flops=40,
                     grad=vjp(lambda x, y: _sigmoid(x - y), lambda x, y: _sigmoid(y - x)))
equal = ufunc_op(np.equal, "x == y.", infix("=="), verify=Exact(), operator=operator.eq)
not_equal = ufunc_op(np.not_equal, "x != y.", infix("!="), verify=Exact(), operator=operator.ne)
less = ufunc_op(np.less, "x < y.", infix("<"), verify=Exact(), operator=operator.lt)
less_equal = ufunc_op(np.less_equal, "x <= y.", infix("<="), verify=Exact(), operator=operator.le)
greater = ufunc_op(np.greater, "x > y.", infix(">"), verify=Exact(), operator=operator.gt)
greater_equal = ufunc_op(np.greater_equal, "x >= y.", infix(">="), verify=Exact(), operator=operator.ge)
logical_and = ufunc_op(np.logical_and, "Truth value of x AND y.", _AND, verify=Exact())
logical_or = ufunc_op(np.logical_or, "Truth value of x OR y.", _OR, verify=Exact())
logical_xor = ufunc_op(np.logical_xor, "Truth value of x XOR y.", _XOR, verify=Exact())
bitwise_and = ufunc_op(np.bitwise_and, "Bitwise AND of integers or booleans.", infix("&", kinds="biu"), verify=Exact(), operator=operator.and_)
bitwise_or = ufunc_op(np.bitwise_or, "Bitwise OR of integers or booleans.", infix("|", kinds="biu"), verify=Exact(), operator=operator.or_)
bitwise_xor = ufunc_op(np.bitwise_xor, "Bitwise XOR of integers or booleans.", infix("^", kinds="biu"), verify=Exact(), operator=operator.xor)
left_shift = ufunc_op(np.left_shift, "x << y (0 once y reaches the bit width).", _bits("left_shift"), verify=Exact(), domain=_SHIFTS, operator=operator.lshift)
right_shift = ufunc_op(np.right_shift, "x >> y, arithmetic for signed integers.", _bits("right_shift"), verify=Exact(), domain=_SHIFTS, operator=operator.rshift)
# fmt: on

# -- ternary ---------------------------------------------------------------------------
where = elementwise_op(
    "where", "x where cond is true, else y.", numpy=np.where, loop=where_loop, scalar=_WHERE, arity=3,
    numba_loops=[("bool", d, d) for d in _FI], grad=vjp(None, lambda c, x, y: c != 0, lambda c, x, y: c == 0),
)
clip = elementwise_op(
    "clip", "min(max(x, lo), hi), propagating NaN (a zero's sign on ties may differ from NumPy's).",
    numpy=np.clip, loop=clip_loop, scalar=_CLIP, arity=3, domain=((-3, 3), (-2, -0.5), (0.5, 2)),
    grad=vjp(lambda x, lo, hi: (x >= lo) & (x <= hi), lambda x, lo, hi: x < lo, lambda x, lo, hi: x > hi),
)
