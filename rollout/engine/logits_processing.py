"""Edits of a draw's logits before sampling: penalties, logit bias, and min_new_tokens.

A draw's logits change only at a few tokens: those its sequence has seen (the prompt for the
repetition penalty, the output for all three penalties), those with a bias, and the stop
tokens while `min_new_tokens` forbids stopping. So the host lists the edits as entries, one
per (draw, token), and the device applies them in one gather-edit-scatter:

    z = logit / scale if logit > 0 else logit * scale     (scale: the repetition penalty, or 1)
    z = z + add                                           (add: -frequency * count - presence * [count > 0] + bias)
    z = -inf where banned

A draw inside a draft tree sees the drafts above it as output too (verification must draw
from the distribution plain decoding would have), so its counts include its path's tokens.
Steps with edits run eagerly and never chain after a step whose tokens the host has not
seen (see Engine.step): the counts must be complete.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from rollout.engine.sequence import Sequence
from spec.step import to_device


@dataclass
class LogitEdits:
    """Entries of one step, on the host or the device: draw [E], token [E], scale [E], add [E], ban [E]."""

    draws: torch.Tensor | np.ndarray
    tokens: torch.Tensor | np.ndarray
    scale: torch.Tensor | np.ndarray
    add: torch.Tensor | np.ndarray
    ban: torch.Tensor | np.ndarray

    def to(self, device: torch.device) -> "LogitEdits":
        return LogitEdits(*(to_device(a, device) for a in (self.draws, self.tokens, self.scale, self.add, self.ban)))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [draws, vocab] float32, one row per draw; edited in place and returned."""
        if len(self.draws) == 0:
            return logits
        z = logits[self.draws, self.tokens]
        z = torch.where(z > 0, z / self.scale, z * self.scale) + self.add
        logits[self.draws, self.tokens] = z.masked_fill(self.ban, float("-inf"))
        return logits


def logit_edits(seqs: Seq[Sequence], paths: Seq[Seq[int]], first_draw: int = 0) -> LogitEdits | None:
    """The edits of draws `first_draw + i` (i = 0, 1, ...): draw i continues `seqs[i]` after the
    drafts `paths[i]` (empty outside a draft tree). None when no draw's request asks for any."""
    parts = [_entries(seq, path) for seq, path in zip(seqs, paths)]
    if not any(p is not None for p in parts):
        return None
    draws, tokens, scale, add, ban = [], [], [], [], []
    for i, p in enumerate(parts, first_draw):
        if p is None:
            continue
        t, s, a, b = p
        draws.append(np.full(len(t), i, dtype=np.int64))
        tokens.append(t)
        scale.append(s)
        add.append(a)
        ban.append(b)
    cat = np.concatenate
    return LogitEdits(cat(draws), cat(tokens), cat(scale).astype(np.float32), cat(add).astype(np.float32), cat(ban))


def _entries(seq: Sequence, path: Seq[int]):
    """(tokens, scale, add, ban) of one draw, tokens distinct; None when its request edits nothing."""
    req = seq.request
    p = req.params
    if not p.processes_logits:
        return None
    counts = dict(seq.output_counts)
    for t in path:
        counts[t] = counts.get(t, 0) + 1
    seen = np.fromiter(counts, dtype=np.int64, count=len(counts))
    groups = [seen]
    if p.repetition_penalty != 1:
        groups.append(req.prompt_token_set)
    bias = p.logit_bias or {}
    if bias:
        groups.append(np.fromiter(bias, dtype=np.int64, count=len(bias)))
    banned = seq.num_output + len(path) < p.min_new_tokens
    if banned:
        groups.append(np.fromiter(req.stop_ids, dtype=np.int64, count=len(req.stop_ids)))
    tokens = np.unique(np.concatenate(groups))
    listed = tokens.tolist()
    count = np.array([counts.get(t, 0) for t in listed], dtype=np.float64)
    scale = np.ones(len(tokens))
    if p.repetition_penalty != 1:
        in_prompt = np.isin(tokens, req.prompt_token_set)
        scale[(count > 0) | in_prompt] = p.repetition_penalty
    add = -p.frequency_penalty * count - p.presence_penalty * (count > 0)
    if bias:
        add += np.array([bias.get(t, 0.0) for t in listed])
    ban = np.isin(tokens, list(req.stop_ids)) if banned else np.zeros(len(tokens), dtype=bool)
    return tokens, scale, add, ban


def reference_logits(logits: torch.Tensor, seq: Sequence, path: Seq[int] = ()) -> torch.Tensor:
    """The definition, token by token over the whole vocabulary (tests hold `logit_edits` to it)."""
    p, req = seq.request.params, seq.request
    out = list(seq.output_ids) + list(path)
    z = logits.clone().double()
    if p.repetition_penalty != 1:
        for t in set(req.prompt_ids) | set(out):
            z[t] = z[t] / p.repetition_penalty if z[t] > 0 else z[t] * p.repetition_penalty
    for t in set(out):
        z[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    for t, b in (p.logit_bias or {}).items():
        z[t] += b
    if len(out) < p.min_new_tokens:
        for t in req.stop_ids:
            z[t] = float("-inf")
    return z.float()
