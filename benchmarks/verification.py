"""What verification costs (issue 4): Freivalds checks, replicas, and how the cost falls with trust.

One run, on this machine, every ratio measured within it:

1. **Freivalds, one product**: numpy ``a @ b`` (n x n float64, this process's BLAS) and
   ``check_product(c, a, b)`` on the same matrices, best of ``--repeats``.
2. **Freivalds on the grid**: ``LabNode.local(volunteers=2)``, ``ga`` product of the
   same size in ``--chunk`` blocks (inputs persisted first); the ledger's verification
   seconds over the volunteers' compute seconds, for the product alone.
3. **Replicas on the grid**: a lab node whose scheduler runs with
   ``goblin.verification.method = replica`` (every volunteer task computed again on a
   second volunteer while trust is low; the lab compares): the same product; then, on a
   fresh node, ``--rounds`` random arrays (``--trust-n``, ``--trust-chunk``: replica-method
   tasks) one after another, as trust grows.
4. **Detection and false positives** of the Freivalds check on float32 and float64
   products of several sizes and value distributions: honest results (suspicious, i.e.
   recomputed by the lab; rejected) and results with the largest element off by 1e-3
   relative (rejected).

Run (the section of benchmarks/RESULTS.md is written with ``--write``)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /work/venv/bin/python benchmarks/verification.py --write
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, best, write_section  # noqa: E402

SECTION = "## Verification (issue 4)"


def blas() -> str:
    import threadpoolctl

    info = [d for d in threadpoolctl.threadpool_info() if d.get("user_api") == "blas"]
    return "; ".join(f"{d['internal_api']} {d.get('version')} kernel {d.get('architecture')}, {d['num_threads']} threads"
                     for d in info) or "no BLAS found"


# -- 1. one product -------------------------------------------------------------------------

def freivalds_alone(n: int, repeats: int) -> dict:
    from goblin_dask.validation.freivalds import check_product

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    c = a @ b
    product = best(lambda: a @ b, repeats)
    assert check_product(c, a, b)
    check = best(lambda: check_product(c, a, b), repeats)
    return {"n": n, "product_s": product, "check_s": check, "overhead": check / product}


# -- 2./3. on the grid ----------------------------------------------------------------------

def _seconds(report: dict) -> tuple[float, float]:
    s = report["seconds"]
    return s["compute"], s["check"] + s["replicas"]


def grid_product(node, n: int, chunk: int, seed: int) -> dict:
    """One product on the grid, inputs persisted first; the ledger's verification / compute for it alone."""
    import dask
    from distributed import wait

    import goblin_dask.array as ga

    x = ga.random.standard_normal((n, n), chunks=chunk, seed=seed)
    y = ga.random.standard_normal((n, n), chunks=chunk, seed=seed + 1)
    x, y = node.client.persist([x, y])
    wait([x, y])
    before = node.report()
    t = time.perf_counter()
    z = node.client.persist(x @ y)
    wait(z)
    wall = time.perf_counter() - t
    after = node.report()
    (c0, v0), (c1, v1) = _seconds(before), _seconds(after)
    sample = np.asarray(dask.compute(z[:64, :64])[0])
    want = np.asarray(x[:64].compute()) @ np.asarray(y[:, :64].compute())
    np.testing.assert_allclose(sample, want, rtol=1e-10, atol=1e-10)
    methods = {m: after["by_method"].get(m, 0) - before["by_method"].get(m, 0) for m in after["by_method"]}
    check_cpu = after["seconds"]["check_cpu"] - before["seconds"]["check_cpu"]
    return {"n": n, "chunk": chunk, "wall_s": wall, "compute_s": c1 - c0, "verify_s": v1 - v0, "check_cpu_s": check_cpu,
            "overhead": (v1 - v0) / (c1 - c0), "methods": {m: k for m, k in methods.items() if k},
            "rejected": after["rejected"] - before["rejected"]}


