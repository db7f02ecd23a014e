"""What a volunteer may learn: a cap per task, and an account per person.

The array layer's source blocks are lab-only tasks that name their place in a lab array
(``lab_array=(id, shape, box)``, or ``(id, shape, box, kind)`` for a kind of lab array other than
data, :mod:`goblin_dask.array.sources`; the id is opaque; :func:`parse_lab_array` checks it, and a
task given something else never reaches a volunteer).
From them this plugin follows, on the scheduler, which elements of which lab array every
block holds (its *lineage*): through layout ops (getitem, transpose, reshape, rechunk,
concatenate, ...) and elementwise ops (a block computed element by element reveals its
inputs), and the lab's check task of a volunteer result takes that result's lineage.
Products and reductions make new numbers (aggregates): their results count as no lab
array.  Plain ``DataNode`` blocks of hand-made graphs carry no lineage and are not
counted.  A fused chain of lab-only tasks (:class:`goblin_dask.ops.spec.LabChain`) is
followed step by step, so its result has the lineage its unfused tasks would have had.
Where the exact region is lost (after a reshape, a concatenation, an op of several
operands) a block counts as the whole of what it came from: the account errs on the
side of "the volunteer saw more".

* **Cap** (``goblin.minimization.max-share``, default 1/4; arrays of at most
  ``goblin.minimization.small-array`` = 4096 elements are exempt): before dispatch, a task placed
  on a volunteer whose dependencies hold more than that share of any lab array's
  elements is not sent: the lab computes it (its ``unverified-`` task becomes a no-op on
  the lab worker and the check task computes the op itself), so nothing fails and no
  volunteer sees it.  The array layer sizes product blocks so that this does not happen
  (:mod:`goblin_dask.array.linalg`); the check here catches what sizing cannot see.
  A model's parameters (kind ``"parameters"``) are capped by
  ``goblin.minimization.parameters-max-share`` instead (default None: not capped per task);
  the same array named as data anywhere is data.
* **Account**: for each volunteer and each lab array, the elements it received (distinct
  elements: the union of the regions of the blocks sent to it, so a block received twice
  counts once), as a fraction of the array, parameters as well as data.  A task counts when it is sent to a
  volunteer (``processing`` on it) and when a volunteer returns it (a stolen task).
  ``report()`` gives ``{volunteer: {array id: fraction}}``: ``LabNode.report()["exposure"]``; the
  same summed over each person's credentials (``goblin enroll --person``) is ``["exposure_by_person"]``.
* **Per-person cap** (``goblin.minimization.max-exposure``, default None: off): when set,
  each volunteer task is placed, when its graph arrives, on a volunteer whose person's exposure
  (received by all their credentials plus already planned) stays within the cap for every lab array, the one that
  learns least new from it (then the least loaded); when none can take it, the lab
  computes it.  A volunteer that leaves has its planned tasks placed again the same way.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import defaultdict
from typing import Any

import numpy as np
from dask._task_spec import Alias, Task
from distributed.diagnostics.plugin import SchedulerPlugin

from goblin_dask import settings
from goblin_dask.array.sources import KINDS, carries_lab_data, combined_kind, lab_block, lab_value, read_block, share_cap
from goblin_dask.ops.spec import CatalogTask, LabChain
from goblin_dask.roles import LAB_RESOURCE, VOLUNTEER_RESOURCE
from goblin_dask.validation.checks import accept, is_unverified_key
from scheduler_plugins.catalog_only import submitter

logger = logging.getLogger("goblin_dask.exposure")

#: Beyond this many cells a coverage stops splitting cells and marks whole ones (over-counts).
MAX_CELLS = 1 << 22

# A piece of lineage: (array id, box: ((lo, hi) per array axis), amap) where amap maps each
# axis of the block to an axis of the array (None: a new axis), or is None when the block's
# axes no longer correspond (then the box is all that is known: the block holds at most it).
Piece = tuple

#: The array id of the lineage of a source block whose ``lab_array`` is malformed: a volunteer task
#: that would receive it is computed by the lab (fail closed).
INVALID = "!invalid"


def parse_lab_array(where: Any) -> tuple[str, tuple[int, ...], tuple[tuple[int, int], ...], str]:
    """``(id, shape, box, kind)`` of a source block's ``lab_array=``; ValueError unless it is exactly
    ``(id, shape, box)`` or ``(id, shape, box, kind)``: a non-empty str id, a shape of ints >= 0, a box of
    one ``(lo, hi)`` pair of ints with ``0 <= lo <= hi <= n`` per axis, a kind of
    :data:`goblin_dask.array.sources.KINDS` (the 3-tuple is data)."""
    def is_int(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

    if not isinstance(where, tuple) or len(where) not in (3, 4):
        raise ValueError(f"lab_array: a tuple (id, shape, box[, kind]), got {type(where).__name__}")
    aid, shape, box = where[:3]
    kind = where[3] if len(where) == 4 else "data"
    if not isinstance(aid, str) or not aid or aid == INVALID:
        raise ValueError("lab_array: the id is not a non-empty str")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"lab_array: kind {kind!r} is not one of {KINDS}")
    if not isinstance(shape, tuple) or not all(is_int(n) and n >= 0 for n in shape):
        raise ValueError("lab_array: the shape is not a tuple of ints >= 0")
    if not isinstance(box, tuple) or len(box) != len(shape):
        raise ValueError("lab_array: the box has not one (lo, hi) per axis of the shape")
    for pair, n in zip(box, shape):
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(is_int(v) for v in pair)
                and 0 <= pair[0] <= pair[1] <= n):
            raise ValueError("lab_array: a box axis is not (lo, hi) with 0 <= lo <= hi <= n")
    return (aid, tuple(int(n) for n in shape), tuple((int(lo), int(hi)) for lo, hi in box), kind)


def kept_on_lab(*_deps: Any) -> None:
    """Lab worker: stands in for a volunteer task the lab computes itself (see the module docstring)."""
    return None


class Coverage:
    """The union of boxes in an n-d array, exactly, on a grid cut at the boxes' edges."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = tuple(int(s) for s in shape)
        self.edges = [[0, n] for n in self.shape]
        self.mask = np.zeros((1,) * len(self.shape), dtype=bool)

    def copy(self) -> "Coverage":
        other = Coverage.__new__(Coverage)
        other.shape, other.edges, other.mask = self.shape, [list(e) for e in self.edges], self.mask.copy()
        return other

    def _cut(self, axis: int, p: int) -> None:
        edges = self.edges[axis]
        i = bisect.bisect_left(edges, p)
        if i < len(edges) and edges[i] == p:
            return
        if self.mask.size * (len(edges)) / max(len(edges) - 1, 1) > MAX_CELLS:
            return  # too fine already: whole cells get marked (an over-count)
        edges.insert(i, p)
        self.mask = np.insert(self.mask, i - 1, self.mask.take(i - 1, axis=axis), axis=axis)

    def add(self, box: tuple) -> None:
        clipped = [(max(0, min(lo, n)), max(0, min(hi, n))) for (lo, hi), n in zip(box, self.shape)]
        if any(lo >= hi for lo, hi in clipped):
            return
        for axis, (lo, hi) in enumerate(clipped):
            self._cut(axis, lo)
            self._cut(axis, hi)
        index = []
        for axis, (lo, hi) in enumerate(clipped):
            edges = self.edges[axis]
            index.append(slice(bisect.bisect_right(edges, lo) - 1, bisect.bisect_left(edges, hi)))
        self.mask[tuple(index)] = True

    def covered(self) -> int:
        if not self.shape:
            return int(self.mask.any())
        widths = [np.diff(np.asarray(e, dtype=np.int64)) for e in self.edges]
        # volume = sum(mask * outer(widths)): contract the last axis, then the next ...
        vol = self.mask.astype(np.float64)
        for w in reversed(widths):
            vol = vol @ w.astype(np.float64)
        return int(round(float(vol)))

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _pad(amap: tuple, ndim: int) -> tuple | None:
    if len(amap) > ndim:
        return None
    return (None,) * (ndim - len(amap)) + tuple(amap)


