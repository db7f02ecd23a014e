"""A volunteer that answers the lab worker's fetches with a pickle that would run a command.

Run as ``python -m tests.hostile_link --marker PATH [--as-error | --answer KIND] ADDRESS --token ...``
(``LabNode.add_volunteer(module="tests.hostile_link", extra_args=("--marker", PATH))``).
It computes honestly, but every ``get_data`` answer carries, in place of the result, a
pickled object whose ``__reduce__`` calls ``os.system("touch PATH")``: if the lab ever
unpickled it, PATH would exist.  ``--as-error``: the answer is an error whose ``exception``
is those pickle bytes (distributed's ``clean_exception`` unpickles such bytes after the read).
``--answer list``: a list instead of the answer's dict; ``--answer text``: "OK" with a string as its data.
"""

from __future__ import annotations

import os
import sys


class Command:
    """Unpickling this runs ``touch path`` (where a plain unpickler is used)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def main(argv: list[str]) -> None:
    from tests.agent_options import take_options

    opts, rest = take_options(argv, {"marker": None, "as-error": False, "answer": ""})
    marker, as_error, answer = opts["marker"], opts["as-error"], opts["answer"]
    if marker is None:
        raise SystemExit("tests.hostile_link: --marker PATH is required")

    from distributed import Worker
    from distributed.protocol.serialize import ToPickle

    async def get_data(self, comm, keys=(), who=None, serializers=None):
        if as_error:
            import pickle

            return {"status": "error", "exception": pickle.dumps(Command(marker)), "traceback": None,
                    "exception_text": "no", "traceback_text": ""}
        if answer == "list":
            return ["OK", list(keys)]
        if answer == "text":
            return {"status": "OK", "data": "all of them"}
        return {"status": "OK", "data": {k: ToPickle(Command(marker)) for k in keys}}

    Worker.get_data = get_data
    from goblin_dask.volunteer import main as volunteer_main

    volunteer_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
