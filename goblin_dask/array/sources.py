"""The lab's data as blocks: numpy arrays, memory-mapped files, xarray objects.

Blocks are cut at the source, on the lab side: a numpy array's blocks travel as
``DataNode`` views (only the block's numbers are pickled), a memmap's as lab-only
loader tasks (:func:`read_block`, run by the lab worker, which opens the file and
reads just that block), so a product of matrices larger than the lab worker's memory
streams from disk.  A :class:`Source` can cut the same data again with other block
sizes (``rechunk`` and the blocked product use it), instead of reassembling blocks.
File paths and xarray names stay in these lab-side tasks and the researcher's process.

Data moves once: with a distributed client (the lab node's), an in-memory array of at
least :data:`UPLOAD_MIN_BYTES` is scattered whole to the lab worker once, under a key
named by its content (:func:`content_hash`), and its blocks are lab-only tasks slicing
that copy, so the graph carries a reference, not the numbers: a later compute, or another
``from_array`` of equal content, reuses the copy (:func:`lab_copy`).  The copy lives as
long as the researcher's process holds a graph that reads it (the graph's tasks hold the
``Future``); then distributed releases it from the lab worker.  Without a client the
blocks travel in the graph as before.

Each source block is a lab-only task that names its place in the lab array:
``lab_array=(id, shape, box)`` (an opaque id from the data's token, the whole array's
shape, and the block's ``(start, stop)`` per axis), or ``(id, shape, box, "parameters")``
for a model's parameters (:data:`KINDS`: capped by ``goblin.minimization.parameters-max-share``,
not by ``max-share``; counted in the account all the same).  Only the lab node's scheduler reads
it (``scheduler_plugins.exposure``: the per-task cap and the account of what each
volunteer received); the task never runs on a volunteer.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import mmap
import os
import sys
import threading
import weakref
from typing import Any

import numpy as np
from dask._task_spec import DataNode, Task

from goblin_dask.ops._factories import check_dtype


#: Layer metadata (``collection_annotations``, never sent anywhere) naming a source layer's lab array:
#: ``(id, size)`` for data, ``(id, size, kind)`` otherwise.
LAB_ARRAY = "goblin-lab-array"

#: Kinds of lab array: ``"data"`` (the lab's dataset: inputs, targets, token ids; capped by
#: ``goblin.minimization.max-share``) and ``"parameters"`` (a model's parameters, buffers and optimizer
#: state: every volunteer computing a layer needs its weight tiles; capped by
#: ``goblin.minimization.parameters-max-share``, default null: not capped per task).
KINDS = ("data", "parameters")


def combined_kind(known: str | None, seen: str) -> str:
    """The kind of a lab array named ``seen`` now and ``known`` before (None: not before): an array named
    data anywhere is data (the stricter cap); the same numbers given as data and as parameters are one id."""
    return "data" if "data" in (known, seen) else seen


#: In-memory arrays at least this large go to the lab worker once (smaller ones ride in the graph,
#: cheaper than a scatter's round trip).
UPLOAD_MIN_BYTES = 1 << 20


def lab_block(data: np.ndarray, lab_array: tuple | None = None, index: tuple | None = None) -> np.ndarray:
    """Lab worker: one block of an in-memory lab array (``lab_array`` is for the scheduler).

    ``index``: ``data`` is the whole array's copy on the lab worker (:func:`lab_copy`) and the
    block is this slice of it (a view: the lab worker keeps one copy of the numbers).
    """
    return data if index is None else data[index]


def lab_value(result: Any, path: tuple, lab_array: tuple | None = None, pieces: tuple | None = None) -> np.ndarray:
    """Lab worker: the array at ``path`` in an earlier lab task's result (``result[path[0]][path[1]]...``;
    ``lab_array`` is for the scheduler): numbers that stay on the lab worker between computations, a
    model's parameters between training rounds, instead of travelling to the researcher and back.

    ``pieces``: ``((start, stop), ...)`` of that (1-d) array, one vector of them in order (one piece: a view,
    no copy): a stage task's own parameters cut from the flat vector of all of them (:func:`pieces_array`)."""
    for step in path:
        result = result[step]
    if pieces is None:
        return result
    if len(pieces) == 1:
        return result[pieces[0][0]:pieces[0][1]]
    return np.concatenate([result[a:b] for a, b in pieces])


