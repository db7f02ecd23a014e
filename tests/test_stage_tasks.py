"""Stage tasks: a model's pass (or a micro-batch's forward and backward) as one volunteer task.

Unit tests of the ``program`` op (its interpreter against torch, its allow-list against hostile
programs, its replica comparison against honest rounding and small cheats), then real grids: a
captured GPT and a Trainer on stage tasks give torch's numbers, honest volunteers on another BLAS
kernel are never rejected, and cheaters inside a stage task are caught and banned before any of
their numbers reach an applied update.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import dask
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from goblin_dask.ops import task_violation  # noqa: E402
from goblin_dask.ops.program import (FORMAT, PROGRAM, outputs_of, program_violation, run, same_program_result,  # noqa: E402
                                    unpack)
from goblin_dask.ops.spec import CatalogTask  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from capture import gpt  # noqa: E402


def lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _joint_program(model, x, y):
    from goblin_dask.training.joint import trace

    pn = [n for n, _ in model.named_parameters()]
    bn = [n for n, _ in model.named_buffers()]
    g = trace(model, lm_loss, x, y, pn, bn)
    params = [p.detach().numpy() for p in model.parameters()]
    bufs = [b.numpy() for b in model.buffers()]
    prog = g.stage_program([a.shape for a in params + bufs] + [x.shape, y.shape])
    inputs = params + bufs + [x, y] + [g.flat_constant_value(group) for _, group in g.constant_groups()]
    return prog, inputs


def _batch(vocab=64, rows=4, seq=16, seed=0):
    ids = np.random.default_rng(seed).integers(0, vocab, (rows, seq + 1))
    return ids[:, :-1].copy(), ids[:, 1:].copy()


# -- the op -------------------------------------------------------------------------------------


def test_a_forward_program_gives_torchs_numbers():
    import goblin_dask

    model = gpt(64, 32, 2, 16, 2)
    ids = np.random.default_rng(1).integers(0, 64, (3, 16))
    graph = goblin_dask.capture(model, torch.as_tensor(ids))
    prog = graph.stage_program([ids.shape])
    assert prog is not None and prog.steps > 50
    assert program_violation(prog.spec) is None
    flats = [graph.flat_constant_value(group) for _, group in graph.constant_groups()]
    assert len(flats) < len(graph._stage_names()) - 1  # the constants as one vector per dtype
    out, = unpack(run(ids, *flats, program=prog.spec), prog.spec)
    want = model(torch.as_tensor(ids)).detach().numpy()
    np.testing.assert_allclose(out.reshape(want.shape), want, rtol=1e-4, atol=1e-5)


def test_a_forward_and_backward_program_gives_torchs_gradients():
    model = gpt(64, 32, 2, 16, 2).train()
    x, y = _batch()
    prog, inputs = _joint_program(model, x, y)
    assert prog is not None
    parts = unpack(run(*inputs, program=prog.spec), prog.spec)
    model.zero_grad()
    loss = lm_loss(model(torch.as_tensor(x)), torch.as_tensor(y))
    loss.backward()
    assert parts[0].item() == pytest.approx(float(loss), rel=1e-5)
    for part, p in zip(parts[1:], model.parameters()):
        np.testing.assert_allclose(part, p.grad.numpy(), rtol=1e-3, atol=1e-5)


def _small_program():
    return (FORMAT, 2, (("matmul", 1, (("$ref", 0), ("$ref", 1)), ()),
                        ("add", 1, (("$ref", 2), 1.0), ())),
            ((3, (2, 2), "<f8"),), "<f8", 16.0)


def test_a_small_program_runs_and_packs_its_outputs():
    a, b = np.arange(4.0).reshape(2, 2), np.eye(2)
    out = run(a, b, program=_small_program())
    np.testing.assert_array_equal(out[:4], (a @ b + 1.0).reshape(-1))
    assert out[4] == 0.0  # its rounding floor: no reduction made the output
    summed = (FORMAT, 2, (("subtract", 1, (("$ref", 0), ("$ref", 1)), ()), ("sum", 1, (("$ref", 2),), ())),
              ((3, (), "<f8"),), "<f8", 8.0)
    np.testing.assert_array_equal(run(a, b, program=summed), [np.sum(a - b), 2.0])  # floor: the largest term, |a - b|
    task = CatalogTask(("program-" + "0" * 32, 0), PROGRAM, a, b, program=_small_program())
    assert task_violation(task) is None


@pytest.mark.parametrize("mutate, why", [
    (lambda p: p[:2] + ((("exec", 1, (), ()),),) + p[3:], "not in the goblin catalog"),
    (lambda p: p[:2] + ((("program", 1, (), (("program", p),)),),) + p[3:], "a program inside a program"),
    (lambda p: p[:2] + ((("matmul", 1, (("$ref", 0), ("$ref", 5)), ()),),) + p[3:], "not computed before it"),
    (lambda p: p[:2] + ((("add", 1, ("rm -rf /", 1.0), ()),),) + p[3:], "text is no operand"),
    (lambda p: p[:2] + ((("einsum", 1, (("$ref", 0),), (("subscripts", "__import__('os')"),)),),) + p[3:],
     "not in its grammar"),
    (lambda p: p[:2] + ((("add", 1, (("$ref", 0), 1.0), (("where", 3),)),),) + p[3:], "unknown parameter"),
    (lambda p: p[:3] + (((99, (2, 2), "<f8"),),) + p[4:], "malformed output"),
    (lambda p: ("goblin-program/0",) + p[1:], "not a goblin-program/1 program"),
    (lambda p: p[:4] + ("O",) + p[5:], "result dtype"),
    (lambda p: p[:5] + (float("nan"),), "flops"),
    (lambda p: p[:2] + (tuple(p[2]) * 30_000,) + p[3:], "steps (at most"),
])
def test_a_hostile_program_is_refused_before_anything_runs(mutate, why):
    bad = mutate(_small_program())
    reason = program_violation(bad)
    assert reason is not None and why in reason, reason
    task = CatalogTask(("program-" + "0" * 32, 0), PROGRAM, np.eye(2), np.eye(2), program=bad)
    assert task_violation(task) is not None


def test_the_replica_comparison_takes_other_blas_kernels_and_refuses_a_scaled_gradient():
    """Honest rounding across kernels is ~10 epsilons of an output's scale (measured: SkylakeX, Katmai and
    SandyBridge OpenBLAS kernels on this test's LM, 1 and 2 threads); the tolerance is 4096 elementwise and
    512 in norm; a gradient scaled by 1.001 is ~8400."""
    import threadpoolctl

    model = gpt(64, 32, 2, 16, 2).train()
    prog, inputs = _joint_program(model, *_batch())
    params = {"program": prog.spec}
    with threadpoolctl.threadpool_limits(1):
        one = run(*inputs, program=prog.spec)
    with threadpoolctl.threadpool_limits(2):
        two = run(*inputs, program=prog.spec)
    assert same_program_result(one, two, (), params)
    sizes = np.cumsum([0] + [math.prod(s) for s, _ in outputs_of(prog.spec)])
    scaled = one.copy()
    scaled[sizes[1]:sizes[2]] *= np.float32(1.001)  # one gradient, a little off
    assert not same_program_result(scaled, one, (), params)
    wrong = one.copy()
    wrong[sizes[3] + 5] += 0.05 * float(np.abs(one[sizes[3]:sizes[4]]).max())  # one entry of another
    assert not same_program_result(wrong, one, (), params)
    nan = one.copy()
    nan[0] = np.nan
    assert not same_program_result(nan, one, (), params)


def test_a_pseudo_gradient_keeps_its_own_scale_so_a_scaled_one_is_refused():
    """start - end is a difference of two parameter-sized values: its rounding floor is the step's, the gradient's
    largest term times the learning rate, never the parameters' size (which would let a 1.001 scaling through)."""
    from goblin_dask.ops.program import rounding_floors

    steps = (("sum", 1, (("$ref", 1),), (("axis", 0),)),                 # 2: a gradient
             ("multiply", 1, (("$ref", 2), 1e-3), ()),                   # 3: the step
             ("subtract", 1, (("$ref", 0), ("$ref", 3)), ()),            # 4: the end
             ("subtract", 1, (("$ref", 0), ("$ref", 4)), ()))            # 5: start - end
    spec = (FORMAT, 2, steps, ((5, (64,), "<f4"), (2, (64,), "<f4")), "<f4", 1e4)
    rng = np.random.default_rng(3)
    start, x = rng.standard_normal(64).astype(np.float32), rng.standard_normal((32, 64)).astype(np.float32)
    out = run(start, x, program=spec)
    floors = rounding_floors(out, spec)
    assert floors[0] == pytest.approx(1e-3 * np.abs(x).max(), rel=1e-6) and floors[1] == pytest.approx(np.abs(x).max())
    scaled = out.copy()
    scaled[:64] *= np.float32(1.001)
    assert same_program_result(out, out.copy(), (), {"program": spec})
    assert not same_program_result(scaled, out, (), {"program": spec})


