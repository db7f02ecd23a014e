"""``program``: a straight-line graph of catalog operations run as one volunteer task (a stage).

Why: a model's forward (or forward and backward) cut op by op is hundreds of tasks, each a lab ->
volunteer -> lab round trip with its operands on the wire and its glue on the lab worker.  A stage
task sends the stage's inputs once, runs every op where the data already is, and returns only the
stage's outputs: the work is coarse (Dask's ~1 ms per task, BOINC's and DiLoCo's coarse units).

A program is plain data, never code: ``(FORMAT, n_inputs, steps, outputs, result_dtype, flops)``
where each step is ``(op name, op version, args, kwargs as (name, value) pairs)``, an argument
``("$ref", i)`` is value ``i`` (the inputs first, then one value per step, in order) and every
other argument is a literal of the kinds a catalog task may carry.  Every step's op is resolved
by name from the volunteer's own catalog and checked like a task of its own
(:func:`program_violation`, run by the lab node before placing and by the volunteer before
running).  Ops the lab keeps for itself when they travel alone (layout, selections) run inside
a program: the program is verified as a whole.

The result is one flat array: the outputs raveled and concatenated in ``result_dtype``, then one
*rounding scale* per output (:func:`rounding_floors`; the lab's form check reads the length and dtype
from the program, before any comparison).  Its
verification is a replica on another volunteer, with the lab recomputing the program where they
disagree.  The replica runs as ``program_sketch``: the same program, returning only a fingerprint
of its outputs (:func:`sketch`, about 1/64 of their bytes), drawn from a seed the lab picks after
the first result is in; the lab fingerprints the first result with the same seed and compares
(:func:`same_sketch`).  A replica's upload is then a few percent of a stage's outputs.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import threading
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from goblin_dask.ops.registry import register
from goblin_dask.ops.spec import Aval, Cost, OpSpec, Replica

FORMAT = "goblin-program/1"
REF = "$ref"
#: Most steps one program may hold (a GPT's forward and backward is a few thousand).
MAX_STEPS = 50_000
#: Replica comparison of a program's outputs, in units of the result dtype's epsilon, of each output's
#: norm: honest volunteers (other BLAS kernels, thread counts) differ by rounding that grows with depth
#: (measured on a 4-layer GPT's forward and backward: see ``tests/test_program.py``); a gradient scaled
#: by 1.001 or one wrong product moves an output by far more.
PROGRAM_TOLERANCE_EPS = 4096.0


#: Ops an output is walked back through to find the reductions that made it: those that move, retype or negate
#: their operands' elements, and sums of whole operands (a gradient accumulated over a parameter's uses).
_PASS_THROUGH = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "broadcast_to", "astype", "getitem",
                           "take", "negative", "positive", "concatenate", "stack", "pad", "add", "subtract"})
#: Reductions: an honest result may be pure cancellation (a bias's gradient before a normalization, a key
#: projection's bias in attention: zero in exact arithmetic), so its rounding is measured on its largest term,
#: not on itself.  Products are left out: their own magnitude bounds a cheat tightly, and a whole product
#: that cancels is rare.
_SUMS = frozenset({"sum", "mean"})


def is_ref(value: Any) -> bool:
    return type(value) is tuple and len(value) == 2 and value[0] == REF and type(value[1]) is int


def _parts(program: Any) -> tuple:
    if type(program) is not tuple or len(program) != 6 or program[0] != FORMAT:
        raise ValueError(f"program: not a {FORMAT} program")
    return program


def outputs_of(program: tuple) -> list[tuple[tuple[int, ...], np.dtype]]:
    """The (shape, dtype) of each output, in the order they are packed."""
    return [(tuple(shape), np.dtype(dtype)) for _, shape, dtype in _parts(program)[3]]


def _constant_factor(name: str, args: tuple) -> float | None:
    """The factor ``multiply`` or ``divide`` scales its one value operand by, when every other operand is a number
    literal (the round's weight of a micro-batch's gradient); None for any other step."""
    refs = [i for i, a in enumerate(args) if is_ref(a)]
    if name not in ("multiply", "divide") or len(refs) != 1 or len(args) != 2 or (name == "divide" and refs != [0]):
        return None
    c = args[1 - refs[0]]
    if isinstance(c, bool) or not isinstance(c, (int, float, np.integer, np.floating)) or not np.isfinite(c) or c == 0:
        return None
    return abs(float(c)) if name == "multiply" else 1.0 / abs(float(c))


def _floor_steps(program: tuple) -> list[dict[int, float]]:
    """For each output, the steps whose terms bound its rounding (see :func:`rounding_floors`), each with the factor
    its terms are scaled by on the way: walked back from the output through :data:`_PASS_THROUGH` ops, and through
    a product with (or quotient by) a number literal, to the :data:`_SUMS` steps that made it.  A multi-micro-batch
    gradient is ``add`` of ``multiply(sum, weight)``: zero by construction where a normalization follows its bias,
    it gets its sums' floor times the weight, not 0 (another CPU's BLAS rounds it otherwise, wholly)."""
    _, n_inputs, steps, outputs, _, _ = _parts(program)
    found: list[dict[int, float]] = []
    for value, _, _ in outputs:
        here: dict[int, float] = {}
        todo, seen = [(value, 1.0)], {}
        while todo:
            v, scale = todo.pop()
            if v < n_inputs or seen.get(v, -1.0) >= scale:
                continue
            seen[v] = scale
            name, _, args, _ = steps[v - n_inputs]
            factor = _constant_factor(name, args)
            if name in _SUMS:
                here[v - n_inputs] = max(here.get(v - n_inputs, 0.0), scale)
            elif name in _PASS_THROUGH:
                todo.extend((r, scale) for r in _refs_in(args))
            elif factor is not None:
                todo.extend((r, scale * factor) for r in _refs_in(args))
        found.append(here)
    return found


def _largest_term(operands: list) -> float:
    """The largest magnitude among a reduction's terms (NaN or inf: a floor counted as 0)."""
    peaks = [max(float(x.max()), -float(x.min())) for x in map(np.asarray, operands)  # no temporaries
             if x.dtype.kind in "fiu" and x.size]
    return max(peaks, default=0.0)


