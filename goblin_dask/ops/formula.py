"""Custom formulas: a restricted expression language, compiled to one fused kernel.

``compile_formula("a * exp(-b) + c", ["a", "b", "c"])`` parses the text with ``ast``,
accepts only numbers, the given variables, the operators ``+ - * / // % ** & | ^ << >>
~`` and single comparisons (each the op that declares that Python operator), and calls of
the catalog's elementwise ops (``exp``, ``where``, ``clip``, ``sigmoid``, ...; aliases such
as ``abs`` and ``pow`` as the ops declare them), and
returns the canonical text over ``x0..xN`` (``"x0 * exp(-x1) + x2"``): the
researcher's names never travel.  Anything else is a ValueError naming the piece.

The ``formula`` op re-validates the canonical text wherever it runs (a volunteer trusts
no string) and evaluates it with exactly the semantics of the elementwise ops it calls:
NumPy's loop dtypes at every node, Python-number literals "weak" (NEP 50).  Kernels:
- numpy: op by op with the ops' NumPy kernels (the reference);
- numba: one fused ``vectorize`` kernel per (expression, operand dtypes), generated from
  the validated tree only, with explicit casts to every node's loop dtypes so it computes
  in the same precision as NumPy; memoized and cached on disk (see kernels.py);
- cupy: one ``ElementwiseKernel`` from the same tree.
Measured (2M float64): a fused arithmetic formula is ~3x NumPy; one whose time is in
transcendental calls is ~1.4x slower than NumPy's SIMD loops, but still allocates no
temporaries, which is what bounds block sizes on volunteers.
"""

from __future__ import annotations

import ast
import hashlib
import math
import operator
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from goblin_dask.ops._factories import (
    broadcast_shape,
    concrete,
    describe,
    dtype_arg,
    is_weak,
    matrices,
    weak_of,
)
from goblin_dask.ops.registry import MAX_PARAM_STR, register
from goblin_dask.ops.spec import Aval, OpSpec, Replica, elementwise_cost

#: Python's grammar: the operator each AST node is.  Which catalog op an operator means is
#: the op's own declaration (``OpSpec.operator``), as for ga.Array's dunders.
_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor,
    ast.LShift: operator.lshift, ast.RShift: operator.rshift,
}  # fmt: skip
_UNARYOPS = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
_COMPARISONS = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
}  # fmt: skip
_HINTS = {
    ast.BoolOp: "'and'/'or' are not allowed, use logical_and(a, b) / logical_or(a, b)",
    ast.IfExp: "'x if c else y' is not allowed, use where(c, x, y)",
    ast.Attribute: "attribute access is not allowed",
    ast.Subscript: "subscripts are not allowed",
    ast.Lambda: "lambdas are not allowed",
    ast.NamedExpr: "assignments are not allowed",
}


def _op_of(node_type: type) -> str | None:
    """The catalog op an AST operator node means, or None when no op declares that operator."""
    from goblin_dask.ops.registry import by_operator

    python_operator = _BINOPS.get(node_type) or _UNARYOPS.get(node_type) or _COMPARISONS.get(node_type)
    spec = by_operator(python_operator) if python_operator is not None else None
    return spec.name if spec is not None else None


def _node_of(opname: str) -> type | None:
    """The AST operator node that writes op ``opname``, or None (then it is written as a call)."""
    from goblin_dask.ops.registry import get

    python_operator = get(opname).operator
    for table in (_BINOPS, _UNARYOPS, _COMPARISONS):
        for node_type, op in table.items():
            if op is python_operator:
                return node_type
    return None


def _resolve(name: str) -> str:
    """A function name as written in a formula (an alias such as ``abs``) -> the op's name."""
    from goblin_dask.ops.registry import aliases

    return aliases().get(name, name)

# IR: ("x", i) a variable, ("c", number) a literal, ("op", name, (children...)).


