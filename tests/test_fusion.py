"""Fused chains of lab-only tasks (``goblin_dask.array.graph.fuse_lab_chains``, ``goblin.graph.fuse-lab-chains``).

The fused graph computes what the unfused one does (ga expressions against numpy in float64, a captured
GPT against itself unfused and against torch); only lab-placed catalog tasks are fused, never a volunteer
task, a check, an ``unverified-`` task or a source block; a fused chain is refused by a volunteer's
allow-list and never reaches one; and on a real local grid the exposure account and the verified work are
the same with fusion on and off (the exposure plugin follows lineage through the chain's steps).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import dask
import goblin_dask.array as ga
from dask._task_spec import Task
from goblin_dask.array.graph import fuse_lab_chains, optimize
from goblin_dask.array.sources import lab_block, read_block
from goblin_dask.ops import task_violation
from goblin_dask.ops.spec import CatalogTask, LabChain
from goblin_dask.validation.checks import accept, is_unverified_key

FUSION_OFF = {"goblin.graph.fuse-lab-chains": False}
TO_VOLUNTEERS = {"goblin.placement.min-flops": 0, "goblin.placement.min-product-intensity": 0}


def _graphs(x):
    """(unfused, fused) optimized graphs of collection ``x``."""
    from dask.core import flatten

    dsk, keys = dict(x.__dask_graph__()), x.__dask_keys__()
    with dask.config.set(FUSION_OFF):
        plain = optimize(dsk, keys)
    fused = fuse_lab_chains(plain, list(flatten(keys)))
    assert set(optimize(dsk, keys)) == set(fused)  # what ga's optimize does by default
    return plain, fused


def _check_fused(plain: dict, fused: dict, keys) -> None:
    """Structure: outputs kept, every fused step a lab-placed catalog task of the unfused graph, each
    intermediate read by its successor only; volunteer tasks, checks and sources untouched."""
    from dask.core import flatten

    outputs = set(flatten(keys))
    assert outputs <= set(fused)
    assert set(fused) <= set(plain)
    dependents: dict = {}
    for k, node in plain.items():
        for d in getattr(node, "dependencies", ()):
            dependents.setdefault(d, []).append(k)
    inside = set()
    for key, node in fused.items():
        if not isinstance(node, LabChain):
            assert node is plain[key]
            continue
        assert node.key == key == node.steps[-1].key
        for i, step in enumerate(node.steps):
            assert type(step) is CatalogTask and step.placement == "lab" and not is_unverified_key(step.key)
            assert plain[step.key] is step
            if i < len(node.steps) - 1:
                assert step.key not in outputs and step.key not in fused
                assert dependents[step.key] == [node.steps[i + 1].key]
            inside.add(step.key)
        assert node.dependencies == frozenset().union(*(s.dependencies for s in node.steps)) - {
            s.key for s in node.steps}
    # nothing lost: every unfused task is either in the fused graph or inside a chain
    assert set(plain) == set(fused) | inside
    for node in plain.values():
        if isinstance(node, Task) and (node.func in (accept, lab_block, read_block)
                                       or getattr(node, "placement", None) == "volunteer"):
            assert node.key in fused and fused[node.key] is node


def _expressions():
    rng = np.random.default_rng(17)
    a = rng.standard_normal((40, 30))
    b = rng.standard_normal((30, 20))
    v = rng.standard_normal(30)
    x, y, w = ga.from_array(a, chunks=(16, 10)), ga.from_array(b, chunks=10), ga.from_array(v, chunks=30)
    return [
        (ga.tanh(ga.exp(-(x * 2.0 + 1.0)).T * 0.5), np.tanh(np.exp(-(a * 2.0 + 1.0)).T * 0.5)),
        (ga.sqrt(ga.abs(x - w) + 1.0).sum(axis=0), np.sqrt(np.abs(a - v) + 1.0).sum(axis=0)),
        ((ga.maximum(x, 0.0) @ y).rechunk(7) * 3.0 - 1.0, (np.maximum(a, 0.0) @ b) * 3.0 - 1.0),
        (ga.reshape(ga.sin(x).T, (600, 2))[::3] + 2.0, np.reshape(np.sin(a).T, (600, 2))[::3] + 2.0),
        (ga.softmax(x * 0.1, axis=-1).mean(axis=1), np.exp(a * 0.1 - np.log(np.exp(a * 0.1).sum(-1, keepdims=True)))
         .mean(axis=1)),
    ]


@pytest.mark.parametrize("to_volunteers", [False, True], ids=["lab", "volunteers"])
def test_fused_ga_expressions_compute_the_same(to_volunteers):
    with dask.config.set(TO_VOLUNTEERS if to_volunteers else {}):
        cases = _expressions()
    fused_any = False
    for expr, want in cases:
        plain, fused = _graphs(expr)
        _check_fused(plain, fused, expr.__dask_keys__())
        fused_any |= any(isinstance(n, LabChain) for n in fused.values())
        got = expr.compute(scheduler="sync")
        with dask.config.set(FUSION_OFF):
            unfused = expr.compute(scheduler="sync")
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(got, unfused)
    assert fused_any


def test_an_output_or_a_shared_block_ends_a_chain():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((8, 6))
    x = ga.from_array(a, chunks=8)
    u = ga.exp(x + 1.0)              # read twice below: ends its chain
    v, z = u * 2.0, ga.tanh(u - 1.0)
    dsk = {**dict(v.__dask_graph__()), **dict(z.__dask_graph__())}
    keys = v.__dask_keys__() + z.__dask_keys__()
    with dask.config.set(FUSION_OFF):
        plain = optimize(dsk, keys)
    fused = fuse_lab_chains(plain, keys)
    _check_fused(plain, fused, keys)
    (ukey,) = [k for k in plain if k[0] == u.name]
    assert ukey in fused  # two dependents: not fused away
    # asked for as an output too: stays a key of its own
    also = fuse_lab_chains(plain, keys + [ukey])
    assert ukey in also
    got = dask.compute(v, z, scheduler="sync")
    np.testing.assert_allclose(got[0], np.exp(a + 1.0) * 2.0, rtol=1e-14)
    np.testing.assert_allclose(got[1], np.tanh(np.exp(a + 1.0) - 1.0), rtol=1e-14)


def test_a_lab_chain_is_no_volunteer_task():
    from goblin_dask.safe_pickle import RefusedPickle, safe_loads

    x = ga.from_array(np.arange(12.0).reshape(3, 4), chunks=4)
    _, fused = _graphs(ga.exp(x * 2.0).T + 1.0)
    chains = [n for n in fused.values() if isinstance(n, LabChain)]
    assert chains
    chain = chains[0]
    assert task_violation(chain) is not None                       # the volunteer's allow-list
    with pytest.raises(RefusedPickle):                              # and its unpickler
        safe_loads(pickle.dumps(chain))
    back = pickle.loads(pickle.dumps(chain))                        # the lab node reads it as it was
    assert isinstance(back, LabChain) and back.key == chain.key and back.dependencies == chain.dependencies
    assert [s.key for s in back.steps] == [s.key for s in chain.steps]
    # dask's graph rewrites: copy, substitute an outside dependency (the chain's inside stays)
    assert chain.copy().dependencies == chain.dependencies and chain.copy().key == chain.key
    (dep,) = sorted(chain.dependencies, key=repr)[:1]
    moved = chain.substitute({dep: ("elsewhere", 0), chain.steps[0].key: ("never", 0)})
    assert moved.dependencies == (chain.dependencies - {dep}) | {("elsewhere", 0)}
    assert [s.key for s in moved.steps] == [s.key for s in chain.steps]
    with pytest.raises(TypeError):
        LabChain(chain.key, [Task("f", len, ()), chain.steps[-1]])
    volunteer_step = CatalogTask("v", chain.steps[0].func, 1.0, placement="volunteer")
    with pytest.raises(TypeError):
        LabChain(chain.key, [volunteer_step, chain.steps[-1]])


def _same_lineage(before: dict, after: dict, keys) -> bool:
    """Whether every key of ``keys`` has the same lineage in both: the pieces as a set (their order follows
    the scheduler's set of dependencies, which is no order at all)."""
    def pieces(lin, k):
        return frozenset(lin.get(k, ()))
    return {k: pieces(before, k) for k in keys} == {k: pieces(after, k) for k in keys}


def _lineage(dsk: dict) -> dict:
    """The exposure plugin's lineage of every task of ``dsk``, derived as on the scheduler (real TaskStates)."""
    from dask._task_spec import GraphNode
    from distributed.scheduler import TaskGroup, TaskPrefix, TaskState

    from scheduler_plugins.exposure import ExposurePlugin

    group = TaskGroup("fusion-test", TaskPrefix("fusion-test"))
    tss = {k: TaskState(k, v if isinstance(v, GraphNode) else None, "released", group, False) for k, v in dsk.items()}
    for k, ts in tss.items():
        for d in getattr(dsk[k], "dependencies", ()):
            ts.add_dependency(tss[d])
    plugin = ExposurePlugin(None, None)
    plugin._lineage_of(list(tss.values()))
    return plugin.lineage


def _exposure_graphs(x):
    """(unfused, fused) graphs of ``x`` as the lab node's scheduler sees them: source blocks name their lab arrays."""
    from dask.core import flatten

    from goblin_dask.array.graph import cull
    from goblin_dask.validation.checks import insert_checks

    keys = list(flatten(x.__dask_keys__()))
    plain = insert_checks(cull(dict(x.__dask_graph__()), keys), keys)
    return plain, fuse_lab_chains(plain, keys)


def _lineage_cases():
    rng = np.random.default_rng(23)
    a = rng.standard_normal((64, 48))
    x = ga.from_array(a, chunks=(16, 48))
    y = ga.tanh(x * 0.5 + 1.0)[:, 8:40].T
    z = ga.reshape(ga.exp(x[3:50:2] - 1.0), (12, 2, 48))[:, 1]
    return [y @ y.T, z.T @ z, (ga.transpose(x[::2]) * 2.0) @ x[::2]]


@pytest.mark.parametrize("to_volunteers", [False, True], ids=["lab", "volunteers"])
def test_the_exposure_lineage_is_the_same_fused(to_volunteers):
    """Every key of the fused graph has the lineage it has unfused; the generic rule would have counted more."""
    with dask.config.set(TO_VOLUNTEERS if to_volunteers else {}):
        cases = _lineage_cases()
    coarser = 0
    for expr in cases:
        plain, fused = _exposure_graphs(expr)
        chains = [n for n in fused.values() if isinstance(n, LabChain)]
        assert chains
        before, after = _lineage(plain), _lineage(fused)
        assert before, "no lineage at all: the source blocks name no lab array?"
        assert _same_lineage(before, after, fused)
        for chain in chains:
            generic = {(aid, box) for d in chain.dependencies for aid, box, _ in after.get(d, ())}
            if generic != {(aid, box) for aid, box, _ in after.get(chain.key, ())}:
                coarser += 1
    assert coarser  # the cases do reach chains whose exact region the generic rule would lose


torch = pytest.importorskip("torch")


def _gpt():
    import goblin_dask
    from tests.torch_models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=17, d=16, heads=2, context=8).eval()
    ids = np.random.default_rng(5).integers(0, 17, (3, 8))
    return model, goblin_dask.capture(model, (torch.from_numpy(ids),)), ids


