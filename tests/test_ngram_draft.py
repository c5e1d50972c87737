"""The n-gram drafter of kernels/ngram_draft.py: its torch reference against a brute-force search
that follows the definition line by line, on fresh random token streams."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from kernels.ngram_draft import KEY_SCALE, PADDING, draft_trees_ref


def brute_force(table, lengths, prompt_lens, history_start, row, scan, window, min_match, cands, depth, width):
    """One sequence's tree, straight from the definition (kernels/ngram_draft.py's docstring)."""
    own = table[row][: lengths[row]]
    found = []  # (match length, key, row, c)
    for m, t in enumerate([row] + [-1 if t == row else t for t in scan]):  # the own row first
        if t < 0:
            continue
        toks = table[t][: lengths[t]]
        first = 1 if t == row else max(prompt_lens[t], 1)
        for c in range(first, len(toks)):
            k = 0
            while k < window and c - 1 - k >= 0 and len(own) - 1 - k >= 0 and toks[c - 1 - k] == own[len(own) - 1 - k]:
                k += 1
            if k:
                key = (int(t < history_start) << 40) | (c << 8) | (255 - m)
                found.append((k, key, t, c))
    best = max((f[0] for f in found), default=0)
    chosen = sorted([f for f in found if f[0] == best and best >= min_match], key=lambda f: -f[1])[:cands]
    conts = [table[t][c : min(c + depth, lengths[t])] for _, _, t, c in chosen]
    prefixes = {}  # prefix tuple -> (count, depth, first candidate)
    for i, cont in enumerate(conts):
        for d in range(len(cont)):
            p = tuple(cont[: d + 1])
            count = sum(1 for other in conts if tuple(other[: d + 1]) == p)
            prefixes.setdefault(p, (count, d, i))
    ranked = sorted(prefixes, key=lambda p: (-prefixes[p][0], prefixes[p][1], prefixes[p][2]))[:width]
    node = {p: i + 1 for i, p in enumerate(ranked)}
    tokens = [own[-1]] + [0] * width
    parents, depths = [-1] + [PADDING] * width, [0] + [1] * width
    anc = [1] + [1 | (1 << i) for i in range(1, width + 1)]
    keys = [-1] * (width + 1)
    for p, i in node.items():
        tokens[i], depths[i] = p[-1], len(p)
        parents[i] = node[p[:-1]] if len(p) > 1 else 0
        anc[i] = 1 + sum(1 << node[p[:j]] for j in range(1, len(p) + 1))
        share = Fraction(prefixes[p][0], len(chosen) + 1) * Fraction(best, best + 1)  # step 4
        keys[i] = math.floor(KEY_SCALE * share)
    return tokens, parents, depths, anc, keys


def random_table(rng: random.Random, vocab: int, num_live: int, num_history: int, cap: int):
    """Token rows grouped by prompt: each group's rows share their prompt; streams repeat on purpose."""
    rows = num_live + 1 + num_history  # (the padding row between live rows and history)
    table = [[0] * cap for _ in range(rows)]
    lengths, prompt_lens = [0] * rows, [0] * rows
    groups = []
    live = list(range(num_live))
    history = list(range(num_live + 1, rows))
    rng.shuffle(live)
    rng.shuffle(history)
    while live:
        members = [live.pop() for _ in range(min(len(live), rng.randint(1, 4)))]
        members += [history.pop() for _ in range(min(len(history), rng.randint(0, 3)))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        motif = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        for r in members:
            out = [rng.choice(motif) if rng.random() < 0.7 else rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
            toks = (prompt + out)[:cap]
            table[r][: len(toks)] = toks
            lengths[r], prompt_lens[r] = len(toks), len(prompt)
        groups.append(members)
    return table, lengths, prompt_lens, groups, num_live + 1


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window,width", [(1, 4), (3, 8), (6, 8), (4, 3)])
def test_reference_matches_the_brute_force_search(seed, window, width):
    rng = random.Random(seed * 100 + window * 10 + width)
    vocab = rng.choice([3, 6, 50])  # few tokens: many matches; many: often none
    table, lengths, prompt_lens, groups, history_start = random_table(rng, vocab, 10, 6, 48)
    seqs = [(r, g) for g in groups for r in g if r < history_start]
    m = max(len(g) for g in groups) + 1
    scan = [g + [-1] * (m - len(g)) for _, g in seqs]
    rows = [r for r, _ in seqs]
    args = dict(window=window, min_match=1, cands=4, depth=5, width=width)
    got = draft_trees_ref(torch.tensor(table, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32),
                          torch.tensor(prompt_lens, dtype=torch.int32), history_start,
                          torch.tensor(rows, dtype=torch.int32), torch.tensor(scan, dtype=torch.int32), **args)
    for i, (row, _) in enumerate(seqs):
        want = brute_force(table, lengths, prompt_lens, history_start, row, scan[i], **args)
        assert [g[i].tolist() for g in got] == [list(w) for w in want], (seed, i)


def test_no_match_gives_a_root_and_padding_only():
    table = torch.tensor([[1, 2, 3, 4, 0, 0], [0] * 6, [7, 8, 9, 5, 0, 0]], dtype=torch.int32)
    lengths = torch.tensor([4, 0, 4], dtype=torch.int32)
    tok, par, dep, anc, key = draft_trees_ref(table, lengths, torch.tensor([2, 0, 2], dtype=torch.int32), 1,
                                         torch.tensor([0], dtype=torch.int32), torch.tensor([[0, 2]], dtype=torch.int32),
                                         window=3, min_match=1, cands=4, depth=4, width=3)
    assert tok.tolist() == [[4, 0, 0, 0]] and par.tolist() == [[-1, PADDING, PADDING, PADDING]]
    assert key.tolist() == [[-1, -1, -1, -1]]


def test_a_repeating_stream_drafts_its_continuation_and_siblings_outrank_history():
    # own row: prompt 5 6 7, output 1 2 3 1 2; a sibling went on 1 2 3 4; history once had 1 2 9
    table = torch.zeros(4, 12, dtype=torch.int32)
    table[0, :8] = torch.tensor([5, 6, 7, 1, 2, 3, 1, 2])
    table[1, :7] = torch.tensor([5, 6, 7, 1, 2, 3, 4])
    table[3, :6] = torch.tensor([5, 6, 7, 1, 2, 9])
    lengths = torch.tensor([8, 7, 0, 6], dtype=torch.int32)
    prompt = torch.tensor([3, 3, 0, 3], dtype=torch.int32)
    tok, par, dep, _, key = draft_trees_ref(table, lengths, prompt, 3, torch.tensor([0], dtype=torch.int32),
                                       torch.tensor([[0, 1, 3]], dtype=torch.int32),
                                       window=2, min_match=1, cands=4, depth=3, width=4)
    # "1 2" continues with 3 (own row, sibling: twice) and 9 (history, once): 3 first
    assert tok[0, :3].tolist() == [2, 3, 9] and par[0, 1:3].tolist() == [0, 0]
    # 3 candidates found, match length 2: "3" is 2 of them (1024 * 2/4 * 2/3), "9" one
    assert key[0, 1:3].tolist() == [341, 170]