def _epsilon(output: np.dtype, packed: np.dtype) -> float:
    """The rounding unit of one output: its own dtype's (a float32 gradient packed beside an int64 counter travels
    as float64, but was computed in float32); the packed dtype's for integer outputs."""
    return float(np.finfo(output if np.dtype(output).kind in "fc" else packed).eps)


def rounding_floors(result: Any, program: tuple) -> np.ndarray:
    """The rounding scale each output of a packed ``result`` reports: the largest term summed into it (its
    :data:`_SUMS` steps' operands), 0 where no reduction made it.  Replica comparisons measure rounding on
    the larger of this and the output's own magnitude, and take the smaller of the two parties' floors, so one
    party alone cannot widen its own tolerance; a floor that is not a finite non-negative number counts as 0."""
    r = np.asarray(result)
    n = len(_parts(program)[3])
    floors = r[r.size - n:].astype(np.float64) if r.size >= n else np.zeros(n)
    return np.where(np.isfinite(floors) & (floors > 0), floors, 0.0)


def unpack(result: Any, program: tuple) -> list[np.ndarray]:
    """A packed result's outputs, each in its shape and dtype (the rounding floors left out)."""
    r, out, at = np.asarray(result), [], 0
    for shape, dtype in outputs_of(program):
        n = math.prod(shape)
        out.append(r[at:at + n].reshape(shape).astype(dtype, copy=False))
        at += n
    return out


def packed_size(program: tuple) -> int:
    """The length of a program's packed result: every output's elements, then one rounding floor per output."""
    return sum(math.prod(shape) for shape, _ in outputs_of(program)) + len(_parts(program)[3])


def _resolve(value: Any, env: list) -> Any:
    if is_ref(value):
        return env[value[1]]
    if type(value) is tuple:
        return tuple(_resolve(v, env) for v in value)
    if type(value) is list:
        return [_resolve(v, env) for v in value]
    return value


