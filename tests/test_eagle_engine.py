"""--spec eagle on the CPU: a tiny target with an EAGLE-3 head trained on its own samples
(recipes/train_eagle.py) drafts chains in the step; greedy decoding equals spec off token for
token with equal logprobs, forks and chunked prompts included, and some drafts are accepted."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from rollout import Engine, SamplingParams
from rollout.config import SpecConfig
from rollout.models.weights import WeightError
from rollout.tools.datasets import arithmetic_tasks
from spec.budget import SHADOW_EVERY, StepPlan
from spec.step import HeadWork

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import train_eagle  # noqa: E402
from test_device_speculation import outputs, same  # noqa: E402


@pytest.fixture(scope="module")
def target_and_head(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    make_tiny_model("llama", root / "target", layers=4)
    engine = Engine(model=str(root / "target"), spec="off", device="cpu", max_running_seqs=16)
    args = train_eagle.parse_args([
        "--out", str(root / "head"), "--device", "cpu", "--temperature", "0", "--max-new-tokens", "40",
        "--draft-vocab", "256", "--intermediate-size", "64", "--ttt", "2", "--steps", "150", "--batch", "4", "--lr", "1e-2",
    ])
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 12))] for _ in range(16)]
    data = train_eagle.sample_data(engine, prompts, args)
    draft_ids = train_eagle.draft_vocabulary(data, args.draft_vocab, 512)
    head, _ = train_eagle.train(engine, data, draft_ids, args, log=lambda line: None)
    train_eagle.write_head(head, draft_ids, engine.model.config, train_eagle.default_aux_layers(4), root / "head")
    return root / "target", root / "head", engine, prompts


def test_greedy_with_an_eagle_head_equals_spec_off(target_and_head):
    target, head, off, prompts = target_and_head
    eagle = Engine(model=str(target), spec="eagle", spec_draft_model=str(head), spec_adaptive=False,  # (the README's call)
                   device="cpu", max_running_seqs=16, max_prefill_tokens=16)  # (long prompts come in chunks)
    params = SamplingParams(temperature=0, max_new_tokens=40, n=2)
    batch = prompts[:6] + [list(range(3, 40))]
    got = outputs(eagle, batch, params)
    same(outputs(off, batch, params), got)
    assert eagle.runner.drafters.head.depth == eagle.spec.depth == 3  # (--spec-head-steps' default: the chain is the tree)
    stats = eagle.stats()
    assert stats["rollout/spec_draft_tokens"] > 0
    assert stats["rollout/spec_accepted_tokens"] > 0.1 * stats["rollout/output_tokens"]  # the head drafts the target's choices
    assert stats["rollout/spec_draft_tokens/eagle"] == stats["rollout/spec_draft_tokens"]  # counted by source
    assert got[0].spec["by_source"].keys() == {"eagle"}


def test_eager_head_steps_bounded_by_the_steps_kv_draft_what_the_whole_context_drafts(target_and_head, monkeypatch):
    """Eager steps bound the head's levels' KV by the step's (the CPU's reference attention pads
    every row to the bound: `make demo` took 5m24s with the pool's whole context, 2m08s bounded,
    on the 2-core CPU); the bound cuts no key: every tree's path scores are the same as with the
    whole context."""
    from spec.head_drafter import HeadDrafter

    target, head, _, prompts = target_and_head
    keep = HeadDrafter._keep

    def scores() -> list[torch.Tensor]:
        seen = []
        monkeypatch.setattr(HeadDrafter, "_keep", lambda self, rows, sc, *a: (seen.append(sc.clone()), keep(self, rows, sc, *a)))
        eng = Engine(model=str(target), spec="eagle", spec_draft_model=str(head), spec_adaptive=False,
                     spec_head_steps=4, spec_head_topk=2, device="cpu", max_running_seqs=16)
        outputs(eng, prompts[:6] + [list(range(3, 40))], SamplingParams(temperature=0, max_new_tokens=24, n=2))
        return seen

    bounded = scores()
    draft = HeadDrafter.draft
    monkeypatch.setattr(HeadDrafter, "draft", lambda self, *args, max_kv_len=None: draft(self, *args))
    whole = scores()
    assert len(bounded) == len(whole) > 10
    for b, w in zip(bounded, whole):
        torch.testing.assert_close(b, w)


def test_a_heads_tree_keeps_its_likeliest_nodes_in_key_order():
    """HeadDrafter._keep and trees: of a tree of 3 levels of 2 (path probabilities 0.6, 0.25;
    0.4, 0.2; 0.3, 0.1), the 4 likeliest lay out by key: a step that verifies a tree's first few
    drafts holds their parents, and along a path the nodes are in depth order. With one token a
    level it is the chain."""
    from kernels.ngram_draft import KEY_SCALE, PADDING
    from spec.head_drafter import HeadDrafter

    def drafter(topk: int, nodes: int) -> HeadDrafter:
        head = object.__new__(HeadDrafter)
        head.depth, head.topk, head.nodes = 3, topk, nodes
        head.tokens, head.parents, head.depths, head.ancestors = (torch.zeros(2, nodes, dtype=torch.long) for _ in range(4))
        head.keys = torch.full((2, nodes), -1)
        head.tracked = torch.tensor([True, True])
        return head

    head = drafter(topk=2, nodes=4)
    p = torch.tensor([[0.6, 0.25, 0.4, 0.2, 0.3, 0.1]])
    head._keep(torch.tensor([0]), p.log(), torch.tensor([[11, 12, 21, 22, 31, 32]]), torch.tensor([[-1, -1, 0, 1, 2, 2]]))
    tokens, parents, depths, ancestors, keys = head.trees_of(torch.tensor([0, 1]), torch.tensor([9, 8]), width=5)
    # nodes: root, 11 (0.6), 21 (0.4), 31 (0.3), 12 (0.25), padding; 22 and 32 are dropped
    assert tokens[0].tolist() == [9, 11, 21, 31, 12, 0]
    assert keys[0].tolist() == [-1] + (KEY_SCALE * p[0, [0, 2, 4, 1]]).long().tolist() + [-1]
    assert parents[0].tolist() == [-1, 0, 1, 2, 0, PADDING]
    assert depths[0].tolist()[:5] == [0, 1, 2, 3, 1]
    assert ancestors[0].tolist()[:5] == [0b1, 0b11, 0b111, 0b1111, 0b10001]
    assert parents[1].tolist() == [-1] + [PADDING] * 5 and tokens[1, 0] == 8  # (nothing left for it)
    chain = drafter(topk=1, nodes=3)
    chain._keep(torch.tensor([0]), torch.tensor([[0.6, 0.3, 0.1]]).log(), torch.tensor([[11, 12, 13]]),
                torch.tensor([[-1, 0, 1]]))
    tokens, parents, depths, ancestors, keys = chain.trees_of(torch.tensor([0]), torch.tensor([9]), width=4)
    node = torch.arange(5)
    assert tokens[0].tolist() == [9, 11, 12, 13, 0] and parents[0].tolist() == [-1, 0, 1, 2, PADDING]
    assert depths[0].tolist() == node.tolist() and ancestors[0].tolist() == ((1 << (node + 1)) - 1).tolist()


@torch.inference_mode()
def test_a_heads_tree_nodes_score_their_paths_as_the_head_drafts_each_path_alone(target_and_head):
    """EAGLE-2's tree (spec/head_drafter.py draft): every node's score is its path's log-probability under
    the head, as a reference computes it path by path (the head one row a step, over the prefix and
    the path's own KV): the head's rows at a level see their ancestors' KV and not their cousins',
    and each takes its own parent's output."""
    from kernels.attention import AttentionMetadata
    from rollout.models.llama import ForwardContext

    target, head, _, prompts = target_and_head
    engine = Engine(model=str(target), spec="eagle", spec_draft_model=str(head), spec_head_topk=3,
                    device="cpu", max_running_seqs=4, overlap_schedule=False)
    runner, eagle, pool = engine.runner, engine.runner.drafters.head, engine.pool
    drafted, kept = [], []
    draft, keep = eagle.draft, eagle._keep
    eagle.draft = lambda *args, **kw: (drafted.append([a.clone() for a in args[:4]]), draft(*args, **kw))
    eagle._keep = lambda rows, *tree: (kept.append(tree), keep(rows, *tree))
    for prompt in prompts[:3]:
        engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=8))
    engine.step()  # the prompts' prefill, whose end drafts their first trees
    (rows, logits, hidden, lengths), (scores, tokens, parents) = drafted[0], kept[0]
    draft_id = {t: d for d, t in enumerate(eagle.d2t.tolist())}
    slots = torch.as_tensor(pool.alloc(eagle.depth), dtype=torch.long)
    checked = 0
    for r in range(rows.shape[0]):
        root = int(lengths[r]) - 1
        table = pool.slot_table[rows[r : r + 1]].clone()
        table[0, root : root + eagle.depth] = slots.to(table.dtype)
        for node in range(scores.shape[1]):
            path = [node]
            while parents[r, path[0]] >= 0:
                path.insert(0, int(parents[r, path[0]]))
            score = torch.log_softmax(logits[r].float(), dim=-1)[draft_id[int(tokens[r, path[0]])]]
            h = hidden[r : r + 1]
            for i in range(1, len(path)):  # the head over the path's node i - 1, one row
                meta = AttentionMetadata(
                    seq_rows=torch.zeros(1, dtype=torch.int32), kv_lens=torch.tensor([root + i], dtype=torch.int32),
                    qo_indptr=torch.tensor([0, 1], dtype=torch.int32), slot_table=table, out_slots=slots[i - 1 : i],
                    tree_mask=None, max_q_len=1, max_kv_len=pool.max_context)
                runner.backend.plan(meta)
                at = root + i - 1
                cos, sin = runner.cos[at : at + 1], runner.sin[at : at + 1]
                ctx = ForwardContext(meta, runner.backend, pool.k_caches, pool.v_caches, cos, sin)
                out_logits, h = eagle._head(tokens[r, path[i - 1] : path[i - 1] + 1], h, ctx)
                score = score + torch.log_softmax(out_logits[0].float(), dim=-1)[draft_id[int(tokens[r, path[i]])]]
            assert float(scores[r, node]) == pytest.approx(float(score), abs=1e-4)  # (float32 sums)
            checked += len(path) == eagle.depth
    assert checked >= 3 * 3  # (every row's last level)


