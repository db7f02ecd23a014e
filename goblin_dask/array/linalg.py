"""Blocked products sized for the volunteers: matmul, tensordot, einsum, dot.

``C = A @ B`` is cut into output blocks ``C[i, j]``; each is one volunteer task when a
row panel of A and a column panel of B fit the volunteer's memory budget, otherwise a
chain ``C = A[i,0] @ B[0,j]``, then ``C += A[i,k] @ B[k,j]`` (``matmul_accumulate``) in
increasing k, so at most one partial of each output block exists at a time and a
volunteer never holds more than ``A[i,k]``, ``B[k,j]`` and two copies of ``C[i,j]``.
Every step is a Freivalds-checkable product, checked on the lab worker.

Block sizes come from the volunteers' memory limits as the lab node reports them
(``client.scheduler_info()``): a task may use ``goblin.product.memory-fraction``
(default 1/4) of a volunteer thread's share, leaving room for the next task's inputs
arriving while one computes.  Output blocks are the largest squares that still give
every volunteer thread work, counting the products built to run side by side
(:func:`concurrent_products`: a Trainer's micro-batches).

What a volunteer may learn (``goblin.minimization.max-share``, default 1/4): no task
sends a volunteer more than that share of any lab array's elements.  The operands'
lab arrays (:func:`goblin_dask.array.sources.lab_arrays`) bound the panels: for each
lab array L, ``bm*bk`` (if A may hold L's elements) plus ``bk*bn`` (if B may) stays
within ``max-share * |L|`` (the sum, since ``A.T @ A`` sends two panels of the same
array).  Two ways fit the cap: cutting the inner step ``bk`` (a longer chain, output
blocks cut only when the steps would get thinner than a quarter of the blocks), or
cutting only the output blocks along the capped operand (``activations @ weights``: no
partial sums travel); the output cut wins when it moves fewer elements in no more tasks, or in up
to as many times the chain's tasks as the chain has steps (at most 4x): each chain step uploads a
partial sum as large as its output block, so a two-step chain has volunteers upload twice the
result's bytes, over a home's slow direction (:func:`_prefer_output_cut`).  The lab node checks every
volunteer task again before dispatch (``scheduler_plugins.exposure``).  Lab arrays of at
most ``goblin.minimization.small-array`` elements (4096: a vector of means broadcast against
every block) are not capped.  A model's parameters (lab arrays of kind ``"parameters"``,
:data:`goblin_dask.array.sources.KINDS`) are capped by ``goblin.minimization.parameters-max-share``
instead (default null: not capped), and so are activations that carry their elements (a language
model's residual stream holds its embedding tables' rows).

Only volunteers need tiles: when the placement rule (:mod:`goblin_dask.array.placement`) would keep
even the largest tile on the lab worker (too few flops per element to be worth a check), the product
is the lab's own and is cut only for the lab's memory (usually one task), not by max-share or a
volunteer's budget.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Any

import dask
import numpy as np

from goblin_dask import settings
from goblin_dask.array.core import Array, asarray, astype, blockwise, catalog_task, from_graph, refuse
from goblin_dask.array.keys import block_key, new_name, part_key
from goblin_dask.array.layout import expand_dims, rechunk, reshape, squeeze, transpose
from goblin_dask.array.numpy_api import implements
from goblin_dask.ops import get
from goblin_dask.ops.spec import Aval

DEFAULT_VOLUNTEER_MEMORY = 2 * 2**30
MIN_BLOCK = 64


@contextlib.contextmanager
def _binding(var: contextvars.ContextVar, value: Any):
    """``var`` set to ``value`` within the block."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


#: The workers a graph being built sees (:func:`one_reading_of_the_workers`): a dict that keeps the
#: first reading under ``"workers"``, or None: ask each time.
_WORKERS: contextvars.ContextVar = contextvars.ContextVar("goblin_workers_reading", default=None)


def one_reading_of_the_workers():
    """Within this block, :func:`volunteer_capacity` asks the lab node for its workers once.

    Each product of a graph sizes its tiles from the volunteers' memory and threads; asking the
    scheduler is a round trip (~2 ms), and a language model's round builds ~200 products (0.45 s of
    a 1.3 s build, measured).  One graph is built against one view of the volunteers; an inner block
    keeps the outer one's view."""
    return contextlib.nullcontext() if _WORKERS.get() is not None else _binding(_WORKERS, {})