def test_a_gradient_summed_over_weighted_micro_batches_keeps_its_sums_rounding_floor():
    """A round of several micro-batches sums each one's gradient times its weight (``add`` of ``multiply`` by a
    number).  Where the gradient is zero by construction (a bias before BatchNorm) each term is rounding noise,
    which another CPU's BLAS gives wholly otherwise.  Before, the walk back stopped at the ``multiply``: floor 0,
    and an honest volunteer on another CPU was rejected; now the floor is each sum's largest term times its
    weight.  A product of two values is no scaling: its floor stays 0."""
    from goblin_dask.ops.program import rounding_floors

    steps = (("sum", 1, (("$ref", 0),), (("axis", 0),)),                 # 2: micro-batch 1's gradient
             ("sum", 1, (("$ref", 1),), (("axis", 0),)),                 # 3: micro-batch 2's
             ("multiply", 1, (("$ref", 2), np.float32(0.25)), ()),       # 4
             ("multiply", 1, (np.float32(0.75), ("$ref", 3)), ()),       # 5
             ("add", 1, (("$ref", 4), ("$ref", 5)), ()),                 # 6: the round's gradient
             ("multiply", 1, (("$ref", 2), ("$ref", 3)), ()))            # 7: no scaling
    spec = (FORMAT, 2, steps, ((6, (16,), "<f4"), (7, (16,), "<f4")), "<f4", 1e3)
    rng = np.random.default_rng(5)
    one, two = (rng.standard_normal((24, 16)).astype(np.float32) for _ in range(2))
    one[:, 3], two[:, 3] = rng.standard_normal(24).astype(np.float32) * 8, 0  # the largest terms
    one -= one.mean(axis=0)  # each sum cancels to rounding noise, as a bias's gradient before BatchNorm does
    two -= two.mean(axis=0)
    out = run(one, two, program=spec)
    floors = rounding_floors(out, spec)
    want = max(0.25 * np.abs(one).max(), 0.75 * np.abs(two).max())
    assert floors[0] == pytest.approx(want, rel=1e-6) and floors[1] == 0, floors
    params = {"program": spec}
    eps32 = float(np.finfo(np.float32).eps)
    honest = out.copy()
    honest[:16] += np.float32(40 * eps32 * want) * np.sign(rng.standard_normal(16)).astype(np.float32)
    assert same_program_result(honest, out, (), params) and same_program_result(out, honest, (), params)
    wrong = out.copy()
    wrong[:16] += np.float32(0.05 * want)
    assert not same_program_result(wrong, out, (), params)


_CNN_STAGE = """
import sys, numpy as np, threadpoolctl, torch, torch.nn.functional as F
from torch import nn
from goblin_dask.ops.program import run
from goblin_dask.training.joint import trace
torch.manual_seed(6)
model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 5)).train()
rng = np.random.default_rng(7)
x, y = rng.standard_normal((4, 3, 6, 6)).astype(np.float32), rng.integers(0, 5, 4)
g = trace(model, F.cross_entropy, x, y, [n for n, _ in model.named_parameters()], [n for n, _ in model.named_buffers()])
state = [p.detach().numpy() for p in model.parameters()] + [b.numpy() for b in model.buffers()]
prog = g.stage_program([a.shape for a in state] + [x.shape, y.shape])
inputs = state + [x, y] + [g.flat_constant_value(group) for _, group in g.constant_groups()]
with threadpoolctl.threadpool_limits(int(sys.argv[2])):
    np.save(sys.argv[1], run(*inputs, program=prog.spec))
import pickle; pickle.dump(prog.spec, open(sys.argv[1] + ".spec", "wb"))
"""


def _cnn_stage_result(tmp_path, name, threads, env=()):
    """The CNN's forward-and-backward program run in a process of its own (OpenBLAS picks its kernel at start)."""
    import os
    import pickle
    import subprocess

    out = tmp_path / f"{name}.npy"
    subprocess.run([sys.executable, "-c", _CNN_STAGE, str(out), str(threads)], check=True,
                   env={**os.environ, **dict(env)})
    return np.load(out), pickle.load(open(str(out) + ".spec", "rb"))


def test_a_cancelled_gradient_beside_an_integer_counter_is_compared_at_its_own_rounding(tmp_path):
    """A CNN whose conv bias feeds BatchNorm: the bias's gradient is zero in exact arithmetic, so two honest
    kernels give noise (~1e-8) that differs wholly; and the BatchNorm counter (int64) packs every float32 output
    as float64.  Each output is compared in its own dtype's epsilons of its rounding scale, the largest term
    summed into it (the floor), so the other kernel passes, whole and fingerprinted; a cheat still fails."""
    from goblin_dask.ops.program import rounding_floors, same_sketch, sketch

    one, spec = _cnn_stage_result(tmp_path, "one", 1)
    two, _ = _cnn_stage_result(tmp_path, "two", 2, {"OPENBLAS_CORETYPE": "SandyBridge"})
    assert one.dtype == np.float64 and [str(dt) for _, dt in outputs_of(spec)].count("float32") == 9
    params = {"program": spec}
    assert same_program_result(one, two, (), params) and same_program_result(two, one, (), params)
    assert same_sketch(sketch(two, spec, 11), sketch(one, spec, 11), spec)

    edges = np.cumsum([0] + [math.prod(s) for s, _ in outputs_of(spec)])
    bias = slice(edges[2], edges[3])  # the conv bias's gradient
    floors = rounding_floors(one, spec)
    assert floors[2] > 1e3 * np.abs(one[bias]).max()  # pure cancellation: its terms dwarf it
    eps32 = float(np.finfo(np.float32).eps)
    honest = one.copy()
    honest[edges[1]:edges[2]] *= 1 + 30 * eps32  # float32 rounding of a weight's gradient, in float64 dtype
    honest[bias] += 40 * eps32 * floors[2]  # rounding of the bias's 144 terms
    assert same_program_result(honest, one, (), params)
    assert same_sketch(sketch(honest, spec, 12), sketch(one, spec, 12), spec)

    scaled = one.copy()
    scaled[edges[5]:edges[6]] *= 1.001  # the linear layer's gradient, a little off
    wrong_bias = one.copy()
    wrong_bias[bias] += 0.05 * floors[2]
    for cheat in (scaled, wrong_bias):
        assert not same_program_result(cheat, one, (), params)
        assert not same_sketch(sketch(cheat, spec, 13), sketch(one, spec, 13), spec)
    # a cheater that also reports huge floors widens nothing: the comparison takes the smaller party's floor
    inflated = wrong_bias.copy()
    inflated[edges[-1]:] = 1e6
    assert not same_program_result(inflated, one, (), params)
    assert not same_sketch(sketch(inflated, spec, 14), sketch(one, spec, 14), spec)
    assert not same_sketch(sketch(one, spec, 14), sketch(inflated, spec, 14), spec)


# -- on a grid ----------------------------------------------------------------------------------