def _functions() -> dict[str, OpSpec]:
    """The functions a formula may call: the catalog's elementwise ops."""
    from goblin_dask.ops.registry import catalog

    return {name: spec for name, spec in catalog().items() if spec.elementwise is not None}


def _refuse(what: str, node: ast.AST) -> ValueError:
    return ValueError(f"formula: {what}: {ast.unparse(node)!r}")


def _build(node: ast.AST, names: Sequence[str], functions: dict[str, OpSpec]) -> tuple:
    """Validate ``node`` against the language and turn it into IR."""

    def build(n: ast.AST) -> tuple:
        if isinstance(n, ast.Constant):
            v = n.value
            if type(v) is int:
                if not -(2**63) <= v < 2**63:
                    raise _refuse("integer literal does not fit in int64", n)
                return ("c", v)
            if type(v) is float:
                if not math.isfinite(v):
                    raise _refuse("literal overflows to infinity", n)
                return ("c", v)
            raise _refuse(f"only int and float literals are allowed, not {type(v).__name__}", n)
        if isinstance(n, ast.Name):
            if n.id in names:
                return ("x", names.index(n.id))
            if _resolve(n.id) in functions:
                raise _refuse(f"function {n.id!r} must be called", n)
            raise _refuse(f"unknown name {n.id!r} (variables: {', '.join(names)})", n)
        if isinstance(n, ast.BinOp) and _op_of(type(n.op)) in functions:
            return ("op", _op_of(type(n.op)), (build(n.left), build(n.right)))
        if isinstance(n, ast.UnaryOp) and _op_of(type(n.op)) in functions:
            return ("op", _op_of(type(n.op)), (build(n.operand),))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            raise _refuse("'not' is not allowed, use logical_not(x)", n)
        if isinstance(n, ast.Compare):
            if len(n.ops) != 1:
                raise _refuse("chained comparisons are not allowed, use logical_and", n)
            if _op_of(type(n.ops[0])) not in functions:
                raise _refuse(f"comparison {type(n.ops[0]).__name__} is not allowed", n)
            return ("op", _op_of(type(n.ops[0])), (build(n.left), build(n.comparators[0])))
        if isinstance(n, ast.Call):
            return build_call(n)
        if isinstance(n, (ast.BinOp, ast.UnaryOp)):
            raise _refuse(f"operator {type(n.op).__name__} is not allowed", n)
        raise _refuse(_HINTS.get(type(n), f"{type(n).__name__} is not allowed"), n)

    def build_call(n: ast.Call) -> tuple:
        if not isinstance(n.func, ast.Name):
            raise _refuse(_HINTS.get(type(n.func), "only the allowed functions may be called, by plain name"), n)
        name = _resolve(n.func.id)
        if name not in functions:
            raise _refuse(f"unknown function {n.func.id!r} (allowed: {', '.join(sorted(functions))})", n)
        if n.keywords or any(isinstance(a, ast.Starred) for a in n.args):
            raise _refuse(f"{name} takes positional arguments only", n)
        if len(n.args) != functions[name].arity:
            raise _refuse(f"{name} takes {functions[name].arity} argument(s), got {len(n.args)}", n)
        return ("op", name, tuple(build(a) for a in n.args))

    return build(node)


def _parse(text: str, names: Sequence[str], *, allow_unused: bool = False) -> tuple:
    if not isinstance(text, str):
        raise ValueError(f"formula: expected the expression as a string, got {type(text).__name__}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"formula: not a valid expression: {text!r} ({e.msg})") from None
    functions = _functions()
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"formula: variable name {name!r} is not an identifier")
        if _resolve(name) in functions:
            raise ValueError(f"formula: variable name {name!r} is the name of a function")
    if len(set(names)) != len(names):
        raise ValueError(f"formula: variable names {list(names)} are not unique")
    ir = _build(tree.body, names, functions)
    unused = [names[i] for i in range(len(names)) if not _uses(ir, i)]
    if unused and not allow_unused:
        raise ValueError(f"formula: variable(s) {unused} not used in {text!r}")
    return ir


