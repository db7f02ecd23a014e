"""Cheating volunteers: goblin volunteers whose catalog kernels return wrong numbers.

Run as ``python -m tests.cheaters --cheat KIND [--honest-first N] ADDRESS --token ...``
(``LabNode.add_volunteer(module="tests.cheaters", extra_args=...)`` puts the cheat
options after the volunteer's own; they are taken out before ``goblin volunteer``
parses the rest).  Everything else is the real volunteer agent: it joins over TLS with
its credential, runs the tasks the node sends, and is banned like any other.

KIND (each computes the honest result first, then):

* ``noise``: adds Gaussian noise of 1e-3 times the result's root mean square;
* ``zeros``: returns zeros;
* ``element``: multiplies the largest-magnitude finite element by 1 + 1e-3;
* ``stale``: returns the result of an earlier task of the same shape and dtype;
* ``stall``: never returns (it holds the task until the lab node reissues it);
* ``scale``: multiplies the whole result by 1.001 (a gradient scaled a little);
* ``half``: returns 0.5 everywhere (ones for integers), and for a stage task's replica (``program_sketch``)
  the fingerprint of that: two such volunteers (one person's two credentials) agree on every task;
* ``widen``: for a stage task (``program``), ``noise`` on its outputs and a rounding floor of 1e30 for each
  (a claim that any difference is rounding); other ops as ``noise``.

``--cheat-op NAME``: cheat on that op only (``program``: a stage task's outputs; ``matmul``: one
product inside it), every other op honest.

``--honest-first N``: compute honestly for the first N tasks, then cheat.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

KINDS = ("noise", "zeros", "element", "stale", "stall", "scale", "half", "widen")


def corrupt(kind: str, out, earlier: dict):
    """The wrong result a cheater of ``kind`` returns instead of ``out``."""
    if not isinstance(out, np.ndarray) or out.size == 0:
        return out
    if kind == "stall":
        threading.Event().wait()
    if kind == "zeros":
        return np.zeros_like(out)
    if kind == "half":
        return np.full_like(out, 0.5 if out.dtype.kind in "fc" else 1)
    if kind == "scale" and out.dtype.kind in "fc":
        return (out * out.dtype.type(1 + 1e-3)).astype(out.dtype)
    if kind == "stale":
        return earlier.get((out.shape, out.dtype.str), out)
    if out.dtype.kind not in "fc":  # integers: off by one
        bad = out.copy()
        bad.flat[0] += 1
        return bad
    finite = np.isfinite(out)
    if not finite.any():
        return out
    if kind == "noise":
        rms = float(np.sqrt(np.mean(np.abs(out[finite]) ** 2))) or 1.0
        noise = np.random.default_rng().standard_normal(out.shape) * (1e-3 * rms)
        return (out + noise.astype(out.dtype)).astype(out.dtype)
    if kind == "element":
        bad = out.copy()
        i = np.argmax(np.where(finite, np.abs(out), -1.0))
        bad.flat[i] *= out.dtype.type(1 + 1e-3)
        return bad
    raise ValueError(f"unknown cheat {kind!r}; one of {KINDS}")


def colluding_sketch(*inputs, program, seed):
    """A replica of a stage task from a colluder: the fingerprint of the wrong outputs its partner sent
    (``half``), for the seed the lab drew, so that the lab's comparison of the two agrees."""
    from goblin_dask.ops.program import run, sketch

    return sketch(corrupt("half", run(*inputs, program=program), {}), program, seed)


def parse(argv: list[str]) -> tuple[str, int, str, list[str]]:
    from tests.agent_options import take_options

    opts, rest = take_options(argv, {"cheat": "noise", "honest-first": 0, "cheat-op": ""})
    kind, honest_first = opts["cheat"], int(opts["honest-first"])
    if kind not in KINDS:
        raise SystemExit(f"tests.cheaters: --cheat must be one of {KINDS}, got {kind!r}")
    return kind, honest_first, opts["cheat-op"], rest


def main(argv: list[str]) -> None:
    kind, honest_first, only_op, rest = parse(argv)
    from goblin_dask.ops.spec import OpSpec

    honest_call = OpSpec.__call__
    lock = threading.Lock()
    state = {"tasks": 0}
    earlier: dict = {}

    def cheating_call(self, *args, **params):
        if kind == "half" and self.name == "program_sketch" and only_op in ("", "program"):
            return colluding_sketch(*args, **params)
        out = honest_call(self, *args, **params)
        if only_op and self.name != only_op:
            return out
        with lock:
            state["tasks"] += 1
            honest = state["tasks"] <= honest_first
            previous = earlier.get((getattr(out, "shape", None), getattr(getattr(out, "dtype", None), "str", None)))
            if isinstance(out, np.ndarray):
                earlier[(out.shape, out.dtype.str)] = out.copy()
        if honest:
            return out
        if kind == "stale":
            return previous if previous is not None else out  # the first of its shape: nothing stale yet
        if kind == "widen":
            bad = corrupt("noise", out, earlier)
            if self.name == "program":
                bad[bad.size - len(params["program"][3]):] = 1e30
            return bad
        return corrupt(kind, out, earlier)

    OpSpec.__call__ = cheating_call
    from goblin_dask.volunteer import main as volunteer_main

    volunteer_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
