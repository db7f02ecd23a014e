"""Stage tasks' replica comparison against honest kernels and small cheats (issue 28).

A stage task (``program``) is accepted when a replica on another volunteer agrees with it
(``same_sketch``: a seeded fingerprint) or when the lab's own recomputation does (``same_program_result``).
Honest volunteers differ: their OpenBLAS picks another kernel for their CPU, they run another number
of threads.  This runs each workload's program in a process of its own per kernel setting (OpenBLAS
reads ``OPENBLAS_CORETYPE`` at start), on several data draws, then compares every pair of settings:

* honest pairs: how many were rejected (whole result and fingerprint), and the largest honest
  difference in units of the tolerance (1.0 = rejected), output by output;
* cheats on each honest result: one output's values scaled by 1.001 (a gradient a little off), the
  largest element of one output off by 1e-3 of its magnitude: how many were caught.

Workloads: a GPT's forward and backward (the LM round's stage task), a CNN with a conv bias before
BatchNorm (a gradient that cancels to noise; an int64 counter packs float32 outputs as float64), the same
CNN's task for a round of 2 micro-batches (each one's gradient times its weight, summed: the cancelled
gradient reaches the output through ``multiply`` and ``add``), and a GPT's captured forward pass.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/stage_check.py [--draws 3] [--write]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import publish  # noqa: E402

SECTION = "## Stage tasks: honest kernels and small cheats (issue 28)"
#: (name, environment, threads): the kernels OpenBLAS offers on x86-64 and the thread counts volunteers run.
SETTINGS = [("default, 1 thread", {}, 1), ("default, 2 threads", {}, 2),
            ("SandyBridge, 1 thread", {"OPENBLAS_CORETYPE": "SandyBridge"}, 1),
            ("Haswell, 2 threads", {"OPENBLAS_CORETYPE": "Haswell"}, 2),
            ("Prescott, 1 thread", {"OPENBLAS_CORETYPE": "Prescott"}, 1)]

_RUN = r'''
import pickle, sys, numpy as np, threadpoolctl, torch, torch.nn.functional as F
from torch import nn
sys.path.insert(0, sys.argv[4])
from capture import gpt
from goblin_dask.ops.program import run
from goblin_dask.training.joint import trace
import goblin_dask
workload, draw, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(draw)
rng = np.random.default_rng(100 + draw)
def joint(model, loss, x, y):
    g = trace(model, loss, x, y, [n for n, _ in model.named_parameters()], [n for n, _ in model.named_buffers()])
    state = [p.detach().numpy() for p in model.parameters()] + [b.numpy() for b in model.buffers()]
    prog = g.stage_program([a.shape for a in state] + [x.shape, y.shape])
    return prog.spec, state + [x, y] + [g.flat_constant_value(group) for _, group in g.constant_groups()]
if workload == "GPT forward and backward":
    def lm(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    ids = rng.integers(0, 128, (4, 65))
    spec, inputs = joint(gpt(128, 64, 2, 64, 2).train(), lm, ids[:, :-1].copy(), ids[:, 1:].copy())
elif workload == "CNN, conv bias before BatchNorm":
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 5)).train()
    spec, inputs = joint(model, F.cross_entropy, rng.standard_normal((8, 3, 8, 8)).astype(np.float32),
                         rng.integers(0, 5, 8))
elif workload == "CNN, 2 micro-batches summed":
    from goblin_dask.training.trainer import Trainer
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 5)).train()
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=2)
    x, y = rng.standard_normal((8, 3, 8, 8)).astype(np.float32), rng.integers(0, 5, 8)
    parts = np.array_split(np.arange(8), 2)
    inputs = [trainer._params[k] for k in trainer.param_names] + [trainer._buffers[k] for k in trainer.buffer_names]
    spec = trainer._group_program(x, y, parts, [0.5, 0.5], [0, 1], inputs[:len(trainer.param_names)],
                                  inputs[len(trainer.param_names):]).spec
    for idx in parts:
        g = trainer._graph_for(x[idx[0]:idx[-1] + 1], y[idx[0]:idx[-1] + 1])
        inputs += [x[idx[0]:idx[-1] + 1], y[idx[0]:idx[-1] + 1],
                   *(g._constant_value(k) for k in g._stage_names()[len(g.inputs):])]
else:
    ids = rng.integers(0, 128, (4, 64))
    graph = goblin_dask.capture(gpt(128, 64, 2, 64, 2), torch.as_tensor(ids))
    spec = graph.stage_program([ids.shape]).spec
    inputs = [ids, *(graph.flat_constant_value(group) for _, group in graph.constant_groups())]
with threadpoolctl.threadpool_limits(int(sys.argv[5])):
    result = run(*inputs, program=spec)
pickle.dump((spec, result), open(out, "wb"))
'''

WORKLOADS = ("GPT forward and backward", "CNN, conv bias before BatchNorm", "CNN, 2 micro-batches summed",
             "GPT captured forward")


def results(workload: str, draw: int, tmp: Path) -> list[tuple[tuple, np.ndarray]]:
    """The program's result under each of :data:`SETTINGS` (a process each)."""
    out = []
    for i, (_, env, threads) in enumerate(SETTINGS):
        path = tmp / f"{abs(hash(workload))}-{draw}-{i}.pkl"
        subprocess.run([sys.executable, "-c", _RUN, workload, str(draw), str(path), str(HERE), str(threads)],
                       check=True, env={**os.environ, **env}, stderr=subprocess.DEVNULL)
        out.append(pickle.load(open(path, "rb")))
    return out


