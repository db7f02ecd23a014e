"""A model's parameters are a kind of lab array of their own (``goblin.minimization.parameters-max-share``).

The per-task cap (``max-share``) protects the lab's dataset; the parameters and buffers of a captured model
or a Trainer round are capped by ``parameters-max-share`` (default null: no per-task cap) and are still in
the exposure account.  The inputs stay data.
"""

from __future__ import annotations

import numpy as np
import pytest

import dask

from goblin_dask.array.linalg import share_limits
from goblin_dask.array.sources import from_numpy_like, lab_array_kinds, lab_arrays
from scheduler_plugins.exposure import parse_lab_array

CAPPED = {"goblin.minimization.parameters-max-share": 0.25}


# -- the array layer ---------------------------------------------------------------------------------

def test_parameters_are_not_capped_by_max_share_unless_set():
    rng = np.random.default_rng(0)
    x = from_numpy_like(rng.standard_normal((512, 64)), 128)                    # data
    w = from_numpy_like(rng.standard_normal((64, 256)), 64, kind="parameters")  # a weight
    assert {k for _, k in lab_array_kinds(x).values()} == {"data"}
    assert {k for _, k in lab_array_kinds(w).values()} == {"parameters"}
    # the data is capped, the weight is not
    assert share_limits(x, w) == ((True, False, 0.25 * x.size),)
    # what carries the weight's elements (an elementwise op of it) is not capped either
    assert share_limits(x, w * 2.0 + 1.0) == ((True, False, 0.25 * x.size),)
    with dask.config.set(CAPPED):
        assert sorted(share_limits(x, w)) == sorted([(True, False, 0.25 * x.size), (False, True, 0.25 * w.size)])
    # the same numbers given as data too: one lab array, data
    w_data = from_numpy_like(np.asarray(w.compute(scheduler="sync")), 64)
    assert w_data.name != w.name
    (aid,) = lab_arrays(w)
    assert lab_array_kinds(w + w_data)[aid][1] == "data"
    assert share_limits(x, w + w_data) == ((True, False, 0.25 * x.size), (False, True, 0.25 * w.size))
    with pytest.raises(ValueError, match="kind"):
        from_numpy_like(np.ones(3), 3, kind="weights")


def test_pieces_of_a_flat_vector_are_one_lab_array_of_their_own():
    """A stage task's parameters cut from the flat vector of all of them (``pieces_array``): one lab task, a
    lab array of its own (its id, its size, the kind given), the pieces' numbers in order; one piece is a view
    of the vector on the lab worker (no copy)."""
    from goblin_dask.array.sources import lab_value, pieces_array

    flat = np.arange(20, dtype=np.float32)
    source = from_numpy_like(flat, -1, kind="parameters")
    both = pieces_array(source, [(2, 5), (10, 14)], kind="parameters")
    (key,) = [k for k, t in dict(both.__dask_graph__()).items() if getattr(t, "func", None) is lab_value]
    task = dict(both.__dask_graph__())[key]
    aid, shape, box, kind = parse_lab_array(task.kwargs["lab_array"])
    assert shape == (7,) and box == ((0, 7),) and kind == "parameters"
    assert lab_array_kinds(both) == {aid: (7, "parameters")} and aid not in lab_arrays(source)
    np.testing.assert_array_equal(both.compute(scheduler="sync"), np.r_[flat[2:5], flat[10:14]])
    assert pieces_array(source, [(2, 5), (10, 14)], kind="parameters").name == both.name  # the same key
    assert pieces_array(source, [(2, 5)], kind="parameters").name != both.name
    assert np.shares_memory(lab_value(flat, (), pieces=((3, 9),)), flat)
    for bad in ([], [(5, 2)], [(0, 21)]):
        with pytest.raises(ValueError):
            pieces_array(source, bad)


