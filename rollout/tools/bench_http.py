"""`rollout bench --url`: the same workloads sent over HTTP to running servers or a router.

Each target (`--url label=URL,...`; a bare URL is its own label) is whatever serves there: one
`rollout serve`, one with `--dp-size`, or sglang-router in front of several. Per batch size, a
warm-up rollout (other seeds) goes first: it compiles and captures, and it is the epoch before,
whose samples the servers' drafters keep. Then `--repeats` rounds alternate the targets, each a
rollout of the same prompts: one `/generate` per prompt with its `n` samples, all sent at once,
timed from the first send to the last answer. Rows report medians, as the in-process bench's.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import requests

from rollout.tools.bench import Row, bench_grid, markdown, median_rows, workload_prompts, write_results


def parse_targets(spec: str) -> list[tuple[str, str]]:
    """`a=http://h:1,http://h:2` -> [("a", "http://h:1"), ("http://h:2", "http://h:2")]."""
    out = []
    for item in filter(None, spec.split(",")):
        label, _, url = item.rpartition("=") if "=" in item else (item, "", item)
        out.append((label, url.rstrip("/")))
    return out


def rollout_over_http(url: str, label: str, args, prompts: list[list[int]], n: int, batch_size: int, seed: int) -> Row:
    """One rollout of `prompts` (n samples each) through `url`, timed."""
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=max(10, len(prompts))))

    def one(i: int) -> tuple[dict | list, float]:
        params = {"n": n, "temperature": args.temperature, "max_new_tokens": args.output_len,
                  "ignore_eos": args.workload == "decode" or args.ignore_eos, "sampling_seed": seed + i}
        r = session.post(url + "/generate", json={"input_ids": prompts[i], "sampling_params": params}, timeout=3600)
        r.raise_for_status()
        return r.json(), time.perf_counter()

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(one, range(len(prompts))))
    wall = time.perf_counter() - start
    samples = [s for body, _ in answers for s in (body if isinstance(body, list) else [body])]
    ends = sorted(t - start for _, t in answers)
    tokens = sum(s["meta_info"]["completion_tokens"] for s in samples)
    drafted = sum(s["meta_info"]["spec_draft_token_num"] for s in samples)
    accepted = sum(s["meta_info"]["spec_accept_token_num"] for s in samples)
    verify = sum(s["meta_info"]["spec_verify_ct"] for s in samples)
    return Row(
        workload=args.workload, system="http", spec=label, batch_size=batch_size, prompts=len(prompts), n=n,
        temperature=args.temperature, output_tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
        tail_s=ends[-1] - ends[int(0.9 * (len(ends) - 1))], accept_rate=accepted / drafted if drafted else 0.0,
        accept_length=tokens / verify if verify else 0.0,
    )  # fmt: skip


def cmd_bench_http(args) -> None:
    """`rollout bench --url ...` (the CLI sends a bench with --url here)."""
    from transformers import AutoTokenizer

    from rollout.models.default_model import resolve_model_path

    temperatures, batch_sizes = bench_grid(args)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    write_results(args, bench_over_http(args, tokenizer, temperatures, batch_sizes), [], batch_sizes)


def bench_over_http(args, tokenizer, temperatures: list[float], batch_sizes: list[int]) -> list[Row]:
    targets = parse_targets(args.url)
    runs: list[Row] = []
    for args.temperature in temperatures:
        for b in batch_sizes:
            prompts, n = workload_prompts(args, tokenizer, b)
            for label, url in targets:
                rollout_over_http(url, label, args, prompts, n, b, seed=args.seed + 10_000)
            for r in range(args.repeats):
                for label, url in targets:
                    runs.append(rollout_over_http(url, label, args, prompts, n, b, seed=args.seed + 20_000 * r))
                    print(markdown(runs[-1:]).splitlines()[-1], flush=True)
    rows = median_rows(runs)
    base = {(r.temperature, r.batch_size): r.tokens_per_s for r in rows if r.spec == targets[0][0]}
    for r in rows:
        print(f"{r.spec}: T={r.temperature} b{r.batch_size}: {r.tokens_per_s:.0f} tok/s, "
              f"{r.tokens_per_s / base[(r.temperature, r.batch_size)]:.2f}x {targets[0][0]}", flush=True)
    return rows
