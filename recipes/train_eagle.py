"""Train an EAGLE-3 draft head for a target model on the target's own outputs (issue 25).

    python recipes/train_eagle.py --out heads/smol-eagle3                  # the default model, one GPU
    python recipes/train_eagle.py --out /tmp/head --prompts 8 --steps 4 --device cpu   # seconds (tests)

1. Self-distillation data: the engine samples responses at --temperature (RL's) to arithmetic
   and, with --sharegpt FILE, ShareGPT prompts; prompt and response are kept as token ids.
2. The draft vocabulary: the --draft-vocab tokens the data uses most (the head's lm_head rows,
   and its d2t / t2d maps to the target's vocabulary).
3. Training, a batch of sequences per step: the target runs over each one, writing the hidden
   states entering layers `default_aux_layers(L)` (as it will when the head drafts) and its next-token
   distribution at every position; the head, unrolled --ttt steps as a chain drafts
   (spec/draft_head.py `unrolled`), learns the target's distribution over the draft vocabulary
   of the token each step drafts, on response positions, step j weighted 0.8^j. The head's
   lm_head and norm start from the target's rows and final norm.
4. Written as SpecForge and SGLang write EAGLE-3 heads (LlamaForCausalLMEagle3: fc, midlayer.*,
   norm, lm_head, d2t, t2d; bf16 safetensors), which `spec.draft_head.load_head` reads.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout without installing

from kernels.attention import AttentionMetadata  # noqa: E402
from rollout import Engine, SamplingParams  # noqa: E402
from rollout.models.config import ModelConfig  # noqa: E402
from rollout.models.llama import ForwardContext  # noqa: E402
from rollout.tools.datasets import arithmetic_tasks, chat_prompt_ids, sharegpt_prompts  # noqa: E402
from spec.draft_head import DraftHead, HeadConfig, default_aux_layers, unrolled  # noqa: E402

MAX_PROMPT_TOKENS = 1024  # longer ShareGPT prompts are left out (as rollout bench cuts them)
BENCH_HELD_OUT = 512  # ShareGPT prompts left to rollout bench (its batches take the first ones)
STEP_WEIGHT = 0.8  # the loss of unrolled step j is weighted STEP_WEIGHT ** j (later drafts matter less)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", required=True, help="directory the head is written to")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=2048, help="prompts sampled for data")
    ap.add_argument("--sharegpt", default=None, help="a ShareGPT JSON/JSONL file: half the prompts come from it")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--intermediate-size", type=int, default=768, help="the head's MLP width")
    ap.add_argument("--ttt", type=int, default=3, help="steps the head is unrolled in training")
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps (at most)")
    ap.add_argument("--max-minutes", type=float, default=8.0, help="training stops after this long (sampling not counted)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def sample_data(engine: Engine, prompt_ids: list[list[int]], args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt + response token ids, prompt length) per prompt, sampled by the target."""
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed)
    outs = engine.generate(prompt_ids, params)
    return [(p + o[0].token_ids, len(p)) for p, o in zip(prompt_ids, outs) if o[0].token_ids]