def _uses(ir: tuple, i: int) -> bool:
    if ir[0] == "x":
        return ir[1] == i
    return ir[0] == "op" and any(_uses(c, i) for c in ir[2])


def _to_ast(ir: tuple) -> ast.expr:
    if ir[0] == "x":
        return ast.Name(f"x{ir[1]}")
    if ir[0] == "c":
        return ast.Constant(ir[1])
    name, args = ir[1], [_to_ast(c) for c in ir[2]]
    node = _node_of(name)
    if node in _BINOPS:
        return ast.BinOp(args[0], node(), args[1])
    if node in _UNARYOPS:
        return ast.UnaryOp(node(), args[0])
    if node in _COMPARISONS:
        return ast.Compare(args[0], [node()], [args[1]])
    return ast.Call(ast.Name(name), args, [])


def compile_formula(text: str, names: Sequence[str]) -> str:
    """Validate ``text`` over variables ``names`` (each used); the canonical expression over x0..xN."""
    names = list(names)
    if not names:
        raise ValueError("formula: needs at least one variable")
    return _canonical(_parse(text, names))


def formula_over(text: str, variables: Sequence[str]) -> tuple[str, list[str]]:
    """The canonical expression over the variables ``text`` uses, and their names in order.

    Variables the expression does not use are left out, as ``numexpr.evaluate(text,
    local_dict=...)`` ignores them (ValueError when it uses none).
    """
    names = list(variables)
    ir = _parse(text, names, allow_unused=True)
    used = [i for i in range(len(names)) if _uses(ir, i)]
    if not used:
        raise ValueError(f"formula: {text!r} uses none of the variables {names}")
    return _canonical(_renumber(ir, {old: new for new, old in enumerate(used)})), [names[i] for i in used]


def _renumber(ir: tuple, numbers: dict[int, int]) -> tuple:
    if ir[0] == "x":
        return ("x", numbers[ir[1]])
    if ir[0] == "op":
        return ("op", ir[1], tuple(_renumber(c, numbers) for c in ir[2]))
    return ir


def _canonical(ir: tuple) -> str:
    canonical = ast.unparse(_to_ast(ir))
    if len(canonical) > MAX_PARAM_STR:
        raise ValueError(f"formula: expression too long ({len(canonical)} > {MAX_PARAM_STR} characters): {canonical!r}")
    return canonical


# -- programs --------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def program(expr: str, nargs: int) -> "Program":
    """The validated program of a canonical expression with ``nargs`` operands."""
    if not isinstance(expr, str) or len(expr) > MAX_PARAM_STR:
        raise ValueError(f"formula: expr must be a string of at most {MAX_PARAM_STR} characters")
    if nargs < 1:
        raise ValueError("formula: needs at least one operand")
    return Program(expr, _parse(expr, [f"x{i}" for i in range(nargs)]), nargs)


