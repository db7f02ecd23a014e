"""One declaration per catalog operation, after JAX's primitives.

An :class:`OpSpec` is the single object that *is* an operation: its shape and dtype
rules (run on abstract values, before any data moves), its kernels (numpy reference,
optional numba and cupy), its cost, its typed verification (:class:`Freivalds` with the
op's product form, :class:`Replica`, :class:`Recompute`, :class:`Exact`) and the
placement that follows from it, its gradient rule, its Python operator, aliases and
reduction combine rule, the grammar of any text parameter, and example calls.  The
array API, formulas, NumPy dispatch, the lab's checks and the scheduler's filters read
these declarations; nothing keeps a second table.  The registry built from them is the
allow-list used by the lab node (what may be placed on a volunteer) and by the volunteer
agent (what it will deserialize and run).  A task names its op; the op pickles *by
name*, so a volunteer resolves the kernel from its own installed catalog and never
receives code.  How to add one: ``goblin_dask/ops/README.md``.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, NamedTuple

import numpy as np
from dask._task_spec import Task

#: Where a task of this op may run.  "volunteer": anywhere (volunteers preferred);
#: "lab": only on the trusted lab worker (checking it would cost as much as computing it).
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


# -- how a result is verified ----------------------------------------------------------


class ProductForm(NamedTuple):
    """A product task's result as ``c == a @ b (+ c0)``, what a Freivalds check reads.

    ``same_layout``: ``c`` is the result itself (reshaped at most), so the lab's own product,
    computed when a check fails, can stand in for a rejected result.
    """

    c: Any
    a: Any
    b: Any
    c0: Any = None
    same_layout: bool = False


class Verification:
    """How the lab checks a volunteer's result of an op (see :mod:`goblin_dask.validation.checks`)."""

    #: the method's name in verdicts and reports
    method: ClassVar[str]
    #: checking costs the lab as much as computing: tasks of the op run on the lab worker only
    lab_only: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass(frozen=True, repr=False)
class Replica(Verification):
    """A second volunteer computes it too (BOINC's adaptive replication); disagreements go to the lab."""

    method: ClassVar[str] = "replica"


@dataclass(frozen=True, repr=False)
class Recompute(Verification):
    """The lab computes it again and compares within rounding."""

    method: ClassVar[str] = "recompute"
    lab_only: ClassVar[bool] = True


@dataclass(frozen=True, repr=False)
class Exact(Verification):
    """The result is bitwise determined by the operands: the lab recomputes and compares exactly."""

    method: ClassVar[str] = "exact"
    lab_only: ClassVar[bool] = True


@dataclass(frozen=True)
class Freivalds(Verification):
    """A product: checked in O(output) against O(output x inner) to compute (:mod:`goblin_dask.validation.freivalds`).

    ``form(result, *operands, **params)`` gives the task as a :class:`ProductForm`, or
    None when this call is no product (a one-operand einsum); ``otherwise`` verifies those.
    """

    form: Callable[..., "ProductForm | None"]
    otherwise: Verification = Replica()
    method: ClassVar[str] = "freivalds"

    def __post_init__(self) -> None:
        if not callable(self.form):
            raise TypeError(f"Freivalds(form=...) needs a callable, got {self.form!r}")
        if isinstance(self.otherwise, Freivalds) or not isinstance(self.otherwise, Verification):
            raise TypeError(f"Freivalds(otherwise=...) must be another kind of Verification, got {self.otherwise!r}")

    def __repr__(self) -> str:
        return f"Freivalds(form={getattr(self.form, '__name__', self.form)}, otherwise={self.otherwise!r})"


#: An example call of an op: ``(operands, params)``.
Example = tuple[tuple, dict]