def _refs_in(value: Any):
    if is_ref(value):
        yield value[1]
    elif type(value) in (tuple, list):
        for v in value:
            yield from _refs_in(v)


def run(*inputs: Any, program: tuple) -> np.ndarray:
    """Run the program's steps on its inputs; return the outputs packed (see the module docstring).

    A value is dropped once no later step or output reads it, so a stage holds its live
    activations only, as a framework's own executor would."""
    _, n_inputs, steps, outputs, result_dtype, _ = _parts(program)
    from goblin_dask.ops.registry import op_by_name

    if len(inputs) != n_inputs:
        raise TypeError(f"program: takes {n_inputs} inputs, got {len(inputs)}")
    last = {}
    for i, (_, _, args, kwargs) in enumerate(steps):
        for r in _refs_in((args, kwargs)):
            last[r] = n_inputs + i
    keep = {o[0] for o in outputs}
    floor_steps = _floor_steps(program)
    measured = set().union(*floor_steps) if floor_steps else set()
    terms: dict[int, float] = {}
    env: list = list(inputs)
    for i, (name, version, args, kwargs) in enumerate(steps):
        op = op_by_name(name, version)
        here = n_inputs + i
        operands = _resolve(args, env)
        try:
            value = op(*operands, **{k: _resolve(v, env) for k, v in kwargs})
        except Exception as e:
            e.add_note(f"in step {i} ({name}) of a program")
            raise
        if i in measured:
            terms[i] = _largest_term(list(operands))
        env.append(value)
        for r in set(_refs_in((args, kwargs))):
            if last.get(r) == here and r not in keep:
                env[r] = None
    dtype = np.dtype(result_dtype)
    parts = [np.asarray(env[i]).astype(dtype, copy=False).reshape(-1) for i, _, _ in outputs]
    floors = [max((terms[j] * scale for j, scale in found.items()), default=0.0) for found in floor_steps]
    with np.errstate(over="ignore", invalid="ignore"):
        parts.append(np.asarray(floors, dtype=np.float64).astype(dtype))
    return np.concatenate(parts)


#: Guards :data:`_TOKENS`, :data:`_DECODED` and :data:`_VERDICTS` (a lab worker checks from several threads).
_VERDICTS_LOCK = threading.Lock()
#: The pickle and token of the last programs named, by the program object itself (held, so its id is not reused
#: while here): a lab process names one program several times per task (dask's token, the catalog and
#: minimization checks, the verdict's sketch) and sends it in every task that carries it; a GPT's training step
#: pickles and hashes in about 1.3 ms.
_TOKENS: "OrderedDict[int, tuple[Any, bytes | None, str | None]]" = OrderedDict()
_TOKENS_MAX = 8
#: The programs last decoded, by the SHA-256 of their pickle (:func:`program_from_pickle`).
_DECODED: "OrderedDict[str, Any]" = OrderedDict()


def _remember(program: Any, blob: bytes | None, token: str | None) -> None:
    with _VERDICTS_LOCK:
        _TOKENS[id(program)] = (program, blob, token)
        _TOKENS.move_to_end(id(program))  # the latest named stays longest
        while len(_TOKENS) > _TOKENS_MAX:
            _TOKENS.popitem(last=False)


def _named(program: Any) -> tuple[bytes | None, str | None]:
    with _VERDICTS_LOCK:
        hit = _TOKENS.get(id(program))
    if hit is not None and hit[0] is program:
        return hit[1], hit[2]
    try:
        blob = pickle.dumps(program, protocol=5)
    except Exception:
        return None, None
    token = hashlib.sha256(blob).hexdigest()
    if type(program) is tuple:
        _remember(program, blob, token)
    return blob, token


def program_token(program: Any) -> str | None:
    """A name of ``program``'s exact content (SHA-256 of its pickle: ``1``, ``1.0`` and ``True`` differ), or None
    for a value that does not pickle.  A program is plain data, so this is cheap (dask's own tokenize walks it
    about 10x slower); it is the program's dask token, and the key of its verdict.  Remembered per object
    (:data:`_TOKENS`): a program is a tuple the lab never changes once made."""
    return _named(program)[1]


