"""Run `rollout serve` as a real subprocess (front end + engine process) for a test module."""

from __future__ import annotations

from contextlib import contextmanager

from rollout.tools.launch import free_port, launched_server

__all__ = ["free_port", "running_server"]


@contextmanager
def running_server(model: str, *args: str, timeout: float = 300.0):
    """`rollout serve --model <model> --device cpu <args>`; SIGTERM at the end."""
    with launched_server("--model", model, "--device", "cpu", *args, timeout=timeout) as server:
        yield server