def _getitem(piece: Piece, index: tuple) -> Piece:
    aid, box, amap = piece
    if amap is None or not isinstance(index, tuple):
        return (aid, box, None)
    amap = _pad(amap, sum(1 for i in index if i is not None))
    if amap is None:
        return (aid, box, None)
    box, out, d = list(box), [], 0
    for i in index:
        if i is None:
            out.append(None)
            continue
        axis = amap[d]
        d += 1
        if axis is None:
            if isinstance(i, slice):
                out.append(None)
            continue
        lo, hi = box[axis]
        if hi - lo == 1:  # a broadcast (or size-1) axis: whatever is selected, it is this element
            if isinstance(i, slice):
                out.append(axis)
            continue
        if isinstance(i, slice):
            start, stop, step = i.indices(hi - lo)
            picked = range(start, stop, step)
            if len(picked) == 0:
                return (aid, tuple((0, 0) for _ in box), None)
            box[axis] = (lo + min(picked[0], picked[-1]), lo + max(picked[0], picked[-1]) + 1)
            out.append(axis)
        else:
            p = int(i) % (hi - lo)
            box[axis] = (lo + p, lo + p + 1)
    return (aid, tuple(box), tuple(out))


def _transform(opname: str, params: dict, pieces: tuple, single: bool) -> tuple:
    """Lineage of a block made by ``opname`` from blocks whose lineage is ``pieces``."""
    if opname == "getitem" and single:
        return tuple(_getitem(p, params.get("index")) for p in pieces)
    if opname == "transpose" and single:
        axes = tuple(params.get("axes") or ())
        out = []
        for aid, box, amap in pieces:
            amap = _pad(amap, len(axes)) if amap is not None else None
            out.append((aid, box, tuple(amap[a] for a in axes) if amap is not None else None))
        return tuple(out)
    if opname == "squeeze" and single:
        drop = set(params.get("axis") or ())
        return tuple((aid, box, tuple(a for d, a in enumerate(amap) if d not in drop) if amap is not None else None)
                     for aid, box, amap in pieces)
    if _elementwise(opname) or (single and opname not in ("reshape", "broadcast_to", "concatenate", "stack",
                                                          "expand_dims", "take", "pad")):
        return pieces  # element by element (operands broadcast from the right): the same places
    return tuple((aid, box, None) for aid, box, _ in pieces)