def program_pickle(program: tuple) -> bytes | None:
    """``program``'s pickle, made once per object: a task carries its program as these bytes
    (:meth:`goblin_dask.ops.spec.CatalogTask.__getstate__`), so a round's tasks do not pickle their program
    again at the researcher, at the scheduler for every volunteer it sends one to, and at the lab worker."""
    return _named(program)[0]


def program_from_pickle(blob: bytes, loads: Callable[[bytes], Any]) -> Any:
    """The program pickled in ``blob``, decoded by ``loads`` once per content (:data:`_DECODED`, the latest
    :data:`_TOKENS_MAX`): the next round's tasks carry the same bytes, and a volunteer or the scheduler reads
    them again only when they changed.  The decoded program is shared; a program is never changed once made."""
    token = hashlib.sha256(blob).hexdigest()
    with _VERDICTS_LOCK:
        program = _DECODED.get(token)
        if program is not None:
            _DECODED.move_to_end(token)
    if program is None:
        program = loads(blob)
        with _VERDICTS_LOCK:
            _DECODED[token] = program
            while len(_DECODED) > _TOKENS_MAX:
                _DECODED.popitem(last=False)
    if type(program) is tuple:
        _remember(program, bytes(blob), token)
    return program


#: How :func:`pickled_program` marks a program sent as its pickle (a program itself is a 6-tuple).
_PICKLED = "goblin-program-pickle/1"


def pickled_program(kwargs: dict) -> dict:
    """A task's parameters with its stage ``program`` as ``(_PICKLED, its pickle)``, for the task's own pickle: the
    pickle is made once per program (:func:`program_pickle`), not again for every task that carries it, at the
    researcher, at the scheduler for every volunteer it sends one to, and at the lab worker.  ``kwargs`` itself
    where it holds no program."""
    program = kwargs.get("program") if isinstance(kwargs, dict) else None
    blob = program_pickle(program) if type(program) is tuple else None
    return kwargs if blob is None else {**kwargs, "program": (_PICKLED, blob)}


def unpickled_program(kwargs: dict) -> dict:
    """:func:`pickled_program` undone: the program decoded once per content, under the volunteer's unpickler (plain
    data and nothing else, wherever this runs), and shared (:func:`program_from_pickle`)."""
    packed = kwargs.get("program") if isinstance(kwargs, dict) else None
    if type(packed) is not tuple or len(packed) != 2 or packed[0] != _PICKLED or type(packed[1]) is not bytes:
        return kwargs
    from goblin_dask.safe_pickle import safe_loads

    return {**kwargs, "program": program_from_pickle(packed[1], safe_loads)}


#: The verdicts of the last programs checked, by :func:`program_token`: a round's stage tasks, their
#: replicas and the lab node's several checks of each (placement, minimization) share a few programs.
_VERDICTS: "OrderedDict[str, str | None]" = OrderedDict()
_VERDICTS_MAX = 32


def program_violation(program: Any, where: str = "program") -> str | None:
    """Why ``program`` may not run on a volunteer, or None: every step a catalog op (no program in a
    program) on plain data, text only in the op's text parameters, references only to earlier values.
    Walked once per content (:data:`_VERDICTS`)."""
    token = program_token(program) if type(program) is tuple else None
    with _VERDICTS_LOCK:
        hit = token is not None and token in _VERDICTS
        why = _VERDICTS.get(token) if hit else None
    if not hit:
        why = _program_violation(program, "program")
        if token is not None:
            with _VERDICTS_LOCK:
                _VERDICTS[token] = why
                while len(_VERDICTS) > _VERDICTS_MAX:
                    _VERDICTS.popitem(last=False)
    return None if why is None else why.replace("program", where, 1)


