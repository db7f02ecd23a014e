"""Catalog invariants: every op is fully declared, runs as declared, and travels by name."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
from dask._task_spec import TaskRef

from goblin_dask.ops import Aval, CatalogTask, Cost, catalog, task_violation, warm_up
from goblin_dask.ops._samples import example_calls
from goblin_dask.ops.spec import Exact, Freivalds, OpSpec, Recompute, Replica, Verification
from goblin_dask.validation.checks import judge

EXAMPLES = [(name, i) for name in sorted(catalog()) for i in range(len(example_calls(name, 4, np.random.default_rng(0))))]


def test_catalog_has_at_least_fifty_ops():
    assert len(catalog()) >= 50


@pytest.mark.parametrize("name", sorted(catalog()))
def test_every_op_is_fully_declared(name):
    spec = catalog()[name]
    assert spec.name == name
    assert spec.doc.strip() and "\n" not in spec.doc.strip() and len(spec.doc) < 120
    assert callable(spec.shape_rule) and callable(spec.dtype_rule) and callable(spec.numpy) and callable(spec.cost)
    assert isinstance(spec.verify, Verification)
    assert spec.placement == ("lab" if spec.verify.lab_only else "volunteer")
    assert spec.elementwise is not None or spec.examples is not None, f"{name} declares no examples"
    assert spec.combine is None or spec.combine in catalog()
    assert spec.grad is None or callable(spec.grad) or spec.grad in ("linear", "bilinear")
    assert isinstance(spec.params, tuple)


@pytest.mark.parametrize("name, i", EXAMPLES)
def test_every_op_runs_as_its_rules_say(name, i):
    """Rules on abstract values agree with what the NumPy kernel returns, and the cost is a Cost."""
    spec = catalog()[name]
    args, params = example_calls(name, 4, np.random.default_rng(i))[i]
    with np.errstate(all="ignore"):
        out = np.asarray(spec.numpy(*args, **params))
        kernel_out = np.asarray(spec(*args, **params))
    assert spec.abstract_eval(*args, **params) == Aval(out.shape, out.dtype)
    assert kernel_out.dtype == out.dtype and kernel_out.shape == out.shape
    cost = spec.cost_of(*args, **params)
    assert isinstance(cost, Cost) and cost.flops >= 0 and cost.bytes > 0


@pytest.mark.parametrize("name, i", EXAMPLES)
def test_volunteer_allow_list_holds_exactly_the_volunteer_ops(name, i):
    spec = catalog()[name]
    args, params = example_calls(name, 4, np.random.default_rng(i))[i]
    refs = [TaskRef(f"in-{k}") for k in range(len(args))]
    why = task_violation(CatalogTask(("t-0", 0), spec, *refs, placement="volunteer", **params))
    if spec.placement == "volunteer":
        assert why is None
    else:
        assert f"op {name} runs on the lab worker only" in why


@pytest.mark.parametrize("name, i", EXAMPLES)
def test_every_ops_verification_runs_accepting_honest_and_rejecting_tampered_results(name, i):
    """An op whose declared verification cannot run on its own examples fails here."""
    spec = catalog()[name]
    args, params = example_calls(name, 8, np.random.default_rng(i))[i]
    with np.errstate(all="ignore"):
        honest = np.asarray(spec.kernel("cpu")(*args, **params))
        assert judge(spec, args, params, honest)
        if honest.size == 0:
            return
        tampered = honest.copy()
        flat = tampered.reshape(-1)
        if tampered.dtype.kind == "b":
            flat[0] = ~flat[0]
        elif tampered.dtype.kind in "iu":
            flat[0] += 1
        else:
            flat[0] = flat[0] + 1.0 + 10 * abs(flat[0])
        assert not judge(spec, args, params, tampered)
        assert not judge(spec, args, params, honest.astype(np.complex128))  # the wrong dtype
        assert not judge(spec, args, params, honest.reshape(-1)[:-1])  # the wrong shape


def test_text_reaches_volunteers_only_in_declared_parameters_and_grammars():
    from goblin_dask.ops import get

    ref = TaskRef("in-0")
    assert task_violation(CatalogTask(("t", 0), get("einsum"), ref, ref, subscripts="ij,jk->ik")) is None
    assert "not in its grammar" in task_violation(CatalogTask(("t", 0), get("einsum"), ref, ref, subscripts="ij,jk->ik; rm"))
    assert task_violation(CatalogTask(("t", 0), get("sum"), ref, axis=(0,), dtype="float32")) is None
    assert "not in its grammar" in task_violation(CatalogTask(("t", 0), get("sum"), ref, dtype="patient_id"))
    assert "carries text" in task_violation(CatalogTask(("t", 0), get("sum"), ref, axis=("alice",)))
    assert "text is no operand" in task_violation(CatalogTask(("t", 0), get("exp"), "alice"))
    for spec in catalog().values():
        assert set(spec.text_params) <= set(spec.params), spec.name


def test_declarations_are_typed():
    rules = dict(shape_rule=lambda x: x.shape, dtype_rule=lambda x: x.dtype, numpy=np.negative)
    with pytest.raises(TypeError, match="must be a Verification"):
        OpSpec("bad_op", "A bad op.", verify="replica", **rules)
    with pytest.raises(TypeError, match="needs a callable"):
        Freivalds(form=None)
    with pytest.raises(ValueError, match="runs on the lab only"):
        OpSpec("bad_op", "A bad op.", verify=Exact(), placement="volunteer", **rules)
    assert OpSpec("ok_op", "An op.", verify=Recompute(), **rules).placement == "lab"
    assert OpSpec("ok_op", "An op.", **rules).verify == Replica()


def test_aliases_and_operators_come_from_the_declarations():
    import operator

    from goblin_dask.ops import get
    from goblin_dask.ops.registry import aliases, by_operator

    assert get("abs") is get("absolute") and get("pow") is get("power") and get("true_divide") is get("divide")
    assert aliases()["mod"] == "remainder"
    assert by_operator(operator.add) is get("add") and by_operator(operator.matmul) is get("matmul")
    assert by_operator(operator.concat) is None
    operators = [s.operator for s in catalog().values() if s.operator is not None]
    assert len(operators) == len(set(operators)) >= 23


def test_ops_pickle_by_name():
    for spec in catalog().values():
        assert pickle.loads(pickle.dumps(spec)) is spec
        assert len(pickle.dumps(spec)) < 200


def test_import_is_fast_and_compiles_nothing():
    code = (
        "import time, sys; t = time.perf_counter(); import goblin_dask.ops; "
        "print(time.perf_counter() - t, 'numba' in sys.modules, 'cupy' in sys.modules)"
    )
    seconds, numba, cupy = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert (numba, cupy) == ("False", "False")
    assert float(seconds) < 2.0


def test_warm_up_compiles_every_numba_kernel():
    from goblin_dask.ops.kernels import _FUSED_KERNELS

    declared = sum(len(k.loops) for k in _FUSED_KERNELS)
    # fused: where x4 loops, relu x4, sigmoid x2, erf x2, gelu x2, silu x2, leaky_relu x2; hand-written: moments, 2 layouts x float32/float64
    assert warm_up() == declared + 4 and declared >= 12


def test_product_ops_are_verified_by_freivalds_and_exact_ops_are_integral():
    for name, spec in catalog().items():
        if isinstance(spec.verify, Exact) and spec.elementwise is not None:
            assert spec.abstract_eval(*[np.ones(2, np.int64)] * spec.arity).dtype.kind in "biu", name
    freivalds = {n for n, s in catalog().items() if isinstance(s.verify, Freivalds)}
    assert freivalds >= {"matmul", "matmul_accumulate", "tensordot", "einsum"}
