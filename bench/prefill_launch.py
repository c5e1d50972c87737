"""Host time against device time of an eager prefill step (prefill steps run without CUDA graphs).

    python bench/prefill_launch.py [--prompts 8] [--n 8] [--running 192] [--no-pdl] [--blas cublas|cublaslt]
    python bench/prefill_launch.py --products     # cuBLAS's host time per product, by what is new to it

Admits P arithmetic prompts of n samples while R other sequences decode (as in the grpo
workload, where groups join a running batch), and times each eager forward the engine runs:
the host's time to queue it (the device idle before it) and the time until the device is done.
If the two are close, the host is what bounds a prefill step. The second forward runs under
torch's profiler, whose table of host time by operation comes first.

`--products`: the host time of `F.linear` (bf16, the default model's four layer shapes, 30
layers' weights) per call, when the row count M was seen before and when every pass over
the layers brings a new one, as successive prefill steps do; `--in-engine` runs them in a
process with the engine built, on its model's weights, in inference mode.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from kernels import fused, pdl
from rollout import Engine, SamplingParams
from rollout.datasets import arithmetic_tasks, chat_prompt_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--running", type=int, default=192, help="sequences decoding when the prompts arrive")
    ap.add_argument("--blas", choices=["default", "cublas", "cublaslt"], default="default",
                    help="torch.backends.cuda.preferred_blas_library for the products cuBLAS serves")
    ap.add_argument("--products", action="store_true", help="time cuBLAS's host cost per product instead")
    ap.add_argument("--no-pdl", action="store_true", help="no programmatic dependent launch (kernels/pdl.py)")
    ap.add_argument("--in-engine", action="store_true",
                    help="--products with an engine built, on its model's weights, in inference mode")
    args = ap.parse_args()
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    if args.products:
        return product_host_time(args.in_engine)
    eng = Engine(spec="off", kv_cache_tokens=200_000, pdl=not args.no_pdl)
    tasks = arithmetic_tasks(args.prompts + args.running, seed=0)
    prompts = [chat_prompt_ids(eng.tokenizer, t.question) for t in tasks]
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=256, ignore_eos=True, seed=0)
    eng.generate(prompts[: args.prompts], params)  # warm up

    timings = []
    forward = eng.runner.forward

    def timed_forward(step, *a, **k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if len(timings) == 1:  # the second eager forward, under the profiler: where its host time goes
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = forward(step, *a, **k)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
        else:
            out = forward(step, *a, **k)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        timings.append((step.input_ids.shape[0], (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3))
        return out

    eng.runner.forward = timed_forward
    running = [eng.add_request(p, SamplingParams(n=1, temperature=1.0, max_new_tokens=64, ignore_eos=True, seed=1))
               for p in prompts[args.prompts : args.prompts + args.running]]
    for _ in range(8):
        eng.step()
    reqs = [eng.add_request(p, params) for p in prompts[: args.prompts]]
    while not all(r.finished for r in reqs + running):
        eng.step()
    for tokens, host, total in timings:
        print(f"eager forward of {tokens:5d} tokens: host {host:6.2f} ms, until the device is done {total:6.2f} ms")


def product_host_time(in_engine: bool) -> None:
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down (N, K)
    layers = [[torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for n, k in shapes] for _ in range(30)]
    if in_engine:  # the same products in the engine's process, on its weights
        eng = Engine(spec="off", kv_cache_tokens=20_000)
        layers = [[lay.self_attn.qkv_proj.weight, lay.self_attn.o_proj.weight, lay.mlp.gate_up_proj.weight,
                   lay.mlp.down_proj.weight] for lay in eng.model.model.layers]
        print("threads:", [t.name for t in threading.enumerate()])

    def one_pass(m: int, between=None) -> float:
        """Host microseconds per product over the layers (`between(x)`: launched after each product)."""
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for _, k in shapes}
        torch.cuda.synchronize()
        spent = 0.0
        for weights in layers:
            for w in weights:
                t0 = time.perf_counter()
                y = F.linear(xs[w.shape[1]], w)
                spent += time.perf_counter() - t0
                if between is not None:
                    between(y)
        torch.cuda.synchronize()
        return spent / (len(layers) * len(shapes)) * 1e6

    with torch.inference_mode(in_engine):  # the engine launches its steps in inference mode
        one_pass(600)
        print(f"30 layers x 4 products, M = 600 again:          {one_pass(600):6.1f} us of host time per product")
        print(f"30 layers x 4 products, M = 601 (new):           {one_pass(601):6.1f} us")
        print(f"30 layers x 4 products, M = 601 again:          {one_pass(601):6.1f} us")
        news = [one_pass(700 + m) for m in range(8)]
        print(f"8 passes, a new M each (700-707), median:        {sorted(news)[4]:6.1f} us")
        # as in the decoder, other kernels run between the products: a torch one, or one of ours (Triton)
        torch_op = lambda y: y.mul_(1.0)  # noqa: E731
        triton_op = lambda y: fused.rms_norm(y, torch.ones(y.shape[1], dtype=y.dtype, device="cuda"), 1e-5)  # noqa: E731
        pdl_before = pdl.enabled()  # (an engine turns it on)
        one_pass(600, torch_op)  # warm up (the Triton kernel compiles, with and without PDL)
        for on in (False, True):
            pdl.set_enabled(on)
            one_pass(600, triton_op)
        print(f"M = 600, a torch kernel after each product:      {one_pass(600, torch_op):6.1f} us")
        pdl.set_enabled(False)
        print(f"M = 600, a Triton kernel after each product:     {one_pass(600, triton_op):6.1f} us")
        pdl.set_enabled(True)
        print(f"M = 600, the same launched with PDL:             {one_pass(600, triton_op):6.1f} us")
        pdl.set_enabled(pdl_before)


if __name__ == "__main__":
    main()
