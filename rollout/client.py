"""Clients for a rollout server (or any SGLang-compatible `/generate`): sync and asyncio.

    from rollout.client import RolloutClient
    client = RolloutClient("http://127.0.0.1:30000")
    groups = client.generate(["2+2=?", "3+5=?"], {"temperature": 1.0, "max_new_tokens": 64}, n=8)
    groups[1][3].token_ids, groups[1][3].logprobs, groups[1][3].weight_versions

Prompts go out in chunks of `batch_size` per `/generate` call, `max_concurrency` calls at a
time, so the server's engine sees the whole workload at once. A call that cannot reach the
server (refused, reset, dropped before the answer) is retried with backoff; an HTTP error
answer (4xx/5xx) never is: it raises `RolloutError`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import requests
from requests.adapters import HTTPAdapter

Prompts = str | list[int] | Sequence[str] | Sequence[list[int]]


@dataclass
class Sample:
    """One generated sample, as `/generate` reports it."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None  # of each token in token_ids (None unless return_logprob)
    weight_versions: list[str]  # the weight version that produced each token (the trainer's label, as weight_version)
    finish_reason: str  # stop | length | abort
    matched_stop: int | str | None  # the stop token id or string that ended it
    prompt_tokens: int
    weight_version: str  # the server's weight version when the sample finished
    rid: str
    spec: dict = field(default_factory=dict)  # verify_ct, accept_length, draft_token_num, accept_token_num

    @classmethod
    def from_result(cls, r: dict) -> "Sample":
        meta = r["meta_info"]
        finish = meta["finish_reason"] or {"type": "abort"}
        lps = meta.get("output_token_logprobs")
        return cls(
            text=r["text"],
            token_ids=r["output_ids"],
            logprobs=[lp for lp, _, _ in lps] if lps is not None else None,
            weight_versions=meta["output_token_weight_versions"],
            finish_reason=finish["type"],
            matched_stop=finish.get("matched"),
            prompt_tokens=meta["prompt_tokens"],
            weight_version=meta["weight_version"],
            rid=meta["id"],
            spec={k.removeprefix("spec_"): v for k, v in meta.items() if k.startswith("spec_")},
        )


