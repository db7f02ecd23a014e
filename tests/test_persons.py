"""One person, several volunteer credentials (one per GPU, or several enrolments; issue 29).

The admin records who holds each credential (``goblin enroll --person WHO``, default: the credential's own
name).  The exposure cap counts per person, over all their credentials, and a replica never runs on a
credential of the person whose result it checks: two credentials of one person agree on whatever they like.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from goblin_dask.credentials import CredentialError, LabKeys, issue_credential
from tests.conftest import wait_for
from tests.test_minimization import _pieces


def _seen_together(node, names, a) -> float:
    """The share of ``a``'s elements found in what the curious volunteers ``names`` received, all together."""
    record = b"".join((node.state_dir / f"received-{node.processes[n].pid}.bin").read_bytes() for n in names)
    return _pieces(record, a)["distinct"] / a.size


def _curious(node, name, person):
    return node.add_volunteer(node.enroll(name, person=person), module="tests.curious")


def _product_under_cap(tmp_path, monkeypatch, people: dict[str, str], cap: float, seed: int):
    import dask

    import goblin_dask.array as ga
    from goblin_dask.array.sources import lab_arrays
    from goblin_dask.node.local import LabNode

    a = np.random.default_rng(seed).standard_normal((512, 256))
    monkeypatch.setenv("DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING", "False")
    with dask.config.set({"goblin.minimization.max-exposure": cap}), \
            LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node, \
            node.client.as_current():
        for name, person in people.items():
            _curious(node, name, person)
        x = ga.from_array(a, chunks=128)
        (aid,) = lab_arrays(x)
        got = dask.compute(x.T @ x)[0]
        report = node.report()
        seen = {p: _seen_together(node, [n for n, q in people.items() if q == p], a) for p in set(people.values())}
    np.testing.assert_allclose(got, a.T @ a, rtol=1e-10, atol=1e-9)
    return report, aid, seen


def test_three_credentials_of_one_person_together_see_at_most_the_cap(tmp_path, monkeypatch):
    """Before, the account was per credential: three credentials of one person each stayed within a 0.5 cap
    and together received most of the array.  Now the person's three credentials share the cap."""
    cap = 0.5
    people = {"pat-gpu0": "pat", "pat-gpu1": "pat", "pat-gpu2": "pat"}
    report, aid, seen = _product_under_cap(tmp_path, monkeypatch, people, cap, seed=29)
    assert 0 < seen["pat"] <= cap + 1e-12, (seen, report["exposure"])  # what they received, read off the wire
    assert report["exposure_by_person"]["pat"][aid] == pytest.approx(seen["pat"], abs=1e-9), report["exposure_by_person"]
    for name in people:
        assert report["volunteers"][name]["rejected"] == 0
    assert sum(report["volunteers"][n]["accepted"] for n in people) >= 2, report["volunteers"]


def test_credentials_of_two_people_each_get_their_share(tmp_path, monkeypatch):
    """The cap is per person, not for all volunteers together: two people each see up to the cap."""
    cap = 0.5
    people = {"pat-gpu0": "pat", "pat-gpu1": "pat", "sam": "sam"}
    report, aid, seen = _product_under_cap(tmp_path, monkeypatch, people, cap, seed=30)
    for person in ("pat", "sam"):
        assert 0 < seen[person] <= cap + 1e-12, (seen, report["exposure"])
        assert report["exposure_by_person"][person][aid] == pytest.approx(seen[person], abs=1e-9)
    assert seen["pat"] + seen["sam"] > cap, seen  # more than one person's share left the lab


def test_a_task_reissued_at_its_deadline_stays_within_its_persons_cap(tmp_path, monkeypatch):
    """A deadline reissue is pinned again within the cap of the person of the credential it goes to: the
    holder's blocks do not go to another credential of the holder's person beyond what that person may see."""
    import dask

    import goblin_dask.array as ga
    from goblin_dask.array.sources import lab_arrays
    from goblin_dask.node.local import LabNode

    a = np.random.default_rng(31).standard_normal((512, 256))
    cap = 0.5
    monkeypatch.setenv("DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING", "False")
    with dask.config.set({"goblin.minimization.max-exposure": cap, "goblin.verification.deadline": 2.0}), \
            LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node, \
            node.client.as_current():
        honest = _curious(node, "pat-gpu0", "pat")
        holder = node.add_volunteer(node.enroll("pat-gpu1", person="pat"), module="tests.hostile",
                                    extra_args=("--attack", "hold", "--keep", "64"))
        x = ga.from_array(a, chunks=128)
        (aid,) = lab_arrays(x)
        got = dask.compute(x.T @ x)[0]
        report = node.report()
        seen = _seen_together(node, [honest], a)
    np.testing.assert_allclose(got, a.T @ a, rtol=1e-10, atol=1e-9)
    assert report["reissued"] >= 1 and report["volunteers"][holder]["late"] >= 1, report["volunteers"]
    exposure = report["exposure"]
    assert exposure.get(holder, {}).get(aid, 0) > 0, exposure  # it was given blocks (and held them)
    together = report["exposure_by_person"]["pat"][aid]
    assert together <= cap + 1e-12, report["exposure_by_person"]
    assert together >= max(exposure[holder][aid], seen) - 1e-12, (together, exposure, seen)


