"""The job's own Ray, started by the CLI in a process of its own (pipeline.ray_head): it serves a driver,
shuts Ray down when closed or when its driver dies, and a start that fails says why. Drivers run in
subprocesses: a process that imported Ray already cannot take the head's authentication mode."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.errors import OVBatchError
from pipeline import ray_head
from pipeline.config import JobConfig, RayConfig

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, stdout=subprocess.PIPE, text=True, **kwargs
    )


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _ray_processes(session_pid: int) -> list[str]:
    """Ray's own processes whose command line names the head's session (its gcs_server and raylet)."""
    out = subprocess.run(["pgrep", "-f", f"session_.*_{session_pid}"], capture_output=True, text=True)
    return out.stdout.split()


def _no_ray_processes_after(session_pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while _ray_processes(session_pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def test_a_driver_runs_on_the_heads_ray_and_close_stops_it():
    proc = _python(
        """
        from pipeline.ray_head import RayHead
        head = RayHead(1)
        import ray
        ray.init(address=head.address(), log_to_driver=False)
        print(ray.get(ray.remote(lambda: 41 + 1).remote()), head._proc.pid, flush=True)
        ray.shutdown()
        head.close()
        """
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    answer, head_pid = out.split()
    assert answer == "42"
    assert _gone(int(head_pid), 5) and not _ray_processes(int(head_pid))  # a graceful close: all at once


def test_a_close_that_does_not_wait_returns_at_once_and_ray_still_shuts_down():
    proc = _python(
        """
        from pipeline.ray_head import RayHead
        head = RayHead(1)
        import ray
        ray.init(address=head.address(), log_to_driver=False)
        assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42
        ray.shutdown()
        head.close(wait=False)
        print(head._proc.poll() is None, head._proc.pid, flush=True)
        """
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    running, head_pid = out.split()
    assert running == "True"  # close returned while Ray's teardown went on
    assert _gone(int(head_pid), 30), "the head kept running after its driver closed it"
    assert _no_ray_processes_after(int(head_pid), 30)


def test_a_driver_that_dies_leaves_no_ray_behind():
    proc = _python(
        """
        import time
        from pipeline.ray_head import RayHead
        head = RayHead(1)
        head.address()
        print(head._proc.pid, flush=True)
        time.sleep(600)
        """
    )
    head_pid = int(proc.stdout.readline())
    assert _ray_processes(head_pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _gone(head_pid, 30), "the head kept running after its driver died"
    assert _no_ray_processes_after(head_pid, 30)


def test_a_head_closed_before_any_driver_used_it_returns_at_once_and_ray_shuts_down(monkeypatch):
    monkeypatch.setenv(ray_head.AUTH_MODE, "token")  # RayHead sets it for the process it runs in
    for seconds in (0.0, 1.5):  # before and during Ray's start
        head = ray_head.RayHead(1)
        time.sleep(seconds)
        head.close()
        assert head._proc.poll() is None  # close returned while the head was still starting or shutting down
        head._proc.wait(timeout=60)  # it shut down on its own (TimeoutExpired otherwise)
        assert _no_ray_processes_after(head._proc.pid, 30)


def test_a_ray_that_cannot_start_says_why_and_how_to_go_on(monkeypatch):
    monkeypatch.setenv(ray_head.AUTH_MODE, "token")  # RayHead sets it for the process it runs in
    head = ray_head.RayHead(-1)
    expected = r"did not start \(exit code 1\): ValueError: .*nonnegative.*--local"
    with pytest.raises(OVBatchError, match=expected):
        head.address()
    head.close()


def test_only_a_job_that_starts_its_own_ray_in_a_process_without_ray_gets_a_head(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert ray_head.wanted(JobConfig())
    assert not ray_head.wanted(JobConfig(local=True))
    assert not ray_head.wanted(JobConfig(ray=RayConfig(address="10.0.0.1:6379")))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert not ray_head.wanted(JobConfig())
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setitem(sys.modules, "ray", object())
    assert not ray_head.wanted(JobConfig())


def test_an_address_that_is_no_clusters_is_refused_at_once():
    """Ray retries an unreachable address for over ten minutes; a dashboard URL is a common mix-up."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        with pytest.raises(OVBatchError, match=rf"no Ray cluster answers at {address} \(RAY_ADDRESS: "):
            ray_head.check_reachable(address, "RAY_ADDRESS")
    with pytest.raises(OVBatchError, match="'http://127.0.0.1:8265' is a dashboard URL .* host:6379"):
        ray_head.check_reachable("http://127.0.0.1:8265", "ray.address")
    with pytest.raises(OVBatchError, match="'headnode' is not host:port"):
        ray_head.check_reachable("headnode", "ray.address")
    ray_head.check_reachable("auto", "RAY_ADDRESS")  # left to Ray
