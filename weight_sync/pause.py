"""`/pause_generation` and `/continue_generation`: SGLang's three pause modes, engine side.

- `abort`: every in-flight request is aborted now and returns what it has, with
  finish_reason abort (the engine hands them back on its next step).
- `wait`: in-flight requests run to completion; the pause is in effect once none is left.
- `keep`: in-flight requests stay where they are; the engine stops stepping. A weight
  update applied meanwhile recomputes their KV (unless it was asked not to flush the cache),
  and after `resume()` they continue under the new weights.

In every mode, requests that arrive while paused are held (not rejected) and handed back
by `resume()` for the loop to admit. The gate never calls `engine.step()` itself; the loop
asks `may_step`.
"""

from __future__ import annotations

from concurrent.futures import Future

from weight_sync.errors import WeightSyncError

MODES = ("abort", "wait", "keep")


class PauseGate:
    def __init__(self, engine):
        self.engine = engine
        self.mode: str | None = None
        self._held: list = []
        self._waiters: list[tuple[Future, int]] = []  # (future, requests it aborted)

    @property
    def paused(self) -> bool:
        return self.mode is not None

    @property
    def may_step(self) -> bool:
        """False while requests are held in place (`keep`)."""
        return self.mode != "keep"

    def hold(self, item) -> None:
        """Keep a new request (in whatever form the loop uses) until `resume()`."""
        if not self.paused:
            raise RuntimeError("hold() while not paused: admit the request instead")
        self._held.append(item)

    def pause(self, mode: str = "abort") -> Future:
        """Resolves to {"success", "mode", "aborted"} once the pause is in effect (see the modes above)."""
        fut: Future = Future()
        if mode not in MODES:
            fut.set_exception(WeightSyncError(f"pause mode {mode!r}: choose {', '.join(MODES)}"))
            return fut
        self.mode = mode
        aborted = self.abort_all() if mode == "abort" else []
        self._waiters.append((fut, len(aborted)))
        self.tick()
        return fut

    def abort_all(self) -> list[str]:
        """Abort every in-flight request; they come back from the engine's next step with finish_reason abort."""
        rids = [rid for rid, req in self.engine.requests.items() if not req.finished]
        for rid in rids:
            self.engine.abort(rid)
        return rids

    def resume(self) -> list:
        """Leave the pause; returns the requests held meanwhile, in arrival order, for the loop to admit."""
        self.mode = None
        for fut, aborted in self._waiters:
            fut.set_result({"success": True, "mode": None, "aborted": aborted, "message": "resumed"})
        self._waiters = []
        held, self._held = self._held, []
        return held

    def tick(self) -> None:
        """Call at every step boundary: resolves pauses that are now in effect."""
        if not self._waiters:
            return
        if self.mode == "keep" or not self.engine.requests:
            for fut, aborted in self._waiters:
                fut.set_result({"success": True, "mode": self.mode, "aborted": aborted, "message": f"paused ({self.mode})"})
            self._waiters = []

    @property
    def pending(self) -> bool:
        """A pause was asked for and is not in effect yet."""
        return bool(self._waiters)

    @property
    def num_held(self) -> int:
        return len(self._held)
