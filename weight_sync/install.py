"""Weight sync inside the engine process: a WeightReceiver wired into rollout.engine_loop.EngineLoop.

    with install(loop):        # in rollout.engine_loop.main()
        loop.run()             # the receiver is closed (its groups torn down) when this ends

What it puts on the loop:
- one control op per weight route of weight_sync.routes (same names, the body as keyword
  arguments): each returns the receiver's Future, so the loop answers when the update is in
  (or has failed: WeightSyncError.status becomes the HTTP status) and keeps stepping meanwhile;
- `before_step` = `rx.at_step_boundary`: received weights are swapped in between two steps;
- `may_step`: the pause gate. `keep` holds requests in place; once nothing is left to hold
  (an update with abort_all_requests aborted them) a step runs, which only reports the
  aborted ones. `abort` and `wait` let steps run, so aborted requests report at once;
- `admit`: while paused, new requests are held (not refused); `/continue_generation`
  admits them in arrival order. A held request that is aborted meanwhile (its client left,
  or `/abort_request`) is admitted and aborted at once on continue, so it reports like any
  other aborted request (finish_reason abort, no tokens);
- `version_label` = `rx.version_label`: the trainer's version strings in every output;
- `stats` and `get_server_info`: the receiver's numbers merged in (its
  `rollout/weight_sync_s` is the whole push, receive and swap) plus the pause state.

No wake-up callback is needed: every receiver event resolves a pending control call, and
the loop checks those every BUSY_POLL_MS while any is pending.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from weight_sync.receiver import WeightReceiver


@contextmanager
def install(loop) -> Iterator[WeightReceiver]:
    """Wire a WeightReceiver into `loop` (an EngineLoop); closes it when the block exits."""
    engine = loop.engine
    rx = WeightReceiver(engine)
    gate = rx.gate
    held: set[str] = set()  # rids of the requests the gate holds
    cancelled: set[str] = set()  # ... and of those among them that were aborted while held

    admit, abort, abort_op = loop.admit, loop.abort, loop.handlers["abort_request"]
    stats_op, info_op = loop.handlers["stats"], loop.handlers["get_server_info"]

    def hold_or_admit(add: dict) -> dict | None:
        if not gate.paused:
            return admit(add)
        gate.hold(add)
        held.add(add["rid"])
        return None

    def abort_held_or_running(rid: str) -> bool:
        if rid in held:
            cancelled.add(rid)
            return True
        return abort(rid)

    def abort_request(args: dict) -> dict:
        result = abort_op(args)
        if args.get("abort_all"):
            result["aborted"] += sorted(held - cancelled)
            cancelled.update(held)
        return result

    def continue_generation(args: dict) -> dict:
        adds = gate.resume()
        aborts = [a["rid"] for a in adds if a["rid"] in cancelled]
        held.clear()
        cancelled.clear()
        loop.take_batch(adds, aborts)  # not paused any more: admitted as if they arrived now
        return {"success": True, "message": f"generation resumed; {len(adds)} held request(s) admitted"}

    def weight_stats() -> dict:
        return {**rx.stats(), "rollout/paused": int(gate.paused), "rollout/num_held": gate.num_held}

    def get_server_info(args: dict) -> dict:
        info = info_op(args)
        info["stats"].update(weight_stats())
        info["weight_sync"] = {
            "paused": gate.mode,
            "held_requests": gate.num_held,
            "updates_in_flight": rx.progress(),
            "last_update": rx.last_update,
            "last_error": rx.last_error,
        }
        return info

    loop.handlers.update(
        {
            "init_weights_update_group": lambda a: rx.init_group(**a),
            "destroy_weights_update_group": lambda a: rx.destroy_group(**a),
            "update_weights_from_distributed": lambda a: rx.update_from_distributed(**a),
            "update_weights_from_disk": lambda a: rx.update_from_disk(**a),
            "update_weights_from_tensor": lambda a: rx.update_from_tensor(**a),
            "pause_generation": lambda a: gate.pause(**a),
            "continue_generation": continue_generation,
            "flush_cache": lambda a: rx.flush_cache(),
            "get_weight_version": lambda a: rx.get_weight_version(),
            "abort_request": abort_request,
            "stats": lambda a: {**stats_op(a), **weight_stats()},
            "get_server_info": get_server_info,
        }
    )
    loop.before_step = rx.at_step_boundary
    loop.may_step = lambda: gate.may_step or not engine.scheduler.has_work
    loop.admit = hold_or_admit
    loop.abort = abort_held_or_running
    loop.version_label = rx.version_label
    try:
        yield rx
    finally:
        rx.close()

