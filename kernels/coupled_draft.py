"""Drafts from a sample's earlier rollout under coupled sampling: a chain read off the history row
drawn with the same key, from where its draws used the noise the next draw will use.

Under coupled sampling (rollout/engine/sampler.py) sample i of a prompt draws with the same key in
every rollout of the prompt, and a draw's noise is indexed by the token it follows and how many
earlier draws of the sample followed that token. The next draw of a running sample s (last token
x, followed c times before) has the noise its earlier rollout t used after its (c+1)-th x, so t's
tokens from there are very likely s's next tokens: exactly t's while the two agree, and again
after they part, as soon as s follows a token as often as t had (on the H200, with the noise
indexed by position, such drafts were accepted 0.91-0.99 of the time while the samples stayed
aligned; bench/RESULTS.md says how soon they part and how often they meet again).

For sequence s (own row r): the newest history row t of its scan list (its prompt's group) with the
same sampling key (scan lists hold history newest first) gives the chain t[i + 1 : i + 1 + width]
for i the position of t's (c+1)-th x among its draws' predecessors (the prompt's last token on),
provided the `window` tokens up to i equal s's last ones, its drafts keyed above any n-gram
draft (KEY_SCALE - 1 - depth: kernels/draft_rows.py verifies the batch's best keys first).
Where t has no such draw, s drafts from n-gram matches. (The shared noise alone is a poor
guess once the samples have parted: their contexts differ, and so do their draws. Without the
window, on the H100, such chains were accepted 0.12-0.22 of the time: bench/RESULTS.md.)

Outputs are the n-gram drafter's five [S, width + 1] arrays (kernels/ngram_draft.py) and [S]
which sequences have a chain. Torch ops only: they run inside the step's CUDA graph as they are.
"""

from __future__ import annotations

import torch

from kernels.ngram_draft import KEY_SCALE, PADDING


def coupled_chains(
    tokens: torch.Tensor, lengths: torch.Tensor, prompt_lens: torch.Tensor, keys: torch.Tensor, history_start: int,
    rows: torch.Tensor, scan: torch.Tensor, window: int, width: int,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """tokens [R, C] int32, lengths and prompt_lens [R] int32, keys [R] int64 (each row's sampling
    key); rows [S] int32; scan [S, M] int32 (-1: none); `window`: how many tokens up to the
    meeting point (its own included) must agree. Returns found [S] bool and (tokens, parents, depths, ancestors,
    keys) [S, width + 1] int64."""
    dev = tokens.device
    rows = rows.long()
    s = rows.shape[0]
    cols = torch.arange(tokens.shape[1], device=dev)
    own_len = lengths[rows].long()
    own = tokens[rows]  # [S, C]
    last = own.gather(1, (own_len - 1).clamp(min=0)[:, None])  # [S, 1]
    own_from = prompt_lens[rows].long()[:, None] - 1
    followed = ((own == last) & (cols >= own_from) & (cols < own_len[:, None] - 1)).sum(dim=1)  # c
    t = scan.long()
    t_safe = t.clamp(min=0)
    candidate = (t >= history_start) & (keys[t_safe] == keys[rows][:, None])
    row = t_safe.gather(1, candidate.long().argmax(dim=1, keepdim=True)).squeeze(1)  # the newest with the key
    theirs, their_len = tokens[row], lengths[row].long()[:, None]  # [S, C], [S, 1]
    their_from = prompt_lens[row].long()[:, None] - 1
    same = (theirs == last) & (cols >= their_from) & (cols < their_len - 1)
    hit = same & (same.cumsum(dim=1) - same.long() == followed[:, None])  # t's (c+1)-th x, at most one
    at = hit.long().argmax(dim=1)  # [S]
    back = torch.arange(1, window, device=dev)  # the tokens before the last, on both sides
    mine = own.gather(1, (own_len[:, None] - 1 - back).clamp(min=0))
    their = theirs.gather(1, (at[:, None] - back).clamp(min=0))
    agree = ((mine == their) | (own_len[:, None] - 1 - back < 0)).all(dim=1)
    found = candidate.any(dim=1) & hit.any(dim=1) & agree
    depth = torch.arange(1, width + 1, device=dev)  # [N]
    pos = at[:, None] + depth  # [S, N]
    real = found[:, None] & (pos < their_len)
    node = torch.arange(width + 1, device=dev)
    drafts = theirs.gather(1, pos.clamp(max=tokens.shape[1] - 1)).long()
    out_tok = torch.cat([last.long(), torch.where(real, drafts, 0)], dim=1)
    out_par = torch.cat([torch.full((s, 1), -1, device=dev, dtype=torch.long),
                         torch.where(real, depth - 1, PADDING)], dim=1)
    out_dep = torch.cat([torch.zeros(s, 1, device=dev, dtype=torch.long), torch.where(real, depth, 1)], dim=1)
    chain_anc = (1 << (node + 1)) - 1  # the root and every node up to this one
    pad_anc = 1 | (1 << node)
    out_anc = torch.where(torch.cat([torch.ones(s, 1, device=dev, dtype=torch.bool), real], dim=1), chain_anc, pad_anc)
    out_key = torch.cat([torch.full((s, 1), -1, device=dev, dtype=torch.long),
                         torch.where(real, KEY_SCALE - 1 - depth, -1)], dim=1)
    return found, (out_tok, out_par, out_dep, out_anc, out_key)