def test_greedy_with_a_heads_tree_of_three_a_level_equals_spec_off(target_and_head):
    """--spec-head-topk 3: the head's tree takes its three likeliest tokens at each level and keeps
    the likeliest 8 of them, alone and in the hybrid; greedy decoding is spec off's token for
    token, and more first drafts are accepted than the chain's."""
    target, head, off, prompts = target_and_head
    params = SamplingParams(temperature=0, max_new_tokens=32, n=2)
    batch = prompts[:4] + [[7, 8, 9, 10, 11] * 4]
    want = outputs(off, batch, params)
    first_accepted = {}
    for spec, topk in (("eagle", 1), ("eagle", 3), ("auto", 3)):
        engine = Engine(model=str(target), spec=spec, spec_draft_model=str(head), spec_head_topk=topk, spec_adaptive=False,
                        device="cpu", max_running_seqs=16)
        nodes = 3 if topk == 1 else 8  # (3 levels of topk, within --spec-max-draft-tokens)
        assert engine.runner.drafters.head.nodes == nodes and engine.spec.depth == (nodes if spec == "eagle" else 8)
        same(want, outputs(engine, batch, params))
        stats = engine.stats()
        assert stats["rollout/spec_accepted_tokens/eagle"] > 0
        first_accepted[spec, topk] = stats["rollout/spec_head_version_first_accept"]
    assert first_accepted["eagle", 3] > first_accepted["eagle", 1]  # a sibling is taken where the first draft is not
    assert SpecConfig(method="eagle", draft_model="h", head_topk=2, max_draft_tokens=16).head_nodes == 6
    for bad in (0, 33):  # (33 x 2 rows above the last level: more than a tree mask holds)
        with pytest.raises(ValueError, match="head_topk"):
            SpecConfig(head_topk=bad)


