"""Verification in the graph: no volunteer result is used before the lab accepts it.

:func:`insert_checks` rewrites a graph of catalog tasks: each task placed on a
volunteer is renamed to an ``unverified-`` key, and its original key becomes a check
task on the lab worker that takes the volunteer's result and the same operands,
verifies it by the op's declared method, reports the verdict to the lab node, and
returns the result (or the lab's own recomputation when it was rejected).  Every
downstream task and the researcher therefore only ever see accepted numbers; the
scheduler places a catalog task on a volunteer only under an ``unverified-`` key.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

import numpy as np
from dask._task_spec import GraphNode, Task, TaskRef

from goblin_dask.ops.spec import CatalogTask, OpSpec
from goblin_dask.validation.freivalds import check_product

UNVERIFIED_PREFIX = "unverified-"
VERDICT_OP = "goblin-verdict"


def is_unverified_key(key: Any) -> bool:
    name = key[0] if isinstance(key, tuple) and key else key
    return isinstance(name, str) and name.startswith(UNVERIFIED_PREFIX)


def unverified_key(key: Any) -> Any:
    if isinstance(key, tuple):
        return (UNVERIFIED_PREFIX + str(key[0]),) + key[1:]
    return UNVERIFIED_PREFIX + str(key)


def insert_checks(dsk: Mapping[Any, GraphNode], keys: Any = None) -> dict[Any, GraphNode]:
    """Return ``dsk`` with a lab-side check after every volunteer-placed catalog task."""
    out: dict[Any, GraphNode] = {}
    for key, node in dsk.items():
        if isinstance(node, CatalogTask) and node.placement == "volunteer" and not is_unverified_key(key):
            raw = unverified_key(key)
            out[raw] = CatalogTask(raw, node.func, *node.args, placement="volunteer", **node.kwargs)
            out[key] = Task(key, accept, raw, TaskRef(raw), *node.args, op=node.func, params=dict(node.kwargs))
        else:
            out[key] = node
    return out


def accept(raw_key: Any, result: Any, *operands: Any, op: OpSpec, params: dict) -> Any:
    """Lab worker: verify a volunteer's result; return it, or the lab's recomputation."""
    start = time.perf_counter()
    method, ok = verify(op, result, operands, params)
    report_verdict(raw_key, method, ok, time.perf_counter() - start)
    if ok:
        return result
    return op.numpy(*operands, **params)


def verify(op: OpSpec, result: Any, operands: tuple, params: dict) -> tuple[str, bool]:
    """(method used, accepted?) for one result of ``op``."""
    if op.verify == "freivalds":
        factors = freivalds_factors(op.name, operands, params)
        if factors is not None:
            a, b, c0, shape = factors
            try:
                c = np.asarray(result)
                if c.shape != tuple(shape):
                    return "freivalds", False
                c2 = c.reshape(a.shape[0], b.shape[1]) if c.ndim != 2 or c.shape != (a.shape[0], b.shape[1]) else c
            except (ValueError, TypeError):
                return "freivalds", False
            return "freivalds", check_product(c2, a, b, c0)
    return "recompute", same_result(result, op.numpy(*operands, **params))


def freivalds_factors(name: str, operands: tuple, params: dict):
    """(A, B, C0, result shape) so that result == A @ B + C0, for product-like ops."""
    if name == "matmul":
        a, b = (np.asarray(x) for x in operands)
        if a.ndim == 2 and b.ndim == 2:
            return a, b, None, (a.shape[0], b.shape[1])
        return None
    if name == "matmul_accumulate":
        c0, a, b = (np.asarray(x) for x in operands)
        if a.ndim == 2 and b.ndim == 2 and c0.shape == (a.shape[0], b.shape[1]):
            return a, b, c0, c0.shape
        return None
    if name == "tensordot":
        a, b = (np.asarray(x) for x in operands)
        axes = params.get("axes", 2)
        if isinstance(axes, int):
            ax_a, ax_b = list(range(a.ndim - axes, a.ndim)), list(range(axes))
        else:
            ax_a, ax_b = [list(np.atleast_1d(x)) for x in axes]
        ax_a = [x % a.ndim for x in ax_a]
        ax_b = [x % b.ndim for x in ax_b]
        free_a = [i for i in range(a.ndim) if i not in ax_a]
        free_b = [i for i in range(b.ndim) if i not in ax_b]
        inner = math.prod(a.shape[i] for i in ax_a)
        a2 = a.transpose(free_a + ax_a).reshape(-1, inner)
        b2 = b.transpose(ax_b + free_b).reshape(inner, -1)
        return a2, b2, None, tuple(a.shape[i] for i in free_a) + tuple(b.shape[i] for i in free_b)
    return None


def same_result(got: Any, want: Any) -> bool:
    """Exact for integer/bool results, within a few ulps of the dtype for floats; NaN/inf positions exact."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if want.dtype.kind not in "fc":
        return bool(np.array_equal(got, want))
    if not (np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got) & (got > 0), np.isinf(want) & (want > 0))):
        return False
    fin = np.isfinite(want)
    eps = float(np.finfo(want.dtype).eps)
    return bool(np.allclose(got[fin], want[fin], rtol=64 * eps, atol=64 * eps * float(np.abs(want[fin]).max(initial=0.0))))


def report_verdict(raw_key: Any, method: str, accepted: bool, seconds: float) -> None:
    """Tell the lab node's verification ledger (over the lab worker's scheduler stream)."""
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:  # not on a worker (local scheduler, tests): nobody to tell
        return
    msg = {"op": VERDICT_OP, "key": raw_key, "method": method, "accepted": bool(accepted), "seconds": float(seconds)}
    worker.loop.add_callback(worker.batched_stream.send, msg)
