"""A local Ray for one `ovbatch submit` or `rerun`, started in a process of its own as soon as the command
has read its config, so that Ray's start (7.8 s on the H200 at b20e3f0) runs beside the command's
own imports and reading instead of after them. The job's driver connects to it (pipeline.ray_runner.connect)
and closes it at the end; the head also shuts Ray down when its stdin closes, so a driver that dies leaves
no Ray behind.

    python -m pipeline.ray_head NUM_CPUS   # prints Ray's GCS address, keeps Ray up until stdin closes
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from engine.errors import OVBatchError

if TYPE_CHECKING:
    from pipeline.config import JobConfig

# Ray (2.60 here) gives a cluster it starts token authentication unless RAY_AUTH_MODE says otherwise; a
# driver that connects to that cluster must be in the same mode before it imports Ray, which reads it then.
AUTH_MODE = "RAY_AUTH_MODE"
CLOSE_TIMEOUT_S = 30.0  # for Ray's shutdown once asked; then the head is killed
CONNECT_TIMEOUT_S = 10.0  # for a cluster address to answer


class RayHead:
    """The head process: address() waits for Ray to be up; close() shuts it down (idempotent)."""

    def __init__(self, num_cpus: int | None):
        os.environ.setdefault(AUTH_MODE, "token")  # what Ray gives a cluster it starts; the head inherits it
        self._errors = tempfile.TemporaryFile()  # Ray's start can fail loudly: kept for the error message
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.ray_head", str(num_cpus or 0)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._errors,
            text=True,
            # out of the terminal's process group: a Ctrl-C mid-start killed the head before Ray's agents
            # were its children, and left them running; the head stops when the driver closes its stdin
            start_new_session=True,
        )
        self._address: str | None = None

    def address(self) -> str:
        """Ray's GCS address, once the head has started Ray."""
        if self._address is None:
            line = self._proc.stdout.readline().strip()
            if not line:
                self._proc.wait()
                self._errors.seek(0)
                lines = self._errors.read().decode(errors="replace").strip().splitlines()
                last = lines[-1] if lines else "no message"
                raise OVBatchError(
                    f"the local Ray for this job did not start (exit code {self._proc.returncode}): {last}. "
                    "Pass --local to run without Ray, or --address for a running cluster."
                )
            self._address = line
        return self._address

    def close(self, wait: bool = True) -> None:
        """Shut Ray down. wait: until it is down, where a driver used it (a job that ended with nothing of it
        left running passes False: Ray's teardown then goes on after the command returns). A head not
        used yet (the job stopped before it needed Ray, or had nothing to run) finishes its start and shuts
        down on its own, unwaited."""
        if self._proc.stdin.closed:
            return
        self._proc.stdin.close()
        if wait and self._address is not None:
            try:
                self._proc.wait(CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc.stdout.close()  # an unused head's print then fails, which it takes as the driver gone
        self._errors.close()


def cluster_address(cfg: JobConfig) -> str | None:
    """The running cluster a job joins (ray.address, else RAY_ADDRESS); None: the job starts its own Ray."""
    return cfg.ray.address or os.environ.get("RAY_ADDRESS")


def check_reachable(address: str, given_as: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse, at once, an address that is no Ray cluster's (Ray retries one for over ten minutes): a
    dashboard URL, or a host:port that does not answer. `auto` is left to Ray."""
    if address == "auto":
        return
    if address.startswith(("http://", "https://")):
        raise OVBatchError(
            f"{given_as} {address!r} is a dashboard URL (the one `ray job submit` takes): give the cluster's "
            "GCS address, host:6379."
        )
    host, _, port = address.split("://")[-1].rpartition(":")
    if not host or not port.isdigit():
        raise OVBatchError(
            f"{given_as} {address!r} is not host:port: give the cluster's GCS address, host:6379."
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise OVBatchError(
            f"no Ray cluster answers at {address} ({given_as}: {e.strerror or e}): start the cluster or fix "
            "the address (host:6379), or pass --local to run in this process."
        ) from None


def wanted(cfg: JobConfig) -> bool:
    """Whether a job with this config starts a Ray of its own (not local, no cluster address) and this process
    can still take the head's authentication mode (it has not imported Ray: see AUTH_MODE)."""
    return not cfg.local and cluster_address(cfg) is None and "ray" not in sys.modules


@contextmanager
def own_ray(cfg: JobConfig, needed: bool = True) -> Iterator[RayHead | None]:
    """The job's own Ray, started now where wanted() and the command may run shards (else None), closed on
    leaving."""
    head = RayHead(cfg.ray.num_cpus) if needed and wanted(cfg) else None
    try:
        yield head
    finally:
        if head is not None:
            head.close()


def main() -> None:
    import ray

    num_cpus = int(sys.argv[1]) or None
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        print(ray.get_runtime_context().gcs_address, flush=True)
        sys.stdin.read()  # until the driver closes it, or dies
    except BrokenPipeError:  # the driver had gone before Ray was up
        pass
    ray.shutdown()


if __name__ == "__main__":
    main()