def test_an_eagle1_head_drafts_in_the_step_and_greedy_equals_spec_off(target_and_head, tmp_path):
    """EAGLE-1 (LlamaForCausalLMEagle: fc over the token's embedding and the target's last hidden
    state after the final norm, the target's lm_head): a random head's chains are verified and
    greedy decoding is spec off's token for token."""
    from test_draft_head import write_head

    target, _, off, prompts = target_and_head
    write_head(tmp_path / "eagle1", "eagle")
    eagle1 = Engine(model=str(target), spec="eagle", spec_draft_model=str(tmp_path / "eagle1"), spec_adaptive=False,
                    device="cpu", max_running_seqs=16)
    assert eagle1.runner.drafters.head.aux_layers == (4,)  # (the tiny target's 4 layers: past the last)
    params = SamplingParams(temperature=0, max_new_tokens=24, n=2)
    got = outputs(eagle1, prompts[:4], params)
    same(outputs(off, prompts[:4], params), got)
    assert eagle1.stats()["rollout/spec_draft_tokens/eagle"] > 0


def test_hybrid_drafts_from_the_index_where_it_matches_and_from_the_head_elsewhere(target_and_head):
    """--spec auto with a head: each sequence's tree is the n-gram index's where it found a match,
    else the head's chain; greedy stays spec off's token for token, and the statistics count
    each drafter's drafts apart."""
    target, head, off, prompts = target_and_head
    assert SpecConfig(method="auto", draft_model=str(head)).drafters == ("ngram", "eagle")
    hybrid = Engine(model=str(target), spec="auto", spec_draft_model=str(head), spec_adaptive=False, device="cpu",
                    max_running_seqs=16)
    params = SamplingParams(temperature=0, max_new_tokens=40, n=2)
    batch = prompts[:4] + [[7, 8, 9, 10, 11] * 4, [20, 21, 22] * 6]  # (repeats: the index finds matches in these)
    got = outputs(hybrid, batch, params)
    same(outputs(off, batch, params), got)
    stats = hybrid.stats()
    by = {src: stats[f"rollout/spec_draft_tokens/{src}"] for src in ("ngram", "eagle")}
    assert by["ngram"] > 0 and by["eagle"] > 0 and sum(by.values()) == stats["rollout/spec_draft_tokens"]
    assert stats["rollout/spec_accepted_tokens/eagle"] > 0
    per_sample = [o.spec["by_source"] for o in got]
    assert sum(s.get("ngram", {}).get("draft_tokens", 0) for s in per_sample) == by["ngram"]


