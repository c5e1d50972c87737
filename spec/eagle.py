"""Drafting with a learned head (EAGLE-3, or EAGLE-1) inside the step, on the device.

A step leaves each sequence a chain of `depth` drafts and `siblings` more beside its first for
the next one (`tokens`, `keys` by KV row), so the next step verifies them like any tree
(`trees`: keys are each draft's path probability, quantised as the n-gram drafter's are, so
the draft-rows kernel and the accept walk serve both). The chain is made at the end of the
step that verifies the one before:

- the head runs over the step's own rows (`extend`), with the target's attention metadata,
  tree mask and slots: row r's input is the token the target drew at r and the hidden states
  the target wrote entering the head's aux layers. Every accepted node's head KV so lands in
  its accepted slot (the accept walk only moves slots), and a rejected node's is dropped with
  its slot;
- the deepest accepted node's output gives the first draft (`draft`), and its next likeliest
  tokens the first draft's siblings (`siblings`: --spec-head-topk less one; leaves); each
  further draft of the chain is one row per sequence, standing one position on, its KV in a
  scratch slot of the sequence's own, entered into the slot table past the sequence's end (the
  next step's layout writes over those entries).

The n samples of a prompt share its last slot, whose head KV depends on each sample's first
token: the first sample's is kept, so its forks' first chains are drafted from a slightly
different context. Verification keeps every sample exact; only their acceptance pays.
"""

from __future__ import annotations

import torch

from kernels.attention import AttentionMetadata
from kernels.ngram_draft import KEY_SCALE, PADDING
from rollout.engine.kv_pool import KVPool
from rollout.models.llama import CausalLM, ForwardContext
from spec.draft_head import DraftHead


