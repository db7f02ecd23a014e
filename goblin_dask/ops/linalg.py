"""Matrix products: the compute-dense core of the grid, verified by Freivalds checks.

Every product here is, after transposes and reshapes, a (batched) matrix product:
each op's ``Freivalds(form=...)`` gives the lab that form, ``c == a @ b + c0``
(:class:`~goblin_dask.ops.spec.ProductForm`), so one Freivalds check serves them all.  The
kernels compute through ``@`` (BLAS for floats), and are written against array methods
only, so the same function runs NumPy arrays on a CPU and cupy arrays on a GPU.
"""

from __future__ import annotations

import math
import operator
import string
from typing import Any

import numpy as np

from goblin_dask.ops._factories import matrices, normalize_axes, numeric_result, unbroadcast
from goblin_dask.ops.registry import register
from goblin_dask.ops.spec import Aval, Cost, Freivalds, OpSpec, ProductForm, Replica


def _matmul_shape(a: Aval, b: Aval, opname: str = "matmul") -> tuple[int, ...]:
    if a.shape == () or b.shape == ():
        raise ValueError(f"{opname}: operands must be at least 1-d, got shapes {a.shape} and {b.shape}")
    ak = a.shape[-1]
    bk = b.shape[-2] if len(b.shape) >= 2 else b.shape[0]
    if ak != bk:
        raise ValueError(f"{opname}: shapes {a.shape} and {b.shape} are not aligned ({ak} != {bk})")
    try:
        out = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise ValueError(f"{opname}: batch dimensions of {a.shape} and {b.shape} do not broadcast") from None
    tail = (a.shape[-2],) if len(a.shape) >= 2 else ()
    tail += (b.shape[-1],) if len(b.shape) >= 2 else ()
    return tuple(out) + tail


def _product_cost(out_shape: tuple[int, ...], inner: int, *avals: Aval, extra_flops: float = 0.0) -> Cost:
    """2 flops per multiply-add; bytes: every operand read once, the result written once."""
    n_out = math.prod(out_shape)
    itemsize = np.result_type(*(a.dtype for a in avals)).itemsize
    return Cost(2.0 * n_out * inner + extra_flops, sum(a.nbytes for a in avals) + n_out * itemsize)


def _matmul_cost(a: Aval, b: Aval) -> Cost:
    return _product_cost(_matmul_shape(a, b), a.shape[-1], a, b)


def _as_2d(a: Any, b: Any) -> tuple[Any, Any]:
    """matmul's promotion of 1-d operands: a row vector on the left, a column on the right."""
    return (a[None, :] if a.ndim == 1 else a), (b[:, None] if b.ndim == 1 else b)


def _matmul_vjp(g: Any, a: Any, b: Any) -> tuple:
    a2, b2 = _as_2d(np.asarray(a), np.asarray(b))
    g2 = np.asarray(g)
    g2 = g2[..., None, :] if np.ndim(a) == 1 else g2
    g2 = g2[..., None] if np.ndim(b) == 1 else g2
    ga = g2 @ np.swapaxes(b2, -1, -2)
    gb = np.swapaxes(a2, -1, -2) @ g2
    return unbroadcast(ga, a2.shape).reshape(np.shape(a)), unbroadcast(gb, b2.shape).reshape(np.shape(b))


def product_op(name: str, doc: str, shape_rule, kernel, cost, grad, *, form, numpy=None, otherwise=Replica(),
               **kw: Any) -> OpSpec:
    """Declare a product: Freivalds-verified through ``form``, NumPy's promoted dtype, ``kernel`` on NumPy and cupy arrays."""
    return register(
        OpSpec(
            name=name, doc=doc, shape_rule=shape_rule, dtype_rule=numeric_result(name), numpy=numpy or kernel,
            cupy=kernel, cost=cost, verify=Freivalds(form=form, otherwise=otherwise), grad=grad, **kw,
        )  # fmt: skip
    )


def _two_matrices(*param_sets: dict):
    """Example calls: two n x n operands with each of ``param_sets``."""
    return lambda n, rng, dtype: [(tuple(matrices(n, rng, dtype)), dict(p)) for p in param_sets]


def _matmul(a: Any, b: Any) -> Any:
    return a @ b


def _matmul_form(c: Any, a: Any, b: Any) -> ProductForm:
    return ProductForm(c, a, b, same_layout=True)


matmul = product_op(
    "matmul", "Matrix product a @ b with numpy's broadcasting of batch dimensions.",
    _matmul_shape, _matmul, _matmul_cost, _matmul_vjp, form=_matmul_form, numpy=np.matmul, arity=2,
    operator=operator.matmul,
    examples=lambda n, rng, dtype: [(tuple(matrices(n, rng, dtype)), {}),
                                    ((matrices(n, rng, dtype, 1)[0], rng.standard_normal(n).astype(dtype)), {})],
)  # fmt: skip


