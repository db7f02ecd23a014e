"""Data minimization on the lab node: what may and may not reach a volunteer."""

from __future__ import annotations

import numpy as np
import pytest
from dask._task_spec import DataNode, TaskRef

from goblin_dask.ops import CatalogTask, get
from goblin_dask.validation.checks import insert_checks
from scheduler_plugins.minimization import key_violation, string_violation
from goblin_dask.array.linalg import product_blocks
from tests.conftest import blocked_product_graph


def test_key_rules():
    assert key_violation(("matmul-0123456789abcdef", 0, 1)) is None
    assert key_violation(("unverified-matmul-0123456789abcdef", 2, 3)) is None
    assert "opaque" in key_violation(("patients-0123456789abcdef", 0))
    assert "opaque" in key_violation("heart_rate")
    assert "non-integer" in key_violation(("matmul-0123456789abcdef", "ward7"))
    # the array layer's fixed suffixes for intermediate parts (code, not data)
    assert key_violation(("unverified-matmul-0123456789abcdef-partial", 1, 0, 2)) is None
    assert key_violation(("sum-0123456789abcdef-tree", 0, 1, 0)) is None
    assert "opaque" in key_violation(("matmul-0123456789abcdef-ward7", 0))
    assert "opaque" in key_violation(("matmul-0123456789abcdef-partial-heart", 0))


def _array_layer_keys() -> set:
    """Every key of a spread of ga computations, with the lab's checks inserted (``unverified-`` keys)."""
    import dask

    import goblin_dask.array as ga

    rng = np.random.default_rng(5)
    a = rng.standard_normal((9, 8))
    x = ga.from_array(a, chunks=(2, 3))
    y = x + 0  # not source-backed: its rechunks slice and concatenate
    # a chain of volunteer product steps (tiles this small would be the lab's, computed whole)
    with dask.config.set({"goblin.product.volunteer-memory": 800_000, "goblin.placement.min-product-intensity": 1}):
        product = ga.from_array(rng.standard_normal((300, 500))) @ ga.from_array(rng.standard_normal((500, 200)))
    arrays = [
        product, x @ x.T, ga.matmul(x.reshape(1, 9, 8), x.T), ga.tensordot(x, x, axes=((0,), (0,))),
        ga.einsum("ij,kj->ik", x, x), x.dot(x.T),
        x.sum(axis=0), x.prod(), x.max(axis=1), x.min(), x.any(), (x > 0).all(axis=0), x.mean(), x.var(axis=0),
        x.std(), x.argmax(axis=0), x.argmin(), ga.nanvar(x), ga.nanargmax(x, axis=1),
        y.rechunk((4, 5)), x.rechunk((4, 5)), x[1:7:2, ::-1], x[None, 3], x.T, x.reshape(72), ga.squeeze(x[:1]),
        ga.expand_dims(x, 0), ga.broadcast_to(x[:1], (4, 8)), ga.concatenate([x, y]), ga.stack([x, y]),
        ga.moveaxis(x, 0, 1), ga.exp(x), ga.where(x > 0, x, 1), x.clip(0, 1), x.astype("float32"),
        ga.formula("a * exp(-a)", a=x), ga.zeros((3, 4), chunks=2), ga.ones(3), ga.full((2, 2), 7.0), ga.arange(10),
        ga.eye(5, chunks=2), ga.random.standard_normal((6, 6), chunks=3, seed=1), ga.random.uniform(size=5, seed=2),
    ]
    out = set()
    for arr in arrays:
        out |= set(insert_checks(dict(arr.__dask_graph__())))
    return out