def test_a_joint_graph_is_cut_on_its_forward_and_each_backward_stage_recomputes_its_forward():
    """A training pass cut into stages: the forward's stages, then one backward stage per forward stage, last
    first, each recomputing its forward from the stage's inputs.  So what crosses a cut is the residual stream
    and its gradient, never the activations a backward reads (an MLP's hidden
    layer, 4x the residual), which a cut of the joint graph in node order sends through the lab."""
    from goblin_dask.torch_capture.graph import _LazyConstant, _value_bytes
    from goblin_dask.training.joint import trace

    torch.manual_seed(3)
    model = gpt(64, 32, 4, 16, 2).train()
    x, y = _batch(rows=4, seed=1)
    g = trace(model, lm_loss, x, y, [n for n, _ in model.named_parameters()], [n for n, _ in model.named_buffers()])
    arrays = [p.detach().numpy() for p in model.parameters()] + [b.numpy() for b in model.buffers()] + [x, y]
    env = {i["name"]: _LazyConstant(None, i["name"], a) for i, a in zip(g.inputs, arrays)}
    largest = max(p.numel() * 4 for p in model.parameters())
    residual = 4 * 16 * 32 * 4
    node = {n["name"]: n for n in g.nodes}

    def crossing(plan):
        return max(_value_bytes(node[r], {}) for stage in plan for r in stage.inputs
                   if r in node and r not in g._folded())

    plan = g.stage_plan(env, 60_000)  # a decoder block's parameters (about 50 kB) fit one stage
    assert len(plan) >= 4 and crossing(plan) <= max(residual, largest), crossing(plan)
    # a stage receives at most its forward's input and the gradient of its output: views and transposes of a
    # gradient, and values made from the parameters alone, are made again where they are read, not sent
    for stage in plan:
        received = sum(_value_bytes(node[r], {}) for r in stage.inputs if r in node and r not in g._folded())
        assert received <= 2 * residual, (stage.nodes[:3], received)
    # each backward stage repeats a forward stage's nodes: recomputed, not received
    names = [set(st.nodes) for st in plan]
    assert any(names[i] < names[j] for i in range(len(plan)) for j in range(i + 1, len(plan)))
    g.forward_outputs = None  # the same graph cut as it comes: the backward's activations cross
    assert crossing(g.stage_plan(env, 60_000)) > max(residual, largest)


@pytest.fixture(scope="module")
def stage_grid():
    from goblin_dask.node.local import LabNode

    with LabNode.local(volunteers=2) as node:
        yield node


def test_a_captured_gpt_runs_as_stage_tasks_on_the_grid(stage_grid):
    import goblin_dask

    model = gpt(64, 32, 2, 16, 2)
    ids = np.random.default_rng(2).integers(0, 64, (6, 16))
    graph = goblin_dask.capture(model, torch.as_tensor(ids))
    before = stage_grid.report()
    out = graph(ids)
    dsk = dict(out.__dask_graph__())
    programs = [k for k, v in dsk.items() if isinstance(v, CatalogTask) and v.op.name == "program"]
    assert len(programs) == 2  # one per volunteer thread, each a slice of the batch
    # the model's constants as one flat lab array per dtype (one task, one fetch), not one per constant
    from goblin_dask.array.sources import lab_block

    sources = [v for v in dsk.values() if getattr(v, "func", None) is lab_block]
    held = {v.dtype for v in graph.constants.values()} | {v.dtype for v in graph._folded().values()}
    assert len(graph._stage_names()) - len(graph.inputs) > 20
    assert len(sources) <= len(held) + 1  # (and the token ids, where they are not small enough to ride along)
    got = out.compute()
    np.testing.assert_allclose(got, model(torch.as_tensor(ids)).detach().numpy(), rtol=1e-4, atol=1e-5)
    after = stage_grid.report()
    checked = lambda r: sum(r["by_method"].get(m, 0) for m in ("replica", "audit"))  # noqa: E731
    assert checked(after) - checked(before) == 4  # each replicated (and some audited by the lab)
    assert after["rejected"] == before["rejected"]


class _Rows(torch.nn.Module):
    """A model made of one function of its input."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _bn_train():
    torch.manual_seed(3)  # BatchNorm1d with the batch's statistics (train mode; track_running_stats=False: no buffers)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, track_running_stats=False)).train()


#: models whose rows mix along the batch: a slice of the batch computes other numbers than the whole batch
_MIXING = {
    "cumsum": lambda: _Rows(lambda x: x.cumsum(0)),
    "centered": lambda: _Rows(lambda x: x - x.mean(0, keepdim=True)),
    "gram": lambda: _Rows(lambda x: x @ (x.T @ x)),
    "batchnorm-train": _bn_train,
    "sort": lambda: _Rows(lambda x: x.sort(0).values),
    "softmax-over-batch": lambda: _Rows(lambda x: x.softmax(0)),
    "batch-size": lambda: _Rows(lambda x: x / x.shape[0]),
    "arange-over-batch": lambda: _Rows(lambda x: x + torch.arange(x.shape[0])[:, None]),
    "cat-along-batch": lambda: _Rows(lambda x: torch.cat([x, x]).amax(0, keepdim=True) + x),
    "outer": lambda: _Rows(lambda x: (x[:, None, 0] * x[None, :, 0]).sum(1)),
    "first-rows": lambda: _Rows(lambda x: x @ (x[:2].T @ x[:2])),
}

#: models whose rows stay whole: attention within a row's sequence, per-row norms, BatchNorm in eval mode
_KEEPING = {
    "gpt": lambda: (gpt(64, 32, 2, 16, 2), torch.as_tensor(np.random.default_rng(2).integers(0, 64, (3, 16)))),
    "mlp": lambda: (torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)).eval(),
                    torch.randn(4, 3)),
    "cnn": lambda: (torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                                        torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                                        torch.nn.Linear(36, 5), torch.nn.Softmax(-1)).eval(), torch.randn(4, 3, 6, 6)),
    "row-ops": lambda: (_Rows(lambda x: (x - x.mean(1, keepdim=True)).sort(1).values.cumsum(-1).softmax(1)
                              @ torch.full((3, 3), 0.5) + torch.cat([x, x], 1)[:, :3]), torch.randn(4, 3)),
}


@pytest.mark.parametrize("name", sorted(_MIXING))
def test_a_graph_that_mixes_rows_of_the_batch_says_which_node(name):
    import goblin_dask

    graph = goblin_dask.capture(_MIXING[name](), (torch.randn(4, 3),))
    assert isinstance(graph.inputs[0]["shape"][0], str)  # a batch of any size: it could be sliced
    assert graph.rows_mixed() is not None


@pytest.mark.parametrize("name", sorted(_KEEPING))
def test_a_graph_that_keeps_rows_whole_may_be_sliced(name):
    import goblin_dask

    model, x = _KEEPING[name]()
    graph = goblin_dask.capture(model, (x,))
    assert isinstance(graph.inputs[0]["shape"][0], str)
    assert graph.rows_mixed() is None


def _program_tasks(out) -> int:
    outs = out if isinstance(out, tuple) else (out,)
    dsk = {k: v for o in outs for k, v in dict(o.__dask_graph__()).items()}
    return sum(isinstance(v, CatalogTask) and v.op.name == "program" for v in dsk.values())


@pytest.mark.slow
def test_a_model_mixing_rows_of_the_batch_gives_torchs_numbers_on_volunteers(stage_grid):
    """A graph whose rows mix along the batch (a cumulative sum, a centring, a product over the batch, BatchNorm's
    batch statistics, a sort along it) is one stage task for the whole batch, never one per slice: each slice's
    statistics are not the batch's.  Those with rows whole still get a slice per volunteer thread."""
    import goblin_dask

    x = np.random.default_rng(11).standard_normal((8, 3)).astype(np.float32)
    for name in ("cumsum", "centered", "gram", "batchnorm-train", "sort"):
        model = _MIXING[name]()
        graph = goblin_dask.capture(model, (torch.randn(4, 3),))
        with torch.no_grad():
            want = model(torch.from_numpy(x)).numpy()
        out = graph(x)
        assert _program_tasks(out) == 1, name  # one stage task on a volunteer, the whole batch
        np.testing.assert_allclose(out.compute(), want, rtol=1e-5, atol=1e-5, err_msg=name)
        out = graph(x, slices=2)  # slices asked for: still one, the numbers are torch's
        assert _program_tasks(out) == 1, name
        np.testing.assert_allclose(out.compute(), want, rtol=1e-5, atol=1e-5, err_msg=name)
    for name in ("mlp", "row-ops"):
        model, _ = _KEEPING[name]()
        graph = goblin_dask.capture(model, (torch.randn(4, 3),))
        with torch.no_grad():
            want = model(torch.from_numpy(x)).numpy()
        out = graph(x)
        assert _program_tasks(out) == 2, name  # one per volunteer thread, each a slice of the batch
        np.testing.assert_allclose(out.compute(), want, rtol=1e-5, atol=1e-5, err_msg=name)