@dataclass(frozen=True)
class Elementwise:
    """What makes an op elementwise: the loop NumPy computes in, and its scalar code for fused kernels.

    ``loop(*dtype_args) -> (in dtypes..., out dtype)`` (TypeError when unsupported);
    ``scalar``: a :class:`goblin_dask.ops._factories.Scalar`; ``domain``: one ``(lo, hi)`` per
    operand where the op is defined (for examples and benchmarks); ``flops`` per element.
    """

    loop: Callable[..., tuple]
    scalar: Any
    domain: tuple | None = None
    flops: float = 1.0


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
    verify: Verification = Replica()
    grad: Any = None
    #: "volunteer" or "lab"; by default "lab" exactly when the verification is ``lab_only``
    placement: str | None = None
    arity: int | None = None
    version: int = 1
    #: Names of the static keyword parameters the op accepts (others are refused).
    params: tuple[str, ...] = ()
    #: The parameters that may carry text, each with its grammar (a regular expression the
    #: whole string must match): einsum's subscripts, a formula, a dtype's name.  No other
    #: text reaches a volunteer (:func:`goblin_dask.ops.registry.task_violation`).
    text_params: Mapping[str, str] = field(default_factory=dict)
    #: The Python operator that means this op (``operator.add``): ga.Array's dunders and formulas.
    operator: Callable[..., Any] | None = None
    #: Other names of the op (NumPy's ``abs`` for ``absolute``), in ga, formulas and NumPy dispatch.
    aliases: tuple[str, ...] = ()
    #: For a reduction: the op that merges two partial results (sum: ``add``).
    combine: str | None = None
    #: Set for elementwise ops (fused into formulas, broadcast block by block).
    elementwise: Elementwise | None = None
    #: ``examples(n, rng, dtype) -> [(operands, params), ...]`` on blocks about n x n: the
    #: catalog tests and the GPU check run every op through these (elementwise ops draw their own).
    examples: Callable[..., list[Example]] | None = None
    #: ``compare(got, want, operands, params) -> bool``: whether two results of one task agree, where the
    #: generic rounding rule (:func:`goblin_dask.validation.checks.same_result`) does not fit (a program's
    #: outputs, each with its own scale); None: that rule.
    compare: Callable[..., bool] | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"op name {self.name!r} is not an identifier")
        if not isinstance(self.verify, Verification):
            raise TypeError(f"op {self.name}: verify={self.verify!r} must be a Verification "
                            "(Freivalds(form=...), Replica(), Recompute() or Exact())")
        placement = self.placement or ("lab" if self.verify.lab_only else "volunteer")
        if placement not in PLACEMENTS:
            raise ValueError(f"op {self.name}: placement={self.placement!r} not in {PLACEMENTS}")
        if placement == "volunteer" and self.verify.lab_only:
            raise ValueError(f"op {self.name}: {self.verify!r} checks by computing again, so the op runs on the lab only")
        object.__setattr__(self, "placement", placement)
        if not self.doc or "\n" in self.doc.strip():
            raise ValueError(f"op {self.name}: doc must be one line")
        undeclared = set(self.text_params) - set(self.params)
        if undeclared:
            raise ValueError(f"op {self.name}: text parameter(s) {sorted(undeclared)} are not among its params")
        for alias in self.aliases:
            if not alias.isidentifier() or alias == self.name:
                raise ValueError(f"op {self.name}: bad alias {alias!r}")

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
        out = self.kernel()(*args, **params)
        # NumPy ufuncs on 0-d arrays return scalars; a result is always an ndarray (the lab's form check)
        return np.asarray(out) if isinstance(out, np.generic) else out

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


class ProgramPickleTask(Task):
    """A Task whose stage program, if it carries one, travels as its pickle, made once per program and decoded once
    per content (:func:`~goblin_dask.ops.program.pickled_program`): a round's tasks carry the same program to the
    scheduler, to each volunteer and to the lab worker.  The program is ``kwargs["program"]``, or with
    :attr:`PROGRAM_IN` set, ``kwargs[PROGRAM_IN]["program"]``."""

    __slots__ = ()
    PROGRAM_IN: ClassVar[str | None] = None

    def _program_holder(self) -> Any:
        return self.kwargs if self.PROGRAM_IN is None else self.kwargs.get(self.PROGRAM_IN)

    def _with_holder(self, holder: Any) -> dict:
        return holder if self.PROGRAM_IN is None else {**self.kwargs, self.PROGRAM_IN: holder}

    def __getstate__(self) -> tuple:
        from goblin_dask.ops.program import pickled_program

        state = super().__getstate__()
        holder = self._program_holder()
        packed = pickled_program(holder)
        if packed is holder:
            return state
        at = self.get_all_slots().index("kwargs")
        return (*state[:at], self._with_holder(packed), *state[at + 1:])

    def __setstate__(self, state: tuple) -> None:
        """Decode under the volunteer's unpickler (plain data and nothing else), wherever this runs."""
        from goblin_dask.ops.program import unpickled_program

        super().__setstate__(state)
        holder = self._program_holder()
        unpacked = unpickled_program(holder)
        if unpacked is not holder:
            self.kwargs = self._with_holder(unpacked)


