"""A tensor-parallel rank's process (rank > 0), started by rank 0's engine
(rollout/engine/tensor_parallel.py):

    python -m rollout.engine.rank_process --config JSON --rank R --port P --fd F --parent-pid PID [--hooks module:function]
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import logging
import os
import signal
import threading
import time

from rollout.config import EngineConfig
from rollout.engine.engine import Engine, freeze_heap
from rollout.engine.tensor_parallel import WATCH_S

log = logging.getLogger("rollout")


def main(argv: list[str] | None = None) -> None:
    """A rank's process: build the engine's shard, then replay rank 0's calls until told to stop.
    `--hooks module:function`: called with the engine, returns handlers for the calls that are not
    the engine's (a server's weight receiver: rollout/server/engine_loop.py)."""
    p = argparse.ArgumentParser(prog="python -m rollout.engine.rank_process")
    for flag, kind in (("--config", str), ("--rank", int), ("--port", int), ("--fd", int), ("--parent-pid", int),
                       ("--hooks", str)):
        p.add_argument(flag, type=kind, required=flag != "--hooks")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [tp{args.rank}] %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints where a stuck rank waits
    _exit_with_parent(args.parent_pid)
    pipe = os.fdopen(args.fd, "rb")
    engine = Engine(config=EngineConfig.from_dict(json.loads(args.config)), tp_follower=(args.rank, args.port, pipe))
    freeze_heap()  # as rank 0's process does: no full collection stalls a step the others wait on
    handlers = {}
    if args.hooks:
        module, _, function = args.hooks.partition(":")
        handlers = getattr(importlib.import_module(module), function)(engine)
    try:
        engine.follow(handlers)
        engine.close()
    except EOFError:  # rank 0 is gone
        pass
    except BaseException:
        log.exception("tensor-parallel rank %d failed", args.rank)
        os._exit(1)
    os._exit(0)


def _exit_with_parent(parent_pid: int) -> None:
    """A rank whose rank 0 died would wait in a collective for ever: leave with it."""

    def loop() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_S)
        os._exit(1)

    threading.Thread(target=loop, name="rollout-tp-parent", daemon=True).start()


if __name__ == "__main__":
    main()