def _program_depth(dsk: dict) -> int:
    """The longest chain of program tasks in ``dsk``: the lab -> volunteer -> lab trips one after another."""
    programs = {k for k, v in dsk.items() if isinstance(v, CatalogTask) and v.op.name == "program"}
    depth: dict = {}

    def walk(key) -> int:
        if key not in depth:
            task = dsk.get(key)
            below = max((walk(d) for d in getattr(task, "dependencies", ()) if d in dsk), default=0)
            depth[key] = below + (key in programs)
        return depth[key]

    return max((walk(k) for k in dsk), default=0)


def _pipelined_gpt(stages: int):
    """A 4-layer GPT, its captured graph, a batch, and a ``goblin.stage.memory-fraction`` that makes the model
    about ``stages`` stages (the budget is a fraction of a volunteer thread's memory)."""
    import goblin_dask
    from goblin_dask.torch_capture.graph import stage_budget

    torch.manual_seed(5)
    model = gpt(64, 32, 4, 16, 2).eval()
    ids = np.random.default_rng(6).integers(0, 64, (6, 16))
    graph = goblin_dask.capture(model, torch.as_tensor(ids))
    params = sum(v.nbytes for v in graph.constants.values())
    fraction = float(dask.config.get("goblin.stage.memory-fraction")) * (params / stages) / stage_budget()
    return model, graph, ids, fraction


def test_a_captured_gpt_larger_than_one_stage_runs_as_a_pipeline_of_stage_tasks(stage_grid):
    """A model whose parameters exceed ``goblin.stage.memory-fraction`` of a volunteer thread: cut into stages
    that each fit, one stage task per stage and slice of the batch, activations crossing each cut once (through
    the lab, which verifies them first), each task holding its own stage's parameters only; torch's numbers."""
    from goblin_dask.torch_capture.graph import _held_bytes, stage_budget

    model, graph, ids, fraction = _pipelined_gpt(stages=3)
    before = stage_grid.report()
    with dask.config.set({"goblin.stage.memory-fraction": fraction}):
        budget = stage_budget()
        env = graph._inputs([ids])
        plan = graph.stage_plan(env, budget)
        lab = set(graph.constants) | set(graph._folded())
        held = [_held_bytes(graph, env, [r for r in stage.inputs if r in lab]) for stage in plan]
        assert len(plan) >= 3 and max(held) <= budget < sum(held), (held, budget)
        # every node in exactly one stage, in the model's order
        assert [n for stage in plan for n in stage.nodes] == [n["name"] for n in graph.nodes
                                                             if n["name"] not in graph._folded()]
        # the cuts fall between blocks: the arrays crossing each are the residual stream (batch, seq, d_model),
        # never an MLP's hidden layer (4x wider) or attention's scores; the rest are sizes
        shape = {n["name"]: n.get("shape") for n in graph.nodes}
        crossing = [shape[r] for stage in plan[1:] for r in stage.inputs if r in shape and r not in lab and shape[r]]
        assert crossing and all(s[1:] == [16, 32] for s in crossing), crossing
        out = graph(ids)
        dsk = dict(out.__dask_graph__())
    programs = [k for k, v in dsk.items() if isinstance(v, CatalogTask) and v.op.name == "program"]
    assert len(programs) == 2 * len(plan)  # a slice of the batch per volunteer thread, each through every stage
    assert _program_depth(dsk) == len(plan)  # one trip per stage, never one per op
    got = out.compute()
    np.testing.assert_allclose(got, model(torch.as_tensor(ids)).detach().numpy(), rtol=1e-4, atol=1e-5)
    after = stage_grid.report()
    checked = lambda r: sum(r["by_method"].get(m, 0) for m in ("replica", "audit"))  # noqa: E731
    assert checked(after) - checked(before) == 2 * len(programs)  # every stage task and its replica, before use
    assert after["rejected"] == before["rejected"]


def test_a_cheater_inside_a_pipeline_stage_is_caught_and_the_pass_is_torchs():
    """One volunteer scales every stage task's outputs by 1.001: its replica on the honest volunteer disagrees,
    the lab recomputes, rejects and bans it; no wrong activation reaches the next stage."""
    from goblin_dask.node.local import LabNode

    with LabNode.local(volunteers=1) as node:
        cheater = node.add_volunteer(module="tests.cheaters", extra_args=("--cheat", "scale", "--cheat-op", "program"))
        model, graph, ids, fraction = _pipelined_gpt(stages=3)
        with dask.config.set({"goblin.stage.memory-fraction": fraction}):
            out = graph(ids)
        got = node.client.compute(out).result()
        np.testing.assert_allclose(got, model(torch.as_tensor(ids)).detach().numpy(), rtol=1e-4, atol=1e-5)
        report = node.report()
        assert report["volunteers"][cheater]["rejected"] >= 1, report
        assert all(v["rejected"] == 0 for n, v in report["volunteers"].items() if n != cheater), report


def _torch_round(model, opt, x, y, micro):
    opt.zero_grad()
    total = 0.0
    for idx in np.array_split(np.arange(len(x)), micro):
        loss = lm_loss(model(torch.from_numpy(x[idx])), torch.from_numpy(y[idx])) * (len(idx) / len(x))
        loss.backward()
        total += float(loss.detach())
    opt.step()
    return total


def _train_against_torch(node, rounds=2, micro=4):
    from goblin_dask.training import Trainer

    torch.manual_seed(3)
    model = gpt(64, 32, 2, 16, 2).train()
    ref = copy.deepcopy(model)
    trainer = Trainer(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), micro_batches=micro,
                      client=node.client)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for r in range(rounds):
        x, y = _batch(rows=8, seed=10 + r)
        loss = trainer.step(x, y)
        assert loss == pytest.approx(_torch_round(ref, opt, x, y, micro), rel=1e-4)
    state = trainer.state_dict()
    for k, v in ref.state_dict().items():
        if v.dtype.is_floating_point:
            np.testing.assert_allclose(state[k], v.numpy(), rtol=1e-3, atol=1e-5, err_msg=k)
    return trainer


def _replicated(by_method: dict) -> int:
    """Verdicts of replica pairs, the ones the lab audited included; nothing checked any other way."""
    assert set(by_method) <= {"replica", "audit"}, by_method
    return by_method.get("replica", 0) + by_method.get("audit", 0)


def test_a_training_round_is_one_stage_task_per_volunteer_thread(stage_grid):
    """4 micro-batches on 2 volunteer threads: 2 stage tasks of 2 micro-batches each, each returning one
    gradient (its micro-batches' weighted sum), each replicated: 4 checked results a round, torch's numbers."""
    trainer = _train_against_torch(stage_grid, micro=4)
    for entry in trainer.history:
        v = entry["verification"]
        assert v["tasks"] == 4 and v["rejected"] == 0 and _replicated(v["by_method"]) == 4, v
    x, y = _batch(rows=8, seed=99)
    dsk, _ = trainer.round_graph(x, y)
    programs = [t for t in dsk.values() if isinstance(t, CatalogTask) and t.op.name == "program"]
    assert len(programs) == 2
    with dask.config.set({"goblin.minimization.max-share": 0.25, "goblin.minimization.small-array": 16}):
        dsk, _ = trainer.round_graph(x, y)  # no task may hold more than a quarter of the batch: one per micro-batch
    assert sum(isinstance(t, CatalogTask) and t.op.name == "program" for t in dsk.values()) == 4


