"""Run `rollout serve` as a real subprocess (front end + engine process) for a test module."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

from rollout.tools.launch import free_port, launched_server

__all__ = ["free_port", "running_server", "running_servers"]


@contextmanager
def running_server(model: str, *args: str, timeout: float = 300.0):
    """`rollout serve --model <model> --device cpu <args>`; SIGTERM at the end."""
    with running_servers((model, *args), timeout=timeout) as (server,):
        yield server


@contextmanager
def running_servers(*servers: tuple[str, ...], timeout: float = 300.0):
    """A `running_server` for each (model, *args), started side by side (each loads while the
    others do), once every one answers /health."""
    with ExitStack() as stack:
        started = [stack.enter_context(launched_server("--model", model, "--device", "cpu", *args, wait=False))
                   for model, *args in servers]
        for server in started:
            server.wait_healthy(timeout)
        try:
            yield started
        except BaseException:  # the servers' side of a failure (pytest shows it with the test's output)
            for server in started:
                print(f"---- {server.url}'s log, last 4,000 characters:\n{server.log()[-4000:]}")
            raise