def trust_rounds(node, n: int, chunk: int, rounds: int) -> list[dict]:
    """Replica-method work (random blocks, generated on volunteers) round after round on a fresh node:
    what share is replicated, sampled by the lab or accepted on trust, and what that costs, as trust grows."""
    import dask
    from distributed import wait

    import goblin_dask.array as ga

    out = []
    for r in range(rounds):
        before = node.report()
        spec = ga.random.standard_normal((n, n), chunks=chunk, seed=2000 + r)
        t = time.perf_counter()
        x = node.client.persist(spec)
        wait(x)
        wall = time.perf_counter() - t
        after = node.report()
        np.testing.assert_array_equal(dask.compute(x)[0], spec.compute(scheduler="sync"))  # the numbers made here
        (c0, v0), (c1, v1) = _seconds(before), _seconds(after)
        methods = {m: after["by_method"].get(m, 0) - before["by_method"].get(m, 0) for m in after["by_method"]}
        tasks = after["tasks"] - before["tasks"]
        # a replicated pair gives two verdicts, "audit" ones where the lab drew it to recompute as well
        replicated = (methods.get("replica", 0) + methods.get("audit", 0)) // 2
        res = {"n": n, "chunk": chunk, "wall_s": wall, "blocks": (n // chunk) ** 2, "tasks": tasks,
               "replicated": replicated, "audited": methods.get("audit", 0) // 2, "sampled": methods.get("sample", 0) + methods.get("recompute", 0),
               "trusted": methods.get("trusted", 0), "overhead": (v1 - v0) / (c1 - c0) if c1 > c0 else float("nan"),
               "rejected": after["rejected"] - before["rejected"],
               "trust": {name: v["trust"] for name, v in after["volunteers"].items()}}
        out.append(res)
        print(f"    round {r}: {res}", flush=True)
    return out


# -- 4. detection / false positives ------------------------------------------------------------

def _operands(rng, kind: str, n: int, dtype):
    if kind == "normal":
        a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    elif kind == "uniform":
        a, b = rng.random((n, n)), rng.random((n, n))
    elif kind == "offset":
        a, b = 1 + 1e-3 * rng.standard_normal((n, n)), 1 + 1e-3 * rng.standard_normal((n, n))
    else:  # rows and columns over ten orders of magnitude
        a = rng.standard_normal((n, n)) * 10.0 ** rng.uniform(-5, 5, (n, 1))
        b = rng.standard_normal((n, n)) * 10.0 ** rng.uniform(-5, 5, (1, n))
    return a.astype(dtype), b.astype(dtype)


def rates(sizes: dict[int, int]) -> list[dict]:
    from goblin_dask.validation.freivalds import check_product

    rng = np.random.default_rng(1)
    rows = []
    for dtype in (np.float32, np.float64):
        for n, trials in sizes.items():
            for kind in ("normal", "uniform", "offset", "scaled"):
                suspicious = rejected = detected = 0
                for _ in range(trials):
                    a, b = _operands(rng, kind, n, dtype)
                    c = a @ b
                    v = check_product(c, a, b)
                    suspicious += v.recomputed is not None
                    rejected += not v.accepted
                    wrong = c.copy()
                    wrong.flat[np.argmax(np.abs(c))] *= dtype(1 + 1e-3)
                    detected += not check_product(wrong, a, b).accepted
                rows.append({"dtype": np.dtype(dtype).name, "n": n, "data": kind, "trials": trials,
                             "suspicious": suspicious, "rejected": rejected, "detected": detected})
                print(f"    {rows[-1]}", flush=True)
    return rows


# -- report -----------------------------------------------------------------------------------

def markdown(command: str, kernel: str, alone: dict, fgrid: dict, rgrid: dict, rounds: list, rate_rows: list) -> str:
    lines = [SECTION, "", f"Command: `{command}`", "",
             f"Machine: {os.cpu_count()} cores; BLAS (threadpoolctl, this process; the grid's processes use the "
             f"same library): {kernel}.  All ratios below come from this one run.", "",
             "| measurement | product | verification | overhead |", "|---|---|---|---|",
             f"| Freivalds, numpy {alone['n']}x{alone['n']} float64, one check (k = 9 vectors) "
             f"| {alone['product_s']:.2f} s | {alone['check_s']:.3f} s | **{alone['overhead']:.1%}** |",
             f"| Freivalds on the grid, {fgrid['n']}x{fgrid['n']} in {fgrid['chunk']} blocks, 2 volunteers "
             f"| {fgrid['compute_s']:.1f} s volunteer compute ({fgrid['wall_s']:.1f} s wall) | {fgrid['verify_s']:.2f} s lab "
             f"({fgrid['check_cpu_s']:.2f} s of CPU) | **{fgrid['overhead']:.1%}** "
             f"({fgrid['check_cpu_s'] / fgrid['compute_s']:.1%} counting the checks' CPU) |",
             f"| Replicas on the grid, same product, untrusted volunteers | {rgrid['compute_s']:.1f} s "
             f"({rgrid['wall_s']:.1f} s wall) | {rgrid['verify_s']:.1f} s (replicas + comparisons) "
             f"| **{rgrid['overhead']:.1%}** |", "",
             f"Overhead = verification seconds (lab checks, plus replicas' compute) over the volunteers' compute "
             f"seconds for the product's tasks (ledger of the lab node).  Methods used on the grid: "
             f"Freivalds {fgrid['methods']}, replicas {rgrid['methods']}; rejected: {fgrid['rejected']}, {rgrid['rejected']}.",
             "", f"Adaptive replication as trust grows: a fresh lab node, then round after round a "
             f"{rounds[0]['n']}x{rounds[0]['n']} random array in {rounds[0]['chunk']} blocks ({rounds[0]['blocks']} "
             "replica-method tasks generated on the volunteers; trust threshold 10; `goblin.verification."
             "accept-on-trust: true`, which the lab must opt in to: by default every result is replicated).  Overhead = "
             "replicas' compute plus the lab's comparisons, audits and samples, over the volunteers' compute:", "",
             "| round | blocks | replicated on the other volunteer | of them audited by the lab | recomputed by the lab "
             "(sample) | accepted on trust | overhead | rejected | trust after |", "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rounds):
        lines.append(f"| {i} | {r['blocks']} | {r['replicated']} | {r['audited']} | {r['sampled']} | {r['trusted']} | {r['overhead']:.0%} "
                     f"| {r['rejected']} | {r['trust']} |")
    lines += ["", "Freivalds detection and false positives (largest element off by 1e-3 relative; "
              "suspicious = the tight test failed and the lab recomputed; rejected = honest result rejected):", "",
              "| dtype | n | data | trials | honest suspicious | honest rejected | 1e-3 element detected |",
              "|---|---|---|---|---|---|---|"]
    for r in rate_rows:
        lines.append(f"| {r['dtype']} | {r['n']} | {r['data']} | {r['trials']} | {r['suspicious']} | {r['rejected']} "
                     f"| {r['detected']}/{r['trials']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--trust-n", type=int, default=2048)
    p.add_argument("--trust-chunk", type=int, default=256)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--write", action="store_true", help=f"write the section of {RESULTS.name}")
    args = p.parse_args(argv)
    command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /work/venv/bin/python benchmarks/verification.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    from goblin_dask.node.local import LabNode

    kernel = blas()
    print(f"BLAS: {kernel}", flush=True)
    print("1. Freivalds on one product", flush=True)
    alone = freivalds_alone(args.n, args.repeats)
    print(f"    {alone}", flush=True)
    print("2. Freivalds on the grid", flush=True)
    with LabNode.local(volunteers=2) as node:
        fgrid = grid_product(node, args.n, args.chunk, seed=1)
    print(f"    {fgrid}", flush=True)
    print("3. replicas on the grid", flush=True)
    os.environ["DASK_GOBLIN__VERIFICATION__METHOD"] = "replica"  # the node's processes read it
    try:
        with LabNode.local(volunteers=2) as node:
            rgrid = grid_product(node, args.n, args.chunk, seed=1)
            print(f"    {rgrid}", flush=True)
    finally:
        del os.environ["DASK_GOBLIN__VERIFICATION__METHOD"]
    print("3b. adaptive replication as trust grows (accept-on-trust opted in)", flush=True)
    import dask

    # acceptance on trust is off by default (every result replicated); the node's processes take this config
    with dask.config.set({"goblin.verification.accept-on-trust": True}), LabNode.local(volunteers=2) as node:
        rounds = trust_rounds(node, args.trust_n, args.trust_chunk, args.rounds)
    print("4. detection and false positives", flush=True)
    rate_rows = rates({64: 200, 256: 50, 1024: 10, 2048: 4})
    text = markdown(command, kernel, alone, fgrid, rgrid, rounds, rate_rows)
    print(text)
    if args.write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