def test_lab_array_tuples_are_parsed_strictly():
    assert parse_lab_array(("a1", (4, 6), ((0, 2), (0, 6)))) == ("a1", (4, 6), ((0, 2), (0, 6)), "data")
    assert parse_lab_array(("a1", (4,), ((0, 4),), "parameters"))[3] == "parameters"
    assert parse_lab_array(("a1", (np.int64(4),), ((np.int64(0), np.int64(4)),), "data"))[1] == (4,)
    bad = [None, ["a1", (4,), ((0, 4),)], ("a1", (4,)), ("a1", (4,), ((0, 4),), "parameters", 1),
           ("", (4,), ((0, 4),)), (1, (4,), ((0, 4),)), ("a1", (4,), ((0, 4),), "weights"),
           ("a1", (4,), ((0, 5),)), ("a1", (4,), ((3, 2),)), ("a1", (4, 2), ((0, 4),)), ("a1", (-1,), ((0, 0),)),
           ("a1", (4.0,), ((0, 4),)), ("a1", (4,), ((0.0, 4),)), ("a1", (True,), ((0, 1),)), ("a1", [4], ((0, 4),)),
           ("!invalid", (4,), ((0, 4),))]
    for where in bad:
        with pytest.raises(ValueError):
            parse_lab_array(where)


def test_a_malformed_lab_array_keeps_its_readers_on_the_lab():
    """A source block whose ``lab_array`` does not parse: every volunteer task reading it is the lab's."""
    from types import SimpleNamespace

    from dask._task_spec import DataNode, Task

    from goblin_dask.array.sources import lab_block
    from scheduler_plugins.exposure import INVALID, ExposurePlugin

    plugin = ExposurePlugin(scheduler=None, admission=None)
    ts = SimpleNamespace(key="src", dependencies=(),
                         run_spec=Task("src", lab_block, DataNode(None, np.ones(4)), lab_array=("a1", (4,), ((0, 9),))))
    assert plugin._derive(ts) == ((INVALID, (), None),)
    ts.run_spec = Task("src", lab_block, DataNode(None, np.ones(4)), lab_array=("a1", (4,), ((0, 4),), "parameters"))
    assert plugin._derive(ts) == (("a1", ((0, 4),), (0,)),) and plugin.kinds["a1"] == "parameters"
    ts.run_spec = Task("src", lab_block, DataNode(None, np.ones(4)), lab_array=("a1", (4,), ((0, 4),)))
    plugin._derive(ts)
    assert plugin.kinds["a1"] == "data"  # named data once: data
    ts.run_spec = Task("src", lab_block, DataNode(None, np.ones(4)), lab_array=("a1", (5,), ((0, 4),)))
    assert plugin._derive(ts) == ((INVALID, (), None),)  # one id, two shapes


# -- on a real grid -------------------------------------------------------------------------------------

def _mlp_on_the_grid(config: dict):
    """A captured float64 linear layer (weight 512x256, a lab array of kind parameters) on a data input of
    1024x256, computed on a grid: (input, weight, result, torch's result, report, per volunteer task the
    distinct elements of the input and of the weight its operands hold)."""
    torch = pytest.importorskip("torch")
    from dask.local import get_sync

    import goblin_dask
    from goblin_dask.node.local import LabNode
    from goblin_dask.ops.spec import CatalogTask
    from tests.test_minimization import _pieces

    torch.manual_seed(3)
    model = torch.nn.Linear(256, 512, bias=False).double().eval()
    rng = np.random.default_rng(11)
    x = rng.standard_normal((1024, 256))
    with torch.no_grad():  # distinct float64 values (torch's init is float32's), so operands can be searched
        model.weight.copy_(torch.from_numpy(rng.standard_normal((512, 256)) / 16))
    weight = model.weight.detach().numpy().copy()
    g = goblin_dask.capture(model, (torch.from_numpy(x[:2]),))
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    with dask.config.set(config):
        with dask.config.set(scheduler="sync"):  # built as without a client (the session's grid may be up):
            out = g(x)                           # the blocks travel in the graph, the graph can run here
        dsk = dict(out.__dask_graph__())
        values = dict(zip(dsk, get_sync(dsk, list(dsk))))
        per_task = []
        for t in dsk.values():
            if isinstance(t, CatalogTask) and t.placement == "volunteer":
                held = b"".join(np.ascontiguousarray(values[d]).tobytes() for d in t.dependencies)
                per_task.append((_pieces(held, x)["distinct"], _pieces(held, weight)["distinct"]))
        with LabNode.local(volunteers=1, dashboard=False) as node, node.client.as_current():
            got = out.compute()
            report = node.report()
    return x, weight, got, want, report, per_task