def resident_array(result: Any, path: tuple, shape: tuple, dtype: Any, token: Any, kind: str = "data") -> Any:
    """The array at ``path`` in the lab worker's ``result`` (a Future of an earlier lab task), as a one-block
    lab array of ``kind`` (:data:`KINDS`), named by ``token`` (its exposure is counted as any lab array's)."""
    from goblin_dask.array.core import from_graph
    from goblin_dask.array.keys import block_key, new_name

    if kind not in KINDS:
        raise ValueError(f"resident_array: kind {kind!r}: one of {', '.join(KINDS)}")
    shape = tuple(int(n) for n in shape)
    name = new_name("source", "resident", token, path)
    aid = "r" + name.rsplit("-", 1)[-1][:15]
    tail = () if kind == "data" else (kind,)
    where = (aid, shape, tuple((0, n) for n in shape), *tail)
    key = block_key(name, (0,) * len(shape))
    out = from_graph(name, {key: Task(key, lab_value, result, tuple(path), lab_array=where)},
                     tuple((n,) for n in shape), np.dtype(dtype))
    out.dask.layers[name].collection_annotations = {LAB_ARRAY: (aid, math.prod(shape), *tail)}
    return out


def pieces_array(source: Any, pieces: Any, kind: str = "data") -> Any:
    """The ``pieces`` (``[(start, stop), ...]``) of ``source`` (a one-block 1-d lab array on the lab worker: a
    :func:`resident_array`, or ``from_array``'s) as one vector, a one-block lab array of ``kind`` of its own,
    made by one lab task (:func:`lab_value`): what one stage task reads of a model's flat parameters, and no
    more.  Named by ``source``'s name and the pieces, so the same pieces of the same numbers are one key."""
    from dask._task_spec import TaskRef

    from goblin_dask.array.core import from_graph
    from goblin_dask.array.keys import block_key, new_name

    if kind not in KINDS:
        raise ValueError(f"pieces_array: kind {kind!r}: one of {', '.join(KINDS)}")
    if source.ndim != 1 or source.npartitions != 1:
        raise ValueError(f"pieces_array: a one-block vector, got shape {source.shape} in {source.npartitions} blocks")
    pieces = tuple((int(a), int(b)) for a, b in pieces)
    if not pieces or any(not 0 <= a < b <= source.shape[0] for a, b in pieces):
        raise ValueError(f"pieces_array: pieces {pieces[:3]}... of a vector of {source.shape[0]}")
    n = sum(b - a for a, b in pieces)
    name = new_name("source", "pieces", source.name, pieces, kind)
    aid = "r" + name.rsplit("-", 1)[-1][:15]
    tail = () if kind == "data" else (kind,)
    key = block_key(name, (0,))
    task = Task(key, lab_value, TaskRef(source.__dask_keys__()[0]), (), lab_array=(aid, (n,), ((0, n),), *tail),
                pieces=pieces)
    out = from_graph(name, {key: task}, ((n,),), source.dtype, dependencies=[source])
    out.dask.layers[name].collection_annotations = {LAB_ARRAY: (aid, n, *tail)}
    return out


def content_hash(x: np.ndarray) -> str:
    """32 hex digits naming ``x``'s content: its bytes, dtype, shape and memory order.

    xxh3-128 when ``xxhash`` is installed (0.02 s for 512 MiB on the benchmark machine, memory
    speed), else SHA-256 (0.3 s).  Not a defence against a forger: the researcher names its own
    data; it only has to tell different arrays apart.
    """
    if x.flags.c_contiguous:
        flat, order = x.reshape(-1), "C"
    elif x.flags.f_contiguous:
        flat, order = x.T.reshape(-1), "F"
    else:
        flat, order = np.ascontiguousarray(x).reshape(-1), "C"
    header = f"{x.dtype.str}|{tuple(int(s) for s in x.shape)}|{order}|".encode()
    buf = memoryview(flat.view(np.uint8)) if flat.size else memoryview(b"")
    try:
        import xxhash
    except ImportError:
        h = hashlib.sha256(header)
        h.update(buf)
        return h.hexdigest()[:32]
    h = xxhash.xxh3_128(header)
    h.update(buf)
    return h.hexdigest()


# (client id, content hash) -> the Future of the lab worker's copy; weak: the graphs hold the Futures.
_COPIES: "weakref.WeakValueDictionary[tuple, Any]" = weakref.WeakValueDictionary()
_COPIES_LOCK = threading.Lock()
_GENERATION = itertools.count()


