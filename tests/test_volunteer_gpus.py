"""``goblin volunteer --gpus I,J --gpu-memory-fraction F``: which GPUs (a worker process per GPU), how much of each.

This machine has no GPU (and no cupy): the options' parsing and validation, the per-GPU worker plan (a pure
function: each worker's environment and arguments), and what asking for GPUs without cupy does, through
the real ``goblin volunteer`` command and real processes.  With cupy and GPUs, the memory limit is
``cupy.get_default_memory_pool().set_limit(fraction=F)`` in each worker (``prepare_process``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import click
import pytest

from goblin_dask.credentials import issue_credential
from goblin_dask.volunteer import (check_gpu_memory_fraction, gpu_worker_plan, parse_gpus, run_gpu_workers,
                                   volunteer_command)

NO_CUPY = importlib.util.find_spec("cupy") is None
UNREACHABLE = "tls://127.0.0.1:9"  # nothing listens there


def _goblin_volunteer(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "goblin_dask.cli", "volunteer", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def credentials(tmp_path_factory):
    state = tmp_path_factory.mktemp("lab-state")  # credential files (0600), as `goblin enroll` writes them
    return [str(issue_credential(state, "volunteer", f"gpu-volunteer-{i}").save(state / f"gpu-{i}.credential"))
            for i in range(2)]


def test_gpus_are_indices_separated_by_commas():
    assert parse_gpus(None) is None
    assert parse_gpus("0") == [0] and parse_gpus("0,1") == [0, 1] and parse_gpus(" 3, 1 ") == [3, 1]
    for bad in ("", "a", "0,,1", "-1", "1.5", "0;1", "gpu0"):
        with pytest.raises(click.BadParameter, match="GPU indices separated by commas"):
            parse_gpus(bad)
    with pytest.raises(click.BadParameter, match="names a GPU twice"):
        parse_gpus("0,1,0")


def test_the_gpu_memory_fraction_is_above_0_and_at_most_1():
    assert check_gpu_memory_fraction(None) is None
    assert check_gpu_memory_fraction(0.5) == 0.5 and check_gpu_memory_fraction(1.0) == 1.0
    for bad in (0.0, -0.25, 1.01, 50.0):
        with pytest.raises(click.BadParameter, match="above 0 and at most 1"):
            check_gpu_memory_fraction(bad)


def test_the_plan_runs_a_worker_per_gpu_each_seeing_its_gpu_only_with_its_own_credential_and_directories():
    environ = {"PATH": "/usr/bin", "GOBLIN_TOKEN": "the parent's", "GOBLIN_VOLUNTEER_STATE_DIR": "/shared"}
    plan = gpu_worker_plan([0, 1], ["cred-0", "cred-1"], environ=environ, address="tls://lab:8786", nthreads=4,
                           memory_limit="8GB", gpu_memory_fraction=0.5, state_dir="/v", local_directory="/scratch",
                           status_port=9000, only_when_idle=True, idle_threshold=30.0, max_attempts=5,
                           lab_hosts=("10.0.0.7", "10.1.0.0/16"))
    assert [w["gpu"] for w in plan] == [0, 1]
    for i, worker in enumerate(plan):
        env, argv = worker["env"], worker["argv"]
        assert env["CUDA_VISIBLE_DEVICES"] == str(i) and env["GOBLIN_TOKEN"] == f"cred-{i}"  # not on the command line
        assert env["PATH"] == "/usr/bin" and "GOBLIN_VOLUNTEER_STATE_DIR" not in env
        assert not any("cred" in a for a in argv)
        assert argv == ["tls://lab:8786", "--gpu", "--nthreads", "4", "--memory-limit", "8GB",
                        "--status-port", str(9000 + i), "--gpu-memory-fraction", "0.5",
                        "--state-dir", os.path.join("/v", f"gpu{i}"), "--local-directory", os.path.join("/scratch", f"gpu{i}"),
                        "--only-when-idle", "--idle-threshold", "30.0", "--max-attempts", "5",
                        "--lab-host", "10.0.0.7", "--lab-host", "10.1.0.0/16"]
        # what each worker runs is a `goblin volunteer` command line it accepts
        with volunteer_command.make_context("volunteer", list(argv)) as ctx:
            assert ctx.params["gpu"] is True and ctx.params["gpu_memory_fraction"] == 0.5
            assert ctx.params["lab_hosts"] == ("10.0.0.7", "10.1.0.0/16")
    # any free status port (0) and no page (-1) stay as they are; no state dir: each credential's own default
    for port in (0, -1):
        plan = gpu_worker_plan([2, 3], ["a", "b"], environ={}, address="x", nthreads=1, memory_limit="auto",
                               status_port=port)
        assert [w["argv"][w["argv"].index("--status-port") + 1] for w in plan] == [str(port)] * 2
        assert all("--state-dir" not in w["argv"] and "--gpu-memory-fraction" not in w["argv"] for w in plan)
        assert [w["env"]["CUDA_VISIBLE_DEVICES"] for w in plan] == ["2", "3"]


def test_gpu_indices_count_among_the_devices_this_process_sees():
    plan = gpu_worker_plan([0, 1], ["a", "b"], environ={"CUDA_VISIBLE_DEVICES": "2,3"}, address="x", nthreads=1,
                           memory_limit="auto")
    assert [w["env"]["CUDA_VISIBLE_DEVICES"] for w in plan] == ["2", "3"]
    with pytest.raises(click.BadParameter, match=r"GPU 2: this process sees 2 \(CUDA_VISIBLE_DEVICES=2,3\)"):
        gpu_worker_plan([2], ["a"], environ={"CUDA_VISIBLE_DEVICES": "2,3"}, address="x", nthreads=1,
                        memory_limit="auto")


def test_each_gpu_needs_its_own_credential():
    for tokens in (["only-one"], ["a", "b", "c"]):
        with pytest.raises(click.BadParameter, match="a credential of its own"):
            gpu_worker_plan([0, 1], tokens, environ={}, address="x", nthreads=1, memory_limit="auto")


def test_bad_gpu_options_are_clear_errors_of_the_command(credentials):
    for args, message in [
        (["--gpus", "a,b"], "GPU indices separated by commas"),
        (["--gpus", "0,0"], "names a GPU twice"),
        (["--gpu-memory-fraction", "1.5"], "above 0 and at most 1"),
        (["--gpu-memory-fraction", "0"], "above 0 and at most 1"),
        (["--gpus", "0", "--no-gpu"], "--gpus with --no-gpu"),
    ]:
        done = _goblin_volunteer(UNREACHABLE, "--token", credentials[0], *args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
    done = _goblin_volunteer(UNREACHABLE, "--token", credentials[0], "--token", credentials[1], "--max-attempts", "1")
    assert done.returncode == 2 and "2 credentials for one worker" in done.stderr


@pytest.mark.skipif(not NO_CUPY, reason="cupy is installed here")
def test_asking_for_gpus_without_cupy_says_so(credentials):
    for args in (["--gpus", "0"], ["--gpus", "0,1", "--token", credentials[1]]):
        done = _goblin_volunteer(UNREACHABLE, "--token", credentials[0], *args)
        assert done.returncode == 2 and "--gpus needs cupy, which is not installed here" in done.stderr, done.stderr
    # a memory fraction without a GPU: a warning, and the volunteer computes on the CPU (here: it tries to join)
    done = _goblin_volunteer(UNREACHABLE, "--token", credentials[0], "--gpu-memory-fraction", "0.5",
                             "--max-attempts", "1", "--status-port", "-1")
    assert done.returncode == 3 and "cannot reach lab node" in done.stderr
    assert "--gpu-memory-fraction 0.5 ignored: no usable GPU" in done.stderr and "backend cpu" in done.stderr


@pytest.mark.skipif(not NO_CUPY, reason="cupy is installed here")
def test_each_planned_worker_is_a_process_of_its_own_with_its_gpu(credentials, capfd):
    """Without cupy each per-GPU worker stops at once ('--gpu asked, but no usable GPU'): two real processes,
    each told its GPU, each with its credential, and the worst exit code comes back."""
    plan = gpu_worker_plan([0, 1], credentials, environ=dict(os.environ), address=UNREACHABLE, nthreads=1,
                           memory_limit="auto", status_port=-1, max_attempts=1)
    assert run_gpu_workers(plan) == 2
    err = capfd.readouterr().err
    assert err.count("--gpu asked, but no usable GPU") == 2, err
    assert "no usable GPU (CUDA_VISIBLE_DEVICES=0)" in err and "no usable GPU (CUDA_VISIBLE_DEVICES=1)" in err
