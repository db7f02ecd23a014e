"""Verification in the graph: no volunteer result is used before the lab accepts it.

:func:`insert_checks` rewrites a graph of catalog tasks: each task placed on a
volunteer is renamed to an ``unverified-`` key, and its original key becomes an
:func:`accept` task on the lab worker that takes the volunteer's result and the same
operands, verifies it, reports the verdict to the lab node's ledger
(``scheduler_plugins.verification``) and returns the result, or the lab's own
recomputation when it was rejected.  Every downstream task and the researcher
therefore only ever see accepted numbers; the scheduler places a catalog task on a
volunteer only under an ``unverified-`` key.

How a result is verified follows its op's declared verification (``OpSpec.verify``):

* ``Freivalds(form=...)`` (products): always checked, in O(n^2) (:mod:`.freivalds`),
  through the op's own form of the task as ``c == a @ b (+ c0)``.
* ``Replica()``: the task runs again on a *different* volunteer; the two results are
  compared (exactly for integers and booleans) and on disagreement the lab recomputes
  and decides.  Of the pairs, the ledger draws ``goblin.verification.audit-rate`` for the
  lab to recompute even when they agree (verdict method ``audit``): two credentials of one
  person agree on anything.  Only with ``goblin.verification.accept-on-trust`` does the
  ledger replicate a trusted volunteer's results less often (BOINC's adaptive
  replication), recompute a sample of the rest and accept the others on trust.
* ``Recompute()`` / ``Exact()``: the lab recomputes (such ops run on the lab worker only, so
  only a forced method below reaches this).

``dask.config`` ``goblin.verification.method`` overrides the declared method of every
volunteer task (``"replica"``: replicate products too, for the benchmark).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

import numpy as np
from dask._task_spec import GraphNode, Task, TaskRef
from dask.base import tokenize

from goblin_dask import settings
from goblin_dask.node.rpc import POLICY as POLICY_HANDLER  # the scheduler handler asked how to verify a replica
from goblin_dask.ops.spec import (CatalogTask, Exact, Freivalds, OpSpec, ProgramPickleTask, Recompute, Replica,
                                  Verification)
from goblin_dask.validation.freivalds import check_product

logger = logging.getLogger("goblin_dask.validation")

UNVERIFIED_PREFIX = "unverified-"
#: Key of the verdicts in the check task's metadata (sent with its task-finished message).
VERDICTS = "goblin-verdicts"
#: Methods a verdict may name (the report's ``by_method`` keys).
METHODS = ("freivalds", "replica", "audit", "sample", "recompute", "trusted")
#: What ``goblin.verification.method`` may force on every volunteer task instead of the ops' own.
OVERRIDES = {"replica": Replica(), "recompute": Recompute(), "exact": Exact()}


def is_unverified_key(key: Any) -> bool:
    name = key[0] if isinstance(key, tuple) and key else key
    return isinstance(name, str) and name.startswith(UNVERIFIED_PREFIX)


def unverified_key(key: Any) -> Any:
    if isinstance(key, tuple):
        return (UNVERIFIED_PREFIX + str(key[0]),) + key[1:]
    return UNVERIFIED_PREFIX + str(key)


def insert_checks(dsk: Mapping[Any, GraphNode], keys: Any = None) -> dict[Any, GraphNode]:
    """Return ``dsk`` with a lab-side check after every volunteer-placed catalog task."""
    forced = settings.get("goblin.verification.method")
    if forced is not None and forced not in OVERRIDES:
        raise ValueError(f"goblin.verification.method = {forced!r}: one of {sorted(OVERRIDES)} or None")
    out: dict[Any, GraphNode] = {}
    for key, node in dsk.items():
        if isinstance(node, CatalogTask) and node.placement == "volunteer" and not is_unverified_key(key):
            raw = unverified_key(key)
            out[raw] = CatalogTask(raw, node.func, *node.args, placement="volunteer", **node.kwargs)
            out[key] = check = CheckTask(key, accept, raw, TaskRef(raw), *node.args, op=node.func,
                                         params=dict(node.kwargs), method=forced, refs=_refs(node.args))
            # its token from the checked task's own: the operands and parameters are tokenized once, not twice
            check._token = tokenize(("accept", out[raw]._get_token(), raw, forced, _refs(node.args)))
        else:
            out[key] = node
    return out


class CheckTask(ProgramPickleTask):
    """The lab worker's check of a volunteer task (:func:`accept`): a stage program among its ``params`` travels as
    its pickle, as in the checked :class:`~goblin_dask.ops.spec.CatalogTask` itself."""

    __slots__ = ()
    PROGRAM_IN = "params"


def _refs(args: tuple) -> tuple:
    """The key each operand comes from (None for a literal), so a replica can name the same inputs."""
    return tuple(a.key if isinstance(a, TaskRef) else None for a in args)


# -- on the lab worker ------------------------------------------------------------------


def accept(raw_key: Any, result: Any, *operands: Any, op: OpSpec, params: dict, method: str | None = None,
           refs: tuple = ()) -> Any:
    """Lab worker: verify a volunteer's result; return it, or the lab's recomputation.

    ``method`` (``goblin.verification.method``) overrides the op's declared verification.

    A result that is not a numeric ``numpy.ndarray`` of the shape and dtype the catalog's
    rules predict for the task (:func:`result_form_violation`) is rejected before any check
    runs, with the reason, and the lab's own result is used.
    """
    check = _Check(raw_key, op, operands, params, refs)
    verification = OVERRIDES[method] if method else op.verify
    why = result_form_violation(result, op, operands, params) if _worker() is not None else None
    if why is not None:
        logger.warning("rejected result %r: %s", raw_key, why)
        check.verdict(raw_key, _method_name(verification), False, why)
        out = check.lab_result()
    else:
        out = check.run(result, verification)
    publish_verdicts(check.verdicts, check.seconds, check.cpu_seconds, flops=task_flops(op, operands, params))
    return out


def task_flops(op: OpSpec, operands: tuple, params: dict) -> float:
    """The task's work by the catalog's cost model (the volunteer's credit for an accepted result), 0 when
    the cost rule refuses the operands.  Computed here, on the lab worker, from the operands it holds."""
    try:
        return max(0.0, float(op.cost_of(*operands, **params).flops))
    except Exception:
        return 0.0


def _method_name(verification: Verification) -> str:
    return verification.method if verification.method in METHODS else "recompute"


def result_form_violation(result: Any, op: OpSpec, operands: tuple, params: dict) -> str | None:
    """Why ``result`` cannot be the result of ``op`` on ``operands``, or None.

    Accepted: a ``numpy.ndarray`` (not a subclass) of a numeric or boolean dtype, with the
    shape and dtype of ``op.abstract_eval`` (its shape and dtype rules).  When the rules
    cannot say (operands they refuse), only the type is checked: the lab's recomputation
    will fail the same way.
    """
    if type(result) is not np.ndarray:
        return f"the result is a {type(result).__module__}.{type(result).__qualname__}, not a numpy array"[:200]
    if result.dtype.kind not in "biufc":
        return f"the result's dtype {result.dtype} is not numeric"
    try:
        expected = op.abstract_eval(*operands, **params)
    except Exception:  # the operands themselves are bad: the lab's own computation says so
        return None
    if tuple(result.shape) != tuple(expected.shape):
        return f"the result's shape {tuple(result.shape)} is not {tuple(expected.shape)}"
    if result.dtype != expected.dtype:
        return f"the result's dtype {result.dtype} is not {expected.dtype}"
    return None


def judge(op: OpSpec, operands: tuple, params: dict, result: Any) -> bool:
    """Would the lab accept ``result`` of ``op`` on ``operands``, by the op's declared verification alone?

    The check a volunteer's result meets, without a grid: a Freivalds form is checked, any
    other method compares with the lab's own computation (what a disagreeing replica comes
    to).  The catalog tests run it on every op's examples, so an op whose verification
    cannot run fails there; ``benchmarks/gpu_check.py`` runs it on GPU kernels.
    """
    if result_form_violation(np.asarray(result) if isinstance(result, np.generic) else result, op, operands, params):
        return False
    verification = op.verify
    if isinstance(verification, Freivalds):
        form = verification.form(result, *operands, **params)
        if form is not None:
            return bool(check_product(form.c, form.a, form.b, form.c0))
        verification = verification.otherwise
    want = op.kernel("cpu")(*operands, **params)
    if op.compare is not None:
        return bool(op.compare(result, want, operands, params))
    return same_result(result, want, operands, exact=isinstance(verification, Exact))


class _Check:
    """One volunteer result under verification (see the module docstring for the methods)."""

    def __init__(self, raw_key: Any, op: OpSpec, operands: tuple, params: dict, refs: tuple):
        self.raw_key, self.op, self.operands, self.params, self.refs = raw_key, op, operands, params, refs
        self.seconds = 0.0  # lab time spent verifying (waiting for a replica excluded)
        self.cpu_seconds = 0.0  # of this thread (the lab worker's BLAS runs in the calling thread)
        self.verdicts: list[tuple[Any, str, bool, str | None]] = []
        #: the volunteer whose bytes are checked (the lab worker noted the peer it fetched them from)
        self.source = getattr(_worker(), "goblin_fetched_from", {}).get(raw_key)
        #: replica key -> the volunteer whose bytes of it were compared (:meth:`compute_replica`)
        self.replica_sources: dict[Any, str | None] = {}

    def verdict(self, key: Any, method: str, accepted: bool, reason: str = "") -> None:
        source = self.source if key == self.raw_key else self.replica_sources.get(as_key(key))
        self.verdicts.append((key, method, bool(accepted), source, reason))

    def run(self, result: Any, verification: Verification) -> Any:
        if isinstance(verification, Freivalds):
            return self.freivalds(result, verification)
        if _worker() is None:  # a local scheduler computed it here: nothing untrusted to check
            return result
        if isinstance(verification, Replica):
            return self.replica(result)
        return self.recompute(result, "recompute", exact=isinstance(verification, Exact))

    def _timed(self, fn, *args):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu

    def same(self, got: Any, want: Any, exact: bool = False) -> bool:
        """Do two results of this task agree (the op's own comparison where it declares one)?"""
        if self.op.compare is not None:
            return bool(self.op.compare(got, want, self.operands, self.params))
        return same_result(got, want, self.operands, exact)

    def lab_result(self) -> Any:
        """What an honest CPU volunteer computes: the catalog's CPU kernel (numba where the op has one).

        Then an honest CPU volunteer's result matches the lab's bit for bit, and only other
        kernels (cupy) lean on the comparison's tolerance.  NumPy's kernel may be the less
        accurate one (``moments``: NumPy sums float32 columns in float32, row after row, the
        numba kernel in float64).
        """
        kernel = self.op.kernel("cpu")
        return self._timed(lambda: kernel(*self.operands, **self.params))

    def freivalds(self, result: Any, verification: Freivalds) -> Any:
        expected = self.op.abstract_eval(*self.operands, **self.params)
        verdict = form = None
        if isinstance(result, (np.ndarray, np.generic)) and (result.shape, result.dtype) == tuple(expected):
            form = verification.form(result, *self.operands, **self.params)
            if form is None:  # this call is no product (a one-operand einsum): the op's declared fallback
                return self.run(result, verification.otherwise)
            verdict = self._timed(check_product, form.c, form.a, form.b, form.c0)
        ok = bool(verdict)
        self.verdict(self.raw_key, "freivalds", ok)
        if ok:
            return result
        if verdict is not None and verdict.recomputed is not None and form.same_layout:
            return verdict.recomputed.reshape(np.shape(result))
        return self.lab_result()

    def recompute(self, result: Any, method: str, exact: bool = False) -> Any:
        want = self.lab_result()
        ok = self._timed(self.same, result, want, exact)
        self.verdict(self.raw_key, method, ok)
        return result if ok else want

    def replica(self, result: Any) -> Any:
        policy = ask_policy(self.raw_key)
        if policy is None:  # not on a lab node (local scheduler): nothing to verify against
            return result
        if policy.get("replica") is not None:
            replica = _Replica.of(self)
            second = self.compute_replica(policy["replica"], float(policy.get("timeout", 600)), replica)
            why = replica.form_violation(self, second) if second is not None else None
            if why is not None:  # the replica's volunteer sent no result of this task: rejected, the lab decides
                logger.warning("rejected replica %r: %s", policy["replica"], why)
                self.verdict(policy["replica"], "replica", False, why)
                second = None
            if second is not None:
                return self.compare_replicas(result, policy["replica"], second, replica,
                                             audit=bool(policy.get("audit")))
            return self.recompute(result, "recompute")  # no replica in time: the lab decides alone
        if policy.get("sample"):
            return self.recompute(result, "sample")
        self.verdict(self.raw_key, "trusted", True)
        return result

    def compute_replica(self, replica_key: Any, timeout: float, replica: "_Replica | None" = None) -> Any:
        """The same task again, on another volunteer (the ledger restricts where); None if it does not come back."""
        from distributed import worker_client

        replica = replica or _Replica.of(self)
        key = as_key(replica_key)
        refs = self.refs or (None,) * len(self.operands)
        args = [TaskRef(as_key(r)) if r is not None else x for r, x in zip(refs, self.operands)]
        task = CatalogTask(key, replica.op, *args, placement="volunteer", **replica.params)
        deadline = time.monotonic() + timeout
        with worker_client() as client:
            future = client.get({key: task}, key, sync=False)
            try:
                while True:
                    future.result(timeout=max(0.0, deadline - time.monotonic()))  # finished (or raises)
                    fetched = client.sync(_fetch_noting_source, _worker(), client, key)
                    if fetched is not None:
                        value, self.replica_sources[key] = fetched
                        return value
                    if time.monotonic() > deadline:
                        raise TimeoutError("its holders did not answer the lab worker's fetch")
                    time.sleep(0.05)  # lost meanwhile: computed again, then fetched again
            except Exception as e:  # timed out, or the volunteer failed: the lab decides alone
                logger.warning("replica %r did not come back (%s: %s)", key, type(e).__name__, e)
                return None
            finally:
                future.release()

    def compare_replicas(self, result: Any, replica_key: Any, second: Any, replica: "_Replica | None" = None,
                         audit: bool = False) -> Any:
        """Judge a result and its replica.  ``audit``: the ledger drew this pair for the lab's own
        recomputation, which then decides for each of them even if they agree (verdict method ``audit``)."""
        replica = replica or _Replica.of(self)
        agree = self._timed(replica.agree, self, result, second)
        if agree and not audit:
            self.verdict(self.raw_key, "replica", True)
            self.verdict(replica_key, "replica", True)
            return result
        # They disagree, or the lab audits them: the validator recomputes and decides, for each of them.
        want = self.lab_result()
        ok_first = self._timed(self.same, result, want)
        ok_second = self._timed(replica.agree, self, want, second)
        method = "audit" if agree else "replica"
        why = "" if agree else "the replicas disagree; "
        self.verdict(self.raw_key, method, ok_first, "" if ok_first else why + "differs from the lab's recomputation")
        self.verdict(replica_key, method, ok_second, "" if ok_second else why + "differs from the lab's recomputation")
        return result if ok_first else second if ok_second and replica.op is self.op else want


async def _fetch_noting_source(worker, client, key) -> tuple[Any, str | None] | None:
    """``key``'s value and the address of the worker it was read from (None: this lab worker), or None
    when none of its holders gave it (lost meanwhile: it is computed again).

    A replica's verdict blames the volunteer whose bytes were compared, as a first result's does (the
    lab worker notes the peer in ``gather_dep``).  Who the scheduler says computed the key is not
    enough: when the volunteer that computed it is banned while the lab compares, the key is
    recomputed by another, which the scheduler then names.
    """
    from distributed.worker import get_data_from_worker

    from goblin_dask import link

    answer = await client.scheduler.who_has(keys=[key])
    holders = next((list(h or ()) for k, h in answer.items() if as_key(k) == key), [])
    if worker.address in holders and key in worker.data:
        return worker.data[key], None
    for holder in holders:
        try:
            response = await get_data_from_worker(worker.rpc, [key], holder, who=worker.address)
        except OSError as e:  # the link dropped: the next holder, or the next try
            logger.info("could not fetch replica %r from %s (%s)", key, holder, e)
            continue
        except Exception as e:  # an answer the lab does not read (a pickle, an error, not a dict, ...)
            response = f"{type(e).__name__}: {e}"
        status = response.get("status") if isinstance(response, dict) else None
        data = response.get("data") if status == "OK" else None
        if isinstance(data, dict) and key in data:
            return data[key], holder
        if status not in ("OK", "busy") or not isinstance(data, (dict, type(None))):
            # as for a first result (LabWorker.gather_dep): a volunteer that answers the lab's fetch with
            # anything but its data (or "busy", or OK without a key it lost meanwhile) is not believed again
            name = link.nat_name(holder)
            if name is not None:
                link.refuse(name, f"answered the lab worker's fetch of a replica with {str(response)[:200]}")
    return None


class _Replica:
    """How a replica of a task runs and is compared: the same task, compared with :meth:`_Check.same`; or, for
    a stage task (``program``), ``program_sketch`` with a seed drawn now, after the first result is in: the
    replica returns a fingerprint, compared with the first result's fingerprint for that seed."""

    def __init__(self, op: OpSpec, params: dict, agree):
        self.op, self.params, self.agree = op, params, agree

    @classmethod
    def of(cls, check: "_Check") -> "_Replica":
        if check.op.name != "program":
            return cls(check.op, check.params, lambda c, first, second: c.same(first, second))
        import secrets

        from goblin_dask.ops.program import PROGRAM_SKETCH, same_sketch, sketch

        program, seed = check.params["program"], secrets.randbits(62)

        def agree(c: "_Check", first: Any, fingerprint: Any) -> bool:
            return same_sketch(fingerprint, sketch(first, program, seed), program)

        return cls(PROGRAM_SKETCH, {"program": program, "seed": seed}, agree)

    def form_violation(self, check: "_Check", second: Any) -> str | None:
        return result_form_violation(second, self.op, check.operands, self.params)

def same_result(got: Any, want: Any, operands: tuple = (), exact: bool = False) -> bool:
    """Do two results of the same task agree?  Exact for integers and booleans (and ``exact`` ops).

    Floats: NaN and inf exactly in the same places; elsewhere within ``64 eps`` of the
    result's largest magnitude or, for reductions, of ``sqrt(m)`` times the operands'
    (``m`` elements summed into each output: summation order differs between kernels
    and machines).
    """
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if _same_bits(got, want):  # the usual case: the same kernel on the same inputs; one pass, no temporaries
        return True
    if want.dtype.kind not in "fc" or exact:
        return bool(np.array_equal(got, want, equal_nan=want.dtype.kind in "fc"))
    if not same_nonfinite(got, want):
        return False
    fin = np.isfinite(want)
    eps = float(np.finfo(want.dtype).eps)
    scale = float(np.abs(want[fin]).max(initial=0.0))
    for x in operands:
        x = np.asarray(x) if isinstance(x, (np.ndarray, np.generic, int, float, complex)) else None
        if x is not None and x.dtype.kind in "fciub" and x.size:
            m = x.size // max(want.size, 1)
            if m <= 1:  # elementwise: only the result's own magnitude means anything
                continue
            finite = np.abs(x[np.isfinite(x)]) if x.dtype.kind in "fc" else np.abs(x)
            scale = max(scale, float(np.sqrt(m)) * float(finite.max(initial=0.0)))
    with np.errstate(all="ignore"):
        return bool(np.allclose(got[fin], want[fin], rtol=64 * eps, atol=64 * eps * scale))


def same_nonfinite(got: np.ndarray, want: np.ndarray) -> bool:
    """NaN in the same places, and infinities in the same places with the same signs."""
    if not (np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))):
        return False
    inf = np.isinf(want)
    return not inf.any() or bool(np.array_equal(got[inf], want[inf]))


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    if not (got.flags.c_contiguous and want.flags.c_contiguous) or got.dtype.hasobject:
        return False
    return bool(np.array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)))