@pytest.mark.slow
def test_captured_weights_go_whole_to_volunteers_and_the_data_stays_capped():
    x, weight, got, want, report, per_task = _mlp_on_the_grid({})
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    assert per_task, "no volunteer task"
    assert sum(v["accepted"] for v in report["volunteers"].values()) >= 1, report
    assert all(v["rejected"] == 0 for v in report["volunteers"].values()), report
    data, weights = [d for d, _ in per_task], [w for _, w in per_task]
    assert 0 < max(data) <= x.size // 4, data              # the data: at most a quarter a task
    assert max(weights) > weight.size // 4, weights        # the weight: more than a quarter
    (exposure,) = report["exposure"].values()
    assert len(exposure) == 2, exposure                    # both in the account


@pytest.mark.slow
def test_parameters_max_share_caps_the_weights_again():
    x, weight, got, want, report, per_task = _mlp_on_the_grid(CAPPED)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    assert per_task, "no volunteer task"
    assert 0 < max(w for _, w in per_task) <= weight.size // 4, per_task
    assert max(d for d, _ in per_task) <= x.size // 4


@pytest.mark.slow
def test_a_trainer_lm_round_sends_products_to_volunteers_with_default_settings():
    """The issue-18 case at a test's size: embedding tables over ``small-array`` carry into the residual
    stream; with the parameters uncapped the products are tiled for the volunteers, not kept on the lab.
    Op by op (stage tasks off): a round of stage tasks sends each micro-batch whole to a volunteer, and with
    the parameters capped it runs op by op (``tests/test_stage_tasks.py``)."""
    torch = pytest.importorskip("torch")
    import copy

    from goblin_dask.node.local import LabNode
    from goblin_dask.training import Trainer
    from tests.test_training import assert_same_training, lm_loss, torch_rounds
    from tests.torch_models import GPT

    vocab, context = 64, 64
    torch.manual_seed(4)
    model = GPT(vocab=vocab, d=128, heads=2, context=context, layers=1).train()
    assert model.tok.weight.numel() > 4096 and model.pos.weight.numel() > 4096
    ref = copy.deepcopy(model)
    rng = np.random.default_rng(5)
    batches = []
    for _ in range(2):
        ids = rng.integers(0, vocab, (16, context + 1), dtype=np.int64)
        batches.append((ids[:, :-1].copy(), ids[:, 1:].copy()))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    with LabNode.local(volunteers=2) as node, dask.config.set({"goblin.stage.tasks": False}):
        trainer = Trainer(model, lm_loss, opt, micro_batches=2, client=node.client)
        with dask.config.set(CAPPED):
            capped = _volunteer_products(trainer.round_graph(*batches[0])[0])
        planned = _volunteer_products(trainer.round_graph(*batches[0])[0])
        history = trainer.fit(batches, progress=False)
        report = node.report()
    assert capped == 0 < planned, (capped, planned)
    assert sum(v["accepted"] for v in report["volunteers"].values()) > 0, report
    assert all(h["verification"]["rejected"] == 0 for h in history)
    assert report["exposure"], report  # the parameters the volunteers received are in the account
    assert_same_training(trainer, [h["loss"] for h in history], ref, torch_rounds(ref, lm_loss, ref_opt, batches, 2),
                         2e-3)


def _volunteer_products(dsk) -> int:
    from goblin_dask.ops.spec import CatalogTask

    return sum(1 for t in dsk.values() if isinstance(t, CatalogTask) and t.placement == "volunteer"
               and t.op.name in ("matmul", "matmul_accumulate"))
