"""One declaration per catalog operation, after JAX's primitives.

An :class:`OpSpec` is the single object that *is* an operation: its shape and dtype
rules (run on abstract values, before any data moves), its kernels (numpy reference,
optional numba and cupy), its cost, its verification method and a slot for the
gradient rule.  The registry built from these declarations is the allow-list used by
the lab node (what may be placed on a volunteer) and by the volunteer agent (what it
will deserialize and run).  A task names its op; the op pickles *by name*, so a
volunteer resolves the kernel from its own installed catalog and never receives code.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np
from dask._task_spec import Task

#: Verification methods an op may declare (see goblin_dask.validation).
VERIFY_METHODS = ("freivalds", "replica", "recompute", "exact")
#: Where a task of this op may run.  "volunteer": anywhere (volunteers preferred);
#: "lab": only on the trusted lab worker (it reads the lab's data).
PLACEMENTS = ("volunteer", "lab")

_BACKEND = "cpu"


class Aval(NamedTuple):
    """Abstract value: what the rules see instead of data."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def of(cls, x: Any) -> "Aval":
        if isinstance(x, Aval):
            return x
        if type(x) in (int, float, complex):
            return WeakAval((), np.dtype(type(x)))
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return cls(tuple(int(s) for s in x.shape), np.dtype(x.dtype))
        a = np.asarray(x)
        return cls(a.shape, a.dtype)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def weak(self) -> bool:
        return False


class WeakAval(Aval):
    """A Python int/float/complex operand: it takes the other operands' precision (NumPy's NEP 50)."""

    __slots__ = ()

    @property
    def weak(self) -> bool:
        return True


class Cost(NamedTuple):
    """Work of one task: floating-point (or integer) operations and bytes moved."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / max(self.bytes, 1.0)


def elementwise_cost(*avals: Aval, flops_per_element: float = 1.0, **params: Any) -> Cost:
    """Default cost: one pass over every operand and the (broadcast) output."""
    arrays = [a for a in avals if isinstance(a, Aval)]
    out = max((a.size for a in arrays), default=1)
    moved = sum(a.nbytes for a in arrays) + out * max((a.dtype.itemsize for a in arrays), default=8)
    return Cost(flops_per_element * out, moved)


@dataclass(frozen=True, eq=False)
class OpSpec:
    """A catalog operation.  Call it like its numpy kernel: ``op(*arrays, **params)``.

    ``shape_rule(*avals, **params)`` and ``dtype_rule(*avals, **params)`` raise
    ``ValueError`` / ``TypeError`` naming the op and the offending shapes or dtypes.
    Non-array operands (Python scalars) are passed to the rules as ``Aval`` of a
    0-d array, so broadcasting rules treat them uniformly.
    """

    name: str
    doc: str
    shape_rule: Callable[..., tuple[int, ...]]
    dtype_rule: Callable[..., np.dtype]
    numpy: Callable[..., Any]
    numba: Callable[..., Any] | None = None
    cupy: Callable[..., Any] | None = None
    cost: Callable[..., Cost] = elementwise_cost
    verify: str = "replica"
    grad: Any = None
    placement: str = "volunteer"
    arity: int | None = None
    version: int = 1
    #: Names of the static keyword parameters the op accepts (others are refused).
    params: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"op name {self.name!r} is not an identifier")
        if self.verify not in VERIFY_METHODS:
            raise ValueError(f"op {self.name}: verify={self.verify!r} not in {VERIFY_METHODS}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"op {self.name}: placement={self.placement!r} not in {PLACEMENTS}")
        if not self.doc or "\n" in self.doc.strip():
            raise ValueError(f"op {self.name}: doc must be one line")

    # -- rules -------------------------------------------------------------------
    def _check_call(self, args: tuple, params: dict) -> None:
        if self.arity is not None and len(args) != self.arity:
            raise TypeError(f"op {self.name}: takes {self.arity} operands, got {len(args)}")
        unknown = set(params) - set(self.params)
        if unknown:
            raise TypeError(f"op {self.name}: unknown parameter(s) {sorted(unknown)}; accepts {list(self.params)}")

    def abstract_eval(self, *operands: Any, **params: Any) -> Aval:
        """Output shape and dtype from operands' shapes and dtypes, without data."""
        self._check_call(operands, params)
        avals = tuple(Aval.of(o) for o in operands)
        dtype = np.dtype(self.dtype_rule(*avals, **params))
        shape = tuple(int(s) for s in self.shape_rule(*avals, **params))
        return Aval(shape, dtype)

    def cost_of(self, *operands: Any, **params: Any) -> Cost:
        return self.cost(*(Aval.of(o) for o in operands), **params)

    # -- execution ---------------------------------------------------------------
    def kernel(self, backend: str | None = None) -> Callable[..., Any]:
        """The kernel this process uses for the op: cupy on a GPU volunteer, else numba, else numpy."""
        backend = backend or _BACKEND
        if backend == "gpu" and self.cupy is not None:
            return _on_gpu(self.cupy)
        if backend in ("cpu", "gpu") and self.numba is not None:
            return self.numba
        return self.numpy

    def __call__(self, *args: Any, **params: Any) -> Any:
        return self.kernel()(*args, **params)

    # -- identity --------------------------------------------------------------
    def __reduce__(self):
        # Pickled by name: the receiving side resolves the op from its own catalog.
        from goblin_dask.ops.registry import op_by_name

        return (op_by_name, (self.name, self.version))

    def __repr__(self) -> str:
        return f"<catalog op {self.name} v{self.version}>"

    # dask's tokenize/funcname use these
    @property
    def __name__(self) -> str:  # type: ignore[override]
        return self.name

    def __dask_tokenize__(self):
        return ("goblin-op", self.name, self.version)


def _on_gpu(kernel: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **params: Any) -> Any:
        import cupy

        dev = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
        out = kernel(*dev, **params)
        return cupy.asnumpy(out) if isinstance(out, cupy.ndarray) else out

    return run


def set_backend(backend: str) -> None:
    """Select the kernel family for this process ("cpu", "gpu" or "numpy")."""
    global _BACKEND
    if backend not in ("cpu", "gpu", "numpy"):
        raise ValueError(f"backend must be 'cpu', 'gpu' or 'numpy', got {backend!r}")
    _BACKEND = backend


def get_backend() -> str:
    return _BACKEND


class CatalogTask(Task):
    """A dask Task whose callable is a catalog op; the only task a volunteer runs.

    ``placement`` says where the lab node may place it ("volunteer" or "lab").
    ``block_fusion`` keeps dask's linear fusion from hiding it inside a subgraph task.
    """

    __slots__ = ("placement",)
    placement: str

    def __init__(self, key: Any, op: OpSpec, /, *args: Any, placement: str | None = None, **params: Any):
        if not isinstance(op, OpSpec):
            raise TypeError(f"CatalogTask needs a catalog op, got {op!r}")
        super().__init__(key, op, *args, **params)
        placement = placement or op.placement
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if op.placement == "lab":
            placement = "lab"
        self.placement = placement

    @property
    def block_fusion(self) -> bool:
        return True

    @property
    def op(self) -> OpSpec:
        return self.func

    def copy(self) -> "CatalogTask":
        return CatalogTask(self.key, self.func, *self.args, placement=self.placement, **self.kwargs)


def is_catalog_task(task: Any) -> bool:
    """True for a CatalogTask of a registered op whose nested arguments are plain data."""
    from goblin_dask.ops.registry import is_registered

    return isinstance(task, CatalogTask) and is_registered(task.func)


ReadOnlyCatalog = types.MappingProxyType