def test_fused_captured_model_computes_the_same():
    model, graph, ids = _gpt()
    with dask.config.set(scheduler="threads"):  # no lab node's client (the session's grid may be up): no lab copies
        out = graph(ids)
    plain, fused = _graphs(out)
    _check_fused(plain, fused, out.__dask_keys__())
    assert len(fused) < len(plain) * 0.6  # most of a small model's glue is lab-only chains
    got = out.compute(scheduler="threads")
    with dask.config.set(FUSION_OFF):
        unfused = out.compute(scheduler="threads")
    np.testing.assert_array_equal(got, unfused)
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, float(np.abs(want).max())))
    # the parameters are lab arrays: every key keeps its lineage through the fused chains
    plain, fused = _exposure_graphs(out)
    before, after = _lineage(plain), _lineage(fused)
    assert before and _same_lineage(before, after, fused)


def _on_grid(tmp_path, monkeypatch, fuse: bool):
    """A local grid with one curious volunteer (the scheduler optimizes the graphs: it reads the setting from
    its environment): the captured GPT and a ga expression, results, the report and the task stream."""
    from distributed import get_task_stream

    from goblin_dask.node.local import LabNode

    monkeypatch.setenv("DASK_GOBLIN__GRAPH__FUSE_LAB_CHAINS", "True" if fuse else "False")
    rng = np.random.default_rng(11)
    a = rng.standard_normal((64, 48))
    model, graph, ids = _gpt()
    with dask.config.set({**TO_VOLUNTEERS, "goblin.minimization.small-array": 0}), \
            LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node, \
            node.client.as_current():
        curious = node.add_volunteer(module="tests.curious")
        pid = node.processes[curious].pid
        x = ga.from_array(a, chunks=(16, 48))
        y = ga.tanh(x * 0.5 + 1.0)[:, 8:40].T  # a lab-only chain feeding the products: part of x's blocks
        with get_task_stream(client=node.client) as stream:
            gram = (y @ y.T).compute()
            logits = graph(ids).compute()
        report = node.report()
        vol = set(node.volunteer_addresses().values())
        received = (node.state_dir / f"received-{pid}.bin").read_bytes()
    t = np.tanh(a * 0.5 + 1.0)[:, 8:40]
    return dict(gram=gram, logits=logits, want=t.T @ t,
                report=report, stream=stream.data, vol=vol, received=received, model=model, ids=ids)