def draft_vocabulary(data: list[tuple[list[int], int]], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids the data's responses use most (all the data's tokens break ties), ascending."""
    counts = Counter(t for ids, p in data for t in ids[p:])
    counts.update({t: 0 for ids, _ in data for t in ids})
    ranked = [t for t, _ in counts.most_common()] + [t for t in range(vocab_size) if t not in counts]
    return torch.tensor(sorted(ranked[:size]), dtype=torch.long)


class Target:
    """The target's forward over one sequence: hidden states entering its aux layers and its
    next-token log-distribution at every position (no grad; the engine's model and backend,
    KV in its pool's first slots: the engine is idle while the head trains)."""

    def __init__(self, engine: Engine, layers: tuple[int, ...]):
        self.engine, self.layers = engine, layers
        self.model = engine.model
        self.hidden = engine.model.config.hidden_size

    @torch.no_grad()
    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        e, t = self.engine, len(ids)
        dev = e.device
        slots = torch.arange(1, t + 1, device=dev)
        slot_table = torch.zeros(1, e.pool.max_context, dtype=torch.int32, device=dev)
        slot_table[0, :t] = slots.to(torch.int32)
        meta = AttentionMetadata(seq_rows=torch.zeros(1, dtype=torch.int32, device=dev),
                                 kv_lens=torch.tensor([t], dtype=torch.int32, device=dev),
                                 qo_indptr=torch.tensor([0, t], dtype=torch.int32, device=dev), slot_table=slot_table,
                                 out_slots=slots, tree_mask=None, max_q_len=t, max_kv_len=t)
        e.runner.backend.plan(meta)
        aux = torch.empty(t, len(self.layers) * self.hidden, dtype=self.model.model.embed_tokens.weight.dtype, device=dev)
        ctx = ForwardContext(meta, e.runner.backend, e.pool.k_caches, e.pool.v_caches, e.runner.cos[:t], e.runner.sin[:t],
                             aux_layers=self.layers, aux_hidden=aux)
        logits = self.model(torch.tensor(ids, device=dev), ctx, None)
        return aux.float(), torch.log_softmax(logits, dim=-1)


def head_config(target: ModelConfig, args: argparse.Namespace) -> HeadConfig:
    return HeadConfig(kind="eagle3", hidden_size=target.hidden_size, intermediate_size=args.intermediate_size,
                      num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                      rms_norm_eps=target.rms_norm_eps, target_hidden_size=target.hidden_size,
                      vocab_size=target.vocab_size, draft_vocab_size=args.draft_vocab)


def new_head(engine: Engine, cfg: HeadConfig, draft_ids: torch.Tensor) -> DraftHead:
    """A head in fp32 on the engine's device, its lm_head the target's rows of the draft vocabulary
    and its final norm the target's (the head's output lives in the target's hidden space)."""
    model = engine.model
    head = DraftHead(cfg, model.config, layer=model.config.num_layers).to(device=engine.device, dtype=torch.float32)
    with torch.no_grad():
        head.lm_head.weight.copy_(model.lm_head_weight[draft_ids.to(engine.device)].float())
        head.norm.weight.copy_(model.model.norm.weight.float())
    return head


def sequence_loss(head: DraftHead, embed: torch.nn.Embedding, target: Target, ids: list[int], prompt_len: int,
                  draft_ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, int, int]:
    """The head's loss on one sequence (summed over its response positions and unrolled steps),
    and (step 0's top-1 agreements with the target, positions) on the response."""
    aux, logp = target(ids)
    dev = aux.device
    t_all = len(ids) - 1  # positions with a next token
    # the target's distribution over the draft vocabulary, renormalised, at each position
    teacher = torch.softmax(logp[:, draft_ids.to(dev)], dim=-1)
    tokens = torch.tensor(ids, device=dev)
    cos, sin = target.engine.runner.cos, target.engine.runner.sin
    total, agree, count = aux.new_zeros(()), 0, 0
    for j, (logits, _) in enumerate(unrolled(head, embed, tokens[1:], aux[:t_all], cos, sin, steps=steps)):
        n = logits.shape[0]
        # step j at t drafts the token at t + j + 2, whose distribution the target gave at t + j + 1
        want = teacher[j + 1 : j + 1 + n]
        on_response = torch.arange(n, device=dev) + j + 2 >= prompt_len
        if n == 0 or not bool(on_response.any()):
            continue
        loss = -(want * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        total = total + STEP_WEIGHT**j * loss[on_response].sum()
        if j == 0:
            agree = int((logits.argmax(-1) == want.argmax(-1))[on_response].sum())
            count = int(on_response.sum())
    return total, agree, count


def train(engine: Engine, data: list[tuple[list[int], int]], draft_ids: torch.Tensor,
          args: argparse.Namespace, log=print) -> tuple[DraftHead, list[dict]]:
    """The trained head (fp32) and a record per logged step."""
    torch.manual_seed(args.seed)
    head = new_head(engine, head_config(engine.model.config, args), draft_ids)
    target = Target(engine, default_aux_layers(engine.model.config.num_layers))
    embed = engine.model.model.embed_tokens
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.1, 1 - s / args.steps))
    rng = random.Random(args.seed)
    records, t0 = [], time.perf_counter()
    for step in range(args.steps):
        batch = [data[rng.randrange(len(data))] for _ in range(args.batch)]
        losses, agree, count = [], 0, 0
        for ids, prompt_len in batch:
            loss, a, c = sequence_loss(head, embed, target, ids, prompt_len, draft_ids, args.ttt)
            losses.append(loss)
            agree, count = agree + a, count + c
        positions = max(1, sum(len(ids) - p for ids, p in batch))
        loss = torch.stack(losses).sum() / positions
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        last = step == args.steps - 1 or time.perf_counter() - t0 > 60 * args.max_minutes
        if step % max(1, args.steps // 20) == 0 or last:
            rec = {"step": step, "loss": float(loss.detach()), "top1": agree / max(count, 1), "s": time.perf_counter() - t0}
            records.append(rec)
            log(f"| {step} | {rec['loss']:.3f} | {rec['top1']:.3f} | {rec['s']:.0f} |")
        if last:
            break
    return head, records


def write_head(head: DraftHead, draft_ids: torch.Tensor, target: ModelConfig, layers: tuple[int, ...],
               out: Path) -> int:
    """The head as an EAGLE-3 checkpoint directory (bf16); returns its bytes on disk."""
    cfg = head.cfg
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "torch_dtype": "bfloat16",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": target.rope_theta,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size, "tie_word_embeddings": False,
        # SGLang's convention: the layers whose outputs are read (the ones before those entered)
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers], "use_aux_hidden_state": True},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: t.view().detach().to(torch.bfloat16).contiguous().cpu()
               for name, t in head.weight_targets().items()}
    tensors["d2t"] = (draft_ids - torch.arange(len(draft_ids))).cpu()  # stored as the offset, as SpecForge does
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"))
    return (out / "model.safetensors").stat().st_size