class CatalogTask(ProgramPickleTask):
    """A dask Task whose callable is a catalog op; the only task a volunteer runs.

    ``placement`` says where the lab node may place it ("volunteer" or "lab"); ``why``, for a
    lab-placed task, the reason (a key of :data:`goblin_dask.array.placement.KEPT_AT_LAB`), which the
    lab node counts in its report.  ``block_fusion`` keeps dask's linear fusion from hiding it inside a
    subgraph task.
    """

    __slots__ = ("placement", "why")
    placement: str
    why: str | None

    def __init__(self, key: Any, op: OpSpec, /, *args: Any, placement: str | None = None, why: str | None = None,
                 **params: Any):
        if not isinstance(op, OpSpec):
            raise TypeError(f"CatalogTask needs a catalog op, got {op!r}")
        super().__init__(key, op, *args, **params)
        placement = placement or op.placement
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if op.placement == "lab":
            placement, why = "lab", "lab-only"
        self.placement = placement
        self.why = why if placement == "lab" else None

    @property
    def block_fusion(self) -> bool:
        return True

    @property
    def op(self) -> OpSpec:
        return self.func

    def copy(self) -> "CatalogTask":
        return CatalogTask(self.key, self.func, *self.args, placement=self.placement, why=self.why, **self.kwargs)

    def _get_token(self) -> str:
        """dask's token of the task (it names the graph a client submits); a stage program is named by the
        hash of its pickle (:func:`goblin_dask.ops.program.program_token`), not walked step by step by
        dask's tokenize for every task that carries it."""
        program = self.kwargs.get("program")
        if self._token or type(program) is not tuple:
            return super()._get_token()
        from dask.base import tokenize

        from goblin_dask.ops.program import program_token

        named = program_token(program)
        if named is None:
            return super()._get_token()
        rest = {k: v for k, v in self.kwargs.items() if k != "program"}
        self._token = tokenize((type(self).__name__, self.func, self.args, rest, named))
        return self._token


def lab_chain(*_: Any) -> Any:
    """The callable a :class:`LabChain` names (task streams, reprs); the chain runs its steps itself."""
    raise RuntimeError("lab_chain runs through its LabChain task")


class LabChain(Task):
    """A linear chain of lab-placed catalog tasks run as one task on the lab worker.

    ``steps``: the chain's :class:`CatalogTask` s in order; each step after the first reads the
    previous step's result (and any other operands from outside the chain), and the task's key
    is the last step's.  Made by :func:`goblin_dask.array.graph.fuse_lab_chains` after the lab's
    checks are in the graph, to save the scheduler and the lab worker their per-task costs.
    It is no catalog task: a volunteer's allow-list (``task_violation``, its unpickler) refuses
    it, the lab node places it on the lab worker, and the exposure plugin follows lineage
    through its steps one by one.
    """

    __slots__ = ("steps",)
    steps: tuple

    def __init__(self, key: Any, steps: Any, /):
        steps = tuple(steps)
        if len(steps) < 2:
            raise ValueError("a LabChain needs at least two steps")
        inner = set()
        outer: dict = {}
        for i, step in enumerate(steps):
            if type(step) is not CatalogTask or step.placement != "lab":
                raise TypeError(f"a LabChain's steps are lab-placed CatalogTasks, got {step!r}")
            if i and steps[i - 1].key not in step.dependencies:
                raise ValueError(f"step {step.key!r} does not read the step before it")
            for d in step.dependencies:
                if d not in inner:
                    outer.setdefault(d, None)
            inner.add(step.key)
        if steps[-1].key != key:
            raise ValueError(f"a LabChain takes its last step's key {steps[-1].key!r}, not {key!r}")
        super().__init__(key, lab_chain)
        self.steps = steps
        self._dependencies = frozenset(outer)

    @property
    def block_fusion(self) -> bool:
        return True

    def __call__(self, values: Any = ()) -> Any:
        self._verify_values(values)
        prev, out = None, None
        for step in self.steps:
            try:
                out = step({d: (out if d == prev else values[d]) for d in step.dependencies})
            except Exception as e:
                e.add_note(f"in step {step.key!r} ({step.func.name}) of the fused lab chain {self.key!r}")
                raise
            prev = step.key
        return out

    def _get_token(self) -> str:
        if self._token:
            return self._token
        from dask.base import tokenize

        self._token = tokenize(("LabChain", self.key, self.steps))
        return self._token

    def copy(self) -> "LabChain":
        return LabChain(self.key, tuple(s.copy() for s in self.steps))

    def substitute(self, subs: dict, key: Any = None) -> "LabChain":
        if not (self.dependencies & subs.keys()) and (key is None or key == self.key):
            return self
        outer = {k: subs[k] for k in self.dependencies & subs.keys()}  # subs may be the whole graph
        steps = [s.substitute(outer) for s in self.steps]
        if key is not None and key != self.key:
            last = steps[-1]
            steps[-1] = CatalogTask(key, last.func, *last.args, placement=last.placement, why=last.why,
                                    **last.kwargs)
        return LabChain(key or self.key, steps)

    def __repr__(self) -> str:
        return f"<LabChain {self.key!r} {' -> '.join(s.func.name for s in self.steps)}>"