def _program_violation(program: Any, where: str) -> str | None:
    from goblin_dask.ops.registry import CatalogError, op_by_name, plain_data_violation, text_violation

    try:
        _, n_inputs, steps, outputs, result_dtype, flops = _parts(program)
    except ValueError as e:
        return f"{where}: {e}"
    if type(n_inputs) is not int or n_inputs < 0 or type(steps) is not tuple or type(outputs) is not tuple:
        return f"{where}: malformed header"
    if len(steps) > MAX_STEPS:
        return f"{where}: {len(steps)} steps (at most {MAX_STEPS})"
    if type(flops) not in (int, float) or not math.isfinite(flops) or flops < 0:
        return f"{where}: flops {flops!r}"
    try:
        if np.dtype(result_dtype).kind not in "biufc":
            return f"{where}: result dtype {result_dtype!r}"
    except TypeError:
        return f"{where}: result dtype {result_dtype!r}"
    known = n_inputs
    for i, step in enumerate(steps):
        at = f"{where} step {i}"
        if type(step) is not tuple or len(step) != 4:
            return f"{at}: malformed"
        name, version, args, kwargs = step
        if type(name) is not str or type(version) is not int or type(args) is not tuple or type(kwargs) is not tuple:
            return f"{at}: malformed"
        try:
            op = op_by_name(name, version)
        except CatalogError as e:
            return f"{at}: {e}"
        if op.name in ("program", "program_sketch"):
            return f"{at}: a program inside a program"
        if any(r < 0 or r >= known for r in _refs_in((args, kwargs))):
            return f"{at} ({name}): reads a value that is not computed before it"
        for j, a in enumerate(args):
            if (why := plain_data_violation(_unref(a), f"{at} ({name}) operand {j}")) is not None:
                return why
            if _has_text(a):
                return f"{at} ({name}) operand {j}: text is no operand"
        for pair in kwargs:
            if type(pair) is not tuple or len(pair) != 2 or type(pair[0]) is not str:
                return f"{at} ({name}): malformed parameter"
            k, v = pair
            if k not in op.params:
                return f"{at} ({name}): unknown parameter {k[:40]!r}"
            if (why := plain_data_violation(_unref(v), f"{at} ({name}) parameter {k}")) is not None:
                return why
            if (why := text_violation(op, k, _unref(v))) is not None:
                return f"{at}: {why}"
        known += 1
    for o in outputs:
        if (type(o) is not tuple or len(o) != 3 or type(o[0]) is not int or not 0 <= o[0] < known
                or type(o[1]) is not tuple or any(type(s) is not int or s < 0 for s in o[1])):
            return f"{where}: malformed output {str(o)[:60]}"
        try:
            np.dtype(o[2])
        except TypeError:
            return f"{where}: output dtype {str(o[2])[:40]!r}"
    return None


def _unref(value: Any) -> Any:
    if is_ref(value):
        return None
    if type(value) in (tuple, list):
        return type(value)(_unref(v) for v in value)
    return value


def _has_text(value: Any) -> bool:
    if is_ref(value):
        return False
    if isinstance(value, str):
        return True
    return type(value) in (tuple, list) and any(_has_text(v) for v in value)


def _shape(*inputs: Aval, program: tuple) -> tuple[int, ...]:
    if (why := program_violation(program)) is not None:
        raise ValueError(why)
    if len(inputs) != program[1]:
        raise ValueError(f"program: takes {program[1]} inputs, got {len(inputs)}")
    return (packed_size(program),)


def _dtype(*inputs: Aval, program: tuple) -> np.dtype:
    return np.dtype(_parts(program)[4])


def _cost(*inputs: Aval, program: tuple) -> Cost:
    out = packed_size(program) * np.dtype(_parts(program)[4]).itemsize
    return Cost(float(program[5]), float(sum(a.nbytes for a in inputs) + out))