class EagleDrafter:
    def __init__(self, head: DraftHead, model: CausalLM, pool: KVPool, depth: int, max_rows: int, siblings: int = 0):
        device = pool.device
        self.head, self.model, self.pool, self.depth = head, model, pool, depth
        self.siblings = siblings  # drafts beside the first: the head's next likeliest tokens there, as leaves
        self.source = "mtp" if head.cfg.kind == "mtp" else "eagle"  # (its drafts' name in the statistics)
        self.aux_layers = head.cfg.aux_layers
        self.aux_width = len(self.aux_layers) * model.config.hidden_size
        # by KV row: the chain's drafts, then the siblings'; target ids
        self.tokens = torch.zeros(max_rows + 1, self.nodes, dtype=torch.long, device=device)
        self.keys = torch.full((max_rows + 1, self.nodes), -1, dtype=torch.long, device=device)
        # rows whose head KV holds every token (the head ran over their prompt and every step
        # since): only they draft chains (a sleeping head's sequences fall behind: HeadCycle)
        self.tracked = torch.zeros(max_rows + 1, dtype=torch.bool, device=device)
        self.d2t = head.draft_to_target.to(device)
        # each KV row's scratch slots for its chain's drafts after the first (never freed)
        self.scratch = torch.as_tensor(pool.alloc((max_rows + 1) * max(depth - 1, 1)), device=device).long()
        self.scratch = self.scratch.view(max_rows + 1, -1)

    @property
    def nodes(self) -> int:
        """Drafts in a tree: the chain and its first level's siblings."""
        return self.depth + self.siblings

    def trees(self, rows: torch.Tensor, roots: torch.Tensor, width: int):
        """(tokens, parents, depths, ancestors, keys) [S, width + 1] of the trees left for `rows`
        (none where none was left; padding past the tree), roots [S] their last tokens. The drafts
        stand in key order: a key is its path's probability, never above its parent's, so the
        first few drafts of a tree, which a step verifies (kernels/draft_rows.py), hold their
        parents, and along a path the nodes are in depth order, as the accept walk reads them."""
        s, d, n = rows.shape[0], self.depth, self.nodes
        dev = rows.device
        keys = torch.where(self.tracked[rows, None], self.keys[rows], -1)  # [S, n]: the chain, then the siblings
        if self.siblings:
            order = torch.sort(keys, dim=1, descending=True, stable=True).indices  # (none, -1, last)
            place = torch.empty_like(order).scatter_(1, order, torch.arange(n, device=dev).expand(s, -1).contiguous())
        else:  # a chain's keys fall along it: it is in key order already (no sort in its steps)
            place = torch.arange(n, device=dev).expand(s, -1)
        node = place + 1  # [S, n]: each draft's node
        root = torch.zeros(s, 1, dtype=torch.long, device=dev)
        parent = torch.cat([root, node[:, : d - 1], root.expand(s, self.siblings)], dim=1)
        depth = torch.cat([torch.arange(1, d + 1, device=dev), torch.ones(self.siblings, dtype=torch.long, device=dev)])
        bit = 1 << node
        above = torch.cat([1 + bit[:, :d].cumsum(dim=1), 1 + bit[:, d:]], dim=1)  # (distinct bits: the sum is their OR)
        by_key = [self.tokens[rows], parent, depth.expand(s, -1), above]
        if self.siblings:
            by_key, keys = [t.gather(1, order) for t in by_key], keys.gather(1, order)
        at = torch.arange(width + 1, device=dev)
        pad = torch.full((s, width - n), -1, dtype=torch.long, device=dev)
        keys = torch.cat([root - 1, keys, pad], dim=1)
        drafted = keys >= 0
        tokens = torch.cat([roots[:, None], by_key[0], pad.clamp(min=0)], dim=1)
        parents = torch.cat([root - 1, by_key[1], pad], dim=1)
        parents = torch.where((at == 0) | drafted, parents, PADDING)
        depths = torch.where(drafted, torch.cat([root, by_key[2], pad], dim=1), at)
        ancestors = torch.where(drafted, torch.cat([root + 1, by_key[3], pad], dim=1), (1 << (at + 1)) - 1)
        return tokens, parents, depths, ancestors, keys

    def extend(self, ids: torch.Tensor, aux: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over a step's rows: (logits over the draft vocabulary, output) per row."""
        return self._head(ids, aux, ctx)

    def _head(self, ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        # (EAGLE-1 and MTP layers have no lm_head of their own: the target's, over the whole vocabulary)
        lm_head = None if self.head.cfg.kind == "eagle3" else self.model.lm_head_weight
        return self.head(ids, hidden, ctx, self.model.model.embed_tokens, lm_head)

    def forget(self, rows: torch.Tensor) -> None:
        """These rows start without drafts (a fork's first step)."""
        self.keys.index_fill_(0, rows, -1)  # (a scalar fill: index assignment copies a host tensor, which capture refuses)

    def sleep(self) -> None:
        """The head stops running (spec/head_watch.py HeadCycle): every row's head KV falls behind
        from here on, so none drafts chains again (a row tracks again once a prompt starts in it
        while the head runs). Queued on the stream behind the steps in flight, whose chains it drops."""
        self.tracked.fill_(False)
        self.keys.fill_(-1)

    def track(self, rows: torch.Tensor, like: torch.Tensor | None = None) -> None:
        """These rows' head KV is whole (their prompt starts now), or as whole as `like` rows' (forks)."""
        self.tracked[rows] = True if like is None else self.tracked[like]

    def draft(self, rows: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor, lengths: torch.Tensor,
              backend, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Chains for `rows` [S] from the head's output at their deepest accepted node (logits,
        hidden [S, ...]); lengths [S]: their token counts now (the last token is the next root)."""
        s = rows.shape[0]
        dev = rows.device
        lp = torch.log_softmax(logits.float(), dim=-1)
        top_lp, top = lp.topk(1 + self.siblings, dim=-1)  # the chain's first draft and its siblings
        tok, cum = self.d2t[top[:, 0]], top_lp[:, 0]
        tokens, keys = [tok], [cum]
        slot_table = self.pool.slot_table
        for k in range(1, self.depth):
            at = lengths - 1 + (k - 1)  # where the draft before it stands: the root's position, then on
            slot = self.scratch[rows, k - 1]
            slot_table[rows, at] = slot.to(slot_table.dtype)
            meta = AttentionMetadata(
                seq_rows=rows.to(torch.int32), kv_lens=(at + 1).to(torch.int32),
                qo_indptr=torch.arange(s + 1, dtype=torch.int32, device=dev), slot_table=slot_table,
                out_slots=slot, tree_mask=None, max_q_len=1, max_kv_len=self.pool.max_context,
            )
            backend.plan(meta)
            ctx = ForwardContext(meta, backend, self.pool.k_caches, self.pool.v_caches, cos[at], sin[at])
            logits, hidden = self._head(tok, hidden, ctx)
            lp = torch.log_softmax(logits.float(), dim=-1)
            step_lp, best = lp.max(dim=-1)
            tok, cum = self.d2t[best], cum + step_lp
            tokens.append(tok)
            keys.append(cum)
        self.tokens[rows] = torch.cat([torch.stack(tokens, dim=1), self.d2t[top[:, 1:]]], dim=1)
        # each draft's path probability, quantised as the n-gram keys (non-increasing along a path)
        paths = torch.cat([torch.stack(keys, dim=1), top_lp[:, 1:]], dim=1)
        self.keys[rows] = (KEY_SCALE * paths.exp()).long().clamp(0, KEY_SCALE - 1)