def as_key(key: Any) -> Any:
    """A key as the scheduler knows it (msgpack turns tuples into lists)."""
    return tuple(as_key(k) for k in key) if isinstance(key, list) else key


def _worker():
    from distributed import get_worker

    try:
        return get_worker()
    except ValueError:  # not on a worker (local scheduler, tests)
        return None


def ask_policy(raw_key: Any) -> dict | None:
    """The ledger's decision for a replica-method result: ``{"replica": key|None, "sample": bool, ...}``."""
    from distributed.utils import sync

    worker = _worker()
    if worker is None:
        return None
    return sync(worker.loop, getattr(worker.scheduler, POLICY_HANDLER), key=raw_key)


def publish_verdicts(verdicts: list, seconds: float, cpu_seconds: float = 0.0, flops: float = 0.0) -> None:
    """Attach the verdicts to this check task's metadata: the lab node's ledger reads them
    when the task finishes, so a verdict counts only if the scheduler accepts this run of
    the check (not one it cancelled because its input was lost and recomputed elsewhere)."""
    worker = _worker()
    if worker is None or not verdicts:  # not on a worker: nobody to tell
        return
    ts = worker.state.tasks.get(worker.get_current_task())
    if ts is not None:
        ts.metadata[VERDICTS] = {"seconds": float(seconds), "cpu_seconds": float(cpu_seconds),
                                 "flops": float(flops), "verdicts": [list(v) for v in verdicts]}
