"""How long `/get_server_info` (and `/health`, `/v1/loads`) take while a server is loaded: `--load`
requests are sent at once to a running `rollout serve` (one it starts, on the CPU unless told),
and each route is probed `--probes` times while they run, one probe at a time. A server this
starts is stopped after the probes, failing what is left of the load.

    python bench/server_info_latency.py --load 300 --probes 20            # the default model on the CPU
    python bench/server_info_latency.py --url http://127.0.0.1:30000      # a server already running
"""

import argparse
import statistics
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.tools.launch import launched_server  # noqa: E402

ROUTES = ("/get_server_info", "/health", "/v1/loads")


def flood(url: str, count: int, max_new_tokens: int) -> None:
    """`count` /generate requests at once (4 samples each), in daemon threads."""
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=count))

    def one(i: int) -> None:
        body = {"text": f"Count from {i} to {i + 40}, one number a line.",
                "sampling_params": {"n": 4, "temperature": 1.0, "max_new_tokens": max_new_tokens}}
        try:
            session.post(url + "/generate", json=body, timeout=3600)
        except requests.RequestException:  # (the server stopped under it)
            pass

    for i in range(count):
        threading.Thread(target=one, args=(i,), daemon=True).start()


def probe(url: str, route: str) -> float:
    """Seconds for one GET of `route`."""
    t0 = time.perf_counter()
    r = requests.get(url + route, timeout=60)
    r.raise_for_status()
    return time.perf_counter() - t0


def in_flight(url: str) -> int:
    return sum(x["num_total_reqs"] for x in requests.get(url + "/v1/loads", timeout=60).json()["loads"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start `rollout serve` on the CPU)")
    p.add_argument("--model", default="default")
    p.add_argument("--load", type=int, default=300, help="requests sent at once")
    p.add_argument("--probes", type=int, default=20, help="probes of each route while they run")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()

    serving = nullcontext(None) if args.url else launched_server("--model", args.model, "--device", "cpu")
    with serving as server:
        url = args.url or server.url
        flood(url, args.load, args.max_new_tokens)
        deadline = time.monotonic() + 120
        while in_flight(url) < args.load:
            if time.monotonic() > deadline:
                sys.exit(f"the server holds {in_flight(url)} of {args.load} requests after 120 s")
            time.sleep(0.05)
        times: dict[str, list[float]] = {route: [] for route in ROUTES}
        held = []
        for _ in range(args.probes):
            held.append(in_flight(url))
            for route in ROUTES:
                times[route].append(probe(url, route))
    print(f"{args.load} requests sent at once; requests in flight at each probe: {min(held)}-{max(held)}")
    print("| route | probes | median s | p99 s | max s |")
    print("|---|---|---|---|---|")
    for route, t in times.items():
        p99 = statistics.quantiles(t, n=100, method="inclusive")[98] if len(t) > 1 else t[0]
        print(f"| {route} | {len(t)} | {statistics.median(t):.3f} | {p99:.3f} | {max(t):.3f} |")


if __name__ == "__main__":
    main()