# -- replicas ------------------------------------------------------------------------------------

def _pairs(node, stream, persons) -> dict[tuple, list[str]]:
    """``{block index: [person of each volunteer that computed a volunteer task of that block]}``."""
    from goblin_dask.validation.checks import is_unverified_key

    out: dict[tuple, list[str]] = {}
    for event in stream:
        key = event["key"]
        if isinstance(key, tuple) and is_unverified_key(key) and event["worker"] in persons:
            out.setdefault(tuple(key[1:]), []).append(persons[event["worker"]])
    return out


def test_replicas_never_run_on_two_credentials_of_one_person(tmp_path):
    """Before, a replica was kept off the first result's credential only: one person's other credential
    computed it, and the two agreed.  Now, with only one person's credentials connected, the lab checks each
    result itself; once another person joins, every replica runs there."""
    from distributed import get_task_stream

    import goblin_dask.array as ga
    from goblin_dask.node.local import LabNode

    with LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node:
        for name in ("pat-gpu0", "pat-gpu1"):
            node.add_volunteer(node.enroll(name, person="pat"))
        x = ga.random.standard_normal((4 * 64, 4 * 64), chunks=64, seed=11)
        with get_task_stream(client=node.client) as one_person:
            np.testing.assert_array_equal(node.client.compute(x).result(), x.compute(scheduler="sync"))
        sam = node.add_volunteer(node.enroll("sam"))
        persons = {a: "pat" if n.startswith("pat-") else n for n, a in node.volunteer_addresses().items()}
        first = node.report()
        y = ga.random.standard_normal((4 * 64, 4 * 64), chunks=64, seed=12)
        with get_task_stream(client=node.client) as two_people:
            np.testing.assert_array_equal(node.client.compute(y).result(), y.compute(scheduler="sync"))
        report = node.report()
    assert set(persons.values()) == {"pat", "sam"}, persons
    alone = _pairs(node, one_person.data, persons)
    assert alone and all(len(p) == 1 for p in alone.values()), alone  # no replica on pat's other credential
    assert first["by_method"].get("replica", 0) == 0 and first["by_method"].get("audit", 0) == 0, first["by_method"]
    assert sum(first["volunteers"][n]["accepted"] for n in ("pat-gpu0", "pat-gpu1")) == len(alone), first["volunteers"]
    together = _pairs(node, two_people.data, persons)
    replicated = [p for p in together.values() if len(p) == 2]
    assert replicated, together  # with another person present, results are replicated again
    assert all(sorted(p) == ["pat", "sam"] for p in replicated), together  # never both on pat's credentials
    assert all(len(p) <= 2 for p in together.values()), together
    assert report["volunteers"][sam]["rejected"] == 0


def test_two_credentials_of_one_person_returning_one_wrong_block_are_not_confirmed_by_each_other(tmp_path):
    """Issue 29's case at the default audit rate: one person's two credentials return 0.5 everywhere for every
    random block.  Before, each confirmed the other's (the lab audits 5 % of pairs): the researcher's array
    was wrong.  Now nobody of another person is there to replicate on, so the lab checks every result: both
    are banned, and an honest volunteer joining afterwards finishes numpy's array."""
    import goblin_dask.array as ga
    from goblin_dask.node.local import LabNode

    with LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node:
        pair = [node.add_volunteer(node.enroll(name, person="pat"), module="tests.cheaters",
                                   extra_args=("--cheat", "half")) for name in ("pat-gpu0", "pat-gpu1")]
        x = ga.random.standard_normal((4 * 64, 4 * 64), chunks=64, seed=13)
        future = node.client.compute(x)
        wait_for(lambda: future.done() or all(node.report()["volunteers"].get(n, {}).get("banned") for n in pair),
                 "the result, or both credentials banned", timeout=600)
        if not future.done():
            node.add_volunteer(node.enroll("sam"))
        got = future.result()
        report = node.report()
    np.testing.assert_array_equal(got, x.compute(scheduler="sync"))  # no 0.5 block accepted
    assert report["by_method"].get("replica", 0) == 0, report["by_method"]
    for name in pair:
        assert report["volunteers"][name]["banned"] and report["volunteers"][name]["accepted"] == 0, report["volunteers"]