def upload_client() -> Any | None:
    """The distributed client a compute would use now (synchronous, connected), or None."""
    if "distributed" not in sys.modules:
        return None  # never import distributed for a plain numpy / threaded user
    import dask
    from distributed.client import default_client

    if dask.config.get("scheduler", None) not in (None, "dask.distributed", "distributed"):
        return None
    try:
        client = default_client()
    except ValueError:
        return None
    if client.asynchronous or client.status != "running":
        return None
    return client


def lab_copy(x: np.ndarray, digest: str, min_bytes: int | None = None) -> Any | None:
    """The Future of the lab worker's copy of ``x`` (content ``digest``), scattered on first use; None without a client.

    ``min_bytes`` (default :data:`UPLOAD_MIN_BYTES`): smaller arrays ride in the graph.  Data that every computation reads again
    (a captured model's parameters) goes up at any size: 14 MiB of small weights would otherwise
    travel through the scheduler on every forward pass.

    The key is ``(source-<digest>, generation)``: the digest finds an existing copy; the
    generation makes each upload a new key, so the release of a copy that was just dropped
    can never reach its successor.  On a lab node the scheduler's ``scatter`` puts it on the
    lab worker only (``scheduler_plugins.catalog_only``); volunteers get blocks, through tasks.
    """
    if x.nbytes < (UPLOAD_MIN_BYTES if min_bytes is None else min_bytes) or x.ndim == 0:
        return None
    client = upload_client()
    if client is None:
        return None
    with _COPIES_LOCK:
        fut = _COPIES.get((client.id, digest))
        if fut is not None and fut.status not in ("lost", "error", "cancelled"):
            return fut
        key = (f"source-{digest}", next(_GENERATION))
        try:
            fut = client.scatter({key: x}, direct=False, hash=False)[key]
        except Exception as e:
            raise RuntimeError(f"from_array: could not put the {x.nbytes / 2**20:.0f} MiB array on the lab worker "
                               f"({type(e).__name__}: {e}); is the lab worker connected?") from e
        # Kept for a local scheduler (``compute(scheduler="sync")`` with a client around):
        # :func:`resolve_local` cuts the blocks from it.  Not pickled: the scheduler's copy of
        # the Future is a bare key.
        fut._goblin_data = x
        _COPIES[(client.id, digest)] = fut
        return fut


def resolve_local(dsk: dict) -> dict:
    """Blocks of lab copies as data again, for a scheduler in the researcher's process.

    Runs in ``ga.Array.__dask_optimize__``: in the researcher's process for a local scheduler
    (the Futures there carry their array), on the lab node's scheduler for distributed (its
    Futures are bare keys: nothing changes, the lab worker slices its copy).
    """
    out = None
    for key, node in dsk.items():
        if not (isinstance(node, Task) and node.func is lab_block and node.kwargs.get("index") is not None):
            continue
        data = getattr(node.args[0], "_goblin_data", None) if node.args else None
        if data is None:
            continue
        if out is None:
            out = dict(dsk)
        block = np.ascontiguousarray(data[node.kwargs["index"]])
        out[key] = Task(key, lab_block, DataNode(None, block), lab_array=node.kwargs.get("lab_array"))
    return dsk if out is None else out


def file_version(path: str) -> tuple[int, int, int]:
    """What tells one content of a file from another without reading it: (size, mtime, ctime) in ns.

    The ctime is the kernel's, set on every write and every ``os.utime``: a file rewritten in place at
    the same size, its mtime put back, still has a new version (a new key: volunteers' cached panels
    of the old content are never taken for the new one)."""
    st = os.stat(path)
    return (int(st.st_size), int(st.st_mtime_ns), int(st.st_ctime_ns))


def read_block(path: str, dtype: str, shape: tuple, offset: int, order: str, index: tuple,
               lab_array: tuple | None = None, version: tuple | None = None) -> np.ndarray:
    """Lab worker: one block of a file-backed array (a copy, so the mapping closes).

    ``version`` (:func:`file_version` when ``from_array`` read the file): the file must still be that
    one; a block of other content under the old key would make an honest volunteer's cached panel fail
    its check."""
    if version is not None and file_version(path) != tuple(version):
        raise RuntimeError(f"from_array: the file {path} changed after from_array read it (size, mtime or "
                           "ctime differ); call ga.from_array on it again")
    mm = np.memmap(path, dtype=np.dtype(dtype), mode="r", shape=tuple(shape), offset=offset, order=order)
    try:
        return np.array(mm[index])
    finally:
        del mm