def _catalog_lineage(spec: CatalogTask, deps: list) -> tuple:
    """Lineage of catalog task ``spec`` from its dependencies' lineages ``deps`` (one per dependency)."""
    if not carries_lab_data(spec.func.name):
        return ()
    pieces = tuple(p for lin in deps for p in lin)
    if not pieces:
        return ()
    return _transform(spec.func.name, dict(spec.kwargs), pieces, single=len(deps) == 1)


def _elementwise(opname: str) -> bool:
    """An op whose output element (i, j, ...) reads only element (i, j, ...) of each (broadcast) operand."""
    from goblin_dask.ops._factories import broadcast_shape
    from goblin_dask.ops.registry import op_by_name

    try:
        rule = op_by_name(opname).shape_rule
    except Exception:
        return False
    return getattr(rule, "func", None) is broadcast_shape


class ExposurePlugin(SchedulerPlugin):
    name = "goblin-exposure"

    def __init__(self, scheduler, admission):
        self.scheduler = scheduler
        self.admission = admission
        self.lineage: dict[Any, tuple] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        #: array id -> kind (goblin_dask.array.sources.KINDS); data once any block names it data
        self.kinds: dict[str, str] = {}
        #: volunteer name -> array id -> Coverage of what it received (the report)
        self.received: dict[str, dict[str, Coverage]] = defaultdict(dict)
        #: person -> array id -> Coverage of what all their credentials received (what max-exposure bounds)
        self.learned: dict[str, dict[str, Coverage]] = defaultdict(dict)
        #: person -> array id -> Coverage planned (max-exposure placement), over all their credentials
        self.planned: dict[str, dict[str, Coverage]] = defaultdict(dict)
        #: volunteer address -> its person, for the addresses holding pins (kept after it leaves)
        self.owners: dict[str, str] = {}
        self.pinned: dict[Any, str] = {}
        #: volunteer address -> keys pinned to it (the index of ``pinned``: no scan of every pinned key per task)
        self.pinned_keys: dict[str, set] = defaultdict(set)
        #: processing tasks to pin again once released (:meth:`replan_when_released`)
        self.to_replan: set = set()

    # -- configuration ------------------------------------------------------------
    @staticmethod
    def max_share() -> float:
        share = settings.get("goblin.minimization.max-share")
        return 1.0 if share is None else float(share)

    @staticmethod
    def max_exposure() -> float | None:
        cap = settings.get("goblin.minimization.max-exposure")
        return None if cap is None else float(cap)

    # -- lineage ------------------------------------------------------------------
    def _derive(self, ts) -> tuple:
        spec = ts.run_spec
        deps = [self.lineage.get(d.key, ()) for d in ts.dependencies]
        if isinstance(spec, CatalogTask):
            return _catalog_lineage(spec, deps)
        if isinstance(spec, LabChain):
            # a fused chain: its steps' lineage one by one, as the unfused tasks would have it
            lin, prev = (), None
            for step in spec.steps:
                lin = _catalog_lineage(step, [lin if d == prev else self.lineage.get(d, ()) for d in step.dependencies])
                prev = step.key
            return lin
        if isinstance(spec, Alias):
            return self.lineage.get(spec.target, ())
        if isinstance(spec, Task) and spec.func in (lab_block, lab_value, read_block):
            where = spec.kwargs.get("lab_array")
            if where is None:
                return ()
            try:
                aid, shape, box, kind = parse_lab_array(where)
            except ValueError as e:
                logger.warning("task %r: %s; volunteer tasks reading it are computed on the lab worker", ts.key, e)
                return ((INVALID, (), None),)
            if self.shapes.get(aid, shape) != shape:
                logger.warning("task %r: lab array %s named with two shapes; volunteer tasks reading it are "
                               "computed on the lab worker", ts.key, aid)
                return ((INVALID, (), None),)
            self.shapes[aid] = shape
            self.kinds[aid] = combined_kind(self.kinds.get(aid), kind)
            return ((aid, box, tuple(range(len(box)))),)
        if isinstance(spec, Task) and spec.func is accept:
            raw = [d for d in ts.dependencies if is_unverified_key(d.key)]
            return self.lineage.get(raw[0].key, ()) if raw else ()
        if isinstance(spec, Task) and spec.func is kept_on_lab:
            return ()
        # anything else (a researcher's function on the lab worker): all it was given, somewhere
        return tuple((aid, box, None) for lin in deps for aid, box, _ in lin)

    def _lineage_of(self, tasks) -> None:
        """Fill ``self.lineage`` for ``tasks`` (TaskStates), dependencies first."""
        todo = [ts for ts in tasks if ts.key not in self.lineage]
        pending = {ts.key for ts in todo}
        done: set = set()
        stack = list(todo)
        while stack:
            ts = stack[-1]
            if ts.key in done:
                stack.pop()
                continue
            waiting = [d for d in ts.dependencies if d.key in pending and d.key not in done]
            if waiting:
                stack.extend(waiting)
                continue
            stack.pop()
            done.add(ts.key)
            lin = self._derive(ts) if ts.run_spec is not None else ()
            if lin:
                self.lineage[ts.key] = lin
            else:
                self.lineage.pop(ts.key, None)

    def needs(self, ts) -> dict[str, Coverage]:
        """What running ``ts`` sends its worker, per lab array."""
        out: dict[str, Coverage] = {}
        for d in ts.dependencies:
            for aid, box, _ in self.lineage.get(d.key, ()):
                if aid not in self.shapes:
                    continue
                cov = out.get(aid) or out.setdefault(aid, Coverage(self.shapes[aid]))
                cov.add(box)
        return out

    # -- placement ---------------------------------------------------------------
    def update_graph(self, scheduler, *, tasks: list, client: str | None = None, **kwargs: Any) -> None:
        new = [scheduler.tasks[k] for k in tasks if k in scheduler.tasks]
        self._lineage_of(new)
        share, cap = self.max_share(), self.max_exposure()
        for ts in sorted(new, key=lambda t: t.priority or ()):
            if ts.resource_restrictions != {VOLUNTEER_RESOURCE: 1} or not isinstance(ts.run_spec, CatalogTask):
                continue
            if any(aid == INVALID for d in ts.dependencies for aid, _, _ in self.lineage.get(d.key, ())):
                self.keep_on_lab(ts, "a source block it reads names no valid lab array", "invalid-source", client)
                continue
            needs = self.needs(ts)
            over = [aid for aid, cov in needs.items()
                    if (most := share_cap(cov.size, self.kinds.get(aid, "data"))) is not None
                    and cov.covered() > most + 1e-9]
            if over:
                self.keep_on_lab(ts, f"it would send a volunteer more than its share cap (data: {share:g}) "
                                     f"of lab array(s) {over}", "max-share", client)
            elif cap is not None and needs:
                self.plan(ts, needs, cap, client=client)

    def plan(self, ts, needs: dict[str, Coverage], cap: float, exclude: str | None = None,
             client: str | None = None) -> bool:
        """Pin ``ts`` to a volunteer that stays within ``cap``; else the lab computes it."""
        allowed = set(self.admission.volunteers()) - {exclude}
        if ts.worker_restrictions:
            allowed &= set(ts.worker_restrictions)
        ledger = self.scheduler.plugins.get("goblin-verification")
        if ledger is not None:  # a replica: never the person whose result it checks
            allowed = {a for a in allowed if ledger.may_run(ts.key, self.admission.names.get(a, a))}
        best = None
        for addr in sorted(allowed):
            person = self._person(addr)
            new_elems, fits, merged = 0, True, {}
            for aid, cov in needs.items():
                base = self.planned.get(person, {}).get(aid) or self.learned.get(person, {}).get(aid)
                before = base.covered() if base is not None else 0
                after = base.copy() if base is not None else Coverage(cov.shape)
                for box in _boxes(cov):
                    after.add(box)
                got = after.covered()
                if got > cap * after.size + 1e-9:
                    fits = False
                    break
                new_elems += got - before
                merged[aid] = after
            if fits:
                load = len(self.pinned_keys.get(addr, ()))
                if best is None or (new_elems, load) < best[0]:
                    best = ((new_elems, load), addr, merged)
        if best is None:
            self.keep_on_lab(ts, f"every volunteer would exceed max-exposure {cap:g}", "max-exposure", client)
            return False
        _, addr, merged = best
        self.planned[self._person(addr)].update(merged)
        self._pin(ts.key, addr)
        ts.worker_restrictions = {addr}
        ts.loose_restrictions = False
        return True

    def replan_when_released(self, key) -> None:
        """Once processing task ``key`` is released (reissued at its deadline), :meth:`replan` it before it
        is placed again (its resources may change only while it holds none)."""
        if self.max_exposure() is not None:
            self.to_replan.add(key)

    def replan(self, ts) -> None:
        """Pin ``ts`` again within max-exposure, among the volunteers its restrictions allow now, or the lab
        computes it: for a task placed again outside ``update_graph`` (reissued at its deadline), whose new
        restriction replaced its pin (issue 29: one volunteer reached 0.75 of an array under a 0.5 cap)."""
        cap = self.max_exposure()
        if cap is None or ts.resource_restrictions != {VOLUNTEER_RESOURCE: 1} or not isinstance(ts.run_spec, CatalogTask):
            return
        needs = self.needs(ts)
        if needs:
            self.plan(ts, needs, cap)

    def keep_on_lab(self, ts, why: str, reason: str, client: str | None = None) -> None:
        """The lab computes ``ts`` itself: its check task runs the op, the volunteer task becomes a no-op.
        ``reason``: a key of :data:`goblin_dask.array.placement.KEPT_AT_LAB`, counted in the report for the
        researcher whose graph brought ``ts`` (by ``client`` while its graph arrives, else by the key's owners)."""
        from goblin_dask.validation.checks import UNVERIFIED_PREFIX

        spec = ts.run_spec
        name = ts.key[0] if isinstance(ts.key, tuple) else ts.key
        original = (name[len(UNVERIFIED_PREFIX):],) + tuple(ts.key[1:]) if isinstance(ts.key, tuple) \
            else name[len(UNVERIFIED_PREFIX):]
        check = self.scheduler.tasks.get(original)
        if check is None or not isinstance(check.run_spec, Task) or check.run_spec.func is not accept \
                or check.state not in ("released", "waiting", "no-worker"):
            # a replica or a task without its check: computed on the lab worker as it is
            # (its check compares with a lab result; it never reaches a volunteer)
            ts.resource_restrictions = {LAB_RESOURCE: 1}
            ts.worker_restrictions = None
        else:
            check.run_spec = CatalogTask(original, spec.func, *spec.args, placement="lab", why=reason, **spec.kwargs)
            ts.run_spec = Task(ts.key, kept_on_lab)
            ts.resource_restrictions = {LAB_RESOURCE: 1}
            ts.worker_restrictions = None
        self._unpin(ts.key)
        catalog_only = self.scheduler.plugins.get("goblin-catalog-only")
        if catalog_only is not None and ts.state in ("released", "waiting", "no-worker", "queued"):  # not yet run
            who = submitter(self.scheduler, client=client) if client is not None else submitter(self.scheduler, key=ts.key)
            catalog_only.count.kept_instead(who, reason)
        logger.info("task %r computed on the lab worker: %s", ts.key, why)

    def _person(self, addr: str) -> str:
        """The person holding the volunteer at ``addr`` (one account for all their credentials)."""
        name = self.admission.names.get(addr, addr)
        return self.admission.person(name) or name

    def _pin(self, key, addr: str) -> None:
        self._unpin(key)
        self.pinned[key] = addr
        self.pinned_keys[addr].add(key)
        self.owners.setdefault(addr, self._person(addr))

    def _unpin(self, key) -> str | None:
        addr = self.pinned.pop(key, None)
        if addr is not None:
            keys = self.pinned_keys.get(addr)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.pinned_keys[addr]
        return addr

    def _plan_done(self, addr: str) -> None:
        """``addr`` holds no pin now: once no credential of its person does, their plan is all received."""
        if addr in self.pinned_keys:
            return
        person = self.owners.pop(addr, None)
        if person is not None and not any(self.owners.get(a) == person for a in self.pinned_keys):
            self.planned.pop(person, None)

    # -- the account ---------------------------------------------------------------
    def transition(self, key, start, finish, *args, worker: str | None = None, **kwargs) -> None:
        ts = self.scheduler.tasks.get(key)
        if start == "processing" and key in self.to_replan:
            self.to_replan.discard(key)
            if finish == "released" and ts is not None:  # before released -> waiting places it again
                self.replan(ts)
        if finish == "processing" and ts is not None and ts.processing_on is not None:
            self.record(ts, ts.processing_on.address)
        elif start == "processing" and finish == "memory" and worker and ts is not None:
            self.record(ts, worker)
        if finish in ("memory", "erred", "forgotten", "released"):
            addr = self._unpin(key) if finish != "released" else None
            if addr is not None:
                self._plan_done(addr)
        if finish == "forgotten":
            self.lineage.pop(key, None)

    def record(self, ts, addr: str) -> None:
        if not self.admission.is_volunteer(addr):
            return
        name = self.admission.names.get(addr, addr)
        person = self.admission.person(name) or name
        for aid, cov in self.needs(ts).items():
            for account in (self.received[name], self.learned[person]):
                mine = account.get(aid) or account.setdefault(aid, Coverage(cov.shape))
                for box in _boxes(cov):
                    mine.add(box)

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        cap = self.max_exposure()
        for key in list(self.pinned_keys.get(worker, ())):
            ts = scheduler.tasks.get(key)
            self._unpin(key)
            if ts is None or ts.state not in ("released", "waiting", "no-worker") or cap is None \
                    or ts.resource_restrictions != {VOLUNTEER_RESOURCE: 1}:
                continue  # done, or placed again already (the ledger places the replicas it restricts first)
            ts.worker_restrictions = None
            self.plan(ts, self.needs(ts), cap, exclude=worker)
        self._plan_done(worker)  # its person's plan stays while another credential of theirs holds pins

    def report(self, by_person: bool = False) -> dict[str, dict[str, float]]:
        """``{volunteer: {array id: fraction received}}``; ``by_person``: ``{person: ...}`` over their credentials."""
        out: dict[str, dict[str, float]] = {}
        for name, arrays in sorted((self.learned if by_person else self.received).items()):
            fractions = {aid: cov.covered() / cov.size for aid, cov in sorted(arrays.items()) if cov.size}
            if fractions:
                out[name] = fractions
        return out


def _boxes(cov: Coverage):
    """The marked cells of ``cov`` as boxes (to add one coverage into another)."""
    for cell in zip(*np.nonzero(cov.mask)) if cov.shape else ([()] if cov.mask.any() else []):
        yield tuple((cov.edges[a][i], cov.edges[a][i + 1]) for a, i in enumerate(cell))