class Program:
    """A formula as a list of nodes (operands before users); shared subtrees appear once."""

    def __init__(self, expr: str, ir: tuple, nargs: int):
        self.expr, self.nargs = expr, nargs
        #: regenerated from the validated tree: the only text of the expression that reaches generated code
        self.canonical = ast.unparse(_to_ast(ir))
        self.nodes: list[tuple] = []
        index: dict[str, int] = {}

        def flatten(n: tuple) -> int:
            key = repr(n)  # repr keeps the literals 1 and 1.0 apart
            if key not in index:
                node = n if n[0] != "op" else ("op", n[1], tuple(flatten(c) for c in n[2]))
                index[key] = len(self.nodes)
                self.nodes.append(node)
            return index[key]

        flatten(ir)
        functions = _functions()
        self.specs = [functions[n[1]] if n[0] == "op" else None for n in self.nodes]
        self._typed: dict[tuple, list] = {}
        self._lock = threading.Lock()
        self._compiled: dict[tuple, Any] = {}

    # -- types ---------------------------------------------------------------------
    def typed(self, dargs: tuple) -> list[tuple]:
        """Per node: (loop dtypes or None, dtype argument of its value), NEP 50 throughout."""
        if dargs in self._typed:
            return self._typed[dargs]
        out: list[tuple] = []
        for node, spec in zip(self.nodes, self.specs):
            if node[0] == "x":
                out.append((None, dargs[node[1]]))
            elif node[0] == "c":
                out.append((None, type(node[1])))
            else:
                children = [out[j][1] for j in node[2]]
                try:
                    loop = tuple(np.dtype(d) for d in spec.elementwise.loop(*children))
                except TypeError as e:
                    raise TypeError(f"formula: {spec.name} in {self.expr!r} on ({describe(children)}): {e}") from None
                out.append((loop, weak_of(loop[-1]) if all(map(is_weak, children)) else loop[-1]))
        self._typed[dargs] = out
        return out

    def dargs(self, args: Sequence[Any]) -> tuple:
        if len(args) != self.nargs:
            raise TypeError(f"formula: {self.expr!r} takes {self.nargs} operands, got {len(args)}")
        return tuple(dtype_arg("formula", a) for a in args)

    def result_dtype(self, args: Sequence[Any]) -> np.dtype:
        return concrete(self.typed(self.dargs(args))[-1][1])

    def root_loop(self, args: Sequence[Any]) -> tuple:
        return self.typed(self.dargs(args))[-1][0]

    def flops_per_element(self) -> float:
        return float(sum(spec.elementwise.flops for spec in self.specs if spec is not None))

    # -- evaluation op by op -------------------------------------------------------
    def evaluate(self, args: Sequence[Any], *, keep: bool = False) -> Any:
        """NumPy evaluation with the ops' NumPy kernels (``keep``: return every node's value)."""
        self.dargs(args)  # arity and dtype checks
        values: list[Any] = []
        for node, spec in zip(self.nodes, self.specs):
            if node[0] == "x":
                values.append(args[node[1]])
            elif node[0] == "c":
                values.append(node[1])
            else:
                children = [values[j] for j in node[2]]
                value = spec.numpy(*children)
                if all(type(c) in (int, float, complex) for c in children) and np.ndim(value) == 0:
                    value = np.asarray(value).item() if np.asarray(value).dtype.kind in "ifc" else value
                values.append(value)
        if keep:
            return values
        return np.asarray(values[-1], dtype=self.result_dtype(args)) if np.ndim(values[-1]) == 0 else values[-1]

    def vjp(self, g: Any, args: Sequence[Any]) -> tuple:
        """Cotangents of the operands, by reverse accumulation through the ops' vjps."""
        values = self.evaluate(args, keep=True)
        cot: list[Any] = [None] * len(self.nodes)
        cot[-1] = g
        with np.errstate(invalid="ignore", divide="ignore"):  # partials into literals are dropped
            self._backward(values, cot)
        by_var = {node[1]: cot[k] for k, node in enumerate(self.nodes) if node[0] == "x"}
        return tuple(by_var.get(i) for i in range(self.nargs))

    def _backward(self, values: list, cot: list) -> None:
        for k in range(len(self.nodes) - 1, -1, -1):
            node, spec = self.nodes[k], self.specs[k]
            if node[0] != "op" or cot[k] is None or not callable(spec.grad):
                continue
            for j, c in zip(node[2], spec.grad(cot[k], *(values[j] for j in node[2]))):
                if c is not None and self.nodes[j][0] != "c":
                    cot[j] = c if cot[j] is None else cot[j] + c

    # -- code generation -----------------------------------------------------------
    def _generate(self, dargs: tuple, side: str) -> tuple[list[str], list[np.dtype], np.dtype] | None:
        """Statements computing the formula for ``side`` ("numba" or "cuda"), or None if unsupported."""
        from goblin_dask.ops.elementwise import ctype

        typed = self.typed(dargs)
        inputs = [concrete(d) for d in dargs]
        out = concrete(typed[-1][1])
        supported = set(_SUPPORTED)
        if not {d.name for d in inputs + [out]} <= supported:
            return None
        cast = _numba_cast if side == "numba" else _cuda_cast
        refs: list[str] = []
        have: list[np.dtype | None] = []
        lines: list[str] = []
        for k, (node, spec, (loop, _)) in enumerate(zip(self.nodes, self.specs, typed)):
            if node[0] == "x":
                refs.append(f"x{node[1]}")
                have.append(inputs[node[1]])
                continue
            if node[0] == "c":
                refs.append(repr(node[1]) + ("LL" if side == "cuda" and type(node[1]) is int else ""))
                have.append(None)
                continue
            scalar = spec.elementwise.scalar
            if any(d.name not in supported or d.kind not in scalar.kinds for d in loop):
                return None
            operands = [cast(refs[j], have[j], loop[n]) for n, j in enumerate(node[2])]
            value = cast(scalar.code(side, loop).format(*operands), None, loop[-1])
            lines.append(f"t{k} = {value}" if side == "numba" else f"{ctype(loop[-1])} t{k} = {value};")
            refs.append(f"t{k}")
            have.append(loop[-1])
        lines.append(
            f"return {cast(refs[-1], have[-1], out)}" if side == "numba" else f"y = {cast(refs[-1], have[-1], out)};"
        )
        return lines, inputs, out

    def numba_source(self, dargs: tuple) -> tuple[str, str] | None:
        """(source, signature) of the fused numba kernel for these operand dtypes, or None."""
        generated = self._generate(dargs, "numba")
        if generated is None:
            return None
        lines, inputs, out = generated
        params = ", ".join(f"x{i}" for i in range(self.nargs))
        source = "\n".join(
            [f"# generated by goblin_dask.ops.formula: {self.canonical}", f"# helpers {_helpers_digest()}",
             "import math", "", "import numpy as np", "",
             "import goblin_dask.ops._numba_scalars as _s", "", "", f"def kernel({params}):"]
            + [f"    {line}" for line in lines]
        ) + "\n"  # fmt: skip
        signature = f"{_numba_type(out)}({', '.join(map(_numba_type, inputs))})"
        return source, signature

    def numba_ufunc(self, dargs: tuple) -> np.ufunc | None:
        from goblin_dask.ops.kernels import compile_ufunc

        generated = self.numba_source(tuple(dargs))
        return None if generated is None else compile_ufunc(*generated)

    def cuda_source(self, dargs: tuple) -> tuple[str, str, str] | None:
        """(in_params, out_params, operation) of the cupy ElementwiseKernel, or None."""
        generated = self._generate(dargs, "cuda")
        if generated is None:
            return None
        lines, inputs, out = generated
        in_params = ", ".join(f"{d.name} x{i}" for i, d in enumerate(inputs))
        return in_params, f"{out.name} y", "\n".join(lines)

    def cupy_kernel(self, dargs: tuple) -> Any:
        with self._lock:
            key = ("cuda", dargs)
            if key not in self._compiled:
                source = self.cuda_source(dargs)
                if source is None:
                    self._compiled[key] = None
                else:
                    import cupy

                    digest = hashlib.sha256(repr(source).encode()).hexdigest()[:16]
                    self._compiled[key] = cupy.ElementwiseKernel(
                        *source, name=f"goblin_formula_{digest}", preamble=CUDA_PREAMBLE
                    )
            return self._compiled[key]