def _parameter_numbers_in(dsk, at_least):
    """The shapes of the arrays of at least ``at_least`` elements that ride in a graph's tasks (literals, not
    references)."""
    from dask._task_spec import DataNode

    found = []

    def walk(v):
        if isinstance(v, np.ndarray) and v.size >= at_least:
            found.append(v.shape)
        elif isinstance(v, (list, tuple)):
            for e in v:
                walk(e)
        elif isinstance(v, dict):
            for e in v.values():
                walk(e)
        elif isinstance(v, DataNode):
            walk(v.value)
        elif hasattr(v, "args") and hasattr(v, "kwargs"):
            walk(v.args)
            walk(v.kwargs)

    for t in dsk.values():
        walk(t)
    return found


def _trainer_in_stages(node, seed: int):
    """A Trainer of a small GPT whose ``stage_memory`` cuts it into several stages (SGD with momentum, 4
    micro-batches), the same model in torch and torch's optimizer for it: ``(trainer, model, optimizer)``."""
    from goblin_dask.training import Trainer

    torch.manual_seed(seed)
    model = gpt(64, 32, 4, 16, 2).train()
    ref = copy.deepcopy(model)
    trainer = Trainer(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), micro_batches=4,
                      client=node.client, stage_memory=80_000)
    return trainer, ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)


def test_a_model_larger_than_one_stage_trains_as_pipelines_of_stage_tasks(stage_grid):
    """A Trainer whose ``stage_memory`` cuts the model into several stages: the joint forward and backward runs
    as pipelines of stage tasks (every volunteer task a ``program``, none op by op), the activations the
    backward reads crossing through the lab, verified; torch's losses and parameters.  4 micro-batches on 2
    volunteer threads: 2 pipelines side by side, each stage task running its 2 micro-batches in turn and
    returning one gradient, their weighted sum (with 1 micro-batch per group, one pipeline each).  The
    parameters and optimizer state stay on the lab worker between rounds: the second round's graph carries
    none of their numbers, and the researcher's process takes them only at ``state_dict``."""
    from goblin_dask.array.sources import lab_value
    from goblin_dask.training import optim

    trainer, ref, opt = _trainer_in_stages(stage_grid, 3)
    assert len(trainer.plan.stages) > 1
    before = stage_grid.report()
    for r in range(2):
        x, y = _batch(rows=8, seed=60 + r)
        dsk, key = trainer.round_graph(x, y)
        on_volunteers = [v for v in dsk.values() if isinstance(v, CatalogTask) and v.placement == "volunteer"]
        assert on_volunteers and all(v.op.name == "program" for v in on_volunteers)
        depth = _program_depth(dsk)
        assert 3 <= depth <= len(on_volunteers) // 2  # 2 groups' pipelines side by side
        if not r:  # a group of one micro-batch each (no task may hold more of the batch): twice the stage tasks
            with dask.config.set({"goblin.minimization.max-share": 0.25, "goblin.minimization.small-array": 16}):
                single, _ = trainer.round_graph(x, y)
            assert sum(isinstance(v, CatalogTask) and v.op.name == "program" for v in single.values()) \
                == 2 * len(on_volunteers)
        assert dsk[key].func is optim.lab_round
        if r:  # the first round's step left the model and the momentum on the lab worker: read there
            batch = {x.shape, x[:2].shape}  # the batch and its micro-batches ride in the graph, nothing else
            assert set(_parameter_numbers_in(dsk, 2)) <= batch
            assert all(tuple(p.shape) not in batch for p in ref.parameters())
            blocks = [t for t in dsk.values() if getattr(t, "func", None) is lab_value]
            assert any(t.args[1] == ("flat",) for t in blocks)  # (each stage's cut from it: see the test below)
        assert trainer.step(x, y) == pytest.approx(_torch_round(ref, opt, x, y, 4), rel=1e-4)
        assert trainer._host_round < trainer.rounds  # the new parameters did not come to this process
    state = trainer.state_dict()
    for k, v in ref.state_dict().items():
        if v.dtype.is_floating_point:
            np.testing.assert_allclose(state[k], v.numpy(), rtol=1e-3, atol=1e-5, err_msg=k)
    after = stage_grid.report()
    assert after["rejected"] == before["rejected"]


def test_a_round_in_stages_reads_each_stages_parameters_as_one_lab_array(stage_grid):
    """Issue 28: a round of pipelines of stage tasks (a model larger than one stage) after the first reads the
    parameters the lab worker kept as one lab array per stage, holding exactly that stage's parameters (cut
    from their flat vector by one lab task; a forward stage and its backward, which recomputes that forward,
    share it), plus the flat vector itself, which the step reads: a handful of lab tasks, where there was one
    per parameter (53 here).  Each stage task has one parameter input; no stage task receives another stage's
    parameters; the step still cuts the gradients from the packed results; torch's numbers."""
    from goblin_dask.array.sources import lab_value
    from goblin_dask.training import optim

    trainer, ref, opt = _trainer_in_stages(stage_grid, 4)
    P = len(trainer.param_names)
    sizes = [trainer._params[k].size for k in trainer.param_names]
    for r in range(3):
        x, y = _batch(rows=8, seed=70 + r)
        if r:  # the first round reads this process's copies, one lab array each (sent once)
            dsk, key = trainer.round_graph(x, y)
            assert dsk[key].func is optim.lab_round
            held = [(k, t) for k, t in dsk.items() if getattr(t, "func", None) is lab_value]
            per_parameter = [k for k, t in held if t.args[1][:1] == ("params",)]
            flat = [k for k, t in held if t.args[1] == ("flat",) and "pieces" not in t.kwargs]
            stages = {k: t for k, t in held if "pieces" in t.kwargs}
            assert not per_parameter and len(flat) == 1, (per_parameter, flat)
            programs = {k: t for k, t in dsk.items() if isinstance(t, CatalogTask) and t.op.name == "program"}
            depth = _program_depth(dsk)  # the stage tasks one after another: the plan's stages
            # at most one vector per stage, a forward stage and its backward sharing one: here 14 for 27 stage
            # tasks a pipeline (the graph's stage budget is a fraction of stage_memory), 53 parameters
            assert 3 <= depth and 2 <= len(stages) < depth
            assert len(stages) + len(flat) < P // 2
            for k, t in stages.items():  # each a vector of its stage's parameters, cut from the flat one
                assert set(t.dependencies) == set(flat)
                n = sum(b - a for a, b in t.kwargs["pieces"])
                assert t.kwargs["lab_array"][1] == (n,) and 0 < n < sum(sizes)
            read = [[d for d in t.dependencies if d in stages] for t in programs.values()]
            assert all(len(d) == 1 for d in read), read  # one parameter input per stage task, never the flat one
            assert not any(set(t.dependencies) & set(flat) for t in programs.values())
            if r == 1:  # a per-task cap that each parameter is under (goblin.minimization.small-array) and most
                # stages' vectors of several are not: those stage tasks read their parameters one by one, as before
                caps = {"goblin.minimization.parameters-max-share": 0.5, "goblin.minimization.small-array": max(sizes)}
                with dask.config.set(caps):
                    capped, _ = trainer.round_graph(x, y)
                kept = [t for t in capped.values() if getattr(t, "func", None) is lab_value]
                assert all(sum(b - a for a, b in t.kwargs["pieces"]) <= max(sizes) for t in kept if "pieces" in t.kwargs)
                assert P // 2 < sum(t.args[1][:1] == ("params",) for t in kept) < P
                assert sum(isinstance(t, CatalogTask) and t.op.name == "program" for t in capped.values()) \
                    == len(programs)
        assert trainer.step(x, y) == pytest.approx(_torch_round(ref, opt, x, y, 4), rel=1e-4)
    state = trainer.state_dict()
    for k, v in ref.state_dict().items():
        if v.dtype.is_floating_point:
            np.testing.assert_allclose(state[k], v.numpy(), rtol=1e-3, atol=1e-5, err_msg=k)
    assert trainer.history[-1]["verification"]["rejected"] == 0


