"""A curious volunteer: an honest goblin volunteer that records every byte it receives.

Run as ``python -m tests.curious ADDRESS --token ...`` (``LabNode.add_volunteer(module=
"tests.curious")``): it appends every frame of every message read from any connection
(TLS already decrypted) to ``received-<pid>.bin`` in its working directory, then behaves
exactly like ``goblin volunteer``.  Tests search the record for what must not arrive.
It also appends each message to ``messages-<pid>.bin`` as an 8-byte little-endian length
then the message's frames, so a test can judge what arrived in one message (one task's
operands from one peer).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    import os

    import distributed.comm.tcp as tcp

    record_path = os.path.join(os.getcwd(), f"received-{os.getpid()}.bin")

    original = tcp.from_frames
    record = open(record_path, "ab", buffering=0)
    messages = open(os.path.join(os.getcwd(), f"messages-{os.getpid()}.bin"), "ab", buffering=0)

    async def recording_from_frames(frames, *args, **kwargs):
        data = [bytes(frame) for frame in frames]
        for frame in data:
            record.write(frame)
        messages.write(sum(len(f) for f in data).to_bytes(8, "little") + b"".join(data))
        return await original(frames, *args, **kwargs)

    tcp.from_frames = recording_from_frames
    from goblin_dask.volunteer import main as volunteer_main

    volunteer_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