def same_program_result(got: Any, want: Any, operands: tuple = (), params: dict | None = None) -> bool:
    """Do two results of one program agree?  Output by output: NaN and inf in the same places, and the
    rest within ``PROGRAM_TOLERANCE_EPS`` epsilons of that output's rounding scale, elementwise, and of its
    norm, as a whole (a whole output moved by a little, as a scaled
    gradient, fails the second).  The rounding scale is the larger of the output's largest magnitude and the
    smaller of the two results' :func:`rounding_floors`; the norm is at least that floor."""
    from goblin_dask.validation.checks import same_nonfinite

    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.dtype.kind not in "fc":
        return bool(np.array_equal(got, want))
    program = (params or {}).get("program")
    bounds, floors, dtypes = [(0, want.size)], np.zeros(1), [want.dtype]
    if program is not None:
        forms = outputs_of(program)
        edges = np.cumsum([0, *(math.prod(s) for s, _ in forms)])
        bounds, dtypes = list(zip(edges[:-1], edges[1:])), [dt for _, dt in forms]
        floors = np.minimum(rounding_floors(got, program), rounding_floors(want, program))
    for (lo, hi), floor, dtype in zip(bounds, floors, dtypes):
        g, w = got[lo:hi], want[lo:hi]
        tol = PROGRAM_TOLERANCE_EPS * _epsilon(dtype, want.dtype)
        if not same_nonfinite(g, w):
            return False
        fin = np.isfinite(w)
        g64, w64 = g[fin].astype(np.float64), w[fin].astype(np.float64)
        diff = np.abs(g64 - w64)
        scale = max(float(np.abs(w64).max(initial=0.0)), float(floor))
        if float(diff.max(initial=0.0)) > tol * scale:
            return False
        norm = max(float(np.linalg.norm(w64)), float(floor))
        if float(np.linalg.norm(diff)) > tol * norm / 8:
            return False
    return True


#: A fingerprint projects each block of ``SKETCH_BLOCK`` output elements on ``SKETCH_ROWS`` random sign vectors.
SKETCH_BLOCK = 256
SKETCH_ROWS = 2
#: Per output: its largest finite magnitude, its norm, (count, weighted position sum) of its NaN, +inf, -inf,
#: and its rounding floor (:func:`rounding_floors`).
_HEADER = 9


def _segment_sketch(values: np.ndarray, seed: int, index: int, floor: float) -> np.ndarray:
    from goblin_dask.ops._sketch_kernel import block_projections

    v = values.reshape(-1)
    mixed = (int(seed) * 1_000_003 + index) % (1 << 64)
    head = np.zeros(_HEADER)
    got = block_projections(v, mixed, SKETCH_ROWS, SKETCH_BLOCK)
    if got is None:  # NaN or inf somewhere: where, by (count, randomly weighted position sum); the rest as 0
        weights = np.random.Generator(np.random.PCG64([seed, index, 1])).random(v.size)
        for j, mask in enumerate((np.isnan(v), v == np.inf, v == -np.inf)):
            head[2 + 2 * j] = float(mask.sum())
            head[3 + 2 * j] = float(weights[mask].sum())
        got = block_projections(np.where(np.isfinite(v), v, 0), mixed, SKETCH_ROWS, SKETCH_BLOCK)
    projections, head[0], head[1] = got
    head[8] = floor
    return np.concatenate([head, projections.reshape(-1)])


def sketch(result: Any, program: tuple, seed: int) -> np.ndarray:
    """The fingerprint of a program's packed ``result`` for ``seed`` (float64; see :func:`same_sketch`)."""
    r = np.asarray(result)
    sizes = [math.prod(s) for s, _ in outputs_of(program)]
    edges = np.cumsum([0, *sizes])
    floors = rounding_floors(r, program)
    return np.concatenate([_segment_sketch(r[lo:hi], int(seed), i, float(floors[i]))
                           for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:]))] or [np.zeros(0)])


