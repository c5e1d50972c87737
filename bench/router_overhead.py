"""What sglang-router alone adds to a rollout's requests, apart from the GPU's round-to-round noise:
a stand-in worker answers every `/generate` after `--hold` seconds with an rl-sized body (n samples
of 260 tokens, text and meta_info as `rollout serve` sends), and `--requests` requests sent at once
(as `rollout bench --url` sends a rollout) go to it directly and through the router, in turns.

    python bench/router_overhead.py --requests 256 --rounds 3
"""
# (no `from __future__ import annotations`: FastAPI reads the stand-in's route annotations)

import argparse
import asyncio
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.tools.launch import free_port, launched_process, launched_router  # noqa: E402


def serve_stand_in(port: int, hold: float) -> None:
    import uvicorn
    from fastapi import FastAPI, Request

    app = FastAPI()
    sample = {"text": "word " * 260, "output_ids": list(range(1000, 1260)),
              "meta_info": {"id": "x", "finish_reason": {"type": "stop"}, "prompt_tokens": 120, "completion_tokens": 260,
                            "weight_version": "0", "spec_draft_token_num": 90, "spec_accept_token_num": 40, "spec_verify_ct": 170}}

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/get_server_info")
    @app.get("/get_model_info")
    async def info() -> dict:
        return {"model_path": "stand-in"}

    @app.post("/generate")
    async def generate(request: Request) -> list:
        body = await request.json()
        await asyncio.sleep(hold)
        return [sample] * body["sampling_params"].get("n", 1)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def rollout_wall(url: str, count: int, n: int) -> float:
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=count))

    def one(i: int) -> None:
        body = {"input_ids": [5, 9, 13 + i, 7] * 30, "sampling_params": {"n": n, "max_new_tokens": 260, "sampling_seed": i}}
        session.post(url + "/generate", json=body, timeout=120).raise_for_status()

    start = time.perf_counter()
    with ThreadPoolExecutor(count) as pool:
        list(pool.map(one, range(count)))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--hold", type=float, default=1.0, help="seconds the stand-in worker holds each request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # (the stand-in worker's own process)
    args = ap.parse_args()
    if args.serve:
        return serve_stand_in(args.serve, args.hold)
    port = free_port()
    cmd = [sys.executable, __file__, "--serve", str(port), "--hold", str(args.hold)]
    with launched_process(cmd, f"http://127.0.0.1:{port}", 60) as worker, launched_router([worker.url]) as router:
        walls: dict[str, list[float]] = {"direct": [], "router": []}
        for _ in range(args.rounds):
            for label, url in (("direct", worker.url), ("router", router.url)):
                walls[label].append(rollout_wall(url, args.requests, args.n))
    direct, routed = statistics.median(walls["direct"]), statistics.median(walls["router"])
    print(f"{args.requests} requests of n={args.n}, held {args.hold} s: direct {direct:.3f} s, through sglang-router "
          f"{routed:.3f} s (medians of {args.rounds}): the router adds {routed - direct:+.3f} s")


if __name__ == "__main__":
    main()
