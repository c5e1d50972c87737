"""Where half precision's logprob noise comes from: one float32 island at a time, on the CPU.

    python bench/numerics_ablation.py [--samples 16] [--tokens 192] [--dtypes bfloat16,float16]

The default model (transformers' Llama, eager attention) in float32 samples completions of the
bench's arithmetic prompts at T=1 and teacher-forces them: the trainer. The same model in the
serving dtype teacher-forces the same tokens with each island kept in float32, alone and all
together, and the table gives the mismatch against the trainer (rollout.tools.mismatch):

- residual: the residual stream between sublayers (each sublayer still reads and writes the dtype);
- norm: each RMSNorm's output, weight times normalised input, rounded once (transformers rounds the
  normalised input to the dtype, then the product);
- rope: the rotary embedding's cos, sin and products (transformers rounds cos and sin to the dtype);
- attention: scores, softmax and the weighted sum of values (transformers rounds the softmax to the
  dtype before the sum);
- lm_head: the final norm's output and the LM head's weight and product;
- lm_head_input: the same with the LM head's weight as served (rounded to the dtype), read by a
  float32 product: an island that costs no weight bytes;

and last, every activation in float32 with only the weights rounded to the dtype: the floor of any
design that serves weights in that dtype; then the same with the KV cache in the dtype (keys and
values rounded as a cache in the dtype holds them; keys before the rotary embedding, where a hook sees
them), and with each product's input also rounded to tf32 (10 bits of mantissa, what tensor cores
read from float32 inputs) or read as two rows in the dtype (the value and its rounding remainder, as
--enable-fp32-lm-head reads the LM head's input) or rounded to the dtype (only the products' outputs
in float32): what serving weights in the dtype with float32 activations through such products would give.

This is transformers' arithmetic, not the engine's kernels (which accumulate every product in float32
and round where transformers does): it says which rounding carries the noise, so that an island is
built where it pays.
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch
import transformers.models.llama.modeling_llama as llama
from transformers import AutoModelForCausalLM

from rollout.models.default_model import ensure_default_model
from rollout.tools.mismatch import mismatch_stats, teacher_forced_logprobs

ISLANDS = ("residual", "norm", "rope", "attention", "lm_head")
# the islands a kernel can keep without reading more weight bytes: the residual stream, and the LM
# head's product from a float32 input over the weights as served
FREE = ("residual", "lm_head_input")


def arithmetic_prompts(tokenizer, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        a, b = torch.randint(10, 999, (2,), generator=g).tolist()
        out.append(tokenizer.encode(f"Question: what is {a} + {b}? Think step by step, then answer.\nAnswer:"))
    return out


@contextlib.contextmanager
def islands(model, names: set[str], low: torch.dtype, master_head: torch.nn.Module):
    """The model (in `low`) with these parts computed in float32 for the duration (`master_head`: the
    trainer's float32 LM head, for the lm_head island)."""
    saved = {"rope": llama.apply_rotary_pos_emb, "attention": llama.eager_attention_forward,
             "rotary": llama.LlamaRotaryEmbedding.forward, "norm": llama.LlamaRMSNorm.forward,
             "layer": llama.LlamaDecoderLayer.forward}
    lm_head, final_norm = model.lm_head, model.model.norm
    rotary_forward = saved["rotary"]

    def rotary(self, x, position_ids):
        cos, sin = rotary_forward(self, x.float(), position_ids)
        return (cos, sin) if "rope" in names else (cos.to(x.dtype), sin.to(x.dtype))

    def rope(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.float().unsqueeze(unsqueeze_dim), sin.float().unsqueeze(unsqueeze_dim)
        rot = lambda x: ((x.float() * cos) + (llama.rotate_half(x.float()) * sin)).to(x.dtype)  # noqa: E731
        return rot(q), rot(k)

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key, value = llama.repeat_kv(key, module.num_key_value_groups), llama.repeat_kv(value, module.num_key_value_groups)
        scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask.float()
        out = torch.matmul(torch.softmax(scores, dim=-1), value.float())
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    def norm(self, hidden_states):  # weight x normalised input, rounded once, to the input's dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * x).to(hidden_states.dtype)

    def layer(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
              position_embeddings=None, **kwargs):
        residual = hidden_states.float()
        h = self.input_layernorm(residual).to(low)
        h, _ = self.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                              use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        residual = residual + h.float()
        h = self.mlp(self.post_attention_layernorm(residual).to(low))
        return residual + h.float()

    head_fp32 = bool({"lm_head", "lm_head_input"} & names)

    class FinalNorm(torch.nn.Module):  # the last norm's output: float32 for a float32 LM head, else the dtype
        def forward(self, hidden_states):
            out = final_norm(hidden_states.float() if head_fp32 else hidden_states)
            return out.float() if head_fp32 else out.to(low)

    llama.LlamaRotaryEmbedding.forward = rotary
    if "rope" in names:
        llama.apply_rotary_pos_emb = rope
    if "attention" in names:
        llama.eager_attention_forward = attention
    if "norm" in names:
        llama.LlamaRMSNorm.forward = norm
    if "residual" in names:
        llama.LlamaDecoderLayer.forward = layer
    model.model.norm = FinalNorm()
    if head_fp32:  # the master weight (lm_head), or the served weight's values in float32 (lm_head_input)
        model.lm_head = master_head if "lm_head" in names else copy.deepcopy(lm_head).float()
    try:
        yield model
    finally:
        llama.apply_rotary_pos_emb, llama.eager_attention_forward = saved["rope"], saved["attention"]
        llama.LlamaRotaryEmbedding.forward, llama.LlamaRMSNorm.forward = saved["rotary"], saved["norm"]
        llama.LlamaDecoderLayer.forward = saved["layer"]
        model.lm_head, model.model.norm = lm_head, final_norm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)  # each (end of sequence held off: a long sample's tokens)
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--configs", default="each,all,free", help="each island alone, all five, the free two together")
    args = ap.parse_args()
    torch.manual_seed(0)
    path = ensure_default_model()
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    from transformers import AutoTokenizer

    prompts = arithmetic_prompts(AutoTokenizer.from_pretrained(path), args.samples)
    completions = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = trainer.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                   top_p=1.0, max_new_tokens=args.tokens, min_new_tokens=args.tokens)
            completions.append(out[0, len(p):].tolist())
        reference = torch.cat(teacher_forced_logprobs(trainer, prompts, completions))
    wanted = args.configs.split(",")
    configs = ([()] + ([(name,) for name in (*ISLANDS, "lm_head_input")] if "each" in wanted else [])
               + ([ISLANDS] if "all" in wanted else []) + ([FREE] if "free" in wanted else []))
    print(f"{len(completions)} samples, {reference.numel()} tokens, default model (transformers, eager attention, CPU)")
    print("| dtype | float32 islands | mean abs diff | p99 | max | mean vs none |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        low = getattr(torch, dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=low, attn_implementation="eager").eval()
        base = None
        for names in configs:
            with torch.no_grad(), islands(model, set(names), low, trainer.lm_head):
                got = torch.cat(teacher_forced_logprobs(model, prompts, completions))
            s = mismatch_stats(reference, got)
            base = base or s["logprob_mismatch_mean"]
            print(f"| {dtype} | {', '.join(names) or 'none'} | {s['logprob_mismatch_mean']:.4f} | "
                  f"{s['logprob_mismatch_p99']:.4f} | {s['logprob_mismatch_max']:.3f} | "
                  f"{s['logprob_mismatch_mean'] / base:.2f} |", flush=True)
        # the floor of serving weights in this dtype: its weights, every activation in float32
        rounded = copy.deepcopy(trainer)
        with torch.no_grad():
            for p in rounded.parameters():
                p.copy_(p.to(low).float())
        for label, rounding in (("everything but the weights", ()),
                                ("everything but the weights and the KV cache", ("kv",)),
                                ("the same, each product's input in tf32", ("kv", "tf32")),
                                ("the same, each product's input as two rows in the dtype", ("kv", "split")),
                                ("the same, each product's input in the dtype (its output float32)", ("kv", "input"))):
            with torch.no_grad(), rounded_activations(rounded, low, set(rounding)):
                got = torch.cat(teacher_forced_logprobs(rounded, prompts, completions))
            s = mismatch_stats(reference, got)
            print(f"| {dtype} | {label} | {s['logprob_mismatch_mean']:.4f} | "
                  f"{s['logprob_mismatch_p99']:.4f} | {s['logprob_mismatch_max']:.3f} | "
                  f"{s['logprob_mismatch_mean'] / base:.2f} |", flush=True)
        del model, rounded


def to_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 rounded to tf32's 10 mantissa bits (to nearest, ties away: the 13 low bits dropped)."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + (1 << 12)) & ~((1 << 13) - 1)).view(torch.float32)


def split_rows(x: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """What a product over weights in `low` sees of a float32 input read as two rows in `low`, the value and its
    rounding remainder, their products summed in float32 (--enable-fp32-lm-head's product): 16 of float32's 24
    mantissa bits in bf16."""
    hi = x.to(low).float()
    return hi + (x - hi).to(low).float()


@contextlib.contextmanager
def rounded_activations(model, low: torch.dtype, what: set[str]):
    """A float32 model with `kv`: keys and values rounded to `low` as a cache in it holds them;
    `tf32`: every hidden product's input (not the LM head's) rounded to tf32; `split`: read as `split_rows`;
    `input`: rounded to `low`."""
    hooks = []
    for name, module in model.model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if "tf32" in what:
            hooks.append(module.register_forward_pre_hook(lambda m, args: (to_tf32(args[0]),)))
        if "input" in what:
            hooks.append(module.register_forward_pre_hook(lambda m, args: (args[0].to(low).float(),)))
        if "split" in what:
            hooks.append(module.register_forward_pre_hook(lambda m, args: (split_rows(args[0], low),)))
        if "kv" in what and name.endswith(("k_proj", "v_proj")):
            hooks.append(module.register_forward_hook(lambda m, args, out: out.to(low).float()))
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()


if __name__ == "__main__":
    main()
