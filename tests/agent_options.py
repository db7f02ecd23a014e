"""The options of a test volunteer agent (``python -m tests.cheaters ...`` & co.), taken out of its argv.

What is left goes to ``goblin volunteer`` unchanged.
"""

from __future__ import annotations


def take_options(argv: list[str], defaults: dict) -> tuple[dict, list[str]]:
    """``--name VALUE`` for each name of ``defaults`` (``--name`` alone where the default is a bool)."""
    opts, rest = dict(defaults), []
    it = iter(argv)
    for arg in it:
        name = arg[2:] if arg.startswith("--") else None
        if name in opts:
            opts[name] = True if isinstance(defaults[name], bool) else next(it)
        else:
            rest.append(arg)
    return opts, rest
