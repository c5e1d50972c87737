#!/usr/bin/env bash
# This session's calls on one H200 (call 1 carries .devcache/smol.part.aa; later calls carry .devcache/smol.part.ab and
# .whl). The pending diffs' trees are made on the machine from their code parts (`ab_versions.sh apply`: no git there).
# (The two diffs it read landed as 7ece987 and c64a45b; git holds them under bench/pending/ before those commits.)
#   va:       bench/pending/verified-acceptance.diff against this checkout: grpo b512 at T=0.7 then 1.0, 2 cycles
#   va-rl:    the same pair on the rl row at T=0.7 (64 x 8, up to 2,048 tokens), where drafting pays, 2 cycles
#   inv:      bench/pending/invariant-one-split-direct.diff: its kernel and engine GPU tests, then deterministic mode's
#             speed on the 8B shape b64 (1,024-token prompts) against this checkout, 2 cycles
source bench/session_env.sh
pending() { bash bench/ab_versions.sh apply "$1" "$1"; }  # ab/NAME: this checkout with bench/pending/NAME.diff's code
case ${1:?va | va-rl | inv} in
va)
  pending verified-acceptance && grep -c observe_verified ab/verified-acceptance/spec/budget.py
  VERSIONS="head verified-acceptance" CYCLES=${CYCLES:-2} bash bench/gpu_session.sh grpo-ab | tail -22
  ;;
va-rl)
  pending verified-acceptance
  CYCLES=${CYCLES:-2} BENCH_OUT=/tmp/bench-va-rl bash bench/ab_versions.sh run head verified-acceptance -- --workload rl \
    --spec-modes off,ngram --batch-sizes 512 --n 8 --max-running-seqs 512 --temperature 0.7 --repeats 1 2>&1 |
    tee "$OUT/va-rl.log" | tail -16
  ;;
inv)
  pending invariant-one-split-direct && grep -c "one split" ab/invariant-one-split-direct/kernels/triton_attention.py
  (cd ab/invariant-one-split-direct && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q \
    tests/test_triton_attention.py -k invariant 2>&1 | tail -3 && PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m pytest \
    -q -m gpu tests/test_engine_gpu.py tests/test_numerics_gpu.py -k "invariant or deterministic or coupled" 2>&1 |
    tail -3) | tee "$OUT/inv-tests.log"
  SHAPE=8b VERSIONS="head invariant-one-split-direct" CYCLES=${CYCLES:-2} bash bench/gpu_session.sh deterministic-ab |
    tail -14
  ;;
esac