class RolloutError(RuntimeError):
    """The server answered with an error status."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def _normalize(prompts: Prompts) -> tuple[list, str]:
    """A list of prompts and the field they go in (text or input_ids)."""
    if isinstance(prompts, str):
        return [prompts], "text"
    prompts = list(prompts)
    if not prompts:
        return [], "text"
    if all(isinstance(t, int) for t in prompts):
        return [prompts], "input_ids"
    if all(isinstance(p, str) for p in prompts):
        return prompts, "text"
    if all(isinstance(p, (list, tuple)) for p in prompts):
        return [list(p) for p in prompts], "input_ids"
    raise TypeError("prompts: a string, a list of token ids, or a list of either (not mixed)")


def _payloads(prompts: list, key: str, params: dict, return_logprob: bool, batch_size: int) -> list[dict]:
    return [
        {key: prompts[i : i + batch_size], "sampling_params": params, "return_logprob": return_logprob}
        for i in range(0, len(prompts), batch_size)
    ]


def _group(results: list[list[dict]], n: int) -> list[list[Sample]]:
    """Flat prompt-major results of each call -> one list of n samples per prompt."""
    flat = [Sample.from_result(r) for chunk in results for r in chunk]
    return [flat[i : i + n] for i in range(0, len(flat), n)]


def _error(status: int, body: str) -> RolloutError:
    try:
        err = json.loads(body)["error"]
        message = err["message"] if isinstance(err, dict) else str(err)
    except Exception:
        message = body[:500]
    return RolloutError(status, message)


def _params(sampling_params: dict | None, n: int | None) -> dict:
    params = dict(sampling_params or {})
    if n is not None:
        params["n"] = n
    return params


class _Base:
    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float = 3600.0,
        batch_size: int = 32,
        max_concurrency: int = 64,
        max_retries: int = 3,
        admin_key: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.batch_size = batch_size
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else self.headers

    def _backoff(self, attempt: int) -> float:
        return min(0.5 * 2**attempt, 8.0)


class RolloutClient(_Base):
    """Blocking client; `generate` runs its HTTP calls on a thread pool."""

    RETRY_ON = (requests.ConnectionError,)  # refused, reset, dropped; not timeouts, not HTTP errors

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 3600.0, **kwargs):
        super().__init__(url, api_key, timeout, **kwargs)
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=self.max_concurrency)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def generate(
        self,
        prompts: Prompts,
        sampling_params: dict | None = None,
        return_logprob: bool = True,
        n: int | None = None,
    ) -> list[list[Sample]]:
        """One list per prompt, n samples each (`n` overrides sampling_params["n"])."""
        params = _params(sampling_params, n)
        items, key = _normalize(prompts)
        payloads = _payloads(items, key, params, return_logprob, self.batch_size)
        if len(payloads) <= 1:
            results = [self._generate_call(p) for p in payloads]
        else:
            with ThreadPoolExecutor(min(self.max_concurrency, len(payloads))) as pool:
                results = list(pool.map(self._generate_call, payloads))
        return _group(results, params.get("n", 1))

    def _generate_call(self, payload: dict) -> list[dict]:
        out = self.request("POST", "/generate", payload)
        return out if isinstance(out, list) else [out]

    def request(self, method: str, path: str, payload: dict | None = None, admin: bool = False) -> Any:
        """One call, retried only when the server cannot be reached; JSON back, RolloutError on 4xx/5xx."""
        headers = self.admin_headers if admin else self.headers
        for attempt in range(self.max_retries + 1):
            try:
                r = self.session.request(method, self.url + path, json=payload, headers=headers, timeout=self.timeout)
                break
            except self.RETRY_ON:
                if attempt == self.max_retries:
                    raise
                time.sleep(self._backoff(attempt))
        if r.status_code >= 400:
            raise _error(r.status_code, r.text)
        return r.json() if r.content else None

    def health(self) -> bool:
        try:
            return self.session.get(self.url + "/health", timeout=10).status_code == 200
        except requests.RequestException:
            return False

    def wait_until_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url} is not healthy after {timeout:.0f} s")
            time.sleep(0.5)

    def server_info(self) -> dict:
        return self.request("GET", "/get_server_info")

    def abort(self, rid: str | None = None, abort_all: bool = False) -> dict:
        return self.request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all}, admin=True)

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncRolloutClient(_Base):
    """asyncio client with the same surface; use `async with` or call `aclose()`."""

    RETRY_ON = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 3600.0, **kwargs):
        super().__init__(url, api_key, timeout, **kwargs)
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=30.0), limits=limits)
        return self._client

    async def generate(
        self,
        prompts: Prompts,
        sampling_params: dict | None = None,
        return_logprob: bool = True,
        n: int | None = None,
    ) -> list[list[Sample]]:
        """One list per prompt, n samples each (`n` overrides sampling_params["n"])."""
        params = _params(sampling_params, n)
        items, key = _normalize(prompts)
        gate = asyncio.Semaphore(self.max_concurrency)

        async def call(payload: dict) -> list[dict]:
            async with gate:
                out = await self.request("POST", "/generate", payload)
            return out if isinstance(out, list) else [out]

        payloads = _payloads(items, key, params, return_logprob, self.batch_size)
        results = await asyncio.gather(*(call(p) for p in payloads))
        return _group(list(results), params.get("n", 1))

    async def request(self, method: str, path: str, payload: dict | None = None, admin: bool = False) -> Any:
        headers = self.admin_headers if admin else self.headers
        for attempt in range(self.max_retries + 1):
            try:
                r = await self.client.request(method, self.url + path, json=payload, headers=headers)
                break
            except self.RETRY_ON:
                if attempt == self.max_retries:
                    raise
                await asyncio.sleep(self._backoff(attempt))
        if r.status_code >= 400:
            raise _error(r.status_code, r.text)
        return r.json() if r.content else None

    async def health(self) -> bool:
        try:
            return (await self.client.get(self.url + "/health", timeout=10)).status_code == 200
        except httpx.HTTPError:
            return False

    async def wait_until_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not await self.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url} is not healthy after {timeout:.0f} s")
            await asyncio.sleep(0.5)

    async def server_info(self) -> dict:
        return await self.request("GET", "/get_server_info")

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> dict:
        return await self.request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all}, admin=True)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> "AsyncRolloutClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