@lru_cache(maxsize=1)
def _helpers_digest() -> str:
    """Digest of the scalar helpers: numba's cache does not notice when an inlined callee changes."""
    source = (Path(__file__).with_name("_numba_scalars.py")).read_bytes()
    return hashlib.sha256(source).hexdigest()[:16]


_SUPPORTED = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64",
)  # fmt: skip


def _numba_type(dtype: np.dtype) -> str:
    return "boolean" if dtype.kind == "b" else dtype.name


def _numba_cast(expr: str, have: np.dtype | None, want: np.dtype) -> str:
    if have is not None and have == want:  # (np.dtype == None compares as float64)
        return expr
    return f"({expr} != 0)" if want.kind == "b" else f"np.{want.name}({expr})"


def _cuda_cast(expr: str, have: np.dtype | None, want: np.dtype) -> str:
    from goblin_dask.ops.elementwise import ctype

    if have is not None and have == want:  # (np.dtype == None compares as float64)
        return expr
    return f"(({expr}) != 0)" if want.kind == "b" else f"(({ctype(want)})({expr}))"


#: Device helpers of the generated CUDA kernels, mirroring NumPy's loops (and _numba_scalars).
CUDA_PREAMBLE = r"""
template <typename T> __device__ T goblin_maximum(T a, T b) { return (a > b || a != a) ? a : b; }
template <typename T> __device__ T goblin_minimum(T a, T b) { return (a < b || a != a) ? a : b; }
template <typename T> __device__ T goblin_sign(T x) {
  return x > 0 ? (T)1 : (x < 0 ? (T)-1 : (x == 0 ? (T)0 : x));
}
template <typename T> __device__ T goblin_sigmoid(T x) {
  if (x >= 0) return (T)1 / ((T)1 + exp(-x));
  T e = exp(x);
  return e / ((T)1 + e);
}
template <typename T> __device__ T goblin_silu(T x) { return x * goblin_sigmoid(x); }
template <typename T> __device__ T goblin_gelu(T x) { return x * (T)0.5 * ((T)1 + erf(x * (T)0.70710678118654752440)); }
template <typename T> __device__ T goblin_gelu_tanh(T x) {
  return (T)0.5 * x * ((T)1 + tanh((T)0.79788456080286535588 * (x + (T)0.044715 * (x * x * x))));
}
template <typename T> __device__ T goblin_softplus(T x) { return log1p(exp(-fabs(x))) + goblin_maximum(x, (T)0); }
template <typename T> __device__ T goblin_log_sigmoid(T x) { return goblin_minimum(x, (T)0) - log1p(exp(-fabs(x))); }
template <typename T> __device__ T goblin_mish(T x) { return x * tanh(goblin_softplus(x)); }
template <typename T> __device__ T goblin_leaky_relu(T x, T slope) { return x > 0 ? x : x * slope; }
template <typename T> __device__ T goblin_elu(T x, T alpha) { return x > 0 ? x : alpha * expm1(x); }
template <typename T> __device__ T goblin_logaddexp(T x, T y) {
  if (x == y) return x + (T)0.69314718055994530942;
  T d = x - y;
  if (d > 0) return x + log1p(exp(-d));
  if (d <= 0) return y + log1p(exp(d));
  return d;
}
template <typename T> __device__ T goblin_floor_divide_int(T a, T b) {
  if (b == 0) return (T)0;
  if (b < 0 && b == (T)-1) return (T)(0ULL - (unsigned long long)a);
  T q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1;
  return q;
}
template <typename T> __device__ T goblin_remainder_int(T a, T b) {
  if (b == 0 || (b < 0 && b == (T)-1)) return (T)0;
  T r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}
template <typename T> __device__ T goblin_floor_divide_float(T a, T b) {
  if (b == 0) return a / b;
  T mod = fmod(a, b);
  T div = (a - mod) / b;
  if (mod != 0 && ((b < 0) != (mod < 0))) div -= (T)1;
  if (div == 0) return copysign((T)0, a / b);
  T fl = floor(div);
  if (div - fl > (T)0.5) fl += (T)1;
  return fl;
}
template <typename T> __device__ T goblin_remainder_float(T a, T b) {
  T mod = fmod(a, b);
  if (b == 0) return mod;
  if (mod != 0) { if ((b < 0) != (mod < 0)) mod += b; }
  else mod = copysign((T)0, b);
  return mod;
}
template <typename T> __device__ T goblin_power_int(T a, T b) {
  if (b < 0) return (T)0;
  T result = 1;
  unsigned long long e = (unsigned long long)b;
  while (e) { if (e & 1) result = (T)(result * a); a = (T)(a * a); e >>= 1; }
  return result;
}
template <typename T> __device__ T goblin_left_shift(T a, T b, int bits) {
  return (b < 0 || b >= bits) ? (T)0 : (T)(a << b);
}
template <typename T> __device__ T goblin_right_shift(T a, T b, int bits) {
  return (b < 0 || b >= bits) ? (a < 0 ? (T)-1 : (T)0) : (T)(a >> b);
}
"""


