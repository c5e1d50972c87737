"""`/pause_generation` and `/continue_generation`: SGLang's three pause modes, engine side.

- `abort`: every in-flight request is aborted now and returns what it has, with
  finish_reason abort (the engine hands them back on its next step).
- `wait`: in-flight requests run to completion; the pause is in effect once none is left.
- `keep`: in-flight requests stay where they are; the engine stops stepping. A weight
  update applied meanwhile recomputes their KV (unless it was asked not to flush the cache),
  and after `resume()` they continue under the new weights.

In every mode, requests that arrive while paused are held (not rejected) and handed back
by `resume()` for the loop to admit. A held request aborted meanwhile is handed back too,
marked cancelled, so it reports like any other aborted request (finish_reason abort, no
tokens). The gate never steps the engine; the loop asks `may_step`.
"""

from __future__ import annotations

from concurrent.futures import Future

from rollout.server.protocol import AddRequest
from weight_sync.errors import WeightSyncError

MODES = ("abort", "wait", "keep")


class PauseGate:
    def __init__(self, engine):
        self.engine = engine
        self.mode: str | None = None
        self._held: list[AddRequest] = []  # in arrival order
        self._cancelled: set[str] = set()  # rids of held requests aborted meanwhile
        self._waiters: list[tuple[Future, int]] = []  # (future, requests it aborted)

    @property
    def paused(self) -> bool:
        return self.mode is not None

    @property
    def may_step(self) -> bool:
        """False while requests are held in place (`keep`)."""
        return self.mode != "keep"

    @property
    def num_held(self) -> int:
        return len(self._held)

    def hold(self, add: AddRequest) -> None:
        if not self.paused:
            raise RuntimeError("hold() while not paused: admit the request instead")
        self._held.append(add)

    def cancel(self, rid: str) -> bool:
        """Abort a held request; False if none is held under `rid`."""
        if all(add.rid != rid for add in self._held):
            return False
        self._cancelled.add(rid)
        return True

    def cancel_all(self) -> list[str]:
        """Abort every held request; returns the rids not cancelled before."""
        rids = [add.rid for add in self._held if add.rid not in self._cancelled]
        self._cancelled.update(rids)
        return rids

    def pause(self, mode: str = "abort") -> Future:
        """Resolves to {"success", "mode", "aborted"} once the pause is in effect (see the modes above)."""
        fut: Future = Future()
        if mode not in MODES:
            fut.set_exception(WeightSyncError(f"pause mode {mode!r}: choose {', '.join(MODES)}"))
            return fut
        self.mode = mode
        aborted = self.engine.abort_all() if mode == "abort" else []
        self._waiters.append((fut, len(aborted)))
        self.tick()
        return fut

    def resume(self) -> tuple[list[AddRequest], list[str]]:
        """Leave the pause; returns the held requests in arrival order and the rids of those cancelled."""
        self.mode = None
        for fut, aborted in self._waiters:
            fut.set_result({"success": True, "mode": None, "aborted": aborted, "message": "resumed"})
        self._waiters = []
        held, cancelled = self._held, sorted(self._cancelled)
        self._held, self._cancelled = [], set()
        return held, cancelled

    def tick(self) -> None:
        """Call at every step boundary: resolves pauses that are now in effect."""
        if self._waiters and (self.mode == "keep" or not self.engine.requests):
            for fut, aborted in self._waiters:
                fut.set_result({"success": True, "mode": self.mode, "aborted": aborted, "message": f"paused ({self.mode})"})
            self._waiters = []
