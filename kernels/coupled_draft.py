"""Drafts from a sample's earlier rollout under coupled sampling: a chain read off the history row
drawn with the same key.

Under coupled sampling (rollout/engine/sampler.py) sample i of a prompt draws with the same
noise, position by position, in every rollout of the prompt, so while a running sample's tokens
equal its earlier rollout's, its next tokens are very likely that rollout's next tokens (on the
H200 its drafts were accepted 0.91-0.99 of the time while the samples stayed aligned, against what
an n-gram match guesses at T = 1; bench/RESULTS.md says how soon they part).

For sequence s (own row r, L tokens): a history row t of its scan list (its prompt's group) with
the same sampling key, longer than L, whose last `window` tokens before L equal s's at the same
positions (the newest such row first, as scan lists hold history newest first), gives the chain
t[L : L + width], its drafts keyed above any n-gram draft (KEY_SCALE - 1 - depth: kernels/
draft_rows.py verifies the batch's best keys first). A sample that left its earlier rollout
drafts from n-gram matches again, and follows the row again if the two realign.

Outputs are the n-gram drafter's five [S, width + 1] arrays (kernels/ngram_draft.py) and [S]
which sequences have a chain. Torch ops only: they run inside the step's CUDA graph as they are.
"""

from __future__ import annotations

import torch

from kernels.ngram_draft import KEY_SCALE, PADDING


def coupled_chains(
    tokens: torch.Tensor, lengths: torch.Tensor, keys: torch.Tensor, history_start: int, rows: torch.Tensor,
    scan: torch.Tensor, window: int, width: int,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """tokens [R, C] int32, lengths [R] int32, keys [R] int64 (each row's sampling key); rows [S]
    int32; scan [S, M] int32 (-1: none). Returns found [S] bool and (tokens, parents, depths,
    ancestors, keys) [S, width + 1] int64."""
    dev = tokens.device
    rows = rows.long()
    s = rows.shape[0]
    own_len = lengths[rows].long()  # [S]
    t = scan.long()
    t_safe = t.clamp(min=0)
    candidate = (t >= history_start) & (keys[t_safe] == keys[rows][:, None]) & (lengths[t_safe].long() > own_len[:, None])
    back = own_len[:, None] - 1 - torch.arange(window, device=dev)  # [S, W]: the last `window` positions
    seen = back >= 0
    at = back.clamp(min=0)
    mine = tokens[rows[:, None], at]  # [S, W]
    theirs = tokens[t_safe[:, :, None], at[:, None, :]]  # [S, M, W]
    follows = candidate & ((theirs == mine[:, None, :]) | ~seen[:, None, :]).all(dim=2)  # [S, M]
    found = follows.any(dim=1)
    row = t_safe.gather(1, follows.long().argmax(dim=1, keepdim=True)).squeeze(1)  # the first that follows
    depth = torch.arange(1, width + 1, device=dev)  # [N]
    pos = own_len[:, None] - 1 + depth  # [S, N]
    real = found[:, None] & (pos < lengths[row].long()[:, None])
    node = torch.arange(width + 1, device=dev)
    root = tokens[rows, (own_len - 1).clamp(min=0)].long()[:, None]
    drafts = tokens[row[:, None], pos.clamp(max=tokens.shape[1] - 1)].long()
    out_tok = torch.cat([root, torch.where(real, drafts, 0)], dim=1)
    out_par = torch.cat([torch.full((s, 1), -1, device=dev, dtype=torch.long),
                         torch.where(real, depth - 1, PADDING)], dim=1)
    out_dep = torch.cat([torch.zeros(s, 1, device=dev, dtype=torch.long), torch.where(real, depth, 1)], dim=1)
    chain_anc = (1 << (node + 1)) - 1  # the root and every node up to this one
    pad_anc = 1 | (1 << node)
    out_anc = torch.where(torch.cat([torch.ones(s, 1, device=dev, dtype=torch.bool), real], dim=1), chain_anc, pad_anc)
    out_key = torch.cat([torch.full((s, 1), -1, device=dev, dtype=torch.long),
                         torch.where(real, KEY_SCALE - 1 - depth, -1)], dim=1)
    return found, (out_tok, out_par, out_dep, out_anc, out_key)
