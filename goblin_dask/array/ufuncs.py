"""Every elementwise catalog op as a ga function: ``ga.exp``, ``ga.add``, ``ga.sigmoid``, ``ga.isnan`` ...

One definition per op (its docstring is the op's doc), then the aliases the ops declare
(``ga.abs`` is ``ga.absolute``).  Each applies the op block by block with NumPy's
broadcasting (:func:`goblin_dask.array.core.elementwise`).  Written from the catalog;
``tests/test_array.py`` checks that this module lists exactly the catalog's elementwise
ops and their aliases (and prints the definition to add for a new op).
"""

from __future__ import annotations

from goblin_dask.array.core import Array, clip, elementwise, where  # where, clip: with NumPy's optional arguments


def negative(x, /) -> Array:
    """Numerical negative, -x."""
    return elementwise("negative", x)


def positive(x, /) -> Array:
    """Numerical positive, +x (a copy)."""
    return elementwise("positive", x)


def absolute(x, /) -> Array:
    """Absolute value |x|."""
    return elementwise("absolute", x)


def exp(x, /) -> Array:
    """Exponential e**x."""
    return elementwise("exp", x)


def expm1(x, /) -> Array:
    """e**x - 1, accurate for small x."""
    return elementwise("expm1", x)


def log(x, /) -> Array:
    """Natural logarithm."""
    return elementwise("log", x)


def log1p(x, /) -> Array:
    """log(1 + x), accurate for small x."""
    return elementwise("log1p", x)


def log2(x, /) -> Array:
    """Base-2 logarithm."""
    return elementwise("log2", x)


def log10(x, /) -> Array:
    """Base-10 logarithm."""
    return elementwise("log10", x)


def sqrt(x, /) -> Array:
    """Non-negative square root."""
    return elementwise("sqrt", x)


def square(x, /) -> Array:
    """x * x."""
    return elementwise("square", x)


def reciprocal(x, /) -> Array:
    """1 / x."""
    return elementwise("reciprocal", x)


def sin(x, /) -> Array:
    """Sine (radians)."""
    return elementwise("sin", x)


def cos(x, /) -> Array:
    """Cosine (radians)."""
    return elementwise("cos", x)


def tan(x, /) -> Array:
    """Tangent (radians)."""
    return elementwise("tan", x)


def arcsin(x, /) -> Array:
    """Inverse sine."""
    return elementwise("arcsin", x)


def arccos(x, /) -> Array:
    """Inverse cosine."""
    return elementwise("arccos", x)


def arctan(x, /) -> Array:
    """Inverse tangent."""
    return elementwise("arctan", x)


def sinh(x, /) -> Array:
    """Hyperbolic sine."""
    return elementwise("sinh", x)


def cosh(x, /) -> Array:
    """Hyperbolic cosine."""
    return elementwise("cosh", x)


def tanh(x, /) -> Array:
    """Hyperbolic tangent."""
    return elementwise("tanh", x)


def floor(x, /) -> Array:
    """Largest integer <= x."""
    return elementwise("floor", x)


def ceil(x, /) -> Array:
    """Smallest integer >= x."""
    return elementwise("ceil", x)


def rint(x, /) -> Array:
    """Round to the nearest integer, ties to even."""
    return elementwise("rint", x)


def trunc(x, /) -> Array:
    """Round towards zero."""
    return elementwise("trunc", x)


def sign(x, /) -> Array:
    """-1, 0 or 1 by the sign of x (NaN stays NaN)."""
    return elementwise("sign", x)


def logical_not(x, /) -> Array:
    """Truth value of NOT x."""
    return elementwise("logical_not", x)


def invert(x, /) -> Array:
    """Bitwise NOT (logical NOT on booleans)."""
    return elementwise("invert", x)


def isnan(x, /) -> Array:
    """True where x is NaN."""
    return elementwise("isnan", x)


def isinf(x, /) -> Array:
    """True where x is +inf or -inf."""
    return elementwise("isinf", x)


def isfinite(x, /) -> Array:
    """True where x is neither infinite nor NaN."""
    return elementwise("isfinite", x)


def sigmoid(x, /) -> Array:
    """Logistic function 1 / (1 + exp(-x)), overflow-free."""
    return elementwise("sigmoid", x)


def relu(x, /) -> Array:
    """Rectified linear unit max(x, 0) (NaN stays NaN)."""
    return elementwise("relu", x)


def erf(x, /) -> Array:
    """Gauss error function."""
    return elementwise("erf", x)


def gelu(x, /) -> Array:
    """Gaussian error linear unit x * (1 + erf(x / sqrt(2))) / 2 (exact; torch's default)."""
    return elementwise("gelu", x)


def gelu_tanh(x, /) -> Array:
    """GELU's tanh approximation x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x**3))) / 2."""
    return elementwise("gelu_tanh", x)


def silu(x, /) -> Array:
    """Sigmoid linear unit (swish) x * sigmoid(x)."""
    return elementwise("silu", x)


def softplus(x, /) -> Array:
    """log(1 + exp(x)), overflow-free: log1p(exp(-|x|)) + max(x, 0)."""
    return elementwise("softplus", x)


