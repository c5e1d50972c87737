"""Drafting with a learned head (EAGLE-3, EAGLE-1 or an MTP layer) inside the step, on the device.

A step leaves each sequence a tree of drafts for the next one (`tokens`, `parents`, `depths`,
`ancestors`, `keys` by KV row, in key order), which the next step verifies like any tree (keys
are each draft's path probability, quantised as the n-gram drafter's are, so the draft-rows
kernel and the accept walk serve both). The tree is made at the end of the step that verifies
the one before:

- the head runs over the step's own rows (`extend`), with the target's attention metadata,
  tree mask and slots: row r's input is the token the target drew at r and the hidden states
  the target wrote entering the head's aux layers. Every accepted node's head KV so lands in
  its accepted slot (the accept walk only moves slots), and a rejected node's is dropped with
  its slot;
- the deepest accepted node's output gives the tree's first level, the head's `topk` likeliest
  tokens there; each further level is a step of the head over the level before (EAGLE-2's
  dynamic tree, `draft`): the `topk` likeliest of its nodes' children by path probability, of
  `topk` each. The tree keeps the `width` likeliest nodes of all levels, which hold their
  parents (a child is never likelier than its parent). A level's rows stand one position on
  from their parents', their KV in scratch slots of the sequence's own, entered into the slot
  table past the sequence's end (the next step's layout writes over those entries); a row sees
  its ancestors there and not their cousins (a tree mask), so each head step reruns the levels
  above it with the new one (with `topk` 1, a chain, the nodes above are all ancestors: one
  row a step).

The n samples of a prompt share its last slot, whose head KV depends on each sample's first
token: the first sample's is kept, so its forks' first trees are drafted from a slightly
different context. Verification keeps every sample exact; only their acceptance pays.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.attention import AttentionMetadata
from kernels.ngram_draft import KEY_SCALE, PADDING
from rollout.models.llama import CausalLM, ForwardContext
from spec.draft_head import DraftHead
from spec.drafters import Drafter, DraftStep
from spec.step import HeadWork, KVCache, Source, to_device


class HeadDrafter(Drafter):
    """A draft head as a drafter (spec/drafters.py): its trees, its pass over each step's rows, and
    its next trees from the deepest accepted node."""

    source, scale = Source.HEAD, "head"

    def __init__(self, head: DraftHead, model: CausalLM, pool: KVCache, depth: int, topk: int, width: int, max_rows: int):
        device = pool.device
        self.head, self.model, self.pool = head, model, pool
        self.depth, self.topk = depth, topk  # levels of a tree, and the head's top k at each
        self.nodes = self.width = width  # drafts kept of a tree's depth x topk, the likeliest
        self.name = "mtp" if head.cfg.kind == "mtp" else "eagle"  # (DRAFTERS', and its drafts' in the statistics)
        self.aux_layers = head.cfg.aux_layers
        self.backend = self.cos = self.sin = None  # the target's attention and rope tables (attach)
        self.aux_width = len(self.aux_layers) * model.config.hidden_size
        # by KV row, each tree in key order: target ids, parents (0: the root), depths, ancestors'
        # bits (the root's and the node's own included), keys (-1: none)
        rows = max_rows + 1
        self.tokens = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.parents = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.depths = torch.ones(rows, width, dtype=torch.long, device=device)
        self.ancestors = torch.ones(rows, width, dtype=torch.long, device=device)
        self.keys = torch.full((rows, width), -1, dtype=torch.long, device=device)
        # rows whose head KV holds every token (the head ran over their prompt and every step
        # since): only they draft (a sleeping head's sequences fall behind: HeadCycle)
        self.tracked = torch.zeros(rows, dtype=torch.bool, device=device)
        self.d2t = head.draft_to_target.to(device)
        # each KV row's scratch slots for the head's rows past its root: the pool's reserved ones
        scratch = pool.reserved_slots()
        if len(scratch) != rows * self.scratch_per_row(depth, topk):
            raise ValueError(f"the KV pool reserves {len(scratch)} slots; the head needs {rows} x "
                             f"{self.scratch_per_row(depth, topk)}")
        self.scratch = torch.as_tensor(scratch, device=device).view(rows, -1)

    @staticmethod
    def scratch_per_row(depth: int, topk: int) -> int:
        """Scratch KV slots a row needs: one per node the head runs over past the root (at least one)."""
        return max((depth - 1) * topk, 1)

    @property
    def head_rows(self) -> int:
        """Nodes of a tree the head runs over: every level's but the last's."""
        return (self.depth - 1) * self.topk

    def attach(self, backend, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """The target's attention backend and rope tables [positions, head_dim], which the head's levels use."""
        self.backend, self.cos, self.sin = backend, cos, sin

    def runs(self, head: HeadWork) -> bool:
        return head != HeadWork.NONE

    def trees(self, step: DraftStep):
        return self.trees_of(step.rows.long(), step.roots, step.width), None

    def trees_of(self, rows: torch.Tensor, roots: torch.Tensor, width: int):
        """(tokens, parents, depths, ancestors, keys) [S, width + 1] of the trees left for `rows`
        (none where none was left; padding past the tree), roots [S] their last tokens. The drafts
        stand in key order: a step verifies a tree's first few (kernels/draft_rows.py), which hold
        their parents, and along a path the nodes are in depth order, as the accept walk reads them."""
        s, n, dev = rows.shape[0], self.nodes, rows.device
        keys = torch.where(self.tracked[rows, None], self.keys[rows], -1)
        at = torch.arange(width + 1, device=dev)
        root = torch.zeros(s, 1, dtype=torch.long, device=dev)
        pad = torch.full((s, width - n), -1, dtype=torch.long, device=dev)
        keys = torch.cat([root - 1, keys, pad], dim=1)
        drafted = keys >= 0
        tokens = torch.cat([roots[:, None], self.tokens[rows], pad.clamp(min=0)], dim=1)
        parents = torch.cat([root - 1, self.parents[rows], pad], dim=1)
        parents = torch.where((at == 0) | drafted, parents, PADDING)
        depths = torch.where(drafted, torch.cat([root, self.depths[rows], pad], dim=1), at)
        ancestors = torch.where(drafted, torch.cat([root + 1, self.ancestors[rows], pad], dim=1), (1 << (at + 1)) - 1)
        return tokens, parents, depths, ancestors, keys

    def extend(self, ids: torch.Tensor, aux: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over a step's rows: (logits over the draft vocabulary, output) per row."""
        return self._head(ids, aux, ctx)

    def _head(self, ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        # (EAGLE-1 and MTP layers have no lm_head of their own: the target's, over the whole vocabulary)
        lm_head = None if self.head.cfg.kind == "eagle3" else self.model.lm_head_weight
        return self.head(ids, hidden, ctx, self.model.model.embed_tokens, lm_head)

    def after_forward(self, step: DraftStep, drawn: torch.Tensor, aux: torch.Tensor, ctx: ForwardContext):
        """Its pass over the step's rows: each row's draw and the hidden states the target wrote."""
        return self.extend(drawn, aux, ctx)

    def after_accept(self, step: DraftStep, extended, bits: torch.Tensor, row_of_node: torch.Tensor | None,
                     max_kv_len: int | None) -> None:
        """Once the step's trees are walked: its pass keeps its KV and leaves no chains (PASS), or it
        drafts the next step's trees from each sequence's deepest accepted node (CHAIN); `bits` [S]:
        the accepted nodes, `row_of_node` [S, nodes] their rows (None: a row per sequence)."""
        rows = step.rows.long()
        if step.head == HeadWork.PASS:
            self.forget(rows)
            return
        deepest = bits.double().log2().floor().long()
        seqs = torch.arange(rows.shape[0], device=rows.device)
        at = row_of_node[seqs, deepest] if row_of_node is not None else seqs
        self.draft(rows, extended[0][at], extended[1][at], step.table.lengths[rows].long(), self.backend, self.cos,
                   self.sin, max_kv_len=max_kv_len)

    def after_prefill(self, batch, starts: np.ndarray, ctx: ForwardContext, aux: torch.Tensor, drawn: torch.Tensor,
                      logits_rows: list[int], table) -> None:
        """The head over a prefill step's rows (row r's input: the token after it, the prompt's
        or, at a sampling item's last row, its first sample's draw), then trees for the sampled
        sequences (their forks start without: they share the prompt's last slot). A prompt whose
        first chunk this is has its head KV whole from here on (`tracked`). `batch.items`: each
        item's sequence (`tokens`, `row`, `forks`), its new tokens (`num_new`) and whether it draws
        (`samples`); `starts` each item's first position."""
        nexts, first_draw, sampled, forks, fork_of, starting, d = [], [], [], [], [], [], 0
        for item, start in zip(batch.items, starts.tolist()):
            seq = item.seq
            if start == 0:
                starting.append(seq.row)
            following = seq.tokens[start + 1 : start + item.num_new + 1]
            nexts.append(np.asarray(following + [0] * (item.num_new - len(following)), dtype=np.int64))
            if item.samples:
                first_draw.append(d)
                sampled.append(seq.row)
                forks += [f.row for f in seq.forks]
                fork_of += [seq.row] * len(seq.forks)
                d += 1 + len(seq.forks)
        device = drawn.device
        ids = to_device(np.concatenate(nexts), device)
        last = to_device(np.array(logits_rows, dtype=np.int64), device)
        ids[last] = drawn[to_device(np.array(first_draw, dtype=np.int64), device)]
        if starting:
            self.track(to_device(np.array(starting, dtype=np.int64), device))
        logits, hidden = self.extend(ids, aux, ctx)
        if sampled:
            rows = to_device(np.array(sampled, dtype=np.int64), device)
            self.draft(rows, logits[last], hidden[last], table.lengths[rows].long(), self.backend, self.cos, self.sin,
                       max_kv_len=ctx.meta.max_kv_len + 1)  # (+ the first draw)
        if forks:
            fork_rows = to_device(np.array(forks, dtype=np.int64), device)
            self.track(fork_rows, like=to_device(np.array(fork_of, dtype=np.int64), device))
            self.forget(fork_rows)

    def forget(self, rows: torch.Tensor) -> None:
        """These rows start without drafts (a fork's first step)."""
        self.keys.index_fill_(0, rows, -1)  # (a scalar fill: index assignment copies a host tensor, which capture refuses)

    def sleep(self) -> None:
        """The head stops running (spec/head_watch.py HeadCycle): every row's head KV falls behind
        from here on, so none drafts again (a row tracks again once a prompt starts in it while
        the head runs). Queued on the stream behind the steps in flight, whose trees it drops."""
        self.tracked.fill_(False)
        self.keys.fill_(-1)

    def track(self, rows: torch.Tensor, like: torch.Tensor | None = None) -> None:
        """These rows' head KV is whole (their prompt starts now), or as whole as `like` rows' (forks)."""
        self.tracked[rows] = True if like is None else self.tracked[like]

    def draft(self, rows: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor, lengths: torch.Tensor,
              backend, cos: torch.Tensor, sin: torch.Tensor, max_kv_len: int | None = None) -> None:
        """Trees for `rows` [S] from the head's output at their deepest accepted node (logits,
        hidden [S, ...]); lengths [S]: their token counts now (the last token is the next root);
        max_kv_len: a bound of the step's KV lengths (eager steps; None: the pool's context, as
        captured graphs need; the CPU's reference attention pads every row to it).

        Nodes are numbered level by level (level j's k-th is (j - 1) * topk + k) until the end,
        where the tree keeps the likeliest `nodes` of them in key order."""
        s, k, dev = rows.shape[0], self.topk, rows.device
        score, best = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [S, K]: the first level
        scores, tokens = [score], [self.d2t[best]]
        parents = [torch.full((s, k), -1, dtype=torch.long, device=dev)]  # (-1: the root)
        if self.depth > 1:
            n = self.head_rows
            kv_bound = self.pool.max_context if max_kv_len is None else min(max_kv_len + n, self.pool.max_context)
            slot_table = self.pool.slot_table
            root = lengths - 1  # the root's position: the first level's rows stand there
            slot_table[rows[:, None], root[:, None] + torch.arange(n, device=dev)] = self.scratch[rows].to(slot_table.dtype)
            seq_rows = rows.to(torch.int32)
            ids = torch.empty(s, n, dtype=torch.long, device=dev)
            inputs = hidden.new_empty(s, n, hidden.shape[-1])  # each row's: its parent's output
            ids[:, :k], inputs[:, :k] = tokens[0], hidden[:, None]
            if k > 1:  # each row's ancestors among the rows, itself included (a chain's rows need no mask)
                bits = torch.zeros(s, n, dtype=torch.long, device=dev)
                bits[:, :k] = 1 << torch.arange(k, device=dev)
            for level in range(1, self.depth):
                # rows of the levels above first (a row sees its ancestors' KV, not their cousins'),
                # unless every node above is an ancestor (a chain)
                first = 0 if k > 1 else level - 1
                last = level * k
                q = last - first
                at = root[:, None] + torch.arange(level, device=dev).repeat_interleave(k)[first:last]  # [S, q]: positions
                meta = AttentionMetadata(
                    seq_rows=seq_rows, kv_lens=(root + last).to(torch.int32),
                    qo_indptr=torch.arange(0, (s + 1) * q, q, dtype=torch.int32, device=dev), slot_table=slot_table,
                    out_slots=self.scratch[rows, first:last].reshape(-1),
                    tree_mask=bits[:, first:last].reshape(-1) if k > 1 else None,
                    max_q_len=q, max_kv_len=kv_bound,
                )
                backend.plan(meta)
                at = at.reshape(-1)
                ctx = ForwardContext(meta, backend, self.pool.k_caches, self.pool.v_caches, cos[at], sin[at])
                hidden_in = inputs[:, first:last].reshape(-1, inputs.shape[-1])
                out_logits, out = self._head(ids[:, first:last].reshape(-1), hidden_in, ctx)
                out_logits, out = out_logits.view(s, q, -1)[:, q - k:], out.view(s, q, -1)[:, q - k:]  # this level's rows
                lp, child = torch.log_softmax(out_logits.float(), dim=-1).topk(k, dim=-1)  # [S, K, K]
                score, pick = (scores[-1][:, :, None] + lp).view(s, k * k).topk(k, dim=-1)  # the next level: [S, K]
                parent = pick // k  # (among this level's nodes)
                scores.append(score)
                tokens.append(self.d2t[child.view(s, k * k).gather(1, pick)])
                parents.append((level - 1) * k + parent)
                if level < self.depth - 1:  # the next level's rows
                    ids[:, last : last + k] = tokens[-1]
                    inputs[:, last : last + k] = out.gather(1, parent[:, :, None].expand(-1, -1, out.shape[-1]))
                    if k > 1:
                        own = 1 << (last + torch.arange(k, device=dev))
                        bits[:, last : last + k] = bits[:, last - k : last].gather(1, parent) | own
        self._keep(rows, torch.cat(scores, dim=1), torch.cat(tokens, dim=1), torch.cat(parents, dim=1))

    def _keep(self, rows: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> None:
        """Keep the likeliest `nodes` of each tree (scores [S, N]: path log-probabilities, nodes
        level by level; parents [S, N] their parents' numbers, -1 for the root), in key order. A
        child's key is never above its parent's and a stable sort keeps the parent first, so the
        nodes kept hold their parents."""
        s, total, dev = scores.shape[0], scores.shape[1], scores.device
        keys = (KEY_SCALE * scores.exp()).long().clamp(0, KEY_SCALE - 1)
        if self.topk > 1:
            order = torch.sort(keys, dim=1, descending=True, stable=True).indices
            place = torch.empty_like(order).scatter_(1, order, torch.arange(total, device=dev).expand(s, -1).contiguous())
        else:  # a chain's keys fall along it: it is in key order already (no sort in its steps)
            order = place = torch.arange(total, device=dev).expand(s, -1)
        node = place + 1  # each node's number in the tree kept (0: the root)
        kept = node <= self.nodes
        parent_node = torch.where(parents >= 0, node.gather(1, parents.clamp(min=0)), 0)
        own = torch.where(kept, 1 << node.clamp(max=self.nodes), 0)
        ancestors = torch.empty_like(own)
        k = self.topk
        ancestors[:, :k] = 1 + own[:, :k]  # (the root's bit, and its own)
        for start in range(k, total, k):  # level by level: a parent's bits are known before its children's
            ancestors[:, start : start + k] = ancestors.gather(1, parents[:, start : start + k]) | own[:, start : start + k]
        depths = torch.arange(total, device=dev) // k + 1
        first = order[:, : self.nodes]
        self.tokens[rows] = tokens.gather(1, first)
        self.parents[rows] = parent_node.gather(1, first)
        self.depths[rows] = depths.expand(s, -1).gather(1, first)
        self.ancestors[rows] = ancestors.gather(1, first)
        self.keys[rows] = keys.gather(1, first)