def test_a_hybrid_runs_the_heads_chain_only_while_the_index_misses(target_and_head, monkeypatch):
    """The chain serves the sequences the index has nothing for: a hybrid's drafting step makes
    chains only if the index missed some sequence in the last drafting step collected before it
    was planned; where the index matched everywhere the head's steps are saved. Tokens stay spec off's."""
    target, head, off, prompts = target_and_head
    hybrid = Engine(model=str(target), spec="auto", spec_draft_model=str(head), spec_adaptive=False, device="cpu",
                    max_running_seqs=16)
    events, plan, observe = [], hybrid.spec.plan, hybrid.spec.observe
    monkeypatch.setattr(hybrid.spec, "plan", lambda *a, **k: events.append(("plan", plan(*a, **k))) or events[-1][1])

    def observed(*args):
        if args[-1].index_misses is not None:
            events.append(("misses", args[-1].index_misses))
        observe(*args)

    monkeypatch.setattr(hybrid.spec, "observe", observed)
    chains, draft = [], hybrid.runner.drafters.head.draft
    monkeypatch.setattr(hybrid.runner.drafters.head, "draft", lambda *a, **kw: chains.append(1) or draft(*a, **kw))
    params = SamplingParams(temperature=0, max_new_tokens=40)
    batch = [[7, 8, 9, 10, 11] * 4, [20, 21, 22] * 6, prompts[0]]  # (repeats: the index matches; a prompt where it may not)
    want = off.generate(batch, params)
    got = hybrid.generate(batch, params)
    assert [o[0].token_ids for o in want] == [o[0].token_ids for o in got]
    misses, planned = 1, []
    for kind, value in events:
        if kind == "misses":
            misses = value
        else:
            chain = value.head == HeadWork.CHAIN
            assert chain == (value.drafting and misses > 0) and value.head != HeadWork.NONE  # (awake throughout)
            planned.append(chain)
    drafting = [p.drafting for kind, p in events if kind == "plan"]
    assert any(d and not c for d, c in zip(drafting, planned)) and any(planned)
    assert len(chains) == sum(planned) + sum(r.prefill for r in hybrid.step_log)