def test_a_stages_backward_reads_its_input_on_the_volunteer_that_ran_its_forward(stage_grid):
    """Issue 28: a backward stage task recomputes its stage's forward from the stage's input, the accepted output of
    the stage before it.  The volunteers that ran the forward (the task and its replica) still hold that input,
    and the backward and its replica go to them and read it there: it crosses from the lab once, not twice.
    When the round is done the lab lets the inputs go and so do the volunteers (a later result under the same
    key may differ in rounding).  Torch's numbers, nothing rejected."""
    from collections import Counter

    from goblin_dask.volunteer.panel_cache import cacheable_key
    from tests.conftest import volunteer_cache_stats, wait_for

    trainer, ref, opt = _trainer_in_stages(stage_grid, 5)
    names = stage_grid.volunteer_names()
    before = {n: volunteer_cache_stats(stage_grid, n) for n in names}
    for r in range(2):
        x, y = _batch(rows=8, seed=80 + r)
        assert trainer.step(x, y) == pytest.approx(_torch_round(ref, opt, x, y, 4), rel=1e-4)
    dsk, _ = trainer.round_graph(x, y)
    programs = [v for v in dsk.values() if isinstance(v, CatalogTask) and v.op.name == "program"]
    readers = Counter(d for t in programs for d in t.dependencies if not cacheable_key(d))
    again = sum(n - 1 for n in readers.values())  # inputs a later stage task reads again, a round

    def settled():
        return all(volunteer_cache_stats(stage_grid, n)["held"] == 0 for n in names)

    wait_for(settled, "the volunteers to let go of the round's inputs")
    after = {n: volunteer_cache_stats(stage_grid, n) for n in names}
    read_again = sum(after[n]["held_hits"] - before[n]["held_hits"] for n in names)
    released = sum(after[n]["released"] - before[n]["released"] for n in names)
    # read where the forward ran: by the task and its replica, in 2 rounds, 4 x again at most (one still in the
    # worker's memory when its backward arrives is read there, no hit); none without the volunteers' copies
    assert again > 0 and read_again >= 3 * again, (read_again, again, after)
    assert released >= read_again
    assert trainer.history[-1]["verification"]["rejected"] == 0


@pytest.mark.slow
def test_a_tampered_copy_of_a_stages_input_never_reaches_an_update_and_its_holder_is_banned(tmp_path):
    """Issue 28: a volunteer's copy of a stage's input is not trusted.  One that serves its backward stage tasks a
    tampered copy (``tests.cache_volunteers --attack tamper-held``: the largest element off by 1e-3; the lab's data
    blocks honest) returns gradients that its task's replica, on another volunteer, disagrees with: the lab
    recomputes, the applied updates are torch's, and the tamperer is banned; the honest volunteers are not."""
    from goblin_dask.node.local import LabNode
    from tests.conftest import wait_for

    with LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node:
        tamperer = node.add_volunteer(module="tests.cache_volunteers", extra_args=("--attack", "tamper-held"))
        honest = [node.add_volunteer() for _ in range(2)]
        trainer, ref, opt = _trainer_in_stages(node, 6)
        for r in range(10):  # two rounds at least, then until it is caught (2 rejected in the first, in 2 of 2 runs)
            x, y = _batch(rows=8, seed=90 + r)
            assert trainer.step(x, y) == pytest.approx(_torch_round(ref, opt, x, y, 4), rel=1e-4)
            if r >= 1 and node.report()["volunteers"].get(tamperer, {}).get("rejected"):
                break
        wait_for(lambda: node.report()["volunteers"].get(tamperer, {}).get("banned"), f"{tamperer} to be banned")
        state, report = trainer.state_dict(), node.report()
    for k, v in ref.state_dict().items():
        if v.dtype.is_floating_point:
            np.testing.assert_allclose(state[k], v.numpy(), rtol=1e-3, atol=1e-5, err_msg=k)
    assert report["volunteers"][tamperer]["rejected"] >= 1
    assert all(not report["volunteers"][n]["banned"] and report["volunteers"][n]["rejected"] == 0 for n in honest)


def test_the_model_stays_on_the_lab_worker_between_rounds_and_checkpoints_sync_it(stage_grid, tmp_path):
    """After a staged round the next round's graph carries no parameter or optimizer-state numbers (they are
    the lab worker's, read there by reference, the parameters as one flat vector: one task, not one per
    parameter); the optimizer step reads the packed results in one task;
    a checkpoint written from the lab worker's copy resumes into torch's next round."""
    from goblin_dask.array.sources import lab_value
    from goblin_dask.training import Trainer, optim

    torch.manual_seed(5)
    model = gpt(64, 32, 2, 16, 2).train()
    ref = copy.deepcopy(model)
    # SGD with momentum: its state (the momentum buffers) stays on the lab worker too.  (Not Adam here: the
    # gradient of a key bias is rounding noise, softmax being blind to it, and Adam scales noise up to lr.)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    trainer = Trainer(model, lm_loss, make(model), micro_batches=2, client=stage_grid.client)
    opt = make(ref)
    batches = [_batch(rows=8, seed=40 + r) for r in range(3)]
    trainer.step(*batches[0])
    _torch_round(ref, opt, *batches[0], 2)
    dsk, key = trainer.round_graph(*batches[1])
    assert dsk[key].func is optim.lab_round_packed
    x_shape = batches[1][0].shape  # the batch rides in the graph (as x and y); no parameter of this shape
    assert set(_parameter_numbers_in(dsk, 2)) <= {x_shape}
    assert all(tuple(p.shape) != x_shape for p in model.parameters())
    # the parameters as one flat vector (one lab task, one fetch per stage task), the buffers one each
    blocks = [t for t in dsk.values() if getattr(t, "func", None) is lab_value]
    assert len(blocks) == 1 + len(trainer.buffer_names)
    flat = [t for t in blocks if t.args[1] == ("flat",)]
    assert len(flat) == 1
    assert flat[0].kwargs["lab_array"][1] == (sum(p.numel() for p in model.parameters()),)
    assert trainer.step(*batches[1]) == pytest.approx(_torch_round(ref, opt, *batches[1], 2), rel=1e-4)
    # the counters a round asks for twice, without the whole report (whose exposure account grows every round)
    client = stage_grid.client
    brief, full = client.sync(client.scheduler.goblin_report, brief=True), stage_grid.report()
    assert brief == {k: full[k] for k in ("tasks", "accepted", "rejected", "by_method")}
    assert trainer.history[-1]["verification"]["tasks"] > 0
    path = trainer.save(tmp_path)  # from the lab worker's copy
    again = copy.deepcopy(model)
    resumed = Trainer.resume(path, again, lm_loss, make(again), micro_batches=2, client=stage_grid.client)
    assert resumed.step(*batches[2]) == pytest.approx(_torch_round(ref, opt, *batches[2], 2), rel=1e-4)
    state = resumed.state_dict()
    for k, v in ref.state_dict().items():
        if v.dtype.is_floating_point:
            np.testing.assert_allclose(state[k], v.numpy(), rtol=1e-3, atol=1e-5, err_msg=k)


def test_batchnorm_statistics_pass_from_stage_task_to_stage_task(stage_grid):
    """A CNN with BatchNorm in train mode: each micro-batch's stage task reads the running statistics the one
    before it wrote; the parameters and the statistics after two rounds are torch's."""
    from torch import nn

    from goblin_dask.training import Trainer

    torch.manual_seed(6)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 5)).train()
    ref = copy.deepcopy(model)
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                      micro_batches=2, client=stage_grid.client)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rng = np.random.default_rng(7)
    for _ in range(2):
        x, y = rng.standard_normal((8, 3, 6, 6)).astype(np.float32), rng.integers(0, 5, 8)
        opt.zero_grad()
        want = 0.0
        for idx in np.array_split(np.arange(8), 2):
            loss = F.cross_entropy(ref(torch.from_numpy(x[idx])), torch.from_numpy(y[idx])) * (len(idx) / 8)
            loss.backward()
            want += float(loss)
        opt.step()
        assert trainer.step(x, y) == pytest.approx(want, rel=1e-4)
        # one stage task for both micro-batches (the second reads the statistics the first wrote), replicated
        by = trainer.history[-1]["verification"]["by_method"]
        assert by.get("replica", 0) + by.get("audit", 0) == 2 and set(by) <= {"replica", "audit"}, by
    state = trainer.state_dict()
    for k, v in ref.state_dict().items():
        np.testing.assert_allclose(state[k], v.numpy(), rtol=1e-3, atol=1e-5, err_msg=k)