def sketch_size(program: tuple) -> int:
    return sum(_HEADER + SKETCH_ROWS * -(-math.prod(s) // SKETCH_BLOCK) for s, _ in outputs_of(program))


def run_sketch(*inputs: Any, program: tuple, seed: int) -> np.ndarray:
    """A replica of a stage task: the program run in full, only its fingerprint returned."""
    return sketch(run(*inputs, program=program), program, seed)


def same_sketch(got: Any, want: Any, program: tuple) -> bool:
    """Do two fingerprints (same seed) show the same outputs, within :func:`same_program_result`'s rounding?

    Per output: NaN, +inf and -inf at the same places (counts and randomly weighted position sums); each
    block's projections within ``2 x PROGRAM_TOLERANCE_EPS`` epsilons of the output's rounding scale (one
    element off by ~1e-3 of that, in float32, is caught: a sign vector carries it whole); and the projections'
    root mean square within ``PROGRAM_TOLERANCE_EPS / 8`` of its norm (an output scaled by 1.001 is caught).
    The rounding scale and the norm are the smaller of the two fingerprints', raised to the smaller of their
    rounding floors, as in :func:`same_program_result`.
    Honest rounding is ~10 epsilons elementwise (see ``tests/test_stage_tasks.py``).  A cheater who sent the
    first result knew no seed: its error is independent of the sign vectors."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape or got.shape != (sketch_size(program),):
        return False
    packed = np.dtype(_parts(program)[4])
    at = 0
    for shape, dtype in outputs_of(program):
        eps = _epsilon(dtype, packed)
        n = _HEADER + SKETCH_ROWS * -(-math.prod(shape) // SKETCH_BLOCK)
        g, w = got[at:at + n], want[at:at + n]
        at += n
        if not np.all(np.isfinite(g)) or not np.array_equal(g[2:8], w[2:8]):
            return False
        floor = max(min(g[8], w[8]), 0.0)
        scale, norm = max(min(g[0], w[0]), floor), max(min(g[1], w[1]), floor)
        if abs(g[0] - w[0]) > PROGRAM_TOLERANCE_EPS * eps * max(scale, 0.0):
            return False
        d = g[_HEADER:] - w[_HEADER:]
        if float(np.abs(d).max(initial=0.0)) > 2 * PROGRAM_TOLERANCE_EPS * eps * scale:
            return False
        if math.sqrt(float(np.dot(d, d)) / SKETCH_ROWS) > PROGRAM_TOLERANCE_EPS / 8 * eps * norm:
            return False  # each row's squares sum to an estimate of the output's squared error
    return True


def _sketch_shape(*inputs: Aval, program: tuple, seed: int) -> tuple[int, ...]:
    _shape(*inputs, program=program)
    return (sketch_size(program),)


def _example_program(n: int, dtype: np.dtype) -> tuple:
    """Two inputs, a product and a sum of it with the first input; both values out (the examples)."""
    from goblin_dask.ops.registry import catalog

    ops = catalog()
    steps = (("matmul", ops["matmul"].version, (("$ref", 0), ("$ref", 1)), ()),
             ("add", ops["add"].version, (("$ref", 2), ("$ref", 0)), ()))
    outputs = ((3, (n, n), dtype.str), (2, (n, n), dtype.str))
    return (FORMAT, 2, steps, outputs, dtype.str, float(2 * n ** 3 + n * n))


def _examples(n: int, rng: np.random.Generator, dtype: np.dtype, sketched: bool = False) -> list:
    from goblin_dask.ops._factories import matrices

    dtype = np.dtype(dtype) if np.dtype(dtype).kind == "f" else np.dtype(np.float64)
    params = {"program": _example_program(n, dtype)}
    if sketched:
        params["seed"] = int(rng.integers(2 ** 62))
    return [(tuple(matrices(n, rng, dtype)), params)]


PROGRAM = register(OpSpec(
    name="program",
    doc="A stage: a straight-line graph of catalog operations run as one task, its outputs packed flat.",
    shape_rule=_shape,
    dtype_rule=_dtype,
    numpy=run,
    cost=_cost,
    verify=Replica(),
    placement="volunteer",
    params=("program",),
    compare=same_program_result,
    examples=_examples,
))


PROGRAM_SKETCH = register(OpSpec(
    name="program_sketch",
    doc="A stage task's replica: the program run in full, only a fingerprint of its outputs returned.",
    shape_rule=_sketch_shape,
    dtype_rule=lambda *inputs, program, seed: np.dtype(np.float64),
    numpy=run_sketch,
    cost=lambda *inputs, program, seed: _cost(*inputs, program=program),
    verify=Replica(),
    placement="volunteer",
    params=("program", "seed"),
    examples=lambda n, rng, dtype: _examples(n, rng, dtype, sketched=True),
))