def margin(got: np.ndarray, want: np.ndarray, spec: tuple) -> float:
    """The largest honest difference, output by output, in units of its tolerance (elementwise or norm)."""
    from goblin_dask.ops.program import PROGRAM_TOLERANCE_EPS, _epsilon, outputs_of, rounding_floors

    floors = np.minimum(rounding_floors(got, spec), rounding_floors(want, spec))
    worst, at = 0.0, 0
    for (shape, dtype), floor in zip(outputs_of(spec), floors):
        n = math.prod(shape)
        g, w = got[at:at + n].astype(np.float64), want[at:at + n].astype(np.float64)
        at += n
        tol = PROGRAM_TOLERANCE_EPS * _epsilon(dtype, want.dtype)
        diff = np.abs(g - w)
        scale, norm = max(float(np.abs(w).max(initial=0)), floor), max(float(np.linalg.norm(w)), floor)
        if scale > 0:
            worst = max(worst, float(diff.max(initial=0)) / (tol * scale))
        if norm > 0:
            worst = max(worst, float(np.linalg.norm(diff)) / (tol * norm / 8))
    return worst


def cheats(result: np.ndarray, spec: tuple) -> list[tuple[str, int, np.ndarray]]:
    """Each float output (by index) scaled by 1.001, and its largest element off by 1e-3 of it."""
    from goblin_dask.ops.program import outputs_of

    out, at = [], 0
    for k, (shape, dtype) in enumerate(outputs_of(spec)):
        n = math.prod(shape)
        if np.dtype(dtype).kind == "f" and n and np.abs(result[at:at + n]).max() > 0:
            scaled = result.copy()
            scaled[at:at + n] *= 1.001
            element = result.copy()
            i = at + int(np.argmax(np.abs(result[at:at + n])))
            element[i] += 1e-3 * abs(element[i])
            out += [("scaled by 1.001", k, scaled), ("one element off by 1e-3", k, element)]
        at += n
    return out


