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
from goblin_dask.ops.spec import VERIFY_METHODS

EXAMPLES = [(name, i) for name in sorted(catalog()) for i in range(len(example_calls(name, 4, np.random.default_rng(0))))]


def test_catalog_has_at_least_fifty_ops():
    assert len(catalog()) >= 50


@pytest.mark.parametrize("name", sorted(catalog()))
def test_every_op_is_fully_declared(name):
    spec = catalog()[name]
    assert spec.name == name
    assert spec.doc.strip() and "\n" not in spec.doc.strip() and len(spec.doc) < 120
    assert callable(spec.shape_rule) and callable(spec.dtype_rule) and callable(spec.numpy) and callable(spec.cost)
    assert spec.verify in VERIFY_METHODS
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
def test_example_tasks_pass_the_volunteer_allow_list(name, i):
    spec = catalog()[name]
    args, params = example_calls(name, 4, np.random.default_rng(i))[i]
    refs = [TaskRef(f"in-{k}") for k in range(len(args))]
    assert task_violation(CatalogTask(("t-0", 0), spec, *refs, **params)) is None


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
    # fused: where x4 loops, relu x4, sigmoid x2, erf x2; hand-written: moments, 2 layouts x float32/float64
    assert warm_up() == declared + 4 and declared >= 12


def test_product_ops_are_verified_by_freivalds_and_exact_ops_are_integral():
    for name, spec in catalog().items():
        if spec.verify == "exact" and "loop" in spec.extra:
            assert spec.abstract_eval(*[np.ones(2, np.int64)] * spec.arity).dtype.kind in "biu", name
    assert {n for n, s in catalog().items() if s.verify == "freivalds"} >= {"matmul", "matmul_accumulate", "tensordot", "einsum"}
