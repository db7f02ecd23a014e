"""Custom formulas: the language, its refusals, and the fused kernels against NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from goblin_dask.ops import Aval, get
from goblin_dask.ops import kernels as kernels_module
from goblin_dask.ops.formula import (
    compile_formula,
    evaluate_formula_numba,
    evaluate_formula_numpy,
    program,
)

RNG = np.random.default_rng(5)
FORMULA = get("formula")


@pytest.mark.parametrize(
    "text, names, canonical",
    [("a * exp(-b) + c", "abc", "x0 * exp(-x1) + x2"),
     ("  (alpha+beta)  *  (alpha-beta) ", ["alpha", "beta"], "(x0 + x1) * (x0 - x1)"),
     ("abs(x) ** 2 // 3 % 2", ["x"], "absolute(x0) ** 2 // 3 % 2"),
     ("pow(x, 0.5)", ["x"], "x0 ** 0.5"),
     ("where(x > 0, x, 0.1 * x)", ["x"], "where(x0 > 0, x0, 0.1 * x0)"),
     ("clip(u, -1, 1) + maximum(u, v) - minimum(u, v)", ["u", "v"], "clip(x0, -1, 1) + maximum(x0, x1) - minimum(x0, x1)"),
     ("~i & j | i ^ j << 2 >> 1", ["i", "j"], "~x0 & x1 | x0 ^ x1 << 2 >> 1"),
     ("-x0 + +x1", ["x1", "x0"], "-x1 + +x0"),
     ("sigmoid(t) * erf(t) + relu(t) + logical_not(isnan(t))", ["t"], "sigmoid(x0) * erf(x0) + relu(x0) + logical_not(isnan(x0))"),
     ("1e-3 * y + 2", ["y"], "0.001 * x0 + 2")],
)  # fmt: skip
def test_compile_formula_gives_canonical_text_over_x_names(text, names, canonical):
    assert compile_formula(text, names) == canonical
    assert compile_formula(canonical, [f"x{i}" for i in range(len(names))]) == canonical


@pytest.mark.parametrize(
    "text, message",
    [("np.exp(a)", "attribute access"), ("a[0]", "subscripts"), ("(lambda q: q)(a)", "lambdas"),
     ("eval('1')", "unknown function 'eval'"), ("__import__('os')", "unknown function '__import__'"),
     ("open(a)", "unknown function"), ("a.real", "attribute"), ("'s' + a", "only int and float literals"),
     ("a + c", "unknown name 'c'"), ("a and b", "logical_and"), ("not a", "logical_not"), ("a if b else 1", "where"),
     ("a < b < 1", "chained"), ("a in b", "comparison In"), ("a is b", "comparison Is"), ("a @ b", "operator MatMult"),
     ("exp(a)(b)", "only the allowed functions"), ("exp(a, b)", "exp takes 1 argument"), ("exp(x=a) + b", "positional"), ("exp(*a) + b", "positional"),
     ("exp + a + b", "must be called"), ("a + b + True", "only int and float literals"), ("a + b + 1j", "only int and float"),
     ("a + b + 99999999999999999999", "does not fit in int64"), ("a + b + 1e999", "infinity"), ("a = b", "not a valid expression"),
     ("a +", "not a valid expression"), ("(a := b)", "assignments"), ("[a, b]", "List is not allowed"), ("a", "not used"),
     ("f'{a}' + b", "JoinedStr"), ("a + b;", "not a valid expression")],
)  # fmt: skip
def test_refusals_name_the_offending_piece(text, message):
    with pytest.raises(ValueError, match=message):
        compile_formula(text, ["a", "b"])


@pytest.mark.parametrize(
    "names, message",
    [(["a", "a"], "not unique"), (["exp"], "name of a function"), (["1x"], "not an identifier"), ([], "at least one")],
)
def test_bad_variable_names(names, message):
    with pytest.raises(ValueError, match=message):
        compile_formula("1", names)


def test_long_formulas_are_refused_before_they_travel():
    with pytest.raises(ValueError, match="too long"):
        compile_formula(" + ".join(["a"] * 200), ["a"])


def test_the_op_revalidates_the_expression_it_receives():
    x = np.ones(3)
    for expr in ("__import__('os').system('true')", "x0.real", "x2 + x0", "exp(x0) if x0 else x1"):
        with pytest.raises(ValueError, match="formula"):
            FORMULA.abstract_eval(x, x, expr=expr)
        with pytest.raises(ValueError, match="formula"):
            FORMULA(x, x, expr=expr)


EXPRESSIONS = [
    ("x0 * exp(-x1) + x2", 3),
    ("where(x0 > x1, sigmoid(x0), tanh(x1)) * 0.5", 2),
    ("(x0 - x1) ** 2 / (1 + x2 * x2)", 3),
    ("clip(x0, -0.5, 0.5) + relu(x1) - erf(x0 * x1)", 2),
    ("x0 // 2 + x1 % 3 - floor(x0) * sign(x1)", 2),
    ("hypot(x0, x1) + arctan2(x1, x0) + sqrt(absolute(x0))", 2),
    ("(x0 > 0) * x1 + logical_and(x0 < 1, x1 > -1)", 2),
    ("x0 * (2 * 3) + 0.1 * 3 * x1", 2),
    ("maximum(x0, x1) + minimum(x0, 0)", 2),
]


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
@pytest.mark.parametrize("expr, n", EXPRESSIONS)
def test_fused_kernel_matches_numpy_and_float64_reference(expr, n, dtype):
    if dtype == "int64":
        args = [RNG.integers(1, 9, size=(4, 5)) for _ in range(n)]
    else:
        args = [RNG.uniform(-2, 2, size=(4, 5)).astype(dtype) for _ in range(n)]
    with np.errstate(all="ignore"):
        want = evaluate_formula_numpy(*args, expr=expr)
        got = evaluate_formula_numba(*args, expr=expr)
        ref = evaluate_formula_numpy(*[a.astype(np.float64) for a in args], expr=expr)
    assert FORMULA.abstract_eval(*args, expr=expr) == Aval(want.shape, want.dtype)
    assert got.dtype == want.dtype
    eps = float(np.finfo(want.dtype).eps) if want.dtype.kind == "f" else 0.0
    np.testing.assert_allclose(got, want, rtol=16 * eps, atol=16 * eps * max(1.0, float(np.abs(want).max())))
    if want.dtype.kind == "f":
        np.testing.assert_allclose(want, ref, rtol=1e4 * eps, atol=1e4 * eps * max(1.0, float(np.abs(ref).max())))


@pytest.mark.parametrize(
    "args, expr, dtype",
    [((np.ones(3, np.float32), 2.0), "x0 * x1", np.float32),  # weak Python scalar operand
     ((np.ones(3, np.float32), np.float64(2.0)), "x0 * x1", np.float64),
     ((np.ones(3, np.float32),), "x0 * 2.5 + 1", np.float32),  # weak literals
     ((np.ones(3, np.int8),), "x0 * 3 + 1", np.int8),
     ((np.ones(3, np.int8),), "x0 / 2", np.float64),
     ((np.ones(3, np.int16),), "exp(x0)", np.float32),
     ((np.ones(3, np.int8),), "sqrt(x0) + 1", np.float16),  # no numba float16: evaluated op by op
     ((np.ones(3, np.complex128),), "exp(x0) * 2", np.complex128),
     ((np.ones(3, bool), np.ones(3, bool)), "x0 & x1 | (x0 == x1)", np.bool_),
     ((np.ones(3, np.uint64), 1), "x0 + x1 - (x0 << 2)", np.uint64)],
)  # fmt: skip
def test_nep50_dtypes_through_the_formula(args, expr, dtype):
    assert FORMULA.abstract_eval(*args, expr=expr).dtype == dtype
    assert evaluate_formula_numpy(*args, expr=expr).dtype == dtype
    out = evaluate_formula_numba(*args, expr=expr)
    assert out.dtype == dtype
    np.testing.assert_allclose(out, evaluate_formula_numpy(*args, expr=expr), rtol=1e-6)


def test_uint64_keeps_all_bits():
    x = np.array([2**64 - 1, 2**63 + 12345], dtype=np.uint64)
    expr = "maximum(x0, 1) // 1 + relu(x0) % 7 - x0"
    np.testing.assert_array_equal(evaluate_formula_numba(x, expr=expr), evaluate_formula_numpy(x, expr=expr))


def test_formula_broadcasts_and_handles_edge_shapes():
    for shapes in [((3, 1), (1, 4)), ((0, 3), (3,)), ((), ()), ((1,), (2, 1))]:
        args = [RNG.standard_normal(s) for s in shapes]
        out = FORMULA(*args, expr="x0 * x1 + 1")
        assert np.shape(out) == np.broadcast_shapes(*shapes) == FORMULA.abstract_eval(*args, expr="x0 * x1 + 1").shape


def test_formula_errors():
    with pytest.raises(ValueError, match=r"formula: shapes \(2,\) and \(3,\)"):
        FORMULA.abstract_eval(np.ones(2), np.ones(3), expr="x0 + x1")
    with pytest.raises(TypeError, match="formula: bitwise_and"):
        FORMULA.abstract_eval(np.ones(2), np.ones(2), expr="x0 & x1")
    with pytest.raises(TypeError, match="formula: unsupported dtype"):
        FORMULA.abstract_eval(np.array(["a"]), expr="x0 + 1")


def test_kernels_are_memoized_per_expression_and_dtypes():
    prog = program("x0 * x1 - 1", 2)
    f32 = (np.dtype("float32"), np.dtype("float32"))
    assert prog.numba_ufunc(f32) is prog.numba_ufunc(f32)
    assert prog.numba_ufunc(f32) is not prog.numba_ufunc((np.dtype("float64"), np.dtype("float32")))
    assert program("x0 * x1 - 1", 2) is prog


def test_generated_source_comes_from_the_validated_tree():
    source, signature = program("x0 * exp(-x1) + 2", 2).numba_source((np.dtype("float32"), float))
    assert signature == "float32(float32, float64)"
    assert "t2 = np.float64((-x1))" in source  # -x1 of a Python float is a Python float (NEP 50) ...
    assert "np.float32(t3)" in source  # ... that takes x0's precision
    assert "def kernel(x0, x1):" in source and "import os" not in source


def test_generated_source_never_holds_the_received_text():
    expr = "(x0 +\n exp(x0)) * \\\n 2"  # valid, but with line breaks
    source, _ = program(expr, 1).numba_source((np.dtype("float64"),))
    assert source.splitlines()[0] == "# generated by goblin_dask.ops.formula: (x0 + exp(x0)) * 2"
    np.testing.assert_allclose(evaluate_formula_numba(np.ones(2), expr=expr), (1 + np.e) * 2)


def test_tampered_kernel_files_are_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels_module, "kernel_dir", lambda: tmp_path)
    source = "def kernel(x0):\n    return x0\n"
    kernels_module._load_source(source)
    (path,) = tmp_path.glob("goblin_kernel_*.py")
    path.write_text(source + "import os\n")
    kernels_module._load_source(source)  # rewritten from the generated source, not run as found
    assert path.read_text() == source


def test_cuda_source_is_generated_for_supported_dtypes():
    prog = program("where(x0 > 0, x0 // 2, sigmoid(x1)) + (x0 << 1)", 2)
    in_params, out_params, operation = prog.cuda_source((np.dtype("int32"), np.dtype("float32")))
    assert in_params == "int32 x0, float32 x1" and out_params == "float64 y"
    assert "goblin_floor_divide_int" in operation and "goblin_sigmoid" in operation and "goblin_left_shift" in operation
    assert operation.rstrip().endswith(";") and "y = " in operation
    assert prog.cuda_source((np.dtype("int16"), np.dtype("float16"))) is None  # no float16 kernels


def test_formula_vjp_matches_finite_differences():
    expr = "x0 * exp(-x1) + sigmoid(x0 * x1) - x1 ** 2"
    x, y = RNG.standard_normal((3, 4)), RNG.standard_normal(4)
    g = RNG.standard_normal((3, 4))
    gx, gy = FORMULA.grad(g, x, y, expr=expr)
    h = 1e-6
    for ct, i in ((gx, 0), (gy, 1)):
        v = RNG.standard_normal(np.shape([x, y][i]))
        plus = [x + h * v, y] if i == 0 else [x, y + h * v]
        minus = [x - h * v, y] if i == 0 else [x, y - h * v]
        numeric = np.sum(g * (FORMULA(*plus, expr=expr) - FORMULA(*minus, expr=expr))) / (2 * h)
        assert np.isclose(np.sum(ct * v), numeric, rtol=1e-5)


def test_cost_counts_every_node():
    a = Aval((10, 10), np.dtype("f8"))
    assert FORMULA.cost_of(a, a, expr="x0 * x1 + x0").flops == 200
    assert FORMULA.cost_of(a, expr="exp(x0)").flops == 2000