class Source:
    """Data the lab holds, able to produce its blocks for any chunking."""

    def __init__(self, data: Any, upload_min_bytes: int | None = None, kind: str = "data"):
        if kind not in KINDS:
            raise ValueError(f"from_array: kind {kind!r}: one of {', '.join(KINDS)}")
        #: what the lab array is (:data:`KINDS`): decides which share cap applies to it
        self.kind = kind
        self.data = data
        self.file = _file_of(data)
        self.dtype = np.dtype(data.dtype)
        self.shape = tuple(int(s) for s in data.shape)
        if self.file is not None:
            #: the file's version when it was read (:func:`file_version`); every block read checks it
            self.version = file_version(self.file[0])
            self.token = _tokenize("memmap", self.file, *self.version)
        else:
            self.token = content_hash(data)
        #: opaque id of this lab array (the same data cut in other blocks keeps it)
        self.id = "a" + self.token[:15]
        #: the lab worker's copy (a Future) when a client is there (in-memory data only), else None
        self.copy = lab_copy(data, self.token, upload_min_bytes) if self.file is None else None

    def blocks(self, chunks: Any):
        from goblin_dask.array.core import from_graph, normalize_chunks, offsets_of
        from goblin_dask.array.keys import block_key, new_name

        chunks = normalize_chunks(chunks, self.shape, self.dtype, where="from_array")
        kind = () if self.kind == "data" else (self.kind,)  # data is the 3-tuple (and the plain name)
        # the same numbers as data and as parameters: other keys (their tasks name other kinds)
        name = new_name("source", self.token, chunks, *kind)
        offs = [offsets_of(c) for c in chunks]
        layer = {}
        for idx in itertools.product(*(range(len(c)) for c in chunks)):
            index = tuple(slice(o[i], o[i + 1]) for o, i in zip(offs, idx))
            key = block_key(name, idx)
            where = (self.id, self.shape, tuple((o[i], o[i + 1]) for o, i in zip(offs, idx)), *kind)
            if self.file is not None:
                path, offset, order = self.file
                layer[key] = Task(key, read_block, path, self.dtype.str, self.shape, offset, order, index,
                                  lab_array=where, version=self.version)
            elif self.copy is not None:  # a slice of the lab worker's copy: the graph holds a reference
                layer[key] = Task(key, lab_block, self.copy, lab_array=where, index=index)
            else:
                block = np.ascontiguousarray(self.data[index]) if self.data.ndim else np.asarray(self.data)
                layer[key] = Task(key, lab_block, DataNode(None, block), lab_array=where)
        out = from_graph(name, layer, chunks, self.dtype, source=self)
        out.dask.layers[name].collection_annotations = {LAB_ARRAY: (self.id, math.prod(self.shape), *kind)}
        return out


#: Catalog ops whose output carries its inputs' elements (moved, or transformed one by one);
#: products and reductions make new numbers (aggregates) and are not counted as the lab array.
_LAYOUT_OPS = frozenset({"getitem", "transpose", "reshape", "squeeze", "expand_dims", "broadcast_to", "concatenate",
                         "stack", "astype", "rechunk", "formula", "where", "clip", "take", "pad", "cumsum", "cumprod"})


def carries_lab_data(opname: str) -> bool:
    """Does a block made by ``opname`` still reveal its operands' elements (layout, elementwise)?"""
    from goblin_dask.ops import catalog

    spec = catalog().get(opname)
    return opname in _LAYOUT_OPS or (spec is not None and spec.elementwise is not None)


# Lab arrays up to ``goblin.minimization.small-array`` elements are not capped by ``goblin.minimization.max-share``:
# a vector of means or scale factors is broadcast against every block of the data it belongs to,
# so any task would hold more than a share of it; a cap on it would shrink products to 1x1 blocks.


def share_cap(size: int, kind: str = "data") -> float | None:
    """The most elements of a lab array of ``size`` elements one volunteer task may hold (None: no cap).

    ``kind`` (:data:`KINDS`): data is capped by ``goblin.minimization.max-share``, parameters by
    ``goblin.minimization.parameters-max-share`` (default null: no cap); an unknown kind counts as data.
    """
    from goblin_dask import settings

    if kind == "parameters":
        share = settings.get("goblin.minimization.parameters-max-share")
    else:
        share = settings.get("goblin.minimization.max-share")
    small = int(settings.get("goblin.minimization.small-array"))
    if share is None or float(share) >= 1 or size <= small:
        return None
    return float(share) * size


