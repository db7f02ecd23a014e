"""Issue 17 (scale): a captured model's large products are tiled across volunteers.

A Linear layer whose whole product (input, weight and result) is several times the per-task
budget the blocked product gives a volunteer (``goblin.product.volunteer-memory`` x
``memory-fraction``) is computed on the embedded grid as many product tasks, each within the
budget, each verified by Freivalds on the lab, and the numbers are torch's.  So is its conv2d
layer (about 400 KB in one task): cut by images and output channels until a task's input,
filters, im2col patches and output fit the budget.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dask  # noqa: E402
from dask.core import flatten  # noqa: E402

import goblin_dask  # noqa: E402
from goblin_dask import settings  # noqa: E402
from goblin_dask.ops import CatalogTask  # noqa: E402
from goblin_dask.ops.spec import Aval  # noqa: E402
from tests.test_capture_models import close, outputs, reference  # noqa: E402

PRODUCTS = ("matmul", "matmul_accumulate", "conv2d")
BATCH, IN, OUT = 384, 256, 192
IMG = (4, 8, 32, 32)


class LinearAndConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(IN, OUT)
        self.conv = torch.nn.Conv2d(IMG[1], 16, 3, padding=1)

    def forward(self, x, img):
        return torch.relu(self.fc(x)), self.conv(img)


def product_task_bytes(array) -> list[tuple[str, str, int]]:
    """(op, placement, operands + result bytes) of each product task of ``array``'s optimized graph.

    The blocks' shapes come from evaluating the graph locally (sync); the result's from the op's abstract_eval.
    """
    keys = list(flatten(array.__dask_keys__()))
    graph = dict(array.__dask_optimize__(array.__dask_graph__(), keys))
    values = dict(zip(graph, dask.get(graph, list(graph))))
    rows = []
    for task in graph.values():
        if isinstance(task, CatalogTask) and task.op.name in PRODUCTS:
            avals = [Aval.of(values[a.key]) for a in task.args]
            out = task.op.abstract_eval(*avals, **task.kwargs)
            rows.append((task.op.name, task.placement, sum(a.nbytes for a in avals) + out.nbytes))
    return rows


def _volunteer_accepted(report) -> int:
    return sum(v["accepted"] for v in report["volunteers"].values())


def _captured(seed: int):
    """LinearAndConv captured on random inputs: (x, img, the graph, torch's outputs)."""
    torch.manual_seed(0)
    model = LinearAndConv().eval()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, IN)).astype(np.float32)
    img = rng.standard_normal(IMG).astype(np.float32)
    return x, img, goblin_dask.capture(model, (torch.from_numpy(x), torch.from_numpy(img))), reference(model, x, img)


def test_layers_larger_than_a_volunteers_budget_are_tiled_and_verified(lab):
    x, img, g, want = _captured(17)

    with dask.config.set({"goblin.product.volunteer-memory": "1MB", "goblin.placement.min-flops": 0,
                          "goblin.placement.min-product-intensity": 0,
                          "goblin.placement.min-intensity": 0}):
        budget = dask.utils.parse_bytes("1MB") * float(settings.get("goblin.product.memory-fraction"))
        whole = 4 * (BATCH * IN + IN * OUT + BATCH * OUT)
        assert whole > 3 * budget  # the layer's product does not fit one volunteer task

        linear, conv = outputs(g(x, img))
        rows = product_task_bytes(linear)
        ops = Counter(op for op, _, _ in rows)
        # output blocks and inner steps; the Linear's bias enters each block's first step (matmul_accumulate)
        assert ops["matmul_accumulate"] >= 8 and set(ops) <= {"matmul", "matmul_accumulate"}, ops
        on_volunteers = [(op, nbytes) for op, place, nbytes in rows if place == "volunteer"]
        assert len(on_volunteers) == len(rows) >= 8
        assert all(nbytes <= budget for _, nbytes in on_volunteers), (budget, on_volunteers)
        conv_rows = product_task_bytes(conv)
        assert len(conv_rows) >= 2 and all(op == "conv2d" and place == "volunteer" for op, place, _ in conv_rows)
        assert all(nbytes <= budget for _, _, nbytes in conv_rows), (budget, conv_rows)
        on_volunteers += [(op, nbytes) for op, _, nbytes in conv_rows]

        before = lab.report()
        got = [linear.compute(), conv.compute()]
        after = lab.report()
    close(got, want)

    assert after["rejected"] == before["rejected"] == 0
    assert all(v["rejected"] == 0 for v in after["volunteers"].values())
    assert _volunteer_accepted(after) - _volunteer_accepted(before) >= len(on_volunteers)
    assert after["by_method"].get("freivalds", 0) - before["by_method"].get("freivalds", 0) >= len(on_volunteers)
    assert sum(after["by_method"].values()) == after["accepted"]


def test_a_captured_graph_follows_the_client_it_is_computed_with(lab, tmp_path):
    """The parameters go to the lab worker of the client in use at each call: a graph first called under
    one lab node and then under another gives the second its own copies (the first's keys do not exist
    there: computing with them would fail with lost dependencies)."""
    from distributed import Future

    from goblin_dask.array.sources import lab_block
    from goblin_dask.node.local import LabNode

    x, img, g, want = _captured(29)

    def copies(out) -> set:
        return {t.args[0].key for o in outputs(out) for t in dict(o.__dask_graph__()).values()
                if getattr(t, "func", None) is lab_block and t.args and isinstance(t.args[0], Future)}

    with lab.client.as_current():
        first = g(x, img)
        close([o.compute() for o in outputs(first)], want)
    with LabNode.local(volunteers=0, state_dir=tmp_path / "other", dashboard=False) as other, \
            other.client.as_current():
        second = g(x, img)
        assert copies(first) and copies(second) and not copies(first) & copies(second)
        close([o.compute() for o in outputs(second)], want)