def test_the_head_leaves_chains_only_where_the_next_step_may_use_them(target_and_head, monkeypatch):
    """A step leaves chains for the next when it verifies drafts itself or when the next step's
    trees come back for the statistics: with the budget verifying none, the steps around each
    shadow step (one in SHADOW_EVERY) run the head's chain, the statistics still see its chains,
    and the tokens are spec off's."""
    target, head, off, prompts = target_and_head
    eagle = Engine(model=str(target), spec="eagle", spec_draft_model=str(head), device="cpu", max_running_seqs=16)
    budget_plan = eagle.spec.budget.plan
    shadowed = lambda plan: StepPlan(0, plan.shadow, plan.shadow)  # noqa: E731  (the budget's: a shadow step's drafter runs)
    monkeypatch.setattr(eagle.spec.budget, "plan", lambda *a, **k: shadowed(budget_plan(*a, **k)))
    plans, spec_plan = [], eagle.spec.plan
    monkeypatch.setattr(eagle.spec, "plan", lambda *a, **k: plans.append(spec_plan(*a, **k)) or plans[-1])
    chains, draft = [], eagle.runner.drafters.head.draft
    monkeypatch.setattr(eagle.runner.drafters.head, "draft", lambda *a, **kw: chains.append(1) or draft(*a, **kw))
    returned, observe = [], eagle.spec.observe
    monkeypatch.setattr(eagle.spec, "observe", lambda seqs, roots, trees, *a: (
        returned.append(trees[3]) if trees is not None else None, observe(seqs, roots, trees, *a))[1])
    params = SamplingParams(temperature=0, max_new_tokens=40, n=2)
    want = off.generate(prompts[:4], params)
    got = eagle.generate(prompts[:4], params)
    assert [[o.token_ids for o in w] for w in want] == [[o.token_ids for o in g] for g in got]
    drafting, shadow = [p.drafting for p in plans], [p.shadow for p in plans]
    assert drafting[:-1] == [s or after for s, after in zip(shadow, shadow[1:])]  # (its own trees, or the next step's)
    assert 0 < sum(drafting) <= 2 * (len(plans) // SHADOW_EVERY + 1)
    prefills = sum(r.prefill for r in eagle.step_log)
    assert len(chains) <= sum(drafting) + prefills < len(plans)  # (a prefill leaves chains for the prompts it ends)
    assert returned and all((keys[:, 1:] >= 0).any() for keys in returned)  # the trees that came back hold chains
    assert eagle.stats()["rollout/spec_draft_tokens"] == 0


def test_a_head_the_budget_does_not_verify_sleeps_and_wakes_for_new_prompts(target_and_head, monkeypatch):
    """Not verified for IDLE_STEPS steps the head goes to sleep: its pass over the steps' rows stops
    (and the running sequences' chains with it); once it slept SLEEP_STEPS steps, the next prompts
    admitted wake it and their chains are verified. Tokens stay spec off's throughout."""
    import spec.head_watch as head_watch

    monkeypatch.setattr(head_watch, "IDLE_STEPS", 4)
    monkeypatch.setattr(head_watch, "SLEEP_STEPS", 8)
    monkeypatch.setattr(head_watch, "INFORMED_AFTER", 0)  # (the budget below evaluates nothing)
    target, head, off, prompts = target_and_head
    eagle = Engine(model=str(target), spec="eagle", spec_draft_model=str(head), spec_adaptive=False, device="cpu",
                   max_running_seqs=16)
    passes, extend = [], eagle.runner.drafters.head.extend
    monkeypatch.setattr(eagle.runner.drafters.head, "extend", lambda *a: passes.append(1) or extend(*a))
    budget_plan = eagle.spec.budget.plan
    monkeypatch.setattr(eagle.spec.budget, "plan", lambda *a, **k: StepPlan(0, False, False))  # (verifies nothing)
    params = SamplingParams(temperature=0, max_new_tokens=40)
    want = off.generate(prompts[:6], params)
    assert [o[0].token_ids for o in eagle.generate(prompts[:3], params)] == [o[0].token_ids for o in want[:3]]
    stats = eagle.stats()
    assert stats["rollout/spec_head_sleeps"] == 1 and stats["rollout/spec_head_awake"] == 0.0
    assert len(passes) <= 1 + 5 < len(eagle.step_log)  # (the prefill's, then the steps before it slept)
    drafter = eagle.runner.drafters.head  # asleep, no row keeps a chain (dropped once, as it fell asleep)
    assert not drafter.tracked.any() and (drafter.keys < 0).all()
    monkeypatch.setattr(eagle.spec.budget, "plan", budget_plan)
    assert [o[0].token_ids for o in eagle.generate(prompts[3:6], params)] == [o[0].token_ids for o in want[3:]]
    stats = eagle.stats()
    assert stats["rollout/spec_head_awake"] == 1.0 and stats["rollout/spec_draft_tokens/eagle"] > 0


def test_a_hybrids_head_whose_drafts_do_not_pay_for_its_time_sleeps_and_the_index_carries_on(target_and_head, monkeypatch):
    """With what the head's pass and trees cost a step (timed on the GPU's graphs; set here), a head
    whose accepted drafts are a smaller share of the tokens than its work is of the steps' time
    goes to sleep, though verified; the index drafts on and the tokens stay spec off's. One that
    costs nothing stays awake."""
    import spec.head_watch as head_watch

    monkeypatch.setattr(head_watch, "PAY_WINDOW", 8)
    monkeypatch.setattr(head_watch, "INFORMED_AFTER", 0)
    target, head, off, prompts = target_and_head
    params = SamplingParams(temperature=0, max_new_tokens=40, n=2)
    batch = prompts[:4] + [[7, 8, 9, 10, 11] * 4]
    want = outputs(off, batch, params)
    for seconds, sleeps in ((1.0, True), (0.0, False)):  # (a second a step, against CPU steps of milliseconds)
        hybrid = Engine(model=str(target), spec="auto", spec_draft_model=str(head), spec_adaptive=False, device="cpu",
                        max_running_seqs=16)
        hybrid.spec.cycle.costs = {1: (seconds, seconds)}
        same(want, outputs(hybrid, batch, params))
        stats = hybrid.stats()
        assert stats["rollout/spec_head_sleeps"] == sleeps and stats["rollout/spec_draft_tokens/ngram"] > 0
        assert stats["rollout/spec_head_time_share"] > stats["rollout/spec_head_token_share"] if sleeps else \
            stats["rollout/spec_head_time_share"] == 0.0
    read, trees = [], hybrid.runner.drafters.head.trees  # (the free head's engine: awake, its trees read by drafting steps)
    monkeypatch.setattr(hybrid.runner.drafters.head, "trees", lambda *a: read.append(1) or trees(*a))
    hybrid.spec.cycle._sleep("a test")
    same(want, outputs(hybrid, batch, params))
    assert not read and hybrid.stats()["rollout/spec_draft_tokens/ngram"] > 0  # asleep: the index's trees alone, no merge


def test_a_hybrid_whose_head_sleeps_and_wakes_stays_spec_off_under_preemption(target_and_head, monkeypatch):
    """The head falling asleep and waking every few steps while sequences are preempted and
    their prompts come in chunks: the tokens and logprobs stay spec off's."""
    import spec.head_watch as head_watch

    monkeypatch.setattr(head_watch, "IDLE_STEPS", 3)
    monkeypatch.setattr(head_watch, "SLEEP_STEPS", 5)
    target, head, _, _ = target_and_head
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 40))] for _ in range(10)] + [[7, 8, 9, 10, 11] * 5]
    kw = dict(device="cpu", max_running_seqs=8, kv_cache_tokens=400, max_prefill_tokens=24)
    off = Engine(model=str(target), spec="off", **kw)
    hybrid = Engine(model=str(target), spec="auto", spec_draft_model=str(head), **kw)
    for max_new in (30, 50):
        params = SamplingParams(temperature=0, max_new_tokens=max_new, n=2)
        same(outputs(off, prompts, params), outputs(hybrid, prompts, params))
    stats = hybrid.stats()
    assert stats["rollout/num_preempted"] > 0 and stats["rollout/spec_head_sleeps"] > 2