def prompts_for(engine: Engine, args: argparse.Namespace) -> list[list[int]]:
    """Chat prompts: arithmetic tasks, and ShareGPT first turns for half when a file is given;
    none of those `rollout bench` measures on (its ShareGPT prompts are the first BENCH_HELD_OUT
    of the same shuffle, its arithmetic tasks those of seed 0)."""
    tok = engine.tokenizer
    share = []
    if args.sharegpt:
        share = sharegpt_prompts(BENCH_HELD_OUT + args.prompts // 2, seed=0, path=args.sharegpt)[BENCH_HELD_OUT:]
    tasks = arithmetic_tasks(args.prompts - len(share), seed=args.seed + 1)
    questions = [t.question for t in tasks] + share
    return [ids for ids in (chat_prompt_ids(tok, q) for q in questions) if len(ids) <= MAX_PROMPT_TOKENS]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engine = Engine(model=args.model, device=args.device, spec="off", max_running_seqs=min(args.prompts, 512))
    t0 = time.perf_counter()
    data = sample_data(engine, prompts_for(engine, args), args)
    print(f"{len(data)} sequences, {sum(len(ids) - p for ids, p in data)} response tokens "
          f"sampled in {time.perf_counter() - t0:.0f} s")
    cfg = engine.model.config
    draft_ids = draft_vocabulary(data, args.draft_vocab, cfg.vocab_size)
    print("| step | loss | top-1 agreement, step 0 | s |\n|---|---|---|---|")
    head, _ = train(engine, data, draft_ids, args)
    size = write_head(head, draft_ids, cfg, default_aux_layers(cfg.num_layers), Path(args.out))
    print(f"wrote {args.out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
