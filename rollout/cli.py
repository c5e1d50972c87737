"""`rollout` command line: generate (and the subcommands other modules register)."""

from __future__ import annotations

import argparse
import json
import sys

from rollout.config import EngineConfig, SamplingParams, SpecConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every subcommand that builds an engine."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a local HF directory")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="dummy = random weights")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-running-seqs", type=int, default=256)
    g.add_argument("--max-prefill-tokens", type=int, default=4096)
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool size in tokens (default: from memory)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=EngineConfig.kv_cache_memory_fraction,
                   help="share of free GPU memory the KV pool takes when --kv-cache-tokens is not given")
    g.add_argument("--no-cuda-graphs", action="store_true")
    g.add_argument("--no-overlap-schedule", action="store_true",
                   help="wait for each step's tokens before preparing the next (the overlap schedule is on by default)")
    g.add_argument("--no-pdl", action="store_true",
                   help="launch each kernel only after the one before it has finished (PDL is on by default on Hopper)")
    g.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("speculation")
    s.add_argument("--spec", default="auto", choices=["off", "ngram", "auto"], help="auto = best drafter available")
    s.add_argument("--spec-max-draft-tokens", type=int, default=SpecConfig.max_draft_tokens)
    s.add_argument("--spec-max-verify-tokens", type=int, default=SpecConfig.max_verify_tokens)
    s.add_argument("--spec-max-match", type=int, default=SpecConfig.max_match)
    s.add_argument("--spec-history-rows", type=int, default=SpecConfig.history_rows,
                   help="finished samples kept on the device for later rollouts of their prompt")
    s.add_argument("--spec-history-per-prompt", type=int, default=SpecConfig.history_per_prompt)
    s.add_argument("--spec-no-sibling-sharing", action="store_true")
    s.add_argument("--spec-no-adaptive", action="store_true",
                   help="draft the widest tree that fits every step instead of choosing by measured costs and acceptance")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        load_format=args.load_format,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        max_model_len=args.max_model_len,
        max_running_seqs=args.max_running_seqs,
        max_prefill_tokens=args.max_prefill_tokens,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        cuda_graphs=not args.no_cuda_graphs,
        overlap_schedule=not args.no_overlap_schedule,
        pdl=not args.no_pdl,
        seed=args.seed,
        spec=SpecConfig(
            method=args.spec,
            max_draft_tokens=args.spec_max_draft_tokens,
            max_verify_tokens=args.spec_max_verify_tokens,
            max_match=args.spec_max_match,
            history_rows=args.spec_history_rows,
            history_per_prompt=args.spec_history_per_prompt,
            share_siblings=not args.spec_no_sibling_sharing,
            adaptive=not args.spec_no_adaptive,
        ),
    )


def cmd_generate(args: argparse.Namespace) -> None:
    from rollout.datasets import chat_prompt_ids
    from rollout.engine import Engine

    eng = Engine(config=engine_config(args))
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    inputs = [chat_prompt_ids(eng.tokenizer, p) for p in prompts] if args.chat else prompts
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        stop=args.stop,
        seed=args.sample_seed,
    )
    outs = eng.generate(inputs, params, return_logprob=args.json)
    for prompt, group in zip(prompts, outs):
        for i, o in enumerate(group):
            if args.json:
                print(json.dumps({"prompt": prompt, "index": i, **o.__dict__}))
            else:
                print(f"--- [{i}] {o.finish_reason}, {len(o.token_ids)} tokens, accept length {o.spec['accept_length']:.2f}")
                print(o.text)
    if not args.json:
        stats = eng.stats()
        print(f"--- {stats['rollout/tokens_per_s']:.1f} tok/s, accept rate {stats['rollout/spec_accept_rate']:.2f}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout", description="RL-rollout generation with n-gram tree speculation")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions for prompts (arguments or stdin lines)")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: one per stdin line")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--stop", action="append")
    g.add_argument("--sample-seed", type=int, default=None)
    g.add_argument("--json", action="store_true", help="one JSON object per output, logprobs included")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    from rollout.bench import add_bench_parser
    add_bench_parser(sub)
    missing = _missing_server_package()
    if missing is None:
        from rollout.server import add_serve_parser

        add_serve_parser(sub)
    else:  # a machine without the server's packages can still generate and bench
        sub.add_parser("serve", help=f"unavailable: {missing} is not installed", add_help=False)
    return parser


def _missing_server_package() -> str | None:
    try:
        import rollout.server  # noqa: F401
    except ImportError as e:
        return e.name
    return None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"] and (missing := _missing_server_package()) is not None:  # whatever its arguments
        sys.exit(f"rollout serve needs the package {missing}: pip install fastapi uvicorn pyzmq msgpack")
    args = build_parser().parse_args(argv)
    args.command_line = "rollout " + " ".join(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"rollout: error: {e}")


if __name__ == "__main__":
    main()