def test_a_push_that_leaves_the_head_behind_switches_it_off_and_a_push_of_its_weights_back_on(target_and_head, tmp_path):
    """The target's weights replaced by another model's: the head's drafts stop matching, it is
    switched off for that version (the hybrid's n-gram index carries on; the output is that
    model's, spec off's), and a push that includes the head's tensors (under `draft.`) switches
    it on before the next step."""
    from safetensors.torch import load_file, save_file

    target, head, _, prompts = target_and_head
    other = make_tiny_model("llama", tmp_path / "other", seed=7, layers=4).state_dict()
    eagle = Engine(model=str(target), spec="auto", spec_draft_model=str(head), spec_adaptive=False, device="cpu",
                   max_running_seqs=16)  # (hybrid: the n-gram index carries on while the head is off)
    off = Engine(model=str(target), spec="off", device="cpu", max_running_seqs=16)
    for e in (eagle, off):
        e.update_weights(other.items(), version=1)
    params = SamplingParams(temperature=0, max_new_tokens=40, n=2)
    want = off.generate(prompts[:8], params)
    got = eagle.generate(prompts[:8], params)
    assert [[o.token_ids for o in w] for w in want] == [[o.token_ids for o in g] for g in got]
    stats = eagle.stats()
    assert stats["rollout/spec_head_switched_off"] == 1 and stats["rollout/spec_head_on"] == 0.0
    assert "weight version 1" in eagle.spec.watch.transitions[0]
    drafted = stats["rollout/spec_draft_tokens/eagle"]
    eagle.generate(prompts[:4] + [[7, 8, 9, 10, 11] * 4], params)  # off: its chains are masked (no probe in so few steps)
    assert eagle.stats()["rollout/spec_draft_tokens/eagle"] == drafted

    with pytest.raises(WeightError, match="draft.fc.weight"):
        eagle.update_weights([("draft.fc.weight", torch.zeros(3, 3))], version=2)
    # the target again, with the head this time: from disk, one of the pusher's methods
    tensors = load_file(str(head / "model.safetensors"))
    save_file({"draft." + n: t for n, t in tensors.items() if t.is_floating_point()}, str(tmp_path / "other" / "head.safetensors"))
    eagle.update_weights_from_disk(str(tmp_path / "other"), version=2)
    stats = eagle.stats()
    assert stats["rollout/spec_head_on"] == 1.0 and stats["rollout/spec_head_switched_on"] == 1
    assert "pushed with version 2" in eagle.spec.watch.transitions[-1]


