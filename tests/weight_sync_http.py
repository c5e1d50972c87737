"""What the weight-sync tests ask a running `rollout serve` (tests/server_process.py) over HTTP."""

from __future__ import annotations

import time
from collections.abc import Callable

import requests


class ServerApi:
    """A running server as the tests see it: weight/control routes with `admin` headers, generation, stats."""

    def __init__(self, url: str, admin: dict | None = None):
        self.url = url
        self.admin = admin or {}

    def post(self, route: str, body: dict | None = None, headers: dict | None = None, timeout: float = 60) -> requests.Response:
        headers = self.admin if headers is None else headers
        return requests.post(self.url + route, json=body, headers=headers, timeout=timeout)

    def generate(self, prompts: list[list[int]], params: dict, rids: list[str] | None = None, timeout: float = 120) -> list[dict]:
        """One /generate call for a batch of token-id prompts: the flat list of samples (prompt-major)."""
        body = {"input_ids": prompts, "sampling_params": params, **({"rid": rids} if rids else {})}
        r = requests.post(self.url + "/generate", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()

    def tokens(self, prompts: list[list[int]], params: dict) -> list[list[int]]:
        return [s["output_ids"] for s in self.generate(prompts, params)]

    def weight_version(self) -> str:
        r = requests.get(self.url + "/get_weight_version", headers=self.admin, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["weight_version"]

    def info(self) -> dict:
        return requests.get(self.url + "/get_server_info", timeout=30).json()

    def stats(self) -> dict:
        return self.info()["stats"]

    def output_tokens(self) -> int:
        return self.stats()["rollout/output_tokens"]


def versions(sample: dict) -> list[int]:
    """A sample's per-token weight versions (integer labels) as ints."""
    return [int(v) for v in sample["meta_info"]["output_token_weight_versions"]]


def error(r: requests.Response) -> str:
    return r.json()["error"]["message"]


def wait_for(condition: Callable[[], bool], timeout: float = 30, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout} s"
        time.sleep(0.005)