def test_a_model_whose_parameters_are_capped_per_task_runs_op_by_op(stage_grid):
    """``goblin.minimization.parameters-max-share`` set: no volunteer task may hold a whole parameter, so no
    stage task (which holds them all) is built; the round runs op by op and still gives torch's numbers."""
    import dask

    from goblin_dask.training import Trainer

    torch.manual_seed(8)
    model = gpt(64, 32, 2, 16, 2).train()  # its token embedding (2048 elements) over small-array's 1024 below
    ref = copy.deepcopy(model)
    trainer = Trainer(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=2,
                      client=stage_grid.client)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = _batch(rows=8, seed=50)
    with dask.config.set({"goblin.minimization.parameters-max-share": 0.5, "goblin.minimization.small-array": 1024}):
        dsk, _ = trainer.round_graph(x, y)
        assert not any(isinstance(t, CatalogTask) and t.op.name == "program" for t in dsk.values())
        assert trainer.step(x, y) == pytest.approx(_torch_round(ref, opt, x, y, 2), rel=1e-4)


def test_honest_volunteers_on_another_blas_kernel_are_never_rejected():
    from goblin_dask.node.local import LabNode

    with LabNode.local(volunteers=1) as node:
        node.add_volunteer(env={"OPENBLAS_CORETYPE": "SandyBridge", "OPENBLAS_NUM_THREADS": "1"})
        trainer = _train_against_torch(node, rounds=2)
        report = node.report()
        assert report["rejected"] == 0 and report["accepted"] >= 8, report
        # 2 stage tasks a round (one per volunteer thread), each replicated on the other kernel
        assert all(_replicated(e["verification"]["by_method"]) == 4 for e in trainer.history)


@pytest.mark.slow
@pytest.mark.parametrize("cheat, op", [("scale", "program"), ("element", "matmul"), ("stale", "program"),
                                       ("widen", "program")])
def test_a_cheater_inside_a_stage_task_never_reaches_an_update_and_is_banned(cheat, op):
    """A gradient scaled by 1.001, one product inside the stage wrong, a result of an earlier task, noisy
    outputs sent with huge rounding floors (the honest replica's floors bound the comparison)."""
    from goblin_dask.node.local import LabNode

    with LabNode.local(volunteers=1) as node:
        cheater = node.add_volunteer(module="tests.cheaters", extra_args=("--cheat", cheat, "--cheat-op", op))
        _train_against_torch(node, rounds=3)  # every applied update is torch's
        report = node.report()
        assert report["volunteers"][cheater]["rejected"] >= 1, report
        honest = [n for n in report["volunteers"] if n != cheater]
        assert all(report["volunteers"][n]["rejected"] == 0 for n in honest), report
        if report["volunteers"][cheater]["rejected"] >= 2:
            assert report["volunteers"][cheater]["banned"]
            # its removal is the ban, not a crash (the stream closes before the scheduler removes it)
            assert not [f for f in report["faults"]["faults"] if f["volunteer"] == cheater and f["kind"] == "crash"]


def test_two_colluding_volunteers_agreeing_on_a_wrong_stage_result_are_caught_by_the_labs_audit():
    """One person's two credentials: the first returns a stage task's outputs as 0.5 everywhere, the other's
    replica (a ``program_sketch``) fingerprints those same wrong outputs for the lab's seed, so the replicas
    agree; the lab's audit (rate 1 here) runs the program on its own worker, rejects both and bans them, and
    the captured GPT's output is torch's."""
    import dask

    import goblin_dask
    from goblin_dask.node.local import LabNode
    from tests.conftest import wait_for

    model = gpt(64, 32, 2, 16, 2)
    ids = np.random.default_rng(4).integers(0, 64, (6, 16))
    with dask.config.set({"goblin.verification.audit-rate": 1.0}), LabNode.local(volunteers=0) as node:
        pair = [node.add_volunteer(module="tests.cheaters", extra_args=("--cheat", "half", "--cheat-op", "program"))
                for _ in range(2)]
        out = goblin_dask.capture(model, torch.as_tensor(ids))(ids)
        future = node.client.compute(out)
        wait_for(lambda: all(node.report()["volunteers"].get(n, {}).get("banned") for n in pair),
                 "the lab's audits to ban both", timeout=600)
        node.add_volunteer()  # anything the pair left undone needs a volunteer (none is left)
        np.testing.assert_allclose(future.result(), model(torch.as_tensor(ids)).detach().numpy(), rtol=1e-4,
                                   atol=1e-5)
        report = node.report()
        assert report["by_method"].get("audit", 0) >= 2, report
        for name in pair:
            assert "audit" in {r["method"] for r in report["rejections"] if r["volunteer"] == name}, report



# -- local steps (DiLoCo) -----------------------------------------------------------------------


def _torch_outer_round(model, outer, make_inner, loss_fn, x, y, workers, inner_steps):
    """DiLoCo's round in torch: each worker a copy of ``model`` taking ``inner_steps`` steps of a fresh inner
    optimizer on consecutive slices of its shard; the outer SGD steps with the share-weighted mean of
    (start - end) as the gradient; float buffers the share-weighted mean, integer ones rounded."""
    n = len(x)
    start = [p.detach().clone() for p in model.parameters()]
    delta = [torch.zeros_like(p) for p in start]
    buffers = [torch.zeros_like(b, dtype=torch.float64) for b in model.buffers()]
    loss = 0.0
    for shard in np.array_split(np.arange(n), workers):
        share = len(shard) / n
        worker = copy.deepcopy(model)
        inner = make_inner(worker)
        for idx in np.array_split(shard, inner_steps):
            inner.zero_grad()
            step_loss = loss_fn(worker(torch.from_numpy(x[idx])), torch.from_numpy(y[idx]))
            step_loss.backward()
            inner.step()
            loss += float(step_loss.detach()) * len(idx) / n
        for d, p0, p in zip(delta, start, worker.parameters()):
            d += share * (p0 - p.detach())
        for total, b in zip(buffers, worker.buffers()):
            total += share * b.double()
    outer.zero_grad()
    for p, d in zip(model.parameters(), delta):
        p.grad = d
    outer.step()
    with torch.no_grad():
        for b, total in zip(model.buffers(), buffers):
            b.copy_(total.to(b.dtype) if b.dtype.is_floating_point else total.round().to(b.dtype))
    return loss


def _assert_state_is(trainer, ref):
    state = trainer.state_dict()
    for k, v in ref.state_dict().items():
        np.testing.assert_allclose(state[k], v.numpy(), rtol=1e-3, atol=1e-5, err_msg=k)


def test_local_steps_give_torchs_diloco_round_and_resume_from_a_checkpoint(stage_grid, tmp_path):
    """``inner_steps=2`` on 2 workers: each worker's 2 inner SGD steps are one stage task (replicated), the lab
    steps DiLoCo's outer Nesterov SGD with the averaged pseudo-gradient; the losses and the model after each
    round are those of the same computation in torch, a checkpoint resumes it, the outer momentum stays on the
    lab worker, and no parameter number rides in a later round's graph."""
    from goblin_dask.training import Trainer, optim

    torch.manual_seed(8)
    model = gpt(64, 32, 2, 16, 2).train()
    ref = copy.deepcopy(model)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True)  # noqa: E731
    trainer = Trainer(model, lm_loss, make(model), micro_batches=2, inner_steps=2, client=stage_grid.client)
    outer = torch.optim.SGD(ref.parameters(), lr=0.7, momentum=0.9, nesterov=True)  # DiLoCo's, the default
    batches = [_batch(rows=8, seed=60 + r) for r in range(3)]
    for x, y in batches[:2]:
        want = _torch_outer_round(ref, outer, make, lm_loss, x, y, workers=2, inner_steps=2)
        assert trainer.step(x, y) == pytest.approx(want, rel=1e-4)
        v = trainer.history[-1]["verification"]
        assert v["rejected"] == 0 and _replicated(v["by_method"]) == 4, v  # 2 workers' tasks and their replicas
    dsk, key = trainer.round_graph(*batches[2])
    assert dsk[key].func is optim.lab_outer_round_packed
    assert sum(isinstance(t, CatalogTask) and t.op.name == "program" for t in dsk.values()) == 2
    assert set(_parameter_numbers_in(dsk, 2)) <= {batches[2][0].shape}
    _assert_state_is(trainer, ref)
    path = trainer.save(tmp_path)
    again = copy.deepcopy(model)
    with pytest.raises(ValueError, match="inner_steps=2"):
        Trainer.resume(path, again, lm_loss, make(again), micro_batches=2, client=stage_grid.client)
    resumed = Trainer.resume(path, again, lm_loss, make(again), micro_batches=2, inner_steps=2,
                             client=stage_grid.client)
    want = _torch_outer_round(ref, outer, make, lm_loss, *batches[2], workers=2, inner_steps=2)
    assert resumed.step(*batches[2]) == pytest.approx(want, rel=1e-4)
    _assert_state_is(resumed, ref)