# -- matmul_accumulate ---------------------------------------------------------------


def _accumulate_shape(c: Aval, a: Aval, b: Aval) -> tuple[int, ...]:
    out = _matmul_shape(a, b, "matmul_accumulate")
    try:
        ok = np.broadcast_shapes(c.shape, out) == out
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"matmul_accumulate: accumulator of shape {c.shape} does not broadcast to the product's shape {out} "
            f"(operands {a.shape} and {b.shape})"
        )
    return out


def _matmul_accumulate(c: Any, a: Any, b: Any) -> Any:
    """c + a @ b, adding into the product in place when it already has the result dtype."""
    p = a @ b
    dt = np.result_type(getattr(c, "dtype", c), p.dtype)
    if getattr(p, "ndim", 0) > 0 and p.dtype == dt:
        p += c
        return p
    return c + p


def _accumulate_vjp(g: Any, c: Any, a: Any, b: Any) -> tuple:
    return (unbroadcast(g, np.shape(c)), *_matmul_vjp(g, a, b))


def _accumulate_cost(c: Aval, a: Aval, b: Aval) -> Cost:
    out = _accumulate_shape(c, a, b)
    return _product_cost(out, a.shape[-1], c, a, b, extra_flops=math.prod(out))


def _accumulate_form(result: Any, c0: Any, a: Any, b: Any) -> ProductForm:
    return ProductForm(result, a, b, c0, same_layout=True)


matmul_accumulate = product_op(
    "matmul_accumulate", "c + a @ b: one step of a blocked product that accumulates along the inner dimension.",
    _accumulate_shape, _matmul_accumulate, _accumulate_cost, _accumulate_vjp, form=_accumulate_form, arity=3,
    examples=lambda n, rng, dtype: [(tuple(matrices(n, rng, dtype, 3)), {})],
)  # fmt: skip


# -- einsum (matmul-like) -----------------------------------------------------------------


class _Contraction:
    """A matmul-like einsum: distinct indices per operand, explicit output, no ellipsis.

    Index classes: batch (both operands and output), contracted (both, not output), free
    (one operand and output), summed (one operand only, summed away before the product).
    """

    def __init__(self, subscripts: str, shapes: list[tuple[int, ...]]):
        self.subscripts = subscripts
        if not isinstance(subscripts, str) or subscripts.count("->") != 1:
            raise ValueError(f"einsum: subscripts need exactly one explicit '->' output, got {subscripts!r}")
        spec = subscripts.replace(" ", "")
        if "." in spec:
            raise ValueError(f"einsum: ellipsis is not supported ({subscripts!r}); name every index")
        inputs, self.out = spec.split("->")
        self.ins = inputs.split(",")
        if len(self.ins) != len(shapes) or len(shapes) not in (1, 2):
            raise ValueError(f"einsum: {subscripts!r} names {len(self.ins)} operands, got {len(shapes)} (1 or 2 supported)")
        self.sizes: dict[str, int] = {}
        for i, (sub, shape) in enumerate(zip(self.ins, shapes)):
            self._check_operand(i, sub, shape, shapes)
        if not all(c in string.ascii_letters for c in self.out) or len(set(self.out)) != len(self.out):
            raise ValueError(f"einsum: output indices {self.out!r} must be distinct letters")
        missing = [c for c in self.out if c not in self.sizes]
        if missing:
            raise ValueError(f"einsum: output indices {missing} appear in no operand of {subscripts!r}")
        self.shape = tuple(self.sizes[c] for c in self.out)

    def _check_operand(self, i: int, sub: str, shape: tuple[int, ...], shapes: list) -> None:
        if not all(c in string.ascii_letters for c in sub):
            raise ValueError(f"einsum: operand {i} indices {sub!r} must be letters")
        if len(set(sub)) != len(sub):
            raise ValueError(f"einsum: repeated index in operand {i} ({sub!r}): diagonals are not matmul-like")
        if len(sub) != len(shape):
            raise ValueError(f"einsum: operand {i} has shape {shape} but indices {sub!r}")
        for c, n in zip(sub, shape):
            if self.sizes.setdefault(c, n) != n:
                shown = " and ".join(map(str, shapes))
                raise ValueError(f"einsum: index {c!r} has sizes {self.sizes[c]} and {n} in {self.subscripts!r} (shapes {shown})")

    def classes(self) -> tuple[str, str, str, str, str, str]:
        """(batch, contracted, free of a, free of b, summed in a, summed in b), in operand order."""
        a, b = self.ins
        batch = "".join(c for c in a if c in b and c in self.out)
        contracted = "".join(c for c in a if c in b and c not in self.out)
        free_a = "".join(c for c in a if c not in b and c in self.out)
        free_b = "".join(c for c in b if c not in a and c in self.out)
        summed_a = "".join(c for c in a if c not in b and c not in self.out)
        summed_b = "".join(c for c in b if c not in a and c not in self.out)
        return batch, contracted, free_a, free_b, summed_a, summed_b

    def inner(self) -> int:
        """Length of the sum behind each output element (contracted and summed indices)."""
        return math.prod(self.sizes[c] for c in set("".join(self.ins)) - set(self.out))

    def matmul_operands(self, a: Any, b: Any) -> tuple[Any, Any, tuple[str, str, str]]:
        """a as (batch..., F, K) and b as (batch..., K, G), summed indices summed away first."""
        batch, contracted, free_a, free_b, summed_a, summed_b = self.classes()
        a = _sum_indices(a, self.ins[0], summed_a)
        b = _sum_indices(b, self.ins[1], summed_b)
        sub_a = "".join(c for c in self.ins[0] if c not in summed_a)
        sub_b = "".join(c for c in self.ins[1] if c not in summed_b)
        size = lambda idx: math.prod(self.sizes[c] for c in idx)  # noqa: E731
        bshape = tuple(self.sizes[c] for c in batch)
        a2 = a.transpose([sub_a.index(c) for c in batch + free_a + contracted]).reshape(bshape + (size(free_a), size(contracted)))
        b2 = b.transpose([sub_b.index(c) for c in batch + contracted + free_b]).reshape(bshape + (size(contracted), size(free_b)))
        return a2, b2, (batch, free_a, free_b)

    def output_as_matmul(self, c: Any) -> Any:
        """The output arranged as the (batch..., F, G) product of :meth:`matmul_operands`."""
        batch, _, free_a, free_b, _, _ = self.classes()
        order = batch + free_a + free_b
        size = lambda idx: math.prod(self.sizes[x] for x in idx)  # noqa: E731
        bshape = tuple(self.sizes[x] for x in batch)
        return c.transpose([self.out.index(x) for x in order]).reshape(bshape + (size(free_a), size(free_b)))


