"""`rollout serve` in a child process: for recipes, benchmarks and tests that need a real server."""

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


@contextmanager
def launched_server(*serve_args: str, timeout: float = 900.0) -> Iterator[LaunchedServer]:
    """`rollout serve <serve_args>` on a free port, once /health answers; SIGTERM at the end."""
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="rollout-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "rollout", "serve", "--port", str(port), "--log-level", "warning", *serve_args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = LaunchedServer(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"rollout serve exited with {proc.returncode}:\n{server.log()}")
            try:
                if requests.get(server.url + "/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout serve not healthy after {timeout} s:\n{server.log()}")
            time.sleep(0.2)
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
