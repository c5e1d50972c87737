"""`rollout serve`, and SGLang's router in front of servers, in child processes: for recipes,
benchmarks and tests that need real ones."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchedServer:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float) -> None:
        """Until /health answers 200 (RuntimeError with the log if the process exits or takes too long)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[:4]} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.proc.args[:4]} not healthy after {timeout} s:\n{self.log()}")
            time.sleep(0.2)

    def wait_for_workers(self, urls: list[str], timeout: float) -> None:
        """Until a router's /workers lists every one of `urls`: it answers /health before it has
        added them, and a push through it (WeightPusher reads /workers) would reach none."""
        deadline = time.monotonic() + timeout
        while True:
            listed = {w["url"] for w in requests.get(self.url + "/workers", timeout=5).json()["workers"]}
            if listed >= set(urls):
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the router lists {sorted(listed)} of {urls} after {timeout} s:\n{self.log()}")
            time.sleep(0.2)


@contextmanager
def launched_server(*serve_args: str, host: str = "127.0.0.1", timeout: float = 900.0,
                    env: dict[str, str] | None = None, wait: bool = True) -> Iterator[LaunchedServer]:
    """`rollout serve <serve_args>` on `host` and a free port, once /health answers (`wait=False`: at
    once, to start several side by side and then `wait_healthy` each); SIGTERM at the end."""
    port = free_port()
    cmd = [sys.executable, "-m", "rollout", "serve", "--host", host, "--port", str(port), "--log-level", "warning",
           *serve_args]
    with launched_process(cmd, f"http://{host}:{port}", timeout if wait else None, env) as server:
        yield server


@contextmanager
def launched_router(worker_urls: list[str], policy: str = "cache_aware", timeout: float = 120.0) -> Iterator[LaunchedServer]:
    """SGLang's router (`python -m sglang_router.launch_router`, the `sglang-router` package) in
    front of `worker_urls` on a free port, once it answers /health and lists every worker; SIGTERM
    at the end."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--policy", policy, "--worker-urls", *worker_urls, "--log-level", "warn",
           "--prometheus-port", str(free_port())]  # (its default, 29000, is one port for every router on the host)
    with launched_process(cmd, f"http://127.0.0.1:{port}", timeout) as router:
        router.wait_for_workers(worker_urls, timeout)
        yield router


@contextmanager
def launched_process(cmd: list[str], url: str, timeout: float | None, env: dict[str, str] | None = None) -> Iterator[LaunchedServer]:
    """`cmd` started with this repository importable, serving at `url`: once it answers /health
    (unless `timeout` is None), SIGTERM at the end (then SIGKILL after 60 s); its output in a log."""
    log_path = Path(tempfile.mkstemp(prefix="rollout-launched-", suffix=".log")[1])
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = LaunchedServer(url, proc, log_path)
    try:
        if timeout is not None:
            server.wait_healthy(timeout)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log_path.unlink(missing_ok=True)
