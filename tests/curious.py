"""A curious volunteer: an honest goblin volunteer that records every byte it receives.

Run as ``python -m tests.curious ADDRESS --token ...`` (``LabNode.add_volunteer(module=
"tests.curious")``): it appends every frame of every message read from any connection
(TLS already decrypted) to ``received-<pid>.bin`` in its working directory, then behaves
exactly like ``goblin volunteer``.  Tests search the record for what must not arrive.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    import os

    import distributed.comm.tcp as tcp

    record_path = os.path.join(os.getcwd(), f"received-{os.getpid()}.bin")

    original = tcp.from_frames
    record = open(record_path, "ab", buffering=0)

    async def recording_from_frames(frames, *args, **kwargs):
        for frame in frames:
            record.write(bytes(frame))
        return await original(frames, *args, **kwargs)

    tcp.from_frames = recording_from_frames
    from goblin_dask.volunteer import main as volunteer_main

    volunteer_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