def lab_arrays(x: Any) -> dict[str, int]:
    """{lab array id: its element count} of the lab arrays whose elements ``x``'s blocks may hold."""
    return {aid: size for aid, (size, _) in lab_array_kinds(x).items()}


def lab_array_kinds(x: Any) -> dict[str, tuple[int, str]]:
    """{lab array id: (its element count, its kind)} of the lab arrays whose elements ``x``'s blocks may hold.

    The same numbers given once as data and once as parameters are one lab array (one id): data.
    Walks ``x``'s layers back to the sources, through layout and elementwise layers only
    (a product or a reduction is an aggregate: its output does not count as its inputs).
    An upper bound: a slice of a lab array counts as the whole array.
    """
    graph = getattr(x, "dask", None)
    layers = getattr(graph, "layers", None)
    if layers is None:
        return {}
    deps = graph.dependencies
    out: dict[str, tuple[int, str]] = {}
    stack, seen = [x.name], set()
    while stack:
        name = stack.pop()
        if name in seen or name not in layers:
            continue
        seen.add(name)
        found = (layers[name].collection_annotations or {}).get(LAB_ARRAY)
        if found is not None:
            kind = combined_kind(out.get(found[0], (0, None))[1], found[2] if len(found) > 2 else "data")
            out[found[0]] = (int(found[1]), kind)
            continue
        from goblin_dask.array.keys import split_name

        split = split_name(name)
        prefix = split.prefix if split is not None else name
        if prefix != "rechunk" and not carries_lab_data(prefix):
            from goblin_dask.ops import catalog

            if prefix in catalog():
                continue  # an aggregate
        stack.extend(deps.get(name, ()))
    return out


def _tokenize(*args: Any) -> str:
    from dask.base import tokenize

    return tokenize(*args)


def _file_of(x: Any) -> tuple[str, int, str] | None:
    """(path, byte offset, order) when ``x`` is a whole-file ``np.memmap`` (not a view into one)."""
    if not isinstance(x, np.memmap) or not getattr(x, "filename", None) or not isinstance(x.base, mmap.mmap):
        return None
    if x.flags.c_contiguous:
        order = "C"
    elif x.flags.f_contiguous:
        order = "F"
    else:
        return None
    return (os.fspath(x.filename), int(x.offset), order)


def from_numpy_like(x: Any, chunks: Any, upload_min_bytes: int | None = None, kind: str = "data"):
    """``x``'s blocks as a ga.Array: a lab array of ``kind`` (:data:`KINDS`)."""
    if not isinstance(x, np.ndarray):
        if hasattr(x, "__array__") or isinstance(x, (list, tuple, int, float, complex, bool, np.generic)):
            x = np.asarray(x)
        else:
            raise TypeError(f"from_array: cannot make blocks of a {type(x).__name__}")
    if x.dtype.kind in "USO" or x.dtype.fields is not None:
        hint = " (text travels as integer tokens: see goblin_dask.text)" if x.dtype.kind in "USO" else ""
        raise TypeError(f"from_array: unsupported dtype {x.dtype}{hint}; the grid computes on numeric and boolean arrays")
    check_dtype("from_array", x.dtype)
    return Source(x, upload_min_bytes, kind).blocks(chunks)


def from_xarray(x: Any, chunks: Any):
    """The xarray object with its numeric variables as ga.Arrays, or None if ``x`` is not xarray."""
    mod = type(x).__module__
    if not mod.startswith("xarray"):
        return None
    import xarray as xr

    def convert(var):
        data = var.data if isinstance(var.data, np.ndarray) else var.values
        if data.dtype.kind not in "biufc" or data.dtype.fields is not None:
            return var  # non-numeric variables stay in the researcher's process
        if isinstance(chunks, dict):
            per_axis = tuple(chunks.get(d, -1) for d in var.dims)
        else:
            per_axis = chunks
        return var.copy(data=from_numpy_like(data, per_axis))

    if isinstance(x, xr.DataArray):
        return convert(x)
    if isinstance(x, xr.Dataset):
        out = x.copy()
        for name, var in x.data_vars.items():
            out[name] = convert(var)
        return out
    raise TypeError(f"from_array: unsupported xarray object {type(x).__name__}")