def _workers_info() -> list:
    reading = _WORKERS.get()
    if reading is not None and "workers" in reading:
        return reading["workers"]
    try:
        from distributed import default_client

        info = list(default_client().scheduler_info(n_workers=-1)["workers"].values())
    except (ImportError, ValueError, TypeError, KeyError, AttributeError):
        info = []
    if reading is not None:
        reading["workers"] = info
    return info


def volunteer_capacity() -> tuple[float, int]:
    """(memory per volunteer thread in bytes, total volunteer threads) of the default client's lab node."""
    configured = settings.get("goblin.product.volunteer-memory")
    info = _workers_info()
    from goblin_dask.roles import VOLUNTEER_RESOURCE

    volunteers = [w for w in info if VOLUNTEER_RESOURCE in (w.get("resources") or {})]
    threads = sum(int(w.get("nthreads", 1)) for w in volunteers)
    if configured is not None:
        return float(dask.utils.parse_bytes(configured) if isinstance(configured, str) else configured), max(threads, 1)
    if not volunteers:
        return float(DEFAULT_VOLUNTEER_MEMORY), 1
    per_thread = min(float(w.get("memory_limit") or DEFAULT_VOLUNTEER_MEMORY) / max(int(w.get("nthreads", 1)), 1)
                     for w in volunteers)
    return per_thread, max(threads, 1)


#: How many products the graph being built runs side by side (:func:`concurrent_products`).
_CONCURRENT: contextvars.ContextVar = contextvars.ContextVar("goblin_concurrent_products", default=1)


def concurrent_products(n: int):
    """Within this block, products are built ``n`` at a time that may run at once (a Trainer's
    micro-batches): each needs to give only ``1/n`` of the volunteer threads work, so it is cut into
    that many fewer output tiles.  Fewer tiles are fewer tasks and checks, and an input panel sent
    once instead of once per tile; the memory budget still cuts a product whose tile would not fit."""
    n = int(n)
    if n < 1:
        raise ValueError(f"concurrent_products: a positive count, got {n}")
    return _binding(_CONCURRENT, n)


def product_blocks(m: int, k: int, n: int, itemsize: int, budget: float, workers: int,
                   limits: tuple = (), on_volunteers: Any = None) -> tuple[int, int, int]:
    """(bm, bk, bn) for C (m x n) = A (m x k) @ B (k x n) within ``budget`` bytes per task.

    ``limits``: ``(in_a, in_b, elements)`` per lab array: a task's ``bm*bk`` (when A may
    hold the array's elements) plus ``bk*bn`` (when B may) stays within ``elements``.
    ``on_volunteers``: ``blocks -> bool``, would such a tile run on a volunteer (the placement rule)?
    An output cut whose smaller tiles would stay on the lab is not preferred to a chain whose tiles
    would not.  None: not asked.
    """
    memory = _memory_blocks(m, k, n, itemsize, budget, workers)
    limits = [(bool(ia), bool(ib), float(el)) for ia, ib, el in limits if ia or ib]
    if not limits:
        return memory
    chain = _inner_cut(k, memory, limits)
    outputs = _output_cut(memory, limits)
    if outputs is None:
        return chain
    if on_volunteers is not None and on_volunteers(chain) and not on_volunteers(outputs):
        return chain
    return outputs if _prefer_output_cut(m, k, n, chain, outputs, workers) else chain


#: At most this many times a chain's tasks may an output cut have and still be preferred
#: (:func:`_prefer_output_cut`): its checks' flops grow with its task count.
OUTPUT_CUT_TASKS = 4