def test_every_key_the_array_layer_makes_passes_and_the_filter_is_no_wider():
    from goblin_dask.array import keys
    from goblin_dask.ops import catalog

    made = _array_layer_keys()
    bad = {k: why for k in made if (why := key_violation(k)) is not None}
    assert not bad, bad
    names = [keys.split_name(k[0].removeprefix("unverified-")) for k in made]
    # every word the filter admits is one the array layer really produces
    assert {n.part for n in names} - {None} == set(keys.PARTS)
    assert {n.prefix for n in names} - set(catalog()) == set(keys.PLUMBING)
    assert any(k[0].startswith("unverified-") for k in made)
    # prefixes and parts no code produces are refused (the plumbing words the filter used to admit)
    for prefix in ("array", "block", "lab_block", "from_array", "chunk", "patients"):
        assert "opaque" in key_violation((f"{prefix}-0123456789abcdef", 0)), prefix
        with pytest.raises(ValueError, match="neither a catalog op"):
            keys.new_name(prefix, 1)
    for part in ("root", "v", "cat1", "heart"):
        assert "opaque" in key_violation((f"moments-0123456789abcdef-{part}", 0)), part
        with pytest.raises(ValueError, match="not one of"):
            keys.part_key("moments-0123456789abcdef", part, 0)
    assert "opaque" in key_violation(("matmul-0123abc", 0))  # too short for a token


def test_string_parameter_rules():
    ok = CatalogTask("k", get("einsum"), np.ones((2, 2)), np.ones((2, 2)), subscripts="ij,jk->ik")
    assert string_violation(ok) is None
    bad = CatalogTask("k", get("einsum"), np.ones((2, 2)), np.ones((2, 2)), subscripts="patient names")
    assert "subscripts" in string_violation(bad)


def test_named_data_is_refused_before_it_reaches_a_volunteer(lab):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((4, 3)), rng.standard_normal((3, 2))
    dsk = {"cohort-a": DataNode("cohort-a", a), "cohort-b": DataNode("cohort-b", b),
           ("matmul-0123456789abcdef", 0): CatalogTask(("matmul-0123456789abcdef", 0), get("matmul"),
                                                      TaskRef("cohort-a"), TaskRef("cohort-b"))}
    before = lab.report()["tasks"]
    with pytest.raises(PermissionError, match="cohort-[ab].*data minimization"):
        lab.client.get(insert_checks(dsk), ("matmul-0123456789abcdef", 0))
    assert lab.report()["tasks"] == before  # no volunteer computed anything


def test_opaque_graphs_pass(lab):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((20, 10)), rng.standard_normal((10, 30))
    dsk, keys, _ = blocked_product_graph(a, b, block=10)
    results = lab.client.get(dsk, keys)
    assert len(results) == 6
    np.testing.assert_allclose(results[0], a[:10, :10] @ b[:10, :10])


# -- the curious volunteer ----------------------------------------------------------------------
# A real grid (TLS, separate processes) with one honest volunteer and one that records every
# byte it receives (tests/curious.py).  The researcher works on an xarray Dataset full of
# telling names, memory-mapped from a file with a telling name; afterwards the record is
# searched for every one of those strings and for the dataset's numbers.

N_PATIENTS, N_VISITS = 384, 256
VOLUNTEER_MEMORY = 2 * 2**20
# The product's blocks for that budget (a quarter of it per task, 2 volunteer threads): (visits, patients, visits).
BLOCK_VISITS, BLOCK_PATIENTS, _ = product_blocks(N_VISITS, N_PATIENTS, N_VISITS, 8, VOLUNTEER_MEMORY / 4, 2)
SECRETS = [
    "patient_heart_rate_secret", "ward_bed_count_classified",            # variable names
    "patient_id_dim", "visit_time_dim",                                  # dims
    "patient-MRN-", "visit-week-secret-",                                # coord labels (all share these)
    "St-Goblin-Hospital-XYZ", "cardiology cohort of Dr. Grimbleshanks",  # dataset attrs
    "beats_per_minute_secret_unit", "Zorblax-Protocol-7",                # variable attrs
    "confidential_cohort_2026", "researcher_files_secret",              # file name, its folder
    "patient_name_field", "Patient-Zed-Secret",                          # refused structured / text arrays
]


def _encodings(s: str) -> list[bytes]:
    # msgpack and pickle carry str as UTF-8; numpy "U" arrays as UTF-32; Windows-ish text as UTF-16
    return [s.encode(e) for e in ("utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")]