def _sum_indices(x: Any, sub: str, summed: str) -> Any:
    # in the operand's own dtype, as np.einsum accumulates (booleans: any)
    return x.sum(axis=tuple(sub.index(c) for c in summed), dtype=x.dtype) if summed else x


def _einsum_shape(*avals: Aval, subscripts: str) -> tuple[int, ...]:
    return _Contraction(subscripts, [a.shape for a in avals]).shape


def _einsum(*operands: Any, subscripts: str) -> Any:
    """Two operands: transpose/reshape into one batched ``@`` (BLAS); one operand: np.einsum."""
    con = _Contraction(subscripts, [x.shape for x in operands])
    if len(operands) == 1:
        return np.einsum(subscripts, operands[0])
    a, b = operands
    a2, b2, (batch, free_a, free_b) = con.matmul_operands(a, b)
    c = (a2 @ b2).reshape(tuple(con.sizes[x] for x in batch + free_a + free_b))
    return c.transpose([(batch + free_a + free_b).index(x) for x in con.out])


def _einsum_cost(*avals: Aval, subscripts: str) -> Cost:
    con = _Contraction(subscripts, [a.shape for a in avals])
    return _product_cost(con.shape, con.inner() if len(avals) == 2 else 1, *avals)


def _einsum_vjp(g: Any, *operands: Any, subscripts: str) -> tuple:
    con = _Contraction(subscripts, [np.shape(x) for x in operands])
    return tuple(
        _einsum_cotangent(g, con, i, [x for j, x in enumerate(operands) if j != i]) for i in range(len(operands))
    )


def _einsum_cotangent(g: Any, con: _Contraction, i: int, others: list) -> Any:
    """d(out)/d(operand i) applied to g: an einsum of g with the other operand, broadcast back."""
    target = con.ins[i]
    other_subs = [s for j, s in enumerate(con.ins) if j != i]
    present = set(con.out).union(*other_subs)
    keep = "".join(c for c in target if c in present)
    r = np.einsum(",".join([con.out, *other_subs]) + "->" + keep, g, *others)
    r = r.reshape([con.sizes[c] if c in keep else 1 for c in target])
    return np.broadcast_to(r, tuple(con.sizes[c] for c in target)).copy()


