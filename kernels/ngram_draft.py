"""Draft trees from n-gram matches over token rows on the device: prompt lookup, siblings, history.

Every sequence's tokens (prompt and output) live in a row of a token table on the device, and
so do finished samples kept as history. To draft for sequence s (own row r, L tokens), with
query q = its last `window` tokens:

1. Match. In the own row, then each other row t of s's scan list (the own row is skipped
   there), a position c is a candidate continuation when the tokens before it equal the query's
   last k tokens; k is its match length (at most `window`, at least `min_match`). The own row
   offers c in [1, L - 1] (prompt lookup); other rows, which share the prompt, offer only c in
   [prompt_len(t), len(t) - 1]: their outputs, and the first output token after the prompt.
2. Candidates. Only the longest match length found counts (the longest suffix that was ever
   continued); of its positions, the `cands` most recent are kept: live rows before history,
   then the larger c, then the own row, then the earlier row in the scan list.
3. Tree. Each candidate continues with up to `depth` tokens (its row's tokens from c on, up to
   the row's length). The distinct prefixes of those continuations are the possible nodes;
   a prefix's count is how many candidates share it. The `width` best prefixes are drafted,
   ranked by count (how often that continuation occurs), then shallower, then by candidate
   (recency). Counts never grow with depth, so a prefix always ranks above its extensions and
   the chosen set is a tree whose parents precede their children.

4. Confidence. Each draft node gets a key that orders drafts across sequences (a step verifies
   only the best few; rollout/engine/model_runner.py): the share of candidates continuing with
   its prefix, shrunk for few candidates, times that of a long match,
   floor(1024 * count * m / ((found + 1) * (m + 1))) with m the match length and `found` the
   candidates kept. Within a tree it never grows with the rank, so the best few of a sequence
   are always a tree.

Outputs per sequence ([S, width + 1], int64): node tokens, parents (-1: the root, -2: padding,
never accepted), depths (root 0), ancestor bitmasks (bit j: node j is the node or above it) and
keys (-1 for the root and padding), with node 0 the root, the sequence's last token.
`draft_trees` runs the Triton kernel on CUDA and `draft_trees_ref` elsewhere; the reference is
the definition the kernel is held to.
"""

from __future__ import annotations

import torch

from kernels import pdl
from kernels.fused import triton, use_triton

if triton is not None:
    import triton.language as tl

PADDING = -2  # parent of a padding node: it carries no draft and is never accepted
BLOCK = 256  # positions matched per vector step of the kernel
KEY_SCALE = 1024  # a key's resolution (step 4)


