"""`rollout` command line: generate (and the subcommands other modules register)."""

from __future__ import annotations

import argparse
import json
import sys

from rollout.config import EngineConfig, SamplingParams


def cmd_generate(args: argparse.Namespace) -> None:
    from rollout.engine.engine import Engine
    from rollout.tools.datasets import chat_prompt_ids

    eng = Engine(config=EngineConfig.from_args(args))
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    inputs = [chat_prompt_ids(eng.tokenizer, p) for p in prompts] if args.chat else prompts
    params = SamplingParams.from_args(args)
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


def cmd_bench(args: argparse.Namespace) -> None:
    from rollout.tools.bench import cmd_bench as run  # (torch: not for every command)

    run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout", description="RL-rollout generation with n-gram tree speculation")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions for prompts (arguments or stdin lines)")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: one per stdin line")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="one JSON object per output, logprobs included")
    SamplingParams.add_args(g.add_argument_group("sampling"))
    EngineConfig.add_args(g)
    g.set_defaults(func=cmd_generate)

    from rollout.tools.bench_args import add_bench_parser
    add_bench_parser(sub).set_defaults(func=cmd_bench)
    missing = _missing_server_package()
    if missing is None:
        from rollout.server.app import add_serve_parser

        add_serve_parser(sub)
    else:  # a machine without the server's packages can still generate and bench
        sub.add_parser("serve", help=f"unavailable: {missing} is not installed", add_help=False)
    return parser


def _missing_server_package() -> str | None:
    try:
        import rollout.server.app  # noqa: F401
    except ImportError as e:
        return e.name
    return None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"] and (missing := _missing_server_package()) is not None:  # whatever its arguments
        sys.exit(f"rollout serve needs the package {missing}: pip install fastapi uvicorn pyzmq msgpack")
    args = build_parser().parse_args(argv)
    args.command_line = "rollout " + " ".join(argv)
    if getattr(args, "url", None) and args.command == "bench":  # the workload over HTTP, not in this process
        from rollout.tools.bench_http import cmd_bench_http

        args.func = cmd_bench_http
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"rollout: error: {e}")


if __name__ == "__main__":
    main()