def test_local_adamw_steps_with_batchnorm_average_the_workers_statistics(stage_grid):
    """A CNN with BatchNorm, AdamW inside (fresh each round), a plain outer SGD: the parameters, the running
    statistics (the workers' average) and the count of batches after two rounds are torch's."""
    from torch import nn

    from goblin_dask.training import Trainer

    torch.manual_seed(9)
    # no bias before BatchNorm: its gradient is rounding noise (BatchNorm removes it), which Adam scales up to lr
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 5)).train()
    ref = copy.deepcopy(model)
    make = lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.01)  # noqa: E731
    trainer = Trainer(model, F.cross_entropy, make(model), micro_batches=2, inner_steps=3, client=stage_grid.client,
                      outer_optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    outer = torch.optim.SGD(ref.parameters(), lr=0.5)
    rng = np.random.default_rng(10)
    for _ in range(2):
        x, y = rng.standard_normal((13, 3, 6, 6)).astype(np.float32), rng.integers(0, 5, 13)  # uneven shards
        want = _torch_outer_round(ref, outer, make, F.cross_entropy, x, y, workers=2, inner_steps=3)
        assert trainer.step(x, y) == pytest.approx(want, rel=1e-4)
    _assert_state_is(trainer, ref)


def test_local_steps_refuse_what_they_cannot_run_before_anything_is_sent(stage_grid):
    from torch import nn

    from goblin_dask.training import Trainer

    model = gpt(64, 32, 2, 16, 2).train()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="inner_steps must be a positive int"):
            Trainer(model, lm_loss, sgd, inner_steps=bad)
    with pytest.raises(ValueError, match="give inner_steps > 1"):
        Trainer(model, lm_loss, sgd, outer_optimizer=torch.optim.SGD(model.parameters(), lr=0.7))
    with pytest.raises(TypeError, match="outer step is torch.optim.SGD"):
        Trainer(model, lm_loss, sgd, inner_steps=2, outer_optimizer=torch.optim.Adam(model.parameters()))
    with pytest.raises(ValueError, match="not in outer_optimizer"):
        Trainer(model, lm_loss, sgd, inner_steps=2, outer_optimizer=torch.optim.SGD(list(model.parameters())[:1], lr=1))
    trainer = Trainer(model, lm_loss, sgd, micro_batches=2, inner_steps=4, client=stage_grid.client)
    before = stage_grid.report()
    with pytest.raises(ValueError, match="2 micro-batches of 4 inner steps"):
        trainer.step(*_batch(rows=7))
    dropout = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    trainer = Trainer(dropout, F.cross_entropy, torch.optim.SGD(dropout.parameters(), lr=0.1), micro_batches=2,
                      inner_steps=2, client=stage_grid.client)
    x, y = np.ones((8, 8), np.float32), np.zeros(8, np.int64)
    with pytest.raises(ValueError, match="inner_steps=2: each worker's steps run as one stage task"):
        trainer.step(x, y)
    with dask.config.set({"goblin.minimization.max-share": 0.25, "goblin.minimization.small-array": 16}):
        trainer = Trainer(model, lm_loss, sgd, micro_batches=2, inner_steps=2, client=stage_grid.client)
        with pytest.raises(ValueError, match="raise micro_batches"):
            trainer.step(*_batch(rows=8))
    assert stage_grid.report()["tasks"] == before["tasks"]  # nothing was dispatched
    assert model.training


@pytest.mark.slow
def test_a_stale_pseudo_gradient_never_reaches_the_outer_step_and_its_sender_is_banned():
    """A volunteer returning an earlier task's result (a pseudo-gradient of another shard or round) for its
    worker's stage task: the replica disagrees, the lab recomputes, the update applied is torch's."""
    from goblin_dask.node.local import LabNode
    from goblin_dask.training import Trainer

    with LabNode.local(volunteers=1) as node:
        cheater = node.add_volunteer(module="tests.cheaters", extra_args=("--cheat", "stale", "--cheat-op", "program"))
        torch.manual_seed(11)
        model = gpt(64, 32, 2, 16, 2).train()
        ref = copy.deepcopy(model)
        make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
        trainer = Trainer(model, lm_loss, make(model), micro_batches=2, inner_steps=2, client=node.client)
        outer = torch.optim.SGD(ref.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        for r in range(3):
            x, y = _batch(rows=8, seed=70 + r)
            want = _torch_outer_round(ref, outer, make, lm_loss, x, y, workers=2, inner_steps=2)
            assert trainer.step(x, y) == pytest.approx(want, rel=1e-4)
        _assert_state_is(trainer, ref)
        report = node.report()
        assert report["volunteers"][cheater]["rejected"] >= 1, report
        assert all(v["rejected"] == 0 for n, v in report["volunteers"].items() if n != cheater), report


@pytest.mark.slow
def test_a_tampered_resident_copy_of_the_parameters_is_caught_and_a_returning_volunteer_is_sent_them_again(tmp_path):
    """A volunteer keeps a round's parameters in its panel cache between its stage tasks; one that serves its
    tasks a tampered copy (one weight times 1 + 1e-3) is caught by the replica comparison and the lab's
    recomputation, and no tampered number reaches an update.  A volunteer that leaves takes its copy with it:
    one joining in its place is sent the parameters again, and the rounds go on as torch's."""
    import uuid

    from goblin_dask.node.local import LabNode
    from goblin_dask.training import Trainer
    from tests.conftest import read_log

    trigger = tmp_path / f"tamper-{uuid.uuid4().hex}"
    torch.manual_seed(12)
    model = gpt(64, 32, 2, 16, 2).train()
    ref = copy.deepcopy(model)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    opt = make(ref)
    with LabNode.local(volunteers=1) as node:
        tamperer = node.add_volunteer(module="tests.cache_volunteers",
                                      extra_args=("--attack", "tamper", "--trigger", str(trigger)))
        trainer = Trainer(model, lm_loss, make(model), micro_batches=4, client=node.client)

        def round_as_torchs(seed: int) -> None:
            x, y = _batch(rows=8, seed=seed)
            assert trainer.step(x, y) == pytest.approx(_torch_round(ref, opt, x, y, 4), rel=1e-4)

        round_as_torchs(80)
        trigger.touch()  # from now on, what it serves itself from its cache is tampered
        # Its second task of each round reads the parameters from its cache, tampered.  The weight it changes,
        # the largest, lies in a token's embedding row: a task whose micro-batches lack that token computes the
        # same numbers from it, rightly accepted.  Which micro-batches reach it first varies from run to run, so
        # the rounds go on, each checked against torch's, until it has been caught (each round, about 1 in 2).
        for r in range(1, 21):
            round_as_torchs(80 + r)
            if node.report()["volunteers"][tamperer]["rejected"] >= 1:
                break
        served = read_log(node._log_path(tamperer)).count("serving a tampered copy")
        assert served >= 1, f"in {r} rounds its tasks never read the parameters from its cache"
        node.kill_volunteer(tamperer)
        node.add_volunteer()
        round_as_torchs(90)
        _assert_state_is(trainer, ref)
        report = node.report()
    assert report["volunteers"][tamperer]["rejected"] >= 1, (f"{served} tampered copies served", report)
    assert all(v["rejected"] == 0 for n, v in report["volunteers"].items() if n != tamperer), report