# -- bans -----------------------------------------------------------------------------------------

def _product_is_right(node, seed: int, block: int = 48) -> None:
    """One verified blocked product on the volunteers, equal to numpy's."""
    from tests.conftest import assemble, blocked_product_graph

    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((4 * block, 4 * block)), rng.standard_normal((4 * block, 4 * block))
    dsk, keys, blocks = blocked_product_graph(a, b, block)
    results = node.client.get(dsk, keys)
    got = assemble({k[1:]: r for k, r in zip(keys, results)}, (a.shape[0], b.shape[1]), blocks)
    np.testing.assert_allclose(got, a @ b, rtol=1e-10, atol=1e-10)


def _served(node, credential) -> list[str]:
    """What the scheduler answers ``credential`` (a volunteer's) on a few handlers; 'dropped' when it refuses."""
    from goblin_dask.node import rpc
    from tests.test_link import _send

    security = credential.security()
    return [node.client.sync(_send, node.address, security, {"op": op, "reply": True})
            for op in ("identity", rpc.LINK_ENDPOINTS)]


def test_a_wrong_result_bans_every_credential_of_its_person_and_nobody_else(tmp_path):
    """Before, a ban for wrong results reached only the credential that returned them: the same person's other
    credentials stayed connected and served, and the admin could enrol the person again.  Now every credential
    of the person is banned with it (the reason names the one that cheated), across a restart of the node,
    and no credential is enrolled for them again; another person's volunteer is untouched."""
    from goblin_dask.errors import EXIT_REFUSED, EXIT_REVOKED
    from goblin_dask.node.local import LabNode
    from goblin_dask.tls import Credential
    from tests.conftest import read_log

    lab = tmp_path / "lab"
    with LabNode.local(volunteers=0, state_dir=lab, dashboard=False) as node:
        cheat = node.add_volunteer(node.enroll("pat-gpu0", person="pat"), module="tests.cheaters",
                                   extra_args=("--cheat", "zeros"))
        twin = Credential.decode(node.enroll("pat-gpu1", person="pat"))
        node.add_volunteer(twin.encode())
        sam = Credential.decode(node.enroll("sam"))
        node.add_volunteer(sam.encode())
        spare = Credential.decode(node.enroll("pat-gpu2", person="pat"))  # enrolled, never joined
        assert all(answer != "dropped" for answer in _served(node, spare))  # served while pat is in good standing
        for seed in range(8):
            _product_is_right(node, seed)
            if node.report()["volunteers"][cheat]["banned"]:
                break
        report = node.report()
        bans = {b["name"]: b["reason"] for b in report["bans"]}
        assert set(bans) == {cheat, twin.name, spare.name}, bans
        assert "rejected results" in bans[cheat]
        for name in (twin.name, spare.name):
            assert f"credential {cheat} of the same person (pat) was banned: {bans[cheat]}" == bans[name], bans
        assert report["volunteers"][twin.name]["banned"] and report["volunteers"][twin.name]["rejected"] == 0
        wait_for(lambda: twin.name not in node.volunteer_names(), f"{twin.name} disconnected")
        code = node.processes[twin.name].wait(120)  # it tried again and was refused
        assert code in (EXIT_REFUSED, EXIT_REVOKED), (code, read_log(node._log_path(twin.name)))
        for credential in (twin, spare):
            assert _served(node, credential) == ["dropped", "dropped"]
        with pytest.raises(CredentialError, match="person 'pat' is banned from this lab node: their credential "
                                                  "'pat-gpu0' was banned"):
            node.enroll("pat-gpu3", person="pat")
        volunteers = node.report()["volunteers"]
        assert sam.name in node.volunteer_names() and not volunteers[sam.name]["banned"], volunteers
        assert volunteers[sam.name]["rejected"] == 0, volunteers
        _product_is_right(node, 100)
    with LabNode.local(volunteers=0, state_dir=lab, dashboard=False) as node:  # the same lab, restarted
        with pytest.raises(CredentialError, match="person 'pat' is banned"):
            node.enroll("pat-gpu3", person="pat")
        for credential in (twin, spare):
            assert _served(node, credential) == ["dropped", "dropped"]
        node.add_volunteer(twin.encode(), wait=False)
        assert node.processes[twin.name].wait(120) == EXIT_REVOKED, read_log(node._log_path(twin.name))
        node.add_volunteer(sam.encode())
        _product_is_right(node, 101)
        assert node.report()["volunteers"][sam.name]["accepted"] >= 1