def test_spec_mtp_drafts_with_the_checkpoints_own_mtp_layer(tmp_path):
    """A MiMo checkpoint (a Qwen2 body with `model.mtp_layers.0.*`): its body decodes as the same
    weights saved as Qwen2 do, and --spec mtp drafts with its MTP layer, greedy equal to spec off
    token for token with equal logprobs, the drafts counted under `mtp`."""
    import json

    from safetensors.torch import load_file, save_file

    from rollout.models.config import ModelConfig
    from spec.draft_head import DraftHead, HeadConfig

    qwen, mimo = tmp_path / "qwen2", tmp_path / "mimo"
    make_tiny_model("qwen2", qwen, seed=3)
    make_tiny_model("qwen2", mimo, seed=3)
    config = json.loads((mimo / "config.json").read_text())
    config.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (mimo / "config.json").write_text(json.dumps(config))
    target = ModelConfig.from_dir(mimo)
    layer = DraftHead(HeadConfig.mtp(target), target, layer=target.num_layers)
    gen = torch.Generator().manual_seed(4)
    tensors = load_file(str(mimo / "model.safetensors"))
    for name, t in layer.weight_targets().items():
        tensors[f"model.{name}"] = 0.2 * torch.randn(t.shape, generator=gen) + (1.0 if name.endswith("norm.weight") else 0.0)
    save_file(tensors, str(mimo / "model.safetensors"))

    make = lambda path, spec, **kw: Engine(model=str(path), spec=spec, device="cpu", max_running_seqs=8, **kw)  # noqa: E731
    params = SamplingParams(temperature=0, max_new_tokens=24, n=2)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 12))] for _ in range(3)]
    want = outputs(make(qwen, "off"), prompts, params)
    same(want, outputs(make(mimo, "off"), prompts, params))
    mtp = make(mimo, "mtp", spec_adaptive=False)
    same(want, outputs(mtp, prompts, params))
    stats = mtp.stats()
    assert stats["rollout/spec_draft_tokens/mtp"] == stats["rollout/spec_draft_tokens"] > 0
    split = make(mimo, "mtp", spec_adaptive=False, tp_size=2)  # the layer split over 2 ranks, q/k/v biases too
    try:
        assert [o.token_ids for o in outputs(split, prompts, params)] == [o.token_ids for o in want]
        assert split.stats()["rollout/spec_draft_tokens/mtp"] > 0
    finally:
        split.close()
    with pytest.raises(ValueError, match="no MTP layers"):
        make(qwen, "mtp")


def test_eagle_needs_a_head_and_a_head_needs_eagle_or_auto():
    with pytest.raises(ValueError, match="draft model"):
        SpecConfig(method="eagle")
    with pytest.raises(ValueError, match="draft model"):
        SpecConfig(method="ngram", draft_model="/somewhere")
    assert SpecConfig(method="auto").drafters == ("ngram",) and SpecConfig(method="off").drafters == ()