def log_sigmoid(x, /) -> Array:
    """log(sigmoid(x)), overflow-free: min(x, 0) - log1p(exp(-|x|))."""
    return elementwise("log_sigmoid", x)


def mish(x, /) -> Array:
    """Mish activation x * tanh(softplus(x))."""
    return elementwise("mish", x)


def leaky_relu(x, negative_slope=0.01, /) -> Array:
    """x where x > 0, else slope * x (slope: a number, or an array as in PReLU)."""
    return elementwise("leaky_relu", x, negative_slope)


def elu(x, alpha=1.0, /) -> Array:
    """Exponential linear unit: x where x > 0, else alpha * (exp(x) - 1)."""
    return elementwise("elu", x, alpha)


def add(x1, x2, /) -> Array:
    """Sum x + y."""
    return elementwise("add", x1, x2)


def subtract(x1, x2, /) -> Array:
    """Difference x - y."""
    return elementwise("subtract", x1, x2)


def multiply(x1, x2, /) -> Array:
    """Product x * y."""
    return elementwise("multiply", x1, x2)


def divide(x1, x2, /) -> Array:
    """True division x / y."""
    return elementwise("divide", x1, x2)


def floor_divide(x1, x2, /) -> Array:
    """Floor of x / y (0 for integer division by zero)."""
    return elementwise("floor_divide", x1, x2)


def remainder(x1, x2, /) -> Array:
    """x - floor(x / y) * y, with the sign of y."""
    return elementwise("remainder", x1, x2)


def power(x1, x2, /) -> Array:
    """x ** y."""
    return elementwise("power", x1, x2)


def maximum(x1, x2, /) -> Array:
    """Elementwise maximum, propagating NaN."""
    return elementwise("maximum", x1, x2)


def minimum(x1, x2, /) -> Array:
    """Elementwise minimum, propagating NaN."""
    return elementwise("minimum", x1, x2)


def arctan2(x1, x2, /) -> Array:
    """Angle of the point (x2, x1) in radians, in the right quadrant."""
    return elementwise("arctan2", x1, x2)


def hypot(x1, x2, /) -> Array:
    """sqrt(x**2 + y**2) without overflow."""
    return elementwise("hypot", x1, x2)


def logaddexp(x1, x2, /) -> Array:
    """log(exp(x) + exp(y)) without overflow."""
    return elementwise("logaddexp", x1, x2)


def equal(x1, x2, /) -> Array:
    """x == y."""
    return elementwise("equal", x1, x2)


def not_equal(x1, x2, /) -> Array:
    """x != y."""
    return elementwise("not_equal", x1, x2)


def less(x1, x2, /) -> Array:
    """x < y."""
    return elementwise("less", x1, x2)


def less_equal(x1, x2, /) -> Array:
    """x <= y."""
    return elementwise("less_equal", x1, x2)


def greater(x1, x2, /) -> Array:
    """x > y."""
    return elementwise("greater", x1, x2)


def greater_equal(x1, x2, /) -> Array:
    """x >= y."""
    return elementwise("greater_equal", x1, x2)


def logical_and(x1, x2, /) -> Array:
    """Truth value of x AND y."""
    return elementwise("logical_and", x1, x2)


def logical_or(x1, x2, /) -> Array:
    """Truth value of x OR y."""
    return elementwise("logical_or", x1, x2)


def logical_xor(x1, x2, /) -> Array:
    """Truth value of x XOR y."""
    return elementwise("logical_xor", x1, x2)


def bitwise_and(x1, x2, /) -> Array:
    """Bitwise AND of integers or booleans."""
    return elementwise("bitwise_and", x1, x2)


def bitwise_or(x1, x2, /) -> Array:
    """Bitwise OR of integers or booleans."""
    return elementwise("bitwise_or", x1, x2)


def bitwise_xor(x1, x2, /) -> Array:
    """Bitwise XOR of integers or booleans."""
    return elementwise("bitwise_xor", x1, x2)


def left_shift(x1, x2, /) -> Array:
    """x << y (0 once y reaches the bit width)."""
    return elementwise("left_shift", x1, x2)


def right_shift(x1, x2, /) -> Array:
    """x >> y, arithmetic for signed integers."""
    return elementwise("right_shift", x1, x2)



# aliases, as the ops declare them (OpSpec.aliases)
abs = absolute
bitwise_not = invert
true_divide = divide
mod = remainder
pow = power


__all__ = [
    "negative", "positive", "absolute", "exp", "expm1", "log", "log1p", "log2", "log10", "sqrt", "square",
    "reciprocal", "sin", "cos", "tan", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "floor", "ceil",
    "rint", "trunc", "sign", "logical_not", "invert", "isnan", "isinf", "isfinite", "sigmoid", "relu", "erf", "gelu",
    "gelu_tanh", "silu", "softplus", "log_sigmoid", "mish", "leaky_relu", "elu", "add",
    "subtract", "multiply", "divide", "floor_divide", "remainder", "power", "maximum", "minimum", "arctan2",
    "hypot", "logaddexp", "equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "logical_and", "logical_or",
    "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift", "where", "clip", "abs",
    "bitwise_not", "true_divide", "mod", "pow",
]