# -- the op ------------------------------------------------------------------------------


def evaluate_formula_numpy(*operands: Any, expr: str) -> Any:
    """Reference kernel: the formula op by op with the elementwise ops' NumPy kernels."""
    return program(expr, len(operands)).evaluate(operands)


def evaluate_formula_numba(*operands: Any, expr: str) -> Any:
    """One fused numba kernel (op by op in NumPy for dtypes numba does not compute in)."""
    prog = program(expr, len(operands))
    dargs = prog.dargs(operands)
    ufunc = prog.numba_ufunc(dargs)
    if ufunc is None:
        return prog.evaluate(operands)
    signature = tuple(concrete(d) for d in dargs) + (concrete(prog.typed(dargs)[-1][1]),)
    return ufunc(*operands, signature=signature, casting="unsafe")


def evaluate_formula_cupy(*operands: Any, expr: str) -> Any:
    """One cupy ElementwiseKernel; dtypes CUDA lacks (float16, complex) run in NumPy on the host."""
    import cupy

    prog = program(expr, len(operands))
    kernel = prog.cupy_kernel(prog.dargs(operands))
    if kernel is None:
        host = [cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else a for a in operands]
        return cupy.asarray(prog.evaluate(host))
    return kernel(*operands)


def _formula_shape(*avals: Aval, expr: str) -> tuple[int, ...]:
    program(expr, len(avals))
    return broadcast_shape("formula", *avals)