def _prefer_output_cut(m: int, k: int, n: int, chain: tuple, outputs: tuple, workers: int) -> bool:
    """Cut the output (``outputs``: the inner axis longer, usually whole) rather than the inner axis
    (``chain``)?

    Only when it moves fewer elements.  Then with the same number of tasks or fewer (``activations @
    weights`` with the weights capped), or with more tasks in proportion to the uploads it saves, at
    most :data:`OUTPUT_CUT_TASKS` times the chain's: every step of a chain uploads a partial sum as
    large as its output block (the lab checks it; the next step downloads it again), so a chain of s
    steps has the volunteers upload s times the result's bytes, over a home's slow direction (issue 30:
    the 4096^2 product's two-step chain uploaded twice its result), and an output cut of s' steps
    s' times; it may have s / s' times the chain's tasks.  The price: checks that project each panel
    once per output block of its row or column (s / s' times the chain's check flops at most).  Far
    more tasks than that (``A.T @ A`` on one volunteer thread, both panels from one capped array: 8x)
    keep the chain."""
    tasks = [_tasks(m, k, n, blocks) for blocks in (chain, outputs)]
    moved = [_elements_moved(m, k, n, blocks, workers) for blocks in (chain, outputs)]
    if moved[1] >= moved[0]:
        return False
    uploads = [math.ceil(k / blocks[1]) for blocks in (chain, outputs)]  # times the result's bytes
    return tasks[1] <= tasks[0] * min(max(uploads[0] / uploads[1], 1), OUTPUT_CUT_TASKS)