@pytest.mark.slow
def test_on_the_grid_fusion_changes_no_result_no_exposure_and_no_placement(tmp_path, monkeypatch):
    from dask.utils import key_split

    runs = {fuse: _on_grid(tmp_path / str(fuse), monkeypatch, fuse) for fuse in (False, True)}
    off, on = runs[False], runs[True]
    np.testing.assert_allclose(on["gram"], on["want"], rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(on["gram"], off["gram"])
    np.testing.assert_array_equal(on["logits"], off["logits"])
    with torch.no_grad():
        want = off["model"](torch.from_numpy(off["ids"])).numpy()
    np.testing.assert_allclose(on["logits"], want, rtol=2e-5, atol=2e-5 * max(1.0, float(np.abs(want).max())))
    # the same verified work on the volunteer, the same exposure account: lineage followed through the chains
    for run in (off, on):
        assert run["report"]["rejected"] == 0 and run["report"]["accepted"] > 0
        assert run["report"]["exposure"], run["report"]
    (seen_on,), (seen_off,) = on["report"]["exposure"].values(), off["report"]["exposure"].values()
    assert seen_on == seen_off  # (the one volunteer's name differs: it is random)
    assert on["report"]["by_method"] == off["report"]["by_method"]
    assert on["report"]["tasks"] == off["report"]["tasks"]
    assert on["report"]["faults"]["to_lab"] == off["report"]["faults"]["to_lab"]

    def volunteer_keys(run):
        return sorted(str(r["key"]) for r in run["stream"] if r.get("worker") in run["vol"])

    assert volunteer_keys(on) == volunteer_keys(off)
    assert all(key_split(k).startswith("unverified-") for k in volunteer_keys(on))
    assert len(on["stream"]) < len(off["stream"])  # fewer tasks: the chains ran as one each
    # a fused chain never reached the volunteer, not even its name
    for marker in (b"LabChain", b"lab_chain"):
        assert marker not in on["received"]
