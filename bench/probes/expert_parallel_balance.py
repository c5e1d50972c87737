"""The busiest rank's experts under expert parallelism, behind docs/tensor-parallel.md: a token's top-8 of
128 experts, uniformly routed, split evenly over 2 or 4 ranks; the exact expectation of the largest share
(multivariate hypergeometric), against the width split's 8 / ranks on every rank. `python
bench/probes/expert_parallel_balance.py`."""

from __future__ import annotations

from itertools import product
from math import comb, prod

EXPERTS, PICKS = 128, 8


def expected_busiest(ranks: int) -> float:
    per = EXPERTS // ranks
    total = 0
    for counts in product(range(PICKS + 1), repeat=ranks):
        if sum(counts) == PICKS:
            total += prod(comb(per, c) for c in counts) * max(counts)
    return total / comb(EXPERTS, PICKS)


if __name__ == "__main__":
    for ranks in (2, 4):
        busiest = expected_busiest(ranks)
        print(f"{ranks} ranks: busiest {busiest:.2f} experts, width split {PICKS / ranks:g}: {busiest / (PICKS / ranks):.2f}x")
