"""Data minimization on the lab node: what may and may not reach a volunteer."""

from __future__ import annotations

import numpy as np
import pytest
from dask._task_spec import DataNode, TaskRef

from goblin_dask.ops import CatalogTask, get
from goblin_dask.validation.checks import insert_checks
from scheduler_plugins.minimization import key_violation, string_violation
from tests.conftest import blocked_product_graph


def test_key_rules():
    assert key_violation(("matmul-0123456789abcdef", 0, 1)) is None
    assert key_violation(("unverified-matmul-0123456789abcdef", 2, 3)) is None
    assert "opaque" in key_violation(("patients-0123456789abcdef", 0))
    assert "opaque" in key_violation("heart_rate")
    assert "non-integer" in key_violation(("matmul-0123456789abcdef", "ward7"))


def test_string_parameter_rules():
    ok = CatalogTask("k", get("einsum"), np.ones((2, 2)), np.ones((2, 2)), subscripts="ij,jk->ik")
    assert string_violation(ok) is None
    bad = CatalogTask("k", get("einsum"), np.ones((2, 2)), np.ones((2, 2)), subscripts="patient names")
    assert "subscripts" in string_violation(bad)


def test_named_data_is_refused_before_it_reaches_a_volunteer(lab):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((4, 3)), rng.standard_normal((3, 2))
    dsk = {"cohort-a": DataNode("cohort-a", a), "cohort-b": DataNode("cohort-b", b),
           ("matmul-0123456789abcdef", 0): CatalogTask(("matmul-0123456789abcdef", 0), get("matmul"),
                                                      TaskRef("cohort-a"), TaskRef("cohort-b"))}
    before = lab.report()["tasks"]
    with pytest.raises(PermissionError, match="cohort-[ab].*data minimization"):
        lab.client.get(insert_checks(dsk), ("matmul-0123456789abcdef", 0))
    assert lab.report()["tasks"] == before  # no volunteer computed anything


def test_opaque_graphs_pass(lab):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((20, 10)), rng.standard_normal((10, 30))
    dsk, keys, _ = blocked_product_graph(a, b, block=10)
    results = lab.client.get(dsk, keys)
    assert len(results) == 6
    np.testing.assert_allclose(results[0], a[:10, :10] @ b[:10, :10])
