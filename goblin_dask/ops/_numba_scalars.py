"""Scalar helpers the generated numba kernels call, where NumPy's meaning differs from numba's.

Each mirrors NumPy's C loop for one element (NaN propagation of maximum/minimum, integer
division by zero and by -1, shifts past the bit width, the sign of zero), so that a fused
kernel gives NumPy's numbers.  Imported only while compiling a kernel.  Every branch returns the same numba type
(mixing uint64 with int64 would make numba compute in float64 and lose bits).
"""

import math

import numba
import numpy as np

_jit = numba.njit(cache=True, inline="always")


@_jit
def maximum(a, b):
    return a if (a > b or a != a) else b  # b on ties: maximum(-0.0, 0.0) is 0.0, as in NumPy


@_jit
def minimum(a, b):
    return a if (a < b or a != a) else b


@_jit
def floor_divide_int(a, b):
    if b == 0:
        return a - a
    if b == -1:
        return -a
    return a // b


@_jit
def floor_divide_uint(a, b):
    return a - a if b == 0 else a // b


@_jit
def remainder_int(a, b):
    if b == 0 or b == -1:
        return a - a
    return a % b


@_jit
def remainder_uint(a, b):
    return a - a if b == 0 else a % b


@_jit
def power_int(a, b, one):
    # square-and-multiply in the loop's integer type (wraps like NumPy); b < 0 gives 0
    result = one
    base = a
    e = np.int64(b)
    if e < 0:
        return one - one
    while e > 0:
        if e & 1:
            result = result * base
        base = base * base
        e = e >> 1
    return result


@_jit
def left_shift(a, b, bits):
    if b < 0 or b >= bits:
        return a - a
    return a << b


@_jit
def right_shift(a, b, bits):
    if b < 0 or b >= bits:
        return ~(a - a) if a < 0 else a - a
    return a >> b


@_jit
def sign(x):
    if x > 0:
        return 1
    if x < 0:
        return -1
    if x == 0:
        return 0
    return x


@_jit
def sigmoid(x):
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


# -- activations (the NumPy kernels are in elementwise.py) ---------------------------------


@_jit
def gelu(x):
    return x * 0.5 * (1.0 + math.erf(x * 0.7071067811865476))


@_jit
def gelu_tanh(x):
    return 0.5 * x * (1.0 + math.tanh(0.7978845608028654 * (x + 0.044715 * (x * x * x))))


@_jit
def softplus(x):
    return math.log1p(math.exp(-abs(x))) + maximum(x, 0.0)


@_jit
def log_sigmoid(x):
    return minimum(x, 0.0) - math.log1p(math.exp(-abs(x)))


@_jit
def silu(x):
    return x * sigmoid(x)


@_jit
def mish(x):
    return x * math.tanh(softplus(x))


@_jit
def leaky_relu(x, slope):
    return x if x > 0 else x * slope


@_jit
def elu(x, alpha):
    return x if x > 0 else alpha * math.expm1(x)


@_jit
def logaddexp(x, y):
    # NumPy's npy_logaddexp: equal arguments (both infinite too) add log(2)
    if x == y:
        return x + 0.6931471805599453
    d = x - y
    if d > 0:
        return x + math.log1p(math.exp(-d))
    if d <= 0:
        return y + math.log1p(math.exp(d))
    return d