def _pieces(record: bytes, table: np.ndarray) -> dict[str, int]:
    """How much of ``table`` (2-d float64, distinct values) ``record`` holds, at any byte alignment.

    ``piece``: the most values in one unbroken stretch of the record that are all the
    table's (one buffer: a block, a panel, the whole table ...); ``run_c``/``run_f``: the
    longest run of the table's consecutive values in C / F order (a row is ``ncol`` long,
    a column ``nrow``); ``total``: values found, counting repeats; ``distinct``: without.
    """
    flat = np.ascontiguousarray(table, dtype=np.float64).view(np.uint64).ravel()
    order = np.argsort(flat, kind="stable")
    keys = flat[order]
    assert np.unique(keys).size == keys.size, "the table's values must be distinct for the search to mean anything"
    nrow, ncol = table.shape
    out = dict(piece=0, run_c=0, run_f=0, total=0, distinct=0)
    seen = np.zeros(flat.size, dtype=bool)

    def longest(mask: np.ndarray) -> int:
        if not mask.any():
            return 0
        edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
        return int((np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)).max())

    for align in range(8):
        words = np.frombuffer(record, dtype=np.uint64, offset=align, count=(len(record) - align) // 8)
        pos = np.minimum(np.searchsorted(keys, words), keys.size - 1)
        hit = keys[pos] == words
        if not hit.any():
            continue
        c_idx = np.where(hit, order[pos], -10)
        f_idx = np.where(hit, (c_idx % ncol) * nrow + c_idx // ncol, -10)
        both = hit[:-1] & hit[1:]
        out["piece"] = max(out["piece"], longest(hit))
        out["run_c"] = max(out["run_c"], longest((np.diff(c_idx) == 1) & both) + 1)
        out["run_f"] = max(out["run_f"], longest((np.diff(f_idx) == 1) & both) + 1)
        out["total"] += int(hit.sum())
        seen[c_idx[hit]] = True
    out["distinct"] = int(seen.sum())
    return out


def test_a_curious_volunteer_learns_no_names_and_only_its_blocks(tmp_path, monkeypatch):
    import dask
    import xarray as xr

    import goblin_dask.array as ga
    from goblin_dask.node.local import LabNode

    rng = np.random.default_rng(20260505)
    heart = 60 + 12 * rng.standard_normal((N_PATIENTS, N_VISITS))
    beds = rng.integers(0, 40, size=(N_PATIENTS,))
    files = tmp_path / "researcher_files_secret"
    files.mkdir()
    path = files / "confidential_cohort_2026.npy"
    np.save(path, heart)
    mapped = np.load(path, mmap_mode="r")
    ds = xr.Dataset(
        {"patient_heart_rate_secret": (("patient_id_dim", "visit_time_dim"), mapped,
                                       {"units": "beats_per_minute_secret_unit", "protocol": "Zorblax-Protocol-7"}),
         "ward_bed_count_classified": (("patient_id_dim",), beds)},
        coords={"patient_id_dim": [f"patient-MRN-{i:05d}" for i in range(N_PATIENTS)],
                "visit_time_dim": [f"visit-week-secret-{i:03d}" for i in range(N_VISITS)]},
        attrs={"institution": "St-Goblin-Hospital-XYZ",
               "description": "confidential cardiology cohort of Dr. Grimbleshanks"})

    # Without work stealing every block a volunteer is sent belongs to a task it computes,
    # which makes the bound on what it received exact (stealing only moves tasks among volunteers).
    monkeypatch.setenv("DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING", "False")
    with LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node, \
            node.client.as_current(), dask.config.set({"goblin.product.volunteer-memory": VOLUNTEER_MEMORY}):
        curious = node.add_volunteer(module="tests.curious")  # alone for now: whatever is sent, it gets
        record_path = node.state_dir / f"received-{node.processes[curious].pid}.bin"
        before = node.report()["tasks"]

        # What may never be sent is refused in the researcher's process, before any graph exists.
        people = np.array([("Patient-Zed-Secret", 71.5)], dtype=[("patient_name_field", "U32"), ("rate", "f8")])
        with pytest.raises(TypeError, match="unsupported dtype.*numeric"):
            ga.from_array(people)
        with pytest.raises(TypeError, match="unsupported dtype.*text travels as integer tokens"):
            ga.from_array(np.array(["Patient-Zed-Secret"]))
        # ... and a hand-made graph whose key names the data is refused by the node, not sent.
        a = rng.standard_normal((128, 128))
        telling = ("patient_heart_rate_secret-0123456789abcdef", 0)
        dsk = {telling: DataNode(telling, a),
               ("matmul-0123456789abcdef", 0): CatalogTask(("matmul-0123456789abcdef", 0), get("matmul"),
                                                          TaskRef(telling), TaskRef(telling))}
        with pytest.raises(PermissionError, match="patient_heart_rate_secret.*data minimization"):
            node.client.get(insert_checks(dsk), ("matmul-0123456789abcdef", 0))
        assert node.report()["tasks"] == before
        node.add_volunteer()  # an honest one to share the work with

        # The researcher's analysis: blocks of the memmap are read on the lab worker.
        g = ga.from_array(ds, chunks={"patient_id_dim": BLOCK_PATIENTS, "visit_time_dim": BLOCK_VISITS})
        rate = g.patient_heart_rate_secret
        assert isinstance(rate.data, ga.Array) and rate.attrs["units"] == "beats_per_minute_secret_unit"
        centered = rate - rate.mean("patient_id_dim")                     # elementwise: stays on the lab worker
        gram = rate.data.T @ rate.data                                    # products: volunteers
        cov = centered.data.T @ centered.data / (N_PATIENTS - 1)
        assert gram.chunks == ((BLOCK_VISITS,) * 2,) * 2
        # One product at a time, so that each is shared by both volunteers (computed together,
        # the curious one may be kept busy by the first while the honest one takes the other).
        got_gram = gram.compute()
        got_cov, got_mean, got_beds, got_centered = dask.compute(
            cov, rate.mean("patient_id_dim").data, g.ward_bed_count_classified.sum().data, centered.data)
        report = node.report()

    np.testing.assert_allclose(got_gram, heart.T @ heart, rtol=1e-12)
    np.testing.assert_allclose(got_cov, np.cov(heart, rowvar=False), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(got_mean, heart.mean(axis=0), rtol=1e-13)
    np.testing.assert_allclose(got_centered, heart - heart.mean(axis=0), rtol=1e-12, atol=1e-12)
    assert got_beds == beds.sum()
    # The curious volunteer did compute a share of the products (and was not caught lying).
    mine = report["volunteers"][curious]
    assert mine["accepted"] >= 1 and mine["rejected"] == 0, report
    assert report["by_method"].get("freivalds", 0) == report["accepted"]

    record = record_path.read_bytes()
    assert b"compute-task" in record and b"matmul-" in record  # the recorder saw the task traffic
    for secret in [*SECRETS, str(tmp_path), str(path), *ds.attrs.values()]:
        for form in _encodings(secret):
            if (at := record.find(form)) >= 0:
                pytest.fail(f"{secret!r} reached the curious volunteer, at byte {at} of what it received: "
                            f"{record[max(at - 120, 0):at + len(form) + 40]!r}")

    # Numbers: only blocks.  A task gets one product block of each operand (the product's
    # rechunking is done on the lab worker), so no buffer of the data larger than one block
    # arrives, no run of consecutive values longer than a block's side (so no full row, 256
    # values, or column, 384), never the whole table; and all the values the curious
    # volunteer got add up to no more than its tasks' operands.
    block = BLOCK_PATIENTS * BLOCK_VISITS
    for table in (heart, got_centered):
        seen = _pieces(record, table)
        assert seen["distinct"] > 0, "the curious volunteer never saw the data it computed on?"
        assert seen["piece"] <= block, seen
        assert seen["run_c"] <= BLOCK_VISITS and seen["run_f"] <= BLOCK_VISITS, seen
        assert seen["total"] <= mine["accepted"] * 2 * block, (seen, mine)
    assert heart.tobytes() not in record and heart.T.tobytes() not in record