def _capped(bm: int, bn: int, limits: list) -> int:
    """The longest inner step the caps allow for ``bm x bn`` output blocks."""
    return min(int(el // (ia * bm + ib * bn)) for ia, ib, el in limits)


def _inner_cut(k: int, blocks: tuple, limits: list) -> tuple[int, int, int]:
    """Within the caps by cutting the inner axis first (a longer chain of ``matmul_accumulate``),
    the output blocks only once the steps would get thinner than a quarter of the blocks."""
    bm, bk, bn = blocks
    while True:
        cap = _capped(bm, bn, limits)
        if cap >= bk:
            return bm, bk, bn
        if cap >= max(1, min(bm, bn, k) // 4) or max(bm, bn) <= 1:
            return bm, max(cap, 1), bn
        if bm >= bn:
            bm = max(1, bm // 2)
        else:
            bn = max(1, bn // 2)


def _output_cut(blocks: tuple, limits: list) -> tuple[int, int, int] | None:
    """Within the caps by cutting only the output blocks along the capped operands (the inner step
    kept whole); None when they would get thinner than ``MIN_BLOCK`` (or the whole extent, if less)."""
    bm, bk, bn = blocks
    floor_m, floor_n = min(MIN_BLOCK, bm), min(MIN_BLOCK, bn)
    while _capped(bm, bn, limits) < bk:
        shrink_m = any(ia for ia, _, _ in limits) and bm > floor_m
        shrink_n = any(ib for _, ib, _ in limits) and bn > floor_n
        if not (shrink_m or shrink_n):
            return None
        if shrink_m and (bm >= bn or not shrink_n):
            bm = max(floor_m, bm // 2)
        else:
            bn = max(floor_n, bn // 2)
    return bm, bk, bn


def _tasks(m: int, k: int, n: int, blocks: tuple) -> int:
    bm, bk, bn = blocks
    return math.ceil(m / bm) * math.ceil(k / bk) * math.ceil(n / bn)


def _elements_moved(m: int, k: int, n: int, blocks: tuple, workers: int) -> int:
    """Elements a blocked product moves between the lab and volunteers: each panel once per
    volunteer thread that needs it (dask keeps a fetched input while its tasks remain), each
    partial result out and back in along a chain, each output block out."""
    bm, bk, bn = blocks
    steps = math.ceil(k / bk)
    return (m * k * min(math.ceil(n / bn), workers) + k * n * min(math.ceil(m / bm), workers)
            + (2 * steps - 1) * m * n)


def _memory_blocks(m: int, k: int, n: int, itemsize: int, budget: float, workers: int) -> tuple[int, int, int]:
    def need(bm, bk, bn):
        return itemsize * (bm * bk + bk * bn + 2 * bm * bn)

    b = max(m, n, 1)
    while b > MIN_BLOCK and math.ceil(m / b) * math.ceil(n / b) < workers:
        b = max(MIN_BLOCK, b // 2)
    bm, bn, k = min(b, max(m, 1)), min(b, max(n, 1)), max(k, 1)
    while True:
        if need(bm, k, bn) <= budget:
            return bm, k, bn
        # the longest inner step that fits; accept it once steps are no thinner than the blocks
        bk = int((budget / itemsize - 2 * bm * bn) // (bm + bn)) if budget / itemsize > 2 * bm * bn else 0
        if bk >= min(bm, bn, k) or (bk >= 1 and max(bm, bn) <= MIN_BLOCK) or max(bm, bn) <= 1:
            return bm, max(min(bk, k), 1), bn
        # below MIN_BLOCK only when even a one-step chain of MIN_BLOCK blocks would not fit the budget
        # (a tiny cap: a Trainer's stage_memory)
        floor = MIN_BLOCK if max(bm, bn) > MIN_BLOCK else 1
        if bm >= bn:
            bm = max(floor, math.ceil(bm / 2))
        else:
            bn = max(floor, math.ceil(bn / 2))


def share_limits(a: Array, b: Array) -> tuple:
    """``product_blocks``' limits for ``a @ b``: max-share of each lab array either operand may hold."""
    from goblin_dask.array.sources import combined_kind, lab_array_kinds, share_cap

    in_a, in_b = lab_array_kinds(a), lab_array_kinds(b)
    both = dict(in_a)
    for aid, (size, kind) in in_b.items():
        both[aid] = (size, combined_kind(both.get(aid, (size, None))[1], kind))
    caps = {aid: share_cap(size, kind) for aid, (size, kind) in both.items()}
    return tuple((aid in in_a, aid in in_b, cap) for aid, cap in caps.items() if cap is not None)


def even_blocks(n: int, b: int) -> tuple[int, ...]:
    """Blocks of at most ``b`` covering ``n`` in near-equal sizes (better balance than b, b, ..., rest)."""
    if n == 0:
        return (0,)
    count = math.ceil(n / b)
    base, extra = divmod(n, count)
    return tuple(base + (1 if i < extra else 0) for i in range(count))


@implements(np.matmul, op="matmul")
def matmul(x1: Any, x2: Any, /) -> Array:
    """``x1 @ x2`` with NumPy's rules (1-d operands, batch dimensions broadcast)."""
    a, b = asarray(x1), asarray(x2)
    out = get("matmul").abstract_eval(a.aval, b.aval)  # ValueError naming both shapes, before anything runs
    if a.ndim == 1 and b.ndim == 1:
        return reshape(_matmul2(reshape(a, (1, -1)), reshape(b, (-1, 1))), ())
    if a.ndim == 1:
        return squeeze(matmul(expand_dims(a, 0), b), -2)
    if b.ndim == 1:
        return squeeze(matmul(a, expand_dims(b, -1)), -1)
    if a.ndim == 2 and b.ndim == 2:
        return _matmul2(a, b)
    return _batched(a, b, out)


def matmul_add(a: Any, b: Any, bias: Any) -> Array:
    """``bias + a @ b`` for 2-d ``a``, ``b`` and a bias row of ``b``'s width (a linear layer, torch's
    ``addmm``): the bias enters each output block's first product step (``matmul_accumulate``, the
    same rounding as adding it after), so no separate add task per block follows the product."""
    a, b, bias = asarray(a), asarray(b), asarray(bias)
    out = get("matmul").abstract_eval(a.aval, b.aval)
    fold = (a.ndim == b.ndim == 2 and bias.ndim == 1 and bias.shape == (b.shape[1],)
            and np.result_type(bias.dtype, out.dtype) == out.dtype)
    if not fold:
        from goblin_dask.array.ufuncs import add

        return add(matmul(a, b), bias)
    return _matmul2(a, b, bias)


def _matmul2(a: Array, b: Array, bias: Array | None = None) -> Array:
    """``a @ b`` (2-d), cut into tiles for the volunteers' memory and threads.

    The threads are claims (one volunteer may claim up to 256): a product is cut into more tiles for them
    only as far as its tiles stay ones volunteers are given (:func:`_lab_product`), never so fine that the
    lab would compute every tile itself (issue 29: one volunteer claiming 256 threads moved all work to the
    lab).  The memory per thread is bounded below by ``goblin.admission.min-memory-per-thread``."""
    (m, k), n = a.shape, b.shape[1]
    dtype = get("matmul").abstract_eval(a.aval, b.aval).dtype
    budget, workers = volunteer_capacity()
    workers = max(1, math.ceil(workers / _CONCURRENT.get()))  # the threads this product alone must keep busy
    frac = float(settings.get("goblin.product.memory-fraction"))
    limits = share_limits(a, b)
    on_volunteers = lambda blocks: not _lab_product(a, b, *blocks)  # noqa: E731
    bm, bk, bn = product_blocks(m, k, n, dtype.itemsize, budget * frac, workers, limits, on_volunteers=on_volunteers)
    lab = _lab_product(a, b, bm, bk, bn)
    while lab and workers > 1:  # cut for the threads only while volunteers still get the tiles (below)
        workers = max(1, workers // 2)
        fewer = product_blocks(m, k, n, dtype.itemsize, budget * frac, workers, limits, on_volunteers=on_volunteers)
        if not _lab_product(a, b, *fewer):
            (bm, bk, bn), lab = fewer, False
    if lab:  # no volunteer would see a tile: the lab's own blocks, neither max-share nor a volunteer's memory
        bm, bk, bn = _lab_blocks(m, k, n, dtype.itemsize, budget * frac)
    elif bias is not None and not _within_share(bias, bn):  # a task would hold too much of a large lab bias
        from goblin_dask.array.ufuncs import add

        return add(_matmul2(a, b), bias)
    a = rechunk(a, (even_blocks(m, bm), even_blocks(k, bk)))
    b = rechunk(b, (even_blocks(k, bk), even_blocks(n, bn)))
    if bias is not None:
        bias = rechunk(bias, (b.chunks[1],))
    name = new_name("matmul", a.name, b.name, *(() if bias is None else (bias.name,)))
    from dask._task_spec import TaskRef

    task = functools.partial(catalog_task, placement="lab", why=lab) if lab else catalog_task  # else: by cost
    layer = {}
    nk = a.numblocks[1]
    for i in range(a.numblocks[0]):
        for j in range(b.numblocks[1]):
            acc = None
            for kk in range(nk):
                key = block_key(name, (i, j)) if kk == nk - 1 else part_key(name, "partial", i, j, kk)
                ab, bb = a.block_aval((i, kk)), b.block_aval((kk, j))
                if acc is None and bias is not None:
                    layer[key] = task(key, "matmul_accumulate", bias.ref((j,)), a.ref((i, kk)),
                                      b.ref((kk, j)), avals=[bias.block_aval((j,)), ab, bb])
                elif acc is None:
                    layer[key] = task(key, "matmul", a.ref((i, kk)), b.ref((kk, j)), avals=[ab, bb])
                else:
                    cav = Aval((ab.shape[0], bb.shape[1]), dtype)
                    layer[key] = task(key, "matmul_accumulate", acc, a.ref((i, kk)), b.ref((kk, j)),
                                      avals=[cav, ab, bb])
                acc = TaskRef(key)
    return from_graph(name, layer, (a.chunks[0], b.chunks[1]), dtype,
                      dependencies=[a, b] + ([] if bias is None else [bias]))


def _lab_product(a: Array, b: Array, bm: int, bk: int, bn: int) -> str | None:
    """Would every tile of ``a @ b`` cut to ``(bm, bk, bn)`` run on the lab worker (the placement rule)?
    Why (:data:`~goblin_dask.array.placement.KEPT_AT_LAB`), or None: the tiles go to volunteers.

    The largest tile decides: smaller ones have fewer flops per element and go to the lab too, and a
    chain's ``matmul_accumulate`` steps (an accumulator more to move for the same flops) follow its first
    ``matmul``.  Such a product is the lab's own work: cutting it into max-share tiles, or into tiles that
    fit a volunteer's memory, only multiplies its tasks (a language model's residual stream carries its
    small embedding tables' elements: 128x32 tiles, chains of 32 steps, all on the lab)."""
    from goblin_dask.array.placement import placement_reason

    return placement_reason(get("matmul"), Aval((bm, bk), a.dtype), Aval((bk, bn), b.dtype))[1]


def _lab_blocks(m: int, k: int, n: int, itemsize: int, budget: float) -> tuple[int, int, int]:
    """Blocks for a product the lab computes itself: one task when it fits the larger of a volunteer
    task's budget and four blocks of ``array.chunk-size``, no max-share cap (no volunteer sees them)."""
    chunk = float(dask.utils.parse_bytes(dask.config.get("array.chunk-size", "128MiB")))
    return _memory_blocks(m, k, n, itemsize, max(budget, 4 * chunk), 1)


def _within_share(bias: Array, bn: int) -> bool:
    """Does a ``bn``-long piece of ``bias`` stay within max-share of every lab array it may hold?"""
    from goblin_dask.array.sources import lab_array_kinds, share_cap

    caps = [share_cap(size, kind) for size, kind in lab_array_kinds(bias).values()]
    return all(cap is None or bn <= cap for cap in caps)


def _batched(a: Array, b: Array, out: Aval) -> Array:
    """Batched products: one task per batch block and output block (inner axis whole)."""
    from dask._task_spec import TaskRef

    from goblin_dask.array.layout import broadcast_to

    batch = out.shape[:-2]
    a = broadcast_to(a, batch + a.shape[-2:]) if a.shape[:-2] != batch else a
    b = broadcast_to(b, batch + b.shape[-2:]) if b.shape[:-2] != batch else b
    from goblin_dask.array.core import _common_chunks

    bchunks = tuple(_common_chunks(ca, cb) for ca, cb in zip(a.chunks[:-2], b.chunks[:-2]))
    a = rechunk(a, bchunks + (a.chunks[-2], (a.shape[-1],)))
    b = rechunk(b, bchunks + ((b.shape[-2],), b.chunks[-1]))

    def block(idx):
        ia, ib = idx[:-1] + (0,), idx[:-2] + (0, idx[-1])
        return [TaskRef(a.key(ia)), TaskRef(b.key(ib))], [a.block_aval(ia), b.block_aval(ib)], {}

    return blockwise("matmul", bchunks + (a.chunks[-2], b.chunks[-1]), out.dtype, block, token=(a.name, b.name),
                     dependencies=[a, b])


def _tensordot_axes(a: Array, b: Array, axes: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if isinstance(axes, (int, np.integer)):
        n = int(axes)
        if n < 0 or n > min(a.ndim, b.ndim):
            raise ValueError(f"tensordot: axes={n} is out of range for shapes {a.shape} and {b.shape}")
        return tuple(range(a.ndim - n, a.ndim)), tuple(range(n))
    try:
        ax_a, ax_b = axes
    except (TypeError, ValueError):
        raise ValueError(f"tensordot: axes must be an int or a pair of axis sequences, got {axes!r}") from None
    ax_a = (ax_a,) if isinstance(ax_a, (int, np.integer)) else tuple(ax_a)
    ax_b = (ax_b,) if isinstance(ax_b, (int, np.integer)) else tuple(ax_b)
    return tuple(int(x) % a.ndim for x in ax_a), tuple(int(x) % b.ndim for x in ax_b)


@implements(np.tensordot, op="tensordot")
def tensordot(a: Any, b: Any, axes: Any = 2) -> Array:
    """Sum of products over ``axes`` (numpy.tensordot), computed as one blocked product."""
    a, b = asarray(a), asarray(b)
    ax_a, ax_b = _tensordot_axes(a, b, axes)
    out = get("tensordot").abstract_eval(a.aval, b.aval, axes=(ax_a, ax_b))  # shape errors name both shapes
    free_a = [d for d in range(a.ndim) if d not in ax_a]
    free_b = [d for d in range(b.ndim) if d not in ax_b]
    inner = math.prod(a.shape[d] for d in ax_a)
    a2 = reshape(transpose(a, tuple(free_a) + ax_a), (math.prod(a.shape[d] for d in free_a), inner))
    b2 = reshape(transpose(b, ax_b + tuple(free_b)), (inner, math.prod(b.shape[d] for d in free_b)))
    return reshape(_matmul2(a2, b2), out.shape)


@implements(np.einsum)
def einsum(subscripts: str, /, *operands: Any, out: Any = None, dtype: Any = None, order: str = "K",
           casting: str = "safe", optimize: Any = False) -> Array:
    """Matmul-like einsum of one or two operands (explicit output, distinct letters per operand).

    ``optimize`` is accepted and moot (the contraction is one blocked product).
    """
    refuse("einsum", out=out is not None, dtype=dtype is not None, order=order != "K", casting=casting != "safe")
    if optimize not in (None, False, True, "greedy", "optimal"):
        raise TypeError(f"einsum: unsupported optimize={optimize!r}")
    arrays = [asarray(x) for x in operands]
    subscripts = _expand_ellipsis(subscripts.replace(" ", ""), arrays)
    out = get("einsum").abstract_eval(*(x.aval for x in arrays), subscripts=subscripts)  # validates the contraction
    ins, out_sub = subscripts.replace(" ", "").split("->")
    subs = ins.split(",")
    # sum out letters that appear in one operand only and not in the output
    reduced = []
    for x, s in zip(arrays, subs):
        others = "".join(t for t in subs if t is not s) + out_sub
        gone = tuple(i for i, c in enumerate(s) if c not in others)
        if gone:
            from goblin_dask.array.reductions import sum as _sum

            x = _sum(x, axis=gone)
            s = "".join(c for i, c in enumerate(s) if i not in gone)
        reduced.append((x, s))
    if len(reduced) == 1:
        x, s = reduced[0]
        return transpose(x, tuple(s.index(c) for c in out_sub))
    (x, sx), (y, sy) = reduced
    batch = [c for c in sx if c in sy and c in out_sub]
    if batch:
        return astype(_batched_einsum(x, sx, y, sy, out_sub), out.dtype)
    contracted = [c for c in sx if c in sy]
    result = tensordot(x, y, axes=(tuple(sx.index(c) for c in contracted), tuple(sy.index(c) for c in contracted)))
    got = [c for c in sx if c not in contracted] + [c for c in sy if c not in contracted]
    result = transpose(result, tuple(got.index(c) for c in out_sub))
    return astype(result, out.dtype)


def _batched_einsum(x: Array, sx: str, y: Array, sy: str, out_sub: str) -> Array:
    """A two-operand einsum with batch letters: one ``einsum`` task per output block.

    Batch and free axes keep their blocks (batch axes cut alike in both operands), the
    contracted axes are whole in every task; each task is a batched matmul-like einsum the
    lab checks by Freivalds per batch entry.
    """
    from goblin_dask.array.core import _common_chunks

    sub = f"{sx},{sy}->{out_sub}"
    contracted = [c for c in sx if c in sy and c not in out_sub]
    common = {c: _common_chunks(x.chunks[sx.index(c)], y.chunks[sy.index(c)]) for c in sx if c in sy and c in out_sub}

    def want(arr: Array, s: str) -> tuple:
        return tuple((arr.shape[d],) if c in contracted else common.get(c, arr.chunks[d]) for d, c in enumerate(s))

    x, y = rechunk(x, want(x, sx)), rechunk(y, want(y, sy))
    chunks = tuple(x.chunks[sx.index(c)] if c in sx else y.chunks[sy.index(c)] for c in out_sub)
    dtype = get("einsum").abstract_eval(x.aval, y.aval, subscripts=sub).dtype

    def block(idx):
        pos = dict(zip(out_sub, idx))
        ix, iy = tuple(pos.get(c, 0) for c in sx), tuple(pos.get(c, 0) for c in sy)
        return [x.ref(ix), y.ref(iy)], [x.block_aval(ix), y.block_aval(iy)], {"subscripts": sub}

    return blockwise("einsum", chunks, dtype, block, token=(x.name, y.name, sub), dependencies=[x, y])


def _expand_ellipsis(subscripts: str, arrays: list) -> str:
    """Spell out ``...`` (as xarray writes it: ``'...ab,...bc->...ac'``) with unused letters."""
    if "..." not in subscripts:
        return subscripts
    ins, _, out = subscripts.partition("->")
    subs = ins.split(",")
    if len(subs) != len(arrays):
        raise ValueError(f"einsum: {subscripts!r} names {len(subs)} operands, got {len(arrays)}")
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in subscripts]
    widths = [x.ndim - len(s.replace("...", "")) for s, x in zip(subs, arrays)]
    longest = max(widths + [0])
    letters = "".join(free[:longest])
    subs = [s.replace("...", letters[longest - w:]) for s, w in zip(subs, widths)]
    return ",".join(subs) + "->" + out.replace("...", letters)


@implements(np.dot)
def dot(a: Any, b: Any, out: Any = None) -> Array:
    """numpy.dot for 1-d and 2-d operands; N-d as tensordot over (last of a, second-last of b)."""
    refuse("dot", out=out is not None)
    a, b = asarray(a), asarray(b)
    if a.ndim == 0 or b.ndim == 0:
        from goblin_dask.array.core import elementwise

        return elementwise("multiply", a, b)
    if a.ndim <= 2 and b.ndim <= 2:
        return matmul(a, b)
    return tensordot(a, b, axes=((a.ndim - 1,), (max(b.ndim - 2, 0),)))
