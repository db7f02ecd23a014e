"""Where a from-numpy product's second compute spends the time after the volunteers' products (issue 29).

On ``LabNode.local(volunteers=2, threads_per_volunteer=1)``: ``z = ga.from_array(a) @ ga.from_array(b)``,
computed once, then ``--computes`` more times inside distributed's task stream.  For each: when the
volunteers' last product ends, the lab worker's last task (dask's ``finalize``, which assembles the blocks
into one array) with its length, the lab worker's resident memory and minor faults during it (its
``/proc/PID`` files, sampled every 0.1 s), and the time from that task's end to the compute's return (the
result's relay, lab worker -> scheduler -> researcher).  Then the persisted result's gather alone, and the
same assembly (``concatenate3`` of the blocks) outside the grid into fresh and into warm memory.

Old and new code side by side: run it once as is and once with ``PYTHONPATH`` pointing at a worktree of
the old commit (the grid's processes inherit it).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/product_tail.py --n 8192 --chunk 2048
"""

from __future__ import annotations

import argparse
import threading
import time


def _lab_worker_memory(pid: int) -> tuple[int, int]:
    """(minor faults, resident KiB) of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        minflt = int(f.read().rsplit(")", 1)[1].split()[7])
    with open(f"/proc/{pid}/smaps_rollup") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("Rss:"))
    return minflt, rss


def _assembly_outside_the_grid(n: int, chunk: int) -> tuple[float, float]:
    """Seconds of ``concatenate3`` of ``(n / chunk)^2`` float64 blocks, into fresh memory, then again (warm)."""
    import numpy as np
    from dask.array.core import concatenate3

    nb = n // chunk
    blocks = [[np.ones((chunk, chunk)) for _ in range(nb)] for _ in range(nb)]
    times = []
    for _ in range(2):
        t = time.perf_counter()
        out = concatenate3(blocks)
        times.append(time.perf_counter() - t)
        del out
    return times[0], times[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--computes", type=int, default=2)
    args = p.parse_args(argv)

    import numpy as np
    from distributed import get_task_stream, wait

    import goblin_dask
    import goblin_dask.array as ga
    from goblin_dask.node.local import LAB_WORKER_NAME

    print("code:", goblin_dask.__file__)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((args.n, args.n)), rng.standard_normal((args.n, args.n))
    with goblin_dask.LabNode.local(volunteers=2, threads_per_volunteer=1) as node:
        time.sleep(5)  # the grid settles
        z = ga.from_array(a, chunks=args.chunk) @ ga.from_array(b, chunks=args.chunk)
        z.compute()
        lab = node.lab_worker_address()
        pid = node.processes[LAB_WORKER_NAME].pid
        samples: list[tuple[float, int, int]] = []
        done = threading.Event()

        def sample():
            while not done.is_set():
                samples.append((time.time(), *_lab_worker_memory(pid)))
                time.sleep(0.1)

        threading.Thread(target=sample, daemon=True).start()
        for i in range(args.computes):
            t0 = time.time()
            with get_task_stream(client=node.client) as stream:
                z.compute()
            t1 = time.time()
            spans = [(ss["start"], ss["stop"], rec["worker"], str(rec["key"])) for rec in stream.data
                     for ss in rec["startstops"] if ss["action"] == "compute"]
            volunteers_end = max(stop for _, stop, w, _ in spans if w != lab) - t0
            start, stop = max((s, e) for s, e, w, _ in spans if w == lab)
            during = [x for x in samples if start - 0.2 <= x[0] <= stop + 0.2]
            faults = during[-1][1] - during[0][1] if during else 0
            rss = (f"{during[0][2] // 1024} MiB at its start, peak {max(x[2] for x in during) // 1024}, "
                   f"{during[-1][2] // 1024} at its end" if during else "n/a")
            print(f"compute {i + 1}: wall {t1 - t0:.2f} s; volunteers' products end {volunteers_end:.2f} s; "
                  f"the lab worker's last task {start - t0:.2f}-{stop - t0:.2f} s ({stop - start:.2f} s, "
                  f"resident {rss}, {faults} minor faults); after it {t1 - stop:.2f} s")
        done.set()
        kept = z.persist()
        wait(kept)
        for i in range(3):
            t = time.time()
            kept.compute()
            print(f"gather of the persisted result {i + 1}: {time.time() - t:.2f} s")
    fresh, warm = _assembly_outside_the_grid(args.n, args.chunk)
    print(f"the assembly outside the grid: {fresh:.2f} s into fresh memory, {warm:.2f} s into warm")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
