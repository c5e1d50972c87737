"""A stand-in for `rollout serve` with only the weight-sync routes, for tests and benchmarks.

`EngineLoop` owns the engine in one thread (steps it, runs other threads' calls between
steps, drives a WeightReceiver), the way the real engine loop does; `DevServer` puts the
weight routes of DESIGN.md on it with the standard library's HTTP server, so a trainer in
another process can push with `WeightPusher` exactly as it would to the real server.
Not for production: no streaming, no generation routes, one JSON body per request.
"""

from __future__ import annotations

import hmac
import json
import queue
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rollout.config import SamplingParams
from weight_sync.errors import WeightSyncError
from weight_sync.receiver import WeightReceiver

MAX_BODY = 64 << 20


class EngineLoop:
    def __init__(self, engine, receiver: WeightReceiver | None = None, **receiver_kwargs):
        self.engine = engine
        self.receiver = receiver or WeightReceiver(engine, **receiver_kwargs)
        self.receiver.on_ready = self._wake_up
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, fn, *args, **kwargs) -> Future:
        """Run `fn` in the loop thread between steps."""
        fut: Future = Future()
        self._calls.put((fn, args, kwargs, fut))
        self._wake_up()
        return fut

    def call(self, fn, *args, timeout: float = 60, **kwargs):
        return self.submit(fn, *args, **kwargs).result(timeout)

    def add_request(self, prompt, params: SamplingParams, return_logprob: bool = False) -> Future:
        """Resolves to the engine's Request once admitted (held while generation is paused)."""
        fut: Future = Future()

        def admit() -> None:
            try:
                fut.set_result(self.engine.add_request(prompt, params, return_logprob=return_logprob))
            except Exception as e:  # noqa: BLE001
                fut.set_exception(e)

        def arrive() -> None:
            if self.receiver.gate.paused:
                self.receiver.gate.hold(admit)
            else:
                admit()

        self.submit(arrive)
        return fut

    def resume(self) -> dict:
        """`/continue_generation`: admit the requests held while paused."""
        def resume() -> None:
            for admit in self.receiver.gate.resume():
                admit()

        self.call(resume)
        return {"success": True}

    def generate(self, prompts: list, params: SamplingParams, timeout: float = 120) -> list:
        """Like Engine.generate, while the loop keeps serving weight updates."""
        reqs = [self.add_request(p, params).result(timeout) for p in prompts]
        self.wait_finished(reqs, timeout)
        return self.call(lambda: [[self.engine.output(s) for s in r.sequences] for r in reqs])

    def wait_finished(self, reqs, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.call(lambda: all(r.finished for r in reqs)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests did not finish within {timeout} s")
            time.sleep(0.005)

    def close(self) -> None:
        self._stop = True
        self._wake_up()
        self._thread.join(10)
        self.receiver.close()

    def _wake_up(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            self._wake.clear()
            while True:
                try:
                    fn, args, kwargs, fut = self._calls.get_nowait()
                except queue.Empty:
                    break
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001
                    fut.set_exception(e)
            self.receiver.at_step_boundary()
            if self.receiver.gate.may_step and self.engine.has_work:
                self.engine.step()
                self.steps += 1
            else:
                self._wake.wait(0.01)


class DevServer:
    """HTTP on 127.0.0.1 with the weight routes; `url` is where to point a WeightPusher."""

    def __init__(self, loop: EngineLoop, host: str = "127.0.0.1", port: int = 0, admin_key: str | None = None, timeout_s: float = 600):
        self.loop = loop
        rx = loop.receiver
        routes = {
            "/init_weights_update_group": rx.init_group,
            "/destroy_weights_update_group": rx.destroy_group,
            "/update_weights_from_distributed": rx.update_from_distributed,
            "/update_weights_from_disk": rx.update_from_disk,
            "/update_weights_from_tensor": rx.update_from_tensor,
            "/pause_generation": lambda mode="abort": rx.gate.pause(mode),
            "/flush_cache": rx.flush_cache,
        }
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if admin_key is None:
                    return True
                given = self.headers.get("Authorization", "")
                return hmac.compare_digest(given.encode(), f"Bearer {admin_key}".encode())

            def do_GET(self) -> None:
                if not self._authorized():
                    return self._reply(401, {"error": "admin key required"})
                if self.path == "/get_weight_version":
                    return self._reply(200, server.loop.call(rx.get_weight_version))
                self._reply(404, {"error": f"no route {self.path}"})

            def do_POST(self) -> None:
                if not self._authorized():
                    return self._reply(401, {"error": "admin key required"})
                n = int(self.headers.get("Content-Length", 0))
                if n > MAX_BODY:
                    return self._reply(413, {"error": f"body over {MAX_BODY} bytes"})
                try:
                    body = json.loads(self.rfile.read(n) or b"{}")
                    if not isinstance(body, dict):
                        raise ValueError("the body must be a JSON object")
                except ValueError as e:
                    return self._reply(400, {"error": f"malformed JSON: {e}"})
                if self.path == "/continue_generation":
                    return self._reply(200, server.loop.resume())
                fn = routes.get(self.path)
                if fn is None:
                    return self._reply(404, {"error": f"no route {self.path}"})
                try:
                    fut = server.loop.call(lambda: fn(**body))
                    self._reply(200, fut.result(timeout_s))
                except TypeError as e:
                    self._reply(400, {"error": f"bad fields for {self.path}: {e}"})
                except WeightSyncError as e:
                    self._reply(e.status, {"error": str(e)})

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://{host}:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="dev-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
