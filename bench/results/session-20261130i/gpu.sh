#!/usr/bin/env bash
# This session's calls on one H200 (call 1 carries .devcache/smol.part.aa; later calls carry .devcache/smol.part.ab and
# .whl; the trees compared are made on the machine: `ab_versions.sh copy`).
#   steps:  where the grpo b512 row's time goes at T=$TEMP (default 1.0), 256 new tokens, spec off against n-gram: the
#           rollout's wall by part (prefill steps, decode steps, outside the steps, the collector), then step by step
#   floor:  grpo b512 at T=1.0, n-gram against off, in turns with the same budget never choosing a draft row
#           (ab/no-draft: shadow steps still run the drafter for the statistics) and with the drafter never running
#           (ab/no-drafter: the index still fed every step), 2 cycles: what exploring, shadowing and indexing each cost
#   ab:     a bucket's measured drafting costs raise the line's guess at its neighbours, in a checkout with
#           bench/not-kept/neighbour-costs-not-kept.diff applied, against the budget without it (ab/line-only), grpo b512
#           at T=0.7 and 1.0, 2 cycles
#   order:  the bench runs a temperature's rounds together, in a checkout with
#           bench/not-kept/bench-temperature-major-not-kept.diff applied, against rounds of every temperature in turn
#           (ab/rounds-first), grpo b512 at T=0.7 and 1.0, 2 cycles
#   moe:    the Qwen3-30B-A3B shape's fused-MoE tests, kernels and decode b1/b64/b512 at this checkout
source bench/session_env.sh
case ${1:?steps | floor | ab | order | moe} in
steps)
  OUTPUT_LEN=256 TEMP=${TEMP:-1.0} bash bench/gpu_session.sh steps
  ;;
floor)
  bash bench/ab_versions.sh copy no-draft sed -i 's/^            if value(\*best) > 1 \/ plain:$/            if False:/' \
    spec/budget.py
  bash bench/ab_versions.sh copy no-drafter sed -i -e 's/^            if value(\*best) > 1 \/ plain:$/            if False:/' \
    -e 's/^        shadow = self._since_shadow >= self._shadow_every$/        shadow = False/' spec/budget.py
  grep -c "if False:\|shadow = False" ab/no-draft/spec/budget.py ab/no-drafter/spec/budget.py
  TEMPS=1.0 VERSIONS="head no-draft no-drafter" CYCLES=${CYCLES:-2} bash bench/gpu_session.sh grpo-ab | tail -14
  ;;
ab)
  bash bench/ab_versions.sh copy line-only patch -s -R -p1 -i ../../bench/not-kept/neighbour-costs-not-kept.diff
  grep -c NEIGHBOUR spec/budget.py ab/line-only/spec/budget.py
  VERSIONS="line-only head" CYCLES=${CYCLES:-2} bash bench/gpu_session.sh grpo-ab | tail -22
  ;;
order)
  bash bench/ab_versions.sh copy rounds-first patch -s -R -p1 -i ../../bench/not-kept/bench-temperature-major-not-kept.diff
  grep -c itertools.product rollout/tools/bench.py ab/rounds-first/rollout/tools/bench.py
  VERSIONS="rounds-first head" CYCLES=${CYCLES:-2} bash bench/gpu_session.sh grpo-ab | tail -22
  ;;
moe)
  bash bench/gpu_session.sh moe 2>&1 | tail -30
  ;;
esac
