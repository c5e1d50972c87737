"""Data parallelism on one machine, measured over HTTP: `rollout serve --dp-size M` for each M
against M = 1, speculation on and off, and optionally sglang-router in front of a DP1 server of its own.

    python bench/dp_runs.py --dp-sizes 1,2,4 --specs ngram,off --batch-sizes 512 --repeats 3
    python bench/dp_runs.py --dp-sizes 1 --specs ngram --router     # routing overhead: a server alone vs its twin behind the router
    python bench/dp_runs.py --dp-sizes 1 --specs off --router --workload decode --output-len 256   # the same, fixed lengths
    python bench/dp_runs.py --dp-sizes 1,4 --separate 4             # DP inside one server against 4 servers + router

Per spec mode, one server per dp size (and --separate one-GPU servers behind a router) is up at once (replica i of each on GPU i, KV pools sized
by --kv-cache-tokens so that they fit side by side), and `rollout bench --url` alternates
between them round by round. The workload is `rl` (64 prompts x 8 samples per 512, up to 2,048
new tokens, EOS stops); each batch size's warm-up rollout is the epoch before, kept in the
servers' drafters, so the timed rounds are a second epoch. Prints each row and the ratios.
`--workload decode` sends random prompts of one sample each and runs every sample to
--output-len: each target does the same work, so a ratio is the targets' speed alone, not the
lengths their samples drew (rl's rounds spread by up to 30%).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout.tools.cli import main as rollout_main  # noqa: E402
from rollout.tools.launch import launched_router, launched_server  # noqa: E402


def run(args: argparse.Namespace) -> list[dict]:
    from rollout.models.default_model import resolve_model_path

    if args.random_model:  # random weights of a speed shape (the default model's tokenizer)
        from rollout.tools.bench import speed_model_dir

        model, weights = speed_model_dir(args.random_model), ["--load-format", "dummy"]
    else:
        model, weights = str(resolve_model_path(args.model)), []  # once, before servers start side by side
    rows = []
    for spec in args.specs.split(","):
        with ExitStack() as stack:
            common = ["--model", model, *weights, "--spec", spec, "--max-running-seqs", str(args.max_running_seqs),
                      "--kv-cache-tokens", str(args.kv_cache_tokens)]

            def start(*extra: str):
                return stack.enter_context(launched_server(*common, *extra, wait=False))

            servers = {f"{spec}-dp{dp}": start("--dp-size", str(dp), "--tp-size", str(args.tp_size)) for dp in map(int, args.dp_sizes.split(","))}
            singles = [start("--base-gpu-id", str(i)) for i in range(args.separate)]  # one GPU each
            # The router's own server: in front of the dp1 one, its rollouts (the same seeds in a round)
            # would be in that server's n-gram history, and the later of the two would draft from them.
            routed_dp1 = start() if args.router else None
            for server in [*servers.values(), *singles, *([routed_dp1] if routed_dp1 else [])]:  # (they load side by side)
                server.wait_healthy(900)
            targets = [(label, server.url) for label, server in servers.items()]
            if routed_dp1:
                targets.append((f"{spec}-dp1-router", stack.enter_context(launched_router([routed_dp1.url])).url))
            if singles:
                routed = stack.enter_context(launched_router([s.url for s in singles]))
                targets.append((f"{spec}-{len(singles)}servers-router", routed.url))
            out = Path(args.out) / spec
            rollout_main(["bench", "--model", model, "--workload", args.workload, "--n", "8", "--batch-sizes", args.batch_sizes,
                          "--prompt-len", str(args.prompt_len),
                          "--temperature", args.temperature, "--repeats", str(args.repeats), "--out", str(out),
                          *(["--output-len", str(args.output_len)] if args.output_len else []),
                          "--url", ",".join(f"{label}={url}" for label, url in targets)])
            rows += json.loads(next(out.glob("*.json")).read_text())["rows"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--random-model", default=None, metavar="SHAPE",
                    help="random weights of a speed shape (rollout bench's), e.g. llama3-8b for --tp-size 2")
    ap.add_argument("--dp-sizes", default="1,2")
    ap.add_argument("--specs", default="ngram,off")
    ap.add_argument("--tp-size", type=int, default=1, help="each replica's tensor-parallel ranks (GPUs)")
    ap.add_argument("--workload", default="rl", choices=["rl", "decode"],
                    help="rl: prompts x 8 samples, EOS stops; decode: random prompts, every sample to --output-len")
    ap.add_argument("--prompt-len", type=int, default=256, help="decode's random prompt tokens")
    ap.add_argument("--batch-sizes", default="512")
    ap.add_argument("--temperature", default="0.7")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=None, help="max new tokens (default: rl's 2,048)")
    ap.add_argument("--max-running-seqs", type=int, default=512)
    ap.add_argument("--kv-cache-tokens", type=int, default=600_000)
    ap.add_argument("--router", action="store_true", help="also a twin of the dp1 server behind sglang-router (its overhead)")
    ap.add_argument("--separate", type=int, default=0, metavar="N",
                    help="also N one-GPU servers (GPUs 0..N-1) behind one sglang-router: data parallelism across servers")
    ap.add_argument("--out", default="bench/results/dp")
    args = ap.parse_args()
    rows = run(args)
    print("\n| target | batch | T | tok/s (median) | rounds | accept | vs dp1, same spec | vs off, same dp |")
    print("|---|---|---|---|---|---|---|---|")
    by = {(r["spec"], r["batch_size"], r["temperature"]): r["tokens_per_s"] for r in rows}
    for r in rows:
        spec, _, rest = r["spec"].partition("-")
        key = (r["batch_size"], r["temperature"])
        dp1 = by.get((f"{spec}-dp1", *key))
        off = by.get((f"off-{rest}", *key))
        print(f"| {r['spec']} | {r['batch_size']} | {r['temperature']} | {r['tokens_per_s']:,.0f} | {r['repeats']} | "
              f"{r['accept_rate']:.2f} | {r['tokens_per_s'] / dp1:.2f}x | "
              f"{(r['tokens_per_s'] / off) if off else float('nan'):.2f}x |" if dp1 else f"| {r['spec']} | ... |")


if __name__ == "__main__":
    main()
