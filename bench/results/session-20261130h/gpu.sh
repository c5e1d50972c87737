#!/usr/bin/env bash
# This session's calls on one H200 (call 1 carries .devcache/smol.part.aa; later calls carry .devcache/smol.part.ab and
# .whl). A call carries 64 MiB, the model's first part 50 of them: the trees compared are made on the machine
# (`ab_versions.sh copy`).
#   tiles:  bench/pending/invariant-grouped-rows.diff (ab/invariant-grouped-rows): its GPU tests, then the batch-invariant
#           product at prefill's rows in this checkout and in the change (each version's kernels first on the path)
#   det:    deterministic inference, this checkout against the change, in turns (SHAPE=8b: b64 with 1k prompts, its wall
#           counts the prefill; SHAPE=rl: 64 x 8 T=1.0), CYCLES a version, then this checkout's default mode
#   kernels: the fused kernels' GPU tests (the change landed)
#   order:  after it landed: deterministic rl 64 x 8 T=1.0 (decode's 512 rows: 8 row blocks of 64) against the order before
#           (ab/row-order), then the 8B shape with a 256 x 128 tile first (ab/tile-256x128), in turns, 2 cycles each
#   gc:     a finished request lets go of its sequences (1a02d80), against the same without: grpo b512, 2 cycles
#           (request-detach.diff is 1a02d80's change: run this stage from that commit)
#   prefill: the deterministic 8B b64 prefill's kernels against the default mode's
#   steps:  where the grpo b512 row's time goes (256 new tokens, T=$TEMP), spec off against n-gram, step by step
source bench/session_env.sh
case ${1:?tiles | det | kernels | order | gc | prefill | steps} in
tiles)
  bash bench/ab_versions.sh copy invariant-grouped-rows \
    patch -s -p1 -i ../../bench/pending/invariant-grouped-rows.diff  # (then pending)
  (cd ab/invariant-grouped-rows && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu \
    tests/test_fused_kernels.py -k invariant 2>&1 | tail -4) | tee "$OUT/grouped-rows-tests.log"
  for v in . ab/invariant-grouped-rows; do
    echo "== $v"
    PYTHONPATH=/tmp/site:$ROOT/$v:$ROOT timeout 150 python3 bench/invariant_tiles.py --rows 4096,16384 2>&1 | quiet
  done | tee "$OUT/grouped-rows-tiles.log"
  ;;
det)
  SHAPE=${SHAPE:-8b} VERSIONS="head invariant-grouped-rows" CYCLES=${CYCLES:-2} bash bench/gpu_session.sh \
    deterministic-ab 2>&1 | grep -v "^| rollout" | tail -30
  ;;
kernels)  # the fused kernels' GPU tests in this checkout (call 1 of a lease: no model needed)
  timeout 300 python3 -m pytest -q -m gpu tests/test_fused_kernels.py 2>&1 | tail -4 | tee "$OUT/fused-kernels-tests.log"
  ;;
order)  # (ab/row-order: the order before the change; ab/tile-256x128: a tile tried first beside it)
  bash bench/ab_versions.sh copy row-order \
    sed -i 's/GROUP_M=1 if one_block else INVARIANT_GROUP_M/GROUP_M=1/' kernels/skinny_gemm.py
  bash bench/ab_versions.sh copy tile-256x128 \
    sed -i 's/^INVARIANT_TILES = \[.*/&\n    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),/' \
    kernels/skinny_gemm.py
  SHAPE=rl VERSIONS="head row-order" CYCLES=2 bash bench/gpu_session.sh deterministic-ab 2>&1 | grep -v "^| rollout" | tail -12
  SHAPE=8b VERSIONS="head tile-256x128" CYCLES=2 bash bench/gpu_session.sh deterministic-ab 2>&1 | grep -v "^| rollout" | tail -12
  ;;
gc)  # the grpo b512 rows (T=0.7 and 1.0, 3 runs each) in turns with ab/cyclic-requests: this checkout without
  # Request.detach (request-detach.diff reversed), 2 cycles
  bash bench/ab_versions.sh copy cyclic-requests \
    patch -s -R -p1 -i ../../bench/results/session-20261130h/request-detach.diff
  VERSIONS="head cyclic-requests" CYCLES=2 bash bench/gpu_session.sh grpo-ab | tail -16
  ;;
prefill)  # deterministic against default: the 8B shape b64's 1k-token prompts' prefill, its costliest kernels
  timeout 150 python3 bench/tp_profile.py --shape llama3-8b --tp-sizes 1 --batch 64 --prompt-len 1024 --kernels 14 \
    --prefill --variants default,deterministic 2>&1 | quiet | tee "$OUT/prefill-kernels-8b-b64.log" | tail -40
  ;;
steps)
  OUTPUT_LEN=256 TEMP=${TEMP:-0.7} bash bench/gpu_session.sh steps
  ;;
esac