def test_rollout_bench_compares_eagle_with_spec_off(target_and_head, tmp_path):
    import json

    from rollout.tools.cli import main

    target, head, _, _ = target_and_head
    main(["bench", "--device", "cpu", "--model", str(target), "--workload", "decode", "--spec-modes", "off,eagle",
          "--spec-draft-model", str(head), "--batch-sizes", "2", "--prompt-len", "8", "--output-len", "16",
          "--out", str(tmp_path)])
    (result,) = tmp_path.glob("decode-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [r["spec"] for r in rows] == ["off", "eagle"] and rows[0]["output_tokens"] == rows[1]["output_tokens"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_eagle_steps_in_cuda_graphs_equal_eager_and_spec_off_on_the_default_model(default_model_dir, tmp_path):
    """The head's drafting captured in the decode/verify graphs (fp32, greedy), alone and in the
    hybrid, chains and trees: the same tokens and logprobs as the eager steps and as spec off. The head is untrained (the target's
    lm_head and norm, random layer): its drafts are verified, rarely accepted."""
    off = Engine(model=str(default_model_dir), spec="off", device="cuda", dtype="float32", kv_cache_tokens=50_000)
    cfg = train_eagle.head_config(off.model.config, train_eagle.parse_args(["--out", "-", "--draft-vocab", "2048"]))
    draft_ids = torch.arange(2048)
    head = train_eagle.new_head(off, cfg, draft_ids)
    train_eagle.write_head(head, draft_ids, off.model.config, train_eagle.default_aux_layers(off.model.config.num_layers),
                           tmp_path / "head")
    prompts = [t.question for t in arithmetic_tasks(3, seed=2)] + ["Name three primary colors."]
    params = SamplingParams(temperature=0, max_new_tokens=32, n=2)
    want = outputs(off, prompts, params)
    # (auto with a head: the hybrid; topk 3: the head's trees, three levels of the three likeliest, 8 kept)
    for spec, graphs, topk in (("eagle", True, 1), ("eagle", False, 1), ("auto", True, 1), ("eagle", True, 3), ("auto", True, 3)):
        eagle = Engine(model=str(default_model_dir), spec=spec, spec_draft_model=str(tmp_path / "head"), spec_head_topk=topk,
                       spec_adaptive=False, device="cuda", dtype="float32", kv_cache_tokens=50_000, cuda_graphs=graphs)
        assert (eagle.runner.graphs is not None) == graphs
        same(want, outputs(eagle, prompts, params), atol=1e-4)
        assert eagle.stats()["rollout/spec_draft_tokens/eagle"] > 0
        del eagle


def test_a_hybrids_draft_rows_go_to_the_index_before_the_head():
    """Keys of a hybrid's trees: every index draft outranks every head draft (the head fills what
    the index leaves), each drafter's drafts keep their order, roots and padding stay -1."""
    from kernels.ngram_draft import KEY_SCALE
    from spec.drafters import banded

    g = torch.Generator().manual_seed(5)
    keys = torch.randint(0, KEY_SCALE, (64, 9), generator=g)
    keys[:, 0] = -1
    keys[torch.rand(64, 9, generator=g) < 0.2] = -1
    from_head = torch.rand(64, generator=g) < 0.5
    out = torch.where(from_head[:, None], banded(keys, 1, 2), banded(keys, 0, 2))  # (the index's scale first)
    assert ((out < 0) == (keys < 0)).all() and (out < KEY_SCALE).all()
    real = keys >= 0
    head, index = out[real & from_head[:, None]], out[real & ~from_head[:, None]]
    assert head.numel() and index.numel() and head.max() < index.min()
    for mask in (real & from_head[:, None], real & ~from_head[:, None]):
        a, b = keys[mask], out[mask]
        assert ((a[:, None] > a[None, :]) <= (b[:, None] >= b[None, :])).all()  # order kept (ties may merge)


def test_the_default_models_head_in_the_repository_drafts_what_the_model_says(default_engine, target_and_head):
    """--spec-draft-model default: the default model's EAGLE-3 head, kept in the repository
    (recipes/train_eagle.py on the GPU, bench/RESULTS.md): loaded and checked against the model,
    its drafts are accepted often, and greedy decoding is spec off's token for token. It is the
    default model's alone, and its --spec auto is the hybrid with it (--spec ngram: the index alone)."""
    from rollout.config import DEFAULT_HEAD, EngineConfig, SpecConfig

    assert EngineConfig(model="default").spec.drafters == ("ngram", "eagle")
    assert EngineConfig(model="default").spec.draft_model == str(DEFAULT_HEAD)  # (a path, whatever the model becomes)
    assert EngineConfig(model="default", spec="ngram").spec.drafters == ("ngram",)
    assert EngineConfig(model="/some/model").spec.drafters == ("ngram",)  # (no head unless given one)
    mine = SpecConfig(method="auto")
    assert EngineConfig(model="default", spec=mine).spec.draft_model == str(DEFAULT_HEAD) and mine.draft_model is None
    eagle = Engine(model="default", spec="eagle", spec_draft_model="default", spec_adaptive=False, device="cpu")
    prompts = [[{"role": "user", "content": q}] for q in ("What is 17 + 25?", "Name three primary colors.")]
    prompts = [eagle.tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    params = SamplingParams(temperature=0, max_new_tokens=24)
    same(outputs(default_engine, prompts, params), outputs(eagle, prompts, params))
    stats = eagle.stats()
    assert stats["rollout/spec_head_version_first_accept"] > 0.3, stats
    target, _, _, _ = target_and_head
    with pytest.raises(ValueError, match="default model's head"):
        Engine(model=str(target), spec="eagle", spec_draft_model="default", device="cpu")
