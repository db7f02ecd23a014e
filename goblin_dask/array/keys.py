"""Task keys of the array layer: opaque ``<op>-<token>`` names, block indices, fixed part words.

Every layer name the array layer makes comes from :func:`new_name`: a catalog op's name
(or one of the :data:`PLUMBING` words, for layers that are no single op), ``-``, and a
token hashed from the inputs.  A block's key is ``(name, *block_index)``
(:func:`block_key`); a task's intermediate parts (a product's partial sums, a
reduction's tree) are ``(name-<part>, *ints)`` (:func:`part_key`), the part one of the
fixed words in :data:`PARTS`.  Nothing a researcher named reaches a key.

The lab node's data-minimization filter (:mod:`scheduler_plugins.minimization`) accepts
exactly these shapes (:func:`split_name`), so it is as wide as the keys this module can
make and no wider; ``tests/test_minimization.py`` checks that every word here is one the
array layer really produces.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple, Sequence

#: Layer names that are no single catalog op: the lab's data cut in blocks (``source``),
#: the same array in other blocks (``rechunk``: getitem/concatenate tasks and aliases).
PLUMBING: tuple[str, ...] = ("source", "rechunk")

#: Words for a task's intermediate parts: ``matmul-<token>-partial`` (the product's chain
#: along k), a reduction's per-``block`` partials, pairwise ``tree`` and argmax/argmin
#: ``value``/``index`` partials, a rechunk's ``piece`` slices and ``cat`` concatenations.
PARTS: tuple[str, ...] = ("partial", "block", "tree", "value", "index", "piece", "cat")

#: A token: dask's ``tokenize`` (32 hex digits), or at least 16 of them.
TOKEN = r"[0-9a-f]{16,}"

_NAME = re.compile(rf"^(?P<prefix>[a-z][a-z0-9_]*)-(?P<token>{TOKEN})(?:-(?P<part>{'|'.join(PARTS)}))?$")


class Name(NamedTuple):
    """A layer or part name taken apart: ``matmul-<token>-partial`` -> ("matmul", token, "partial")."""

    prefix: str
    token: str
    part: str | None


def prefixes() -> frozenset[str]:
    """Every prefix a name may have: the catalog's op names and :data:`PLUMBING`."""
    from goblin_dask.ops import catalog

    return frozenset(catalog()) | frozenset(PLUMBING)


def new_name(prefix: str, *args: Any) -> str:
    """``<prefix>-<token of prefix and args>``; ``prefix`` is a catalog op or a :data:`PLUMBING` word."""
    from dask.base import tokenize

    if prefix not in prefixes():
        raise ValueError(f"key prefix {prefix!r} is neither a catalog op nor one of {PLUMBING}")
    return f"{prefix}-{tokenize(prefix, *args)}"


def block_key(name: str, index: Sequence[int]) -> tuple:
    """The key of block ``index`` of layer ``name``."""
    return (name, *index)


def part_key(name: str, part: str, *index: int) -> tuple:
    """The key of an intermediate ``part`` (one of :data:`PARTS`) of layer ``name``, at integer ``index``."""
    if part not in PARTS:
        raise ValueError(f"key part {part!r} is not one of {PARTS}")
    return (f"{name}-{part}", *index)


def split_name(name: Any) -> Name | None:
    """``name`` taken apart, or None when it is not ``<prefix>-<token>[-<part>]`` (the prefix is not checked)."""
    match = _NAME.match(name) if isinstance(name, str) else None
    return None if match is None else Name(match["prefix"], match["token"], match["part"])


__all__ = ["PARTS", "PLUMBING", "TOKEN", "Name", "block_key", "new_name", "part_key", "prefixes", "split_name"]
