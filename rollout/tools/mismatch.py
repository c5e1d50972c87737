"""How far a rollout's logprobs are from a trainer's on the same tokens: the mismatch RL pays for.

The trainer recomputes each sampled token's logprob in its own precision (float32 master weights);
the rollout engine drew it in its serving dtype. The difference is rounding noise, and it biases
the policy gradient: the GRPO recipe logs it every step (and can correct for it with truncated
importance sampling, `tis_weights`), and `rollout bench --workload mismatch` measures it by dtype.
"""

from __future__ import annotations

import torch

from rollout.tools.bench_args import TRAINER_STARTS

MISMATCH_KEYS = ("logprob_mismatch_mean", "logprob_mismatch_p99", "logprob_mismatch_max", "kl_k3")


def teacher_forced_logprobs(model, prompts: list[list[int]], completions: list[list[int]],
                            temperature: float = 1.0) -> list[torch.Tensor]:
    """Each completion's per-token logprobs under an HF causal LM, at `temperature`: one padded
    forward over prompt + completion, a 1-D tensor per completion (with the model's graph, so a
    trainer can take gradients through it)."""
    device = next(model.parameters()).device
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=device)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
    logits = model(input_ids=ids, attention_mask=mask).logits.float() / max(temperature, 1e-6)
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return [logprobs[i, len(p) - 1 : len(p) - 1 + len(c)] for i, (p, c) in enumerate(zip(prompts, completions))]


def mismatch_stats(trainer: torch.Tensor, rollout: torch.Tensor) -> dict[str, float]:
    """The mismatch of the same tokens' logprobs [N], trainer's against rollout's: the mean, 99th
    percentile and max of their absolute difference, and the k3 estimate of KL(rollout || trainer)
    (r - 1 - log r for r = p_trainer / p_rollout, averaged over tokens the rollout drew: unbiased,
    never negative)."""
    if trainer.numel() == 0:
        return dict.fromkeys(MISMATCH_KEYS, 0.0)
    log_ratio = trainer.double() - rollout.double()
    diff = log_ratio.abs()
    return {
        "logprob_mismatch_mean": diff.mean().item(),
        "logprob_mismatch_p99": torch.quantile(diff, 0.99).item(),
        "logprob_mismatch_max": diff.max().item(),
        "kl_k3": (log_ratio.exp() - 1 - log_ratio).mean().item(),
    }


def tis_weights(trainer: torch.Tensor, rollout: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: each token's weight min(cap, p_trainer / p_rollout), which
    makes the gradient of tokens the rollout engine drew that of the trainer's policy (up to the
    cap); no gradient flows through it."""
    return (trainer.detach() - rollout).exp().clamp(max=cap)


def start_trainer_weights(model, start: str, dtype: torch.dtype, seed: int = 0) -> None:
    """Set a float32 trainer's weights, in place, to where `start` (TRAINER_STARTS) says a trainer
    holds them against an engine serving `dtype`: 'checkpoint' keeps the checkpoint's own values;
    'served' rounds each to `dtype`, the weights the engine serves (a trainer that loaded the
    checkpoint it serves, or one whose forward reads the low-precision copy it pushes, as
    mixed-precision trainers do); 'spread' moves each to a uniform point of the interval that
    rounds to its served value (`spread_in_rounding`), as float32 master weights lie after many
    steps of training."""
    if start not in TRAINER_STARTS:
        raise ValueError(f"trainer start {start!r}: choose {', '.join(TRAINER_STARTS)}")
    if start == "checkpoint":
        return
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float() if start == "served" else spread_in_rounding(p, dtype, gen))


def spread_in_rounding(t: torch.Tensor, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """float32 `t` moved to a uniform point of the interval that rounds to `t.to(dtype)` (its
    nearest `dtype` value; the interval's edges left out), as a trainer's float32 weights lie
    after many steps. Unchanged where `dtype` is float32."""
    if dtype == torch.float32:
        return t
    served = t.to(dtype).float()
    mantissa, exponent = torch.frexp(served)  # |served| = |mantissa| 2^exponent, |mantissa| in [0.5, 1)
    spacing = torch.ldexp(torch.full_like(served, torch.finfo(dtype).eps), exponent - 1)  # to the next value up
    below = torch.where(mantissa.abs() == 0.5, spacing / 2, spacing)  # (half as far to the next one down at a power of two)
    u = torch.rand(t.shape, generator=gen, device=t.device) - 0.5
    step = torch.where(u > 0, spacing, below) * u * 0.999
    return torch.where(served == 0, served, served + step * served.sign())
