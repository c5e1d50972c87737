"""How far a rollout's logprobs are from a trainer's on the same tokens: the mismatch RL pays for.

The trainer recomputes each sampled token's logprob in its own precision (float32 master weights);
the rollout engine drew it in its serving dtype. The difference is rounding noise, and it biases
the policy gradient: the GRPO recipe logs it every step (and can correct for it with truncated
importance sampling, `tis_weights`), and `rollout bench --workload mismatch` measures it by dtype.
"""

from __future__ import annotations

import torch

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