def draft_trees(
    tokens: torch.Tensor, lengths: torch.Tensor, prompt_lens: torch.Tensor, history_start: int,
    rows: torch.Tensor, scan: torch.Tensor, window: int, min_match: int, cands: int, depth: int, width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trees of `width` drafts (and the root) for the sequences in `rows` [S] int32.

    tokens [R, C] int32: the token table; lengths, prompt_lens [R] int32; rows from
    `history_start` on hold history (older than live rows). scan [S, M] int32: the rows each
    sequence searches, its own among them, -1 for none. Returns tokens, parents, depths, ancestor
    masks and keys, each [S, width + 1] int64. At most 255 rows are scanned per sequence."""
    if use_triton(tokens) and rows.numel():
        return _draft_triton(tokens, lengths, prompt_lens, history_start, rows, scan, window, min_match, cands,
                             depth, width)
    return draft_trees_ref(tokens, lengths, prompt_lens, history_start, rows, scan, window, min_match, cands,
                           depth, width)


# ---------------- the reference ----------------
def draft_trees_ref(tokens, lengths, prompt_lens, history_start, rows, scan, window, min_match, cands, depth, width):
    """`draft_trees` in torch, batched over sequences (the CPU path and the kernel's definition)."""
    dev = tokens.device
    rows = rows.long()
    own_len = lengths[rows].long()  # [S]
    t = scan.long()
    t = torch.cat([rows[:, None], torch.where(t == rows[:, None], -1, t)], dim=1)  # [S, 1 + M]: own row first
    s, m = t.shape
    present = t >= 0
    t_safe = t.clamp(min=0)
    t_len = torch.where(present, lengths[t_safe].long(), 0)  # [S, M]
    cap = max(int(t_len.max()) if t_len.numel() else 0, 1)  # (a host sync: this is the reference)
    first = prompt_lens[t_safe].long().clamp(min=1)  # [S, M]
    first[:, 0] = 1
    c = torch.arange(cap, device=dev)  # candidate continuation positions
    in_range = present[:, :, None] & (c >= first[:, :, None]) & (c < t_len[:, :, None])  # [S, M, C]
    # match length: consecutive equal tokens going back from c - 1 and from the query's end
    table = tokens[t_safe][:, :, :cap].long()  # [S, M, C]
    match = torch.zeros(s, m, cap, dtype=torch.long, device=dev)
    still = in_range.clone()
    for k in range(window):
        src = c - 1 - k
        q_pos = own_len - 1 - k  # [S]
        ok = (src >= 0)[None, None, :] & (q_pos >= 0)[:, None, None]
        left = table.gather(2, src.clamp(min=0).expand(s, m, cap))
        right = tokens[rows, q_pos.clamp(min=0)].long()[:, None, None]
        still = still & ok & (left == right)
        match += still
    best = torch.where(in_range, match, 0).amax(dim=(1, 2))  # [S]
    hit = in_range & (match == best[:, None, None]) & (best >= min_match)[:, None, None]
    live = (t < history_start) & present
    mi = torch.arange(m, device=dev)
    key = (live.long()[:, :, None] << 40) | (c[None, None, :] << 8) | (255 - mi)[None, :, None]
    key = torch.where(hit, key, -1).view(s, -1)
    top, where = key.topk(min(cands, key.shape[1]), dim=1)  # [S, K], most recent first
    found = top >= 0
    cand_t = t_safe.gather(1, where // cap)
    cand_c = where % cap
    return _tree_from_candidates(tokens, lengths, rows, cand_t, cand_c, found, best, depth, width)


def _tree_from_candidates(tokens, lengths, rows, cand_t, cand_c, found, best, depth, width):
    """Steps 3 and 4 of the module docstring, batched: candidates [S, K] -> the five [S, width + 1] outputs."""
    dev = tokens.device
    s, k = cand_t.shape
    d_idx = torch.arange(depth, device=dev)
    pos = cand_c[:, :, None] + d_idx  # [S, K, D]
    valid = found[:, :, None] & (pos < lengths[cand_t].long()[:, :, None])
    cont = tokens[cand_t[:, :, None].expand(s, k, depth), pos.clamp(max=tokens.shape[1] - 1)].long()
    cont = torch.where(valid, cont, -1)
    eq = (cont[:, :, None, :] == cont[:, None, :, :]) & valid[:, :, None, :] & valid[:, None, :, :]  # [S, K, K', D]
    same = eq.long().cumprod(dim=3).bool()  # the whole prefix up to depth d agrees
    count = same.sum(dim=2)  # [S, K, D]
    kk = torch.arange(k, device=dev)
    canon = torch.where(same, kk[None, None, :, None], k).amin(dim=2)  # [S, K, D]
    is_node = valid & (canon == kk[None, :, None])
    score = count * 4096 - d_idx[None, None, :] * 64 - kk[None, :, None]  # count desc, depth asc, candidate asc
    score = torch.where(is_node, score, -(1 << 40)).view(s, -1)
    order = score.argsort(dim=1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(k * depth, device=dev).expand(s, -1))
    chosen = is_node.view(s, -1) & (rank < width)
    node_of = torch.where(chosen, rank + 1, 0).view(s, k, depth)  # tree index of each chosen prefix
    # every prefix's own node, and its ancestors', read at its canonical candidate
    node_at = node_of.gather(1, canon.clamp(max=k - 1))  # [S, K, D]: node of prefix (canon(k, d), d)
    parent = torch.cat([torch.zeros(s, k, 1, dtype=torch.long, device=dev), node_at[:, :, :-1]], dim=2)
    bits = torch.where(node_at > 0, 1 << node_at, 0)
    anc = 1 + bits.cumsum(dim=2)  # distinct bits: the sum is their OR
    m = best[:, None, None]
    key = (KEY_SCALE * count * m) // ((found.sum(dim=1)[:, None, None] + 1) * (m + 1))  # [S, K, D]
    out_tok = torch.zeros(s, width + 1, dtype=torch.long, device=dev)
    out_par = torch.full((s, width + 1), PADDING, dtype=torch.long, device=dev)
    out_dep = torch.ones(s, width + 1, dtype=torch.long, device=dev)
    nodes = torch.arange(width + 1, device=dev)
    out_anc = 1 | (1 << nodes).expand(s, -1).clone()
    out_key = torch.full((s, width + 1), -1, dtype=torch.long, device=dev)
    root_len = lengths[rows.long()].long()
    out_tok[:, 0] = tokens[rows.long(), (root_len - 1).clamp(min=0)].long()
    out_par[:, 0], out_dep[:, 0], out_anc[:, 0] = -1, 0, 1
    flat = chosen.view(s, -1)
    bidx, fidx = flat.nonzero(as_tuple=True)
    target = node_of.view(s, -1)[bidx, fidx]
    out_tok[bidx, target] = cont.view(s, -1)[bidx, fidx]
    out_par[bidx, target] = parent.view(s, -1)[bidx, fidx]
    out_dep[bidx, target] = (fidx % depth) + 1
    out_anc[bidx, target] = anc.view(s, -1)[bidx, fidx]
    out_key[bidx, target] = key.view(s, -1)[bidx, fidx]
    return out_tok, out_par, out_dep, out_anc, out_key


# ---------------- the kernel ----------------
def _draft_triton(tokens, lengths, prompt_lens, history_start, rows, scan, window, min_match, cands, depth, width):
    if cands & (cands - 1):
        raise ValueError(f"the drafting kernel takes a power-of-two number of candidates (got {cands})")
    s, m = scan.shape
    dev = tokens.device
    outs = [torch.empty(s, width + 1, dtype=torch.int64, device=dev) for _ in range(5)]
    _draft_kernel[(s,)](
        tokens, lengths, prompt_lens, rows, scan, *outs, tokens.stride(0), scan.stride(0), history_start, m,
        WINDOW=window, MIN_MATCH=min_match, K=cands, DEPTH=depth, D=triton.next_power_of_2(depth), WIDTH=width,
        NODES=triton.next_power_of_2(width + 1), BLOCK=BLOCK, KEY_SCALE=KEY_SCALE, num_warps=4, **pdl.launch_args(),
    )
    return tuple(outs)


if triton is not None:

    @triton.jit
    def _match_lengths(tokens_ptr, stride, t, c, in_range, q_ptr, own_row, own_len, WINDOW: tl.constexpr):
        """Match length at each candidate position `c` [BLOCK] of row `t`."""
        match = tl.zeros(c.shape, dtype=tl.int32)
        still = in_range
        for k in tl.static_range(WINDOW):
            src = c - 1 - k
            q_pos = own_len - 1 - k
            ok = still & (src >= 0) & (q_pos >= 0)
            left = tl.load(tokens_ptr + t * stride + src, mask=ok, other=-1)
            right = tl.load(tokens_ptr + own_row * stride + q_pos, mask=q_pos >= 0, other=-2)
            still = ok & (left == right)
            match += still.to(tl.int32)
        return match

    @triton.jit
    def _scan_row(scan_ptr, lengths_ptr, prompt_lens_ptr, seq, stride_scan, mi, own_row, own_len):
        """Row mi of a sequence's search: its own row first, then its scan list without it (-1: none).
        Returns the row (0 when none), its length (0 when none) and its first candidate position."""
        listed = tl.load(scan_ptr + seq * stride_scan + tl.maximum(mi - 1, 0)).to(tl.int64)
        t = tl.where(mi == 0, own_row, tl.where(listed == own_row, -1, listed))
        t_safe = tl.maximum(t, 0)
        t_len = tl.where(t >= 0, tl.load(lengths_ptr + t_safe).to(tl.int64), 0)
        first = tl.where(mi == 0, 1, tl.maximum(tl.load(prompt_lens_ptr + t_safe).to(tl.int64), 1))
        return t_safe, t_len, first

    @triton.jit
    def _draft_kernel(
        tokens_ptr, lengths_ptr, prompt_lens_ptr, rows_ptr, scan_ptr,
        out_tok_ptr, out_par_ptr, out_dep_ptr, out_anc_ptr, out_key_ptr,
        stride_tok, stride_scan, history_start, num_scan,
        WINDOW: tl.constexpr, MIN_MATCH: tl.constexpr, K: tl.constexpr, DEPTH: tl.constexpr, D: tl.constexpr,
        WIDTH: tl.constexpr, NODES: tl.constexpr, BLOCK: tl.constexpr, KEY_SCALE: tl.constexpr, PDL: tl.constexpr,
    ):
        """One program per sequence: both passes over its scan rows, then its tree (draft_trees_ref's steps)."""
        pdl.wait_for_previous(PDL)
        seq = tl.program_id(0).to(tl.int64)
        own_row = tl.load(rows_ptr + seq).to(tl.int64)
        own_len = tl.load(lengths_ptr + own_row).to(tl.int64)
        lane = tl.arange(0, BLOCK).to(tl.int64)
        nothing = -(1 << 62)
        # pass 1: the longest match length anywhere
        best = tl.zeros([], dtype=tl.int32)
        for mi in range(num_scan + 1):
            t, t_len, first = _scan_row(scan_ptr, lengths_ptr, prompt_lens_ptr, seq, stride_scan, mi, own_row, own_len)
            for start in range(first, t_len, BLOCK):
                c = start + lane
                match = _match_lengths(tokens_ptr, stride_tok, t, c, c < t_len, tokens_ptr, own_row, own_len,
                                       WINDOW)
                best = tl.maximum(best, tl.max(match, 0))
        # pass 2: the K most recent positions of that length, merged in block by block (hits are rare)
        kk = tl.arange(0, K)
        top = nothing - kk.to(tl.int64)  # keys, unsorted; distinct even when empty
        for mi in range(num_scan + 1):
            t, t_len, first = _scan_row(scan_ptr, lengths_ptr, prompt_lens_ptr, seq, stride_scan, mi, own_row, own_len)
            live = (t < history_start).to(tl.int64)
            for start in range(first, t_len, BLOCK):
                c = start + lane
                match = _match_lengths(tokens_ptr, stride_tok, t, c, c < t_len, tokens_ptr, own_row, own_len,
                                       WINDOW)
                hit = (match == best) & (best >= MIN_MATCH)
                key = tl.where(hit, (live << 40) | (c << 8) | (255 - mi), nothing - K)
                while tl.max(key, 0) > tl.min(top, 0):
                    new = tl.max(key, 0)
                    slot = tl.min(tl.where(top == tl.min(top, 0), kk, K), 0)
                    top = tl.where(kk == slot, new, top)
                    key = tl.where(key == new, nothing - K, key)
        # candidates in key order, most recent first: candidate i holds the key that i keys beat
        beaten_by = tl.sum((top[None, :] > top[:, None]).to(tl.int32), 1)
        perm = beaten_by[None, :] == kk[:, None]  # [K(new), K(old)]
        top = tl.sum(tl.where(perm, top[None, :], 0), 1)
        found = top >= 0
        cand_c = tl.where(found, (top >> 8) & 0xFFFFFFFF, 0)
        m_of = 255 - (top & 255)
        cand_t = tl.load(scan_ptr + seq * stride_scan + m_of - 1, mask=found & (m_of > 0), other=0).to(tl.int64)
        cand_t = tl.where(m_of == 0, own_row, cand_t)
        # continuations [K, D]
        dd = tl.arange(0, D)
        pos = cand_c[:, None] + dd[None, :]
        cand_len = tl.load(lengths_ptr + cand_t, mask=found, other=0).to(tl.int64)
        valid = found[:, None] & (pos < cand_len[:, None]) & (dd[None, :] < DEPTH)
        cont = tl.load(tokens_ptr + cand_t[:, None] * stride_tok + pos, mask=valid, other=-1).to(tl.int64)
        cont = tl.where(valid, cont, -1)
        # same[k, k', d]: the prefixes up to d agree; counts, canonical (first) candidates
        eq = (cont[:, None, :] == cont[None, :, :]) & valid[:, None, :] & valid[None, :, :]
        same = tl.cumsum(tl.where(eq, 0, 1), 2) == 0
        count = tl.sum(same.to(tl.int64), 1)  # [K, D]
        canon = tl.min(tl.where(same, kk[None, :, None], K), 1)  # [K, D]
        is_node = valid & (canon == kk[:, None])
        score = tl.where(is_node, count * 4096 - dd[None, :] * 64 - kk[:, None], -(1 << 40))
        flat = tl.reshape(score, [K * D])
        rank = tl.reshape(tl.sum((flat[None, :] > flat[:, None]).to(tl.int64), 1), [K, D])
        chosen = is_node & (rank < WIDTH)
        node_of = tl.where(chosen, rank + 1, 0)  # [K, D]
        # node of prefix (canon(k, d), d), one-hot over candidates; the parent is that at depth d - 1
        node_at = tl.sum(tl.where(canon[:, None, :] == kk[None, :, None], node_of[None, :, :], 0), 1)
        shift = dd[:, None] == dd[None, :] - 1  # [D(from), D(to)]
        parent = tl.sum(tl.where(shift[None, :, :], node_at[:, :, None], 0), 1)
        bits = tl.where(node_at > 0, tl.full([K, D], 1, tl.int64) << node_at, 0)
        anc = 1 + tl.cumsum(bits, 1)
        m = best.to(tl.int64)
        key = (KEY_SCALE * count * m) // ((tl.sum(found.to(tl.int64), 0) + 1) * (m + 1))  # [K, D]
        # outputs: padding everywhere and the root, then the chosen prefixes at their node index
        nodes = tl.arange(0, NODES)
        node_ok = nodes <= WIDTH
        base = seq * (WIDTH + 1)
        root_tok = tl.load(tokens_ptr + own_row * stride_tok + tl.maximum(own_len - 1, 0)).to(tl.int64)
        one = tl.full([NODES], 1, tl.int64)
        tl.store(out_tok_ptr + base + nodes, tl.where(nodes == 0, root_tok, 0), mask=node_ok)
        tl.store(out_par_ptr + base + nodes, tl.where(nodes == 0, -1, -2), mask=node_ok)
        tl.store(out_dep_ptr + base + nodes, tl.where(nodes == 0, 0, 1), mask=node_ok)
        tl.store(out_anc_ptr + base + nodes, tl.where(nodes == 0, 1, 1 | (one << nodes.to(tl.int64))), mask=node_ok)
        tl.store(out_key_ptr + base + nodes, -one, mask=node_ok)
        tl.debug_barrier()
        target = base + node_of
        tl.store(out_tok_ptr + target, cont, mask=chosen)
        tl.store(out_par_ptr + target, parent, mask=chosen)
        tl.store(out_dep_ptr + target, dd[None, :].to(tl.int64) + 1 + tl.zeros([K, D], tl.int64), mask=chosen)
        tl.store(out_anc_ptr + target, anc, mask=chosen)
        tl.store(out_key_ptr + target, key, mask=chosen)
