"""A one-sequence prefill as its CUDA graph runs it (rollout/engine/prefill_graphs.py): padded to the
bucket, its K/V and attention told the real length, its logits row the chunk's last. The CPU has no
graphs, so the padded step runs eagerly here; on the CPU a row's results do not depend on the rows
beside it (tests/test_speculation.py), so the padded prefill must give the plain one's tokens and
logprobs to the last bit. The graphs themselves: tests/test_engine_gpu.py."""

from __future__ import annotations

import random

import pytest

from rollout import Engine, SamplingParams
from rollout.engine.prefill_graphs import BUCKETS, PrefillGraphs


class EagerPrefillGraphs(PrefillGraphs):
    """The step each graph would capture, run eagerly on the staged inputs."""

    runs = 0

    def graph(self, b: int):
        return self._graphs.setdefault(b, self.inputs(b))

    def run(self, tokens, positions, slots, row, start):
        g = self.graph(self.bucket(len(tokens)))
        self.stage(g, tokens, positions, slots, row, start)
        self.runs += 1
        return self.step(g)


def with_padded_prefill(engine: Engine) -> EagerPrefillGraphs:
    import torch

    runner = engine.runner
    cfg = runner.model.config
    attn_out = torch.zeros(BUCKETS[-1], cfg.num_heads, cfg.head_dim, dtype=engine.dtype)
    runner.prefill_graphs = EagerPrefillGraphs(runner.forward, engine.pool.slot_table, engine.table.padding_row,
                                               engine.pool.max_context, attn_out)
    return runner.prefill_graphs


@pytest.mark.parametrize("spec", ["off", "ngram"])
def test_padded_one_sequence_prefill_gives_the_plain_prefills_tokens_and_logprobs(model_dir, spec):
    # 64-token chunks: a 150-token prompt prefills in three, the later ones from a start past 0
    make = lambda: Engine(model=str(model_dir), spec=spec, device="cpu", max_prefill_tokens=64)  # noqa: E731
    plain, padded = make(), make()
    graphs = with_padded_prefill(padded)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 5, 16, 17, 40, 150)]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=3, ignore_eos=True)
    for prompt in prompts:  # alone: every chunk takes the padded step
        expected = plain.generate([prompt], params, return_logprob=True)[0]
        got = padded.generate([prompt], params, return_logprob=True)[0]
        assert [s.token_ids for s in got] == [s.token_ids for s in expected]
        assert [s.logprobs for s in got] == [s.logprobs for s in expected]
    assert graphs.runs == len(prompts) + 2  # (the 150-token prompt: three chunks)
    together = padded.generate(prompts, params)  # several sequences a step: eager, unchanged
    assert [[s.token_ids for s in o] for o in together] == [[s.token_ids for s in o] for o in plain.generate(prompts, params)]