def _einsum_form(result: Any, *operands: Any, subscripts: str) -> ProductForm | None:
    """The contraction as one batched matmul; None for one operand (only transposed and summed: no product)."""
    if len(operands) != 2:
        return None
    con = _Contraction(subscripts, [np.shape(x) for x in operands])
    a2, b2, _ = con.matmul_operands(*operands)
    return ProductForm(con.output_as_matmul(result), a2, b2)


einsum = product_op(
    "einsum", "Matmul-like einsum of one or two operands (distinct letters per operand, explicit output).",
    _einsum_shape, _einsum, _einsum_cost, _einsum_vjp, form=_einsum_form, otherwise=Replica(), params=("subscripts",),
    text_params={"subscripts": r"[a-zA-Z]*(,[a-zA-Z]*)*(->[a-zA-Z]*)?"},
    examples=lambda n, rng, dtype: [
        *_two_matrices({"subscripts": "ij,jk->ik"}, {"subscripts": "ij,kj->ik"})(n, rng, dtype),
        ((matrices(n, rng, dtype, 1)[0],), {"subscripts": "ij->ji"}),
    ],
)  # fmt: skip


# -- tensordot ------------------------------------------------------------------------------


def _tensordot_axes(a: Aval, b: Aval, axes: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """numpy's axes argument (an int N, or a pair of axis sequences) as two tuples of axes."""
    if isinstance(axes, (int, np.integer)) and type(axes) is not bool:
        if not 0 <= axes <= min(len(a.shape), len(b.shape)):
            raise ValueError(f"tensordot: cannot contract {axes} axes of shapes {a.shape} and {b.shape}")
        axes = (tuple(range(len(a.shape) - axes, len(a.shape))), tuple(range(axes)))
    if not isinstance(axes, (tuple, list)) or len(axes) != 2:
        raise ValueError(f"tensordot: axes must be an int or a pair of axis sequences, got {axes!r}")
    ax_a = normalize_axes("tensordot", axes[0], a.shape)
    ax_b = normalize_axes("tensordot", axes[1], b.shape)
    if len(ax_a) != len(ax_b):
        raise ValueError(f"tensordot: {len(ax_a)} axes of {a.shape} cannot contract with {len(ax_b)} axes of {b.shape}")
    for i, j in zip(ax_a, ax_b):
        if a.shape[i] != b.shape[j]:
            raise ValueError(f"tensordot: shapes {a.shape} and {b.shape} do not match on axes {i} and {j}")
    return ax_a, ax_b


def _tensordot_subscripts(a: Aval, b: Aval, axes: Any) -> str:
    """The same contraction as an einsum."""
    ax_a, ax_b = _tensordot_axes(a, b, axes)
    letters = iter(string.ascii_letters)
    sub_a = [next(letters) for _ in a.shape]
    sub_b = [next(letters) for _ in b.shape]
    for i, j in zip(ax_a, ax_b):
        sub_b[j] = sub_a[i]
    out = [c for k, c in enumerate(sub_a) if k not in ax_a] + [c for k, c in enumerate(sub_b) if k not in ax_b]
    return f"{''.join(sub_a)},{''.join(sub_b)}->{''.join(out)}"


def _tensordot_shape(a: Aval, b: Aval, *, axes: Any = 2) -> tuple[int, ...]:
    ax_a, ax_b = _tensordot_axes(a, b, axes)
    return tuple(n for k, n in enumerate(a.shape) if k not in ax_a) + tuple(n for k, n in enumerate(b.shape) if k not in ax_b)


def _tensordot(a: Any, b: Any, *, axes: Any = 2) -> Any:
    return _einsum(a, b, subscripts=_tensordot_subscripts(Aval.of(a), Aval.of(b), axes))


def _tensordot_cost(a: Aval, b: Aval, *, axes: Any = 2) -> Cost:
    ax_a, _ = _tensordot_axes(a, b, axes)
    return _product_cost(_tensordot_shape(a, b, axes=axes), math.prod(a.shape[i] for i in ax_a), a, b)


def _tensordot_vjp(g: Any, a: Any, b: Any, *, axes: Any = 2) -> tuple:
    return _einsum_vjp(g, a, b, subscripts=_tensordot_subscripts(Aval.of(a), Aval.of(b), axes))


def _tensordot_form(result: Any, a: Any, b: Any, *, axes: Any = 2) -> ProductForm:
    return _einsum_form(result, a, b, subscripts=_tensordot_subscripts(Aval.of(a), Aval.of(b), axes))


tensordot = product_op(
    "tensordot", "Sum of products over the given axes of a and b (numpy.tensordot).",
    _tensordot_shape, _tensordot, _tensordot_cost, _tensordot_vjp, form=_tensordot_form, arity=2, params=("axes",),
    examples=_two_matrices({"axes": 1}, {"axes": ((0,), (1,))}),
)  # fmt: skip