def test_a_malformed_message_bans_only_the_credential_that_sent_it(tmp_path):
    """A malformed message proves nothing about a person: a credential read off one machine (by another local
    user, say) could send one to get its owner's other credentials banned.  The credential that sent it is
    banned; the same person's other volunteer stays connected and computes, and the person may still enrol."""
    from distributed.protocol.serialize import ToPickle

    from goblin_dask.credentials import BANNED_PERSONS_FILE
    from goblin_dask.node.local import LabNode
    from goblin_dask.tls import Credential
    from tests.hostile_link import Command
    from tests.test_link import _send

    lab = tmp_path / "lab"
    with LabNode.local(volunteers=0, state_dir=lab, dashboard=False) as node:
        working = node.add_volunteer(node.enroll("pat-gpu0", person="pat"))
        stolen = Credential.decode(node.enroll("pat-gpu1", person="pat"))
        evil = {"op": "identity", "reply": True, "payload": ToPickle(Command(str(tmp_path / "pwned")))}
        assert node.client.sync(_send, node.address, stolen.security(), evil) == "dropped"
        wait_for(lambda: stolen.name in node.keys.revoked(), f"{stolen.name} banned")
        assert not (tmp_path / "pwned").exists()
        bans = {b["name"]: b["reason"] for b in node.report()["bans"]}
        assert set(bans) == {stolen.name}, bans
        assert working in node.volunteer_names() and working not in node.keys.revoked()
        assert not (lab / BANNED_PERSONS_FILE).exists() or "pat" not in json.loads((lab / BANNED_PERSONS_FILE).read_text())
        _product_is_right(node, 102)
        assert node.report()["volunteers"][working]["accepted"] >= 1
        assert Credential.decode(node.enroll("pat-gpu2", person="pat")).name == "pat-gpu2"


def test_a_person_banned_is_refused_even_for_a_credential_the_ban_missed(tmp_path):
    """The person's ban, not only the revocations it wrote, refuses their credentials: one enrolled while the
    node banned them (a registry entry written after the node listed the person's credentials) is refused."""
    from goblin_dask.credentials import BANNED_PERSONS_FILE

    lab = tmp_path / "lab"
    keys = LabKeys(lab)
    late = keys.issue("volunteer", "pat-gpu5", person="pat")
    keys.ban_person("pat", "pat-gpu0", "2 rejected results")
    assert json.loads((lab / BANNED_PERSONS_FILE).read_text())["pat"]["credential"] == "pat-gpu0"
    for reader in (keys, LabKeys(lab)):  # this node, and one started again on the state directory
        with pytest.raises(CredentialError, match="person 'pat' is banned .* 'pat-gpu0' was banned"):
            reader.verify(late)
        with pytest.raises(CredentialError, match="person 'pat' is banned"):
            reader.issue("volunteer", "pat-gpu6", person="pat")
    assert keys.verify(keys.issue("volunteer", "sam")).name == "sam"


# -- the registry ---------------------------------------------------------------------------------

def test_a_registry_without_persons_still_loads(tmp_path):
    """A lab enrolled before the registry has no file, and an entry may lack its person: each credential is
    then its own person, as before; a registry that cannot be read is an error, never a guess."""
    from goblin_dask.tls import Credential

    lab = tmp_path / "lab"
    old = Credential.decode(issue_credential(lab, "volunteer", "old-timer").encode())
    (lab / "volunteers.json").unlink()  # as a lab before the registry
    keys = LabKeys(lab)
    assert keys.person("old-timer") == "old-timer" and keys.verify(old.token).name == "old-timer"
    (lab / "volunteers.json").write_text(json.dumps({"volunteers": {"old-timer": {}}}))
    assert LabKeys(lab).person("old-timer") == "old-timer"
    issue_credential(lab, "volunteer", "pat-gpu0", person="pat")
    entries = json.loads((lab / "volunteers.json").read_text())["volunteers"]
    assert entries == {"old-timer": {}, "pat-gpu0": {"person": "pat"}}
    keys = LabKeys(lab)
    assert keys.person("pat-gpu0") == "pat" and keys.person("old-timer") == "old-timer"
    (lab / "volunteers.json").write_text("{not json")
    with pytest.raises(CredentialError, match="volunteer registry"):
        LabKeys(lab).person("pat-gpu0")


def test_enroll_records_the_person(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from goblin_dask.cli import main

    lab = tmp_path / "lab"
    issue_credential(lab, "lab", "lab-worker")  # a lab: its secret and CA
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for args in (["--name", "pat-gpu0", "--person", "pat"], ["--name", "sam"]):
        result = runner.invoke(main, ["enroll", "--state-dir", str(lab), *args])
        assert result.exit_code == 0, result.output
    keys = LabKeys(lab)
    assert (keys.person("pat-gpu0"), keys.person("sam")) == ("pat", "sam")
    result = runner.invoke(main, ["enroll", "--state-dir", str(lab), "--name", "x", "--person", "no/slash"])
    assert result.exit_code != 0 and "person" in result.output