def _formula_dtype(*avals: Aval, expr: str) -> np.dtype:
    return program(expr, len(avals)).result_dtype(avals)


def _formula_cost(*avals: Aval, expr: str):
    return elementwise_cost(*avals, flops_per_element=program(expr, len(avals)).flops_per_element())


def _formula_vjp(g: Any, *operands: Any, expr: str) -> tuple:
    return program(expr, len(operands)).vjp(g, operands)


formula = register(
    OpSpec(
        name="formula",
        doc="A validated elementwise expression over x0..xN, computed by one fused kernel.",
        shape_rule=_formula_shape,
        dtype_rule=_formula_dtype,
        numpy=evaluate_formula_numpy,
        numba=evaluate_formula_numba,
        cupy=evaluate_formula_cupy,
        cost=_formula_cost,
        verify=Replica(),
        grad=_formula_vjp,
        params=("expr",),
        # the canonical text compile_formula writes: variables x0..xN, op names, numbers
        text_params={"expr": r"[x0-9a-z_+\-*/%().,<>=!&|~ e]*"},
        examples=lambda n, rng, dtype: [
            (tuple(matrices(n, rng, dtype)), {"expr": "x0 * exp(-x1) + x0 / (1 + x1 * x1)"}),
            (tuple(matrices(n, rng, dtype)), {"expr": "where(x0 > x1, sigmoid(x0), tanh(x1))"}),
        ],
    )
)
