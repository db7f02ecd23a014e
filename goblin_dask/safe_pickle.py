"""The volunteer's unpickler: catalog operations and plain data, nothing else.

distributed unpickles in many places while a message is still being read (``ToPickle``
sub-frames of ``compute-task``, the type header of every array, plugins, functions
for ``run``, remote exceptions), before any handler or blocked-handler check runs.
Every one of those goes through ``distributed.protocol.pickle.loads``; the volunteer
agent replaces it with :func:`safe_loads`, so whatever a peer sends, even a
compromised lab node, the only globals a volunteer will resolve are the ones below.
Anything else raises :class:`RefusedPickle` and nothing of it runs.
"""

from __future__ import annotations

import builtins
import io
import logging
import pickle
from typing import Any

logger = logging.getLogger("goblin_dask.volunteer")


class RefusedPickle(pickle.UnpicklingError):
    """A peer sent a pickle that names a global outside the volunteer's allow-list."""


#: (module, qualname) pairs of numbers and plain containers: all the lab resolves in what a volunteer sends.
PLAIN_DATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        # numpy arrays, scalars and dtypes
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        # plain containers and values
        ("builtins", "slice"),
        ("builtins", "tuple"),
        ("builtins", "list"),
        ("builtins", "dict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "complex"),
        ("builtins", "bytearray"),
        ("builtins", "range"),
    }
)

#: (module, qualname) pairs a volunteer may resolve while unpickling: plain data, and catalog tasks.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = PLAIN_DATA_GLOBALS | frozenset(
    {
        # catalog ops (resolved by name in the local catalog) and catalog tasks
        ("goblin_dask.ops.registry", "op_by_name"),
        ("goblin_dask.ops.spec", "CatalogTask"),
        # dask task-spec plumbing (no callables of their own)
        ("dask._task_spec", "TaskRef"),
        ("dask._task_spec", "DataNode"),
        ("dask._task_spec", "Alias"),
        ("dask._task_spec", "List"),
        ("dask._task_spec", "Tuple"),
        ("builtins", "Ellipsis"),
        ("copyreg", "_reconstructor"),
        ("_codecs", "encode"),
        ("builtins", "object"),
    }
)

_NUMPY_DTYPE_CLASSES = "numpy.dtypes"


def _plain_data(module: str, name: str) -> bool:
    if (module, name) in PLAIN_DATA_GLOBALS:
        return True
    if module == _NUMPY_DTYPE_CLASSES and name.endswith("DType") and not name.startswith(("Object", "Void", "Str", "Bytes")):
        return True  # numpy 2 pickles dtypes through numpy.dtypes.Float64DType & co.
    return module == "numpy" and name in _NUMPY_SCALAR_TYPES


def _allowed(module: str, name: str) -> bool:
    if (module, name) in ALLOWED_GLOBALS or _plain_data(module, name):
        return True
    if module == "builtins":
        # remote errors arrive pickled; builtin exception classes run no code of a peer's
        obj = getattr(builtins, name, None)
        return isinstance(obj, type) and issubclass(obj, BaseException)
    return False


_NUMPY_SCALAR_TYPES = frozenset(
    "bool_ int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 longdouble "
    "complex64 complex128 clongdouble intc uintc".split()
)


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("goblin_dask.ops.registry", "op_by_name"):
            from goblin_dask.ops.registry import volunteer_op_by_name

            return volunteer_op_by_name  # the volunteer's catalog: no lab-only ops
        if _allowed(module, name):
            return super().find_class(module, name)
        raise RefusedPickle(f"volunteer refuses to load {module}.{name}: not a catalog operation or plain data")


def safe_loads(data: bytes | bytearray | memoryview, *, buffers: Any = ()) -> Any:
    """``pickle.loads`` restricted to :data:`ALLOWED_GLOBALS`."""
    try:
        return SafeUnpickler(io.BytesIO(data), buffers=buffers or None).load()
    except RefusedPickle as e:
        logger.warning("refused a pickle from a peer: %s", e)
        raise


class PlainDataUnpickler(pickle.Unpickler):
    """The lab's unpickler for a volunteer's bytes: numbers and plain containers, no class of any other kind."""

    def __init__(self, *args, peer: str = "?", **kwargs):
        super().__init__(*args, **kwargs)
        self.peer = peer

    def find_class(self, module: str, name: str) -> Any:
        if _plain_data(module, name):
            return super().find_class(module, name)
        raise RefusedPickle(f"the lab refuses to load {module}.{name} from volunteer {self.peer}: "
                            "it reads numbers and plain containers only")


def plain_data_loads(data: bytes | bytearray | memoryview, *, buffers: Any = (), peer: str = "?") -> Any:
    """``pickle.loads`` restricted to :data:`PLAIN_DATA_GLOBALS` (what the lab reads from a volunteer)."""
    return PlainDataUnpickler(io.BytesIO(data), buffers=buffers or None, peer=peer).load()


def install() -> None:
    """Make every unpickling done by distributed in this process go through safe_loads."""
    import distributed.protocol.pickle as dpickle

    def loads(x, *, buffers=()):
        return safe_loads(x, buffers=buffers)

    dpickle.loads = loads