def measure(draws: int) -> list[dict]:
    from goblin_dask.ops.program import outputs_of, rounding_floors, same_program_result, same_sketch, sketch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workload in WORKLOADS:
            row = {"workload": workload, "pairs": 0, "differ": 0, "rejected": 0, "sketch rejected": 0,
                   "margin": 0.0, "cheats": {}, "outputs": 0, "escaped": set()}
            for draw in range(draws):
                runs = results(workload, draw, Path(tmp))
                spec = runs[0][0]
                row["outputs"] = len(spec[3])
                for (_, a), (_, b) in itertools.combinations(runs, 2):
                    row["pairs"] += 1
                    row["differ"] += int(not np.array_equal(a, b))
                    row["rejected"] += int(not same_program_result(a, b, (), {"program": spec}))
                    seed = int(np.random.default_rng(draw).integers(2 ** 62))
                    row["sketch rejected"] += int(not same_sketch(sketch(a, spec, seed), sketch(b, spec, seed), spec))
                    row["margin"] = max(row["margin"], margin(a, b, spec))
                honest = runs[0][1]
                floors = rounding_floors(honest, spec)
                edges = np.cumsum([0] + [math.prod(s) for s, _ in outputs_of(spec)])
                for name, k, bad in cheats(honest, spec):
                    caught, seen = row["cheats"].get(name, (0, 0))
                    seed = int(np.random.default_rng(draw + 7).integers(2 ** 62))
                    hit = (not same_program_result(bad, honest, (), {"program": spec})
                           and not same_sketch(sketch(runs[-1][1], spec, seed), sketch(bad, spec, seed), spec))
                    row["cheats"][name] = (caught + int(hit), seen + 1)
                    if not hit:  # how far below its rounding floor the output is
                        own = float(np.abs(honest[edges[k]:edges[k + 1]]).max())
                        row["escaped"].add(f"output {k}: {own:.1e}, floor {floors[k]:.1e}")
            rows.append(row)
            print(row, flush=True)
    return rows


def markdown(command: str, draws: int, rows: list[dict]) -> str:
    lines = [SECTION, "", f"Command: `{command}`.  Kernel settings, each a process of its own: "
             + "; ".join(name for name, _, _ in SETTINGS) + f".  {draws} data draws (model weights and inputs) per "
             "workload; every pair of settings compared on each draw, whole (`same_program_result`, the lab's "
             "audit) and fingerprinted (`same_sketch`, a replica).  Margin: the largest honest difference of any "
             "output in units of its tolerance (1.0 would be rejected).  Cheats: on the first setting's result, "
             "each float output in turn; caught = refused by both comparisons (against another setting's honest "
             "replica).", "",
             "| workload | outputs | honest pairs (bits differ) | honest rejected, whole | honest rejected, fingerprint | "
             "largest honest margin | output scaled by 1.001 caught | largest element off by 1e-3 caught |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r["cheats"]
        fmt = lambda k: f"{c[k][0]}/{c[k][1]}" if k in c else "-"  # noqa: E731
        lines.append(f"| {r['workload']} | {r['outputs']} | {r['pairs']} ({r['differ']}) | {r['rejected']} | "
                     f"{r['sketch rejected']} | {r['margin']:.3f} | {fmt('scaled by 1.001')} | "
                     f"{fmt('one element off by 1e-3')} |")
    escaped = [f"{r['workload']}: " + "; ".join(sorted(r["escaped"])) for r in rows if r["escaped"]]
    if escaped:
        lines += ["", "Cheats not caught, by output (its largest magnitude, its rounding floor): "
                  + " | ".join(escaped) + ".  An output far below its floor is rounding noise (a bias's gradient "
                  "before a normalization, zero in exact arithmetic): a change of 1e-3 of it is below what two "
                  "honest kernels differ by, and moves the model by nothing a check could tell from rounding."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--write", action="store_true", help=f"write the section {SECTION!r} of RESULTS.md")
    args = p.parse_args(argv)
    command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/stage_check.py" + (
        f" --draws {args.draws}" if args.draws != 3 else "") + (" --write" if args.write else "")
    publish(SECTION, markdown(command, args.draws, measure(args.draws)), args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
