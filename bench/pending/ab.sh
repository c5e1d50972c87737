#!/usr/bin/env bash
# The pending diffs' GPU A/B, one stage a device call (H200; the first call of a session carries only
# .devcache/smol.part.aa, the next .devcache/smol.part.ab and .whl, as bench/gpu_session.sh says). Logs to $OUT.
# Device time, estimated: inv-tests ~450 s, inv-ab ~450 s, moe-tests ~500 s (its limits), moe-ab ~450 s, split-k
# ~120 s: more than a session's 1,800 s, so split-k last, and moe-ab before moe-tests (its kernels decide first).
#   inv-tests:  invariant-tma-store.diff's kernel tests; invariant-prefill-pairs.diff's attention tests (a prefill in
#               pairs against each row decoded alone); deterministic mode's and coupled sampling's engine tests over the
#               two stacked
#   inv-ab:     whether invariant attention keeps its bits in larger row blocks (bench/probes/invariant_prefill_rows.py);
#               a prefill step's products in one graph (bench/probes/invariant_tma.py --stack 32) here and with the
#               TMA store; then deterministic mode's speed on the 8B shape b64 (1k prompts), each diff against this
#               checkout, in turns, 2 cycles
#   moe-tests:  moe-routing-counts.diff's and moe-combine-norm.diff's kernel tests, and the MoE engine's GPU tests
#               (graphs = eager = HF greedy, half precision, two GPUs where there are two) over the combine in the norm
#   moe-ab:     this checkout's MoE layer kernel by kernel against each one's bound (bench/moe_kernels.py --parts: where
#               b512's 1.42x goes); one layer's kernels (bench/moe_kernels.py) in this checkout and each tree; then the
#               Qwen3-30B-A3B shape's decode at b1/b64/b512, each diff against this checkout, in turns, 2 cycles
#   split-k:    no diff yet: whether a few-row product split over K, its partials summed by the next norm, beats
#               cuBLAS's split-K and reduce (bench/probes/split_k_partials.py; issues 64 and 65)
source bench/session_env.sh
in_tree() {  # VERSION TIMEOUT PYTEST-ARGS...: the version's own GPU tests over its own code
  local root=$ROOT/ab/$1 limit=$2; shift 2
  (cd "$root" && PYTHONPATH=/tmp/site:$root timeout "$limit" python3 -m pytest -q -m gpu "$@" 2>&1 | tail -4)
}
both() {  # VERSION TIMEOUT SCRIPT ARGS...: a bench script of this checkout over this checkout's code, then the version's
  local v=$1 limit=$2; shift 2
  for root in "$ROOT" "$ROOT/ab/$v"; do
    echo "== ${root#$ROOT/}"
    (cd "$root" && PYTHONPATH=/tmp/site:$root timeout "$limit" python3 "$@" 2>&1 | grep "^|")
  done
}
case ${1:?inv-tests | inv-ab | moe-tests | moe-ab | split-k} in
inv-tests)
  bash bench/ab_versions.sh apply invariant-tma-store invariant-tma-store
  bash bench/ab_versions.sh apply invariant-prefill-pairs invariant-prefill-pairs
  bash bench/ab_versions.sh apply inv-both invariant-tma-store invariant-prefill-pairs
  { in_tree invariant-tma-store 120 tests/test_fused_kernels.py -k "invariant or tma"
    in_tree invariant-prefill-pairs 150 tests/test_triton_attention.py -k invariant
    in_tree inv-both 300 tests/test_engine_gpu.py tests/test_numerics_gpu.py -k "invariant or deterministic or coupled"
  } | tee "$OUT/inv-tests.log"
  ;;
inv-ab)
  bash bench/ab_versions.sh apply invariant-tma-store invariant-tma-store
  bash bench/ab_versions.sh apply invariant-prefill-pairs invariant-prefill-pairs
  timeout 100 python3 bench/probes/invariant_prefill_rows.py 2>&1 | grep "^|" | tee "$OUT/invariant-prefill-rows.log"
  both invariant-tma-store 150 "$ROOT/bench/probes/invariant_tma.py" --stack 32 | tee "$OUT/tma-store-stack.log"
  SHAPE=8b VERSIONS="head invariant-tma-store invariant-prefill-pairs" CYCLES=2 bash bench/gpu_session.sh \
    deterministic-ab | tail -10
  ;;
moe-tests)
  bash bench/ab_versions.sh apply moe-routing-counts moe-routing-counts
  bash bench/ab_versions.sh apply moe-combine-norm moe-combine-norm
  { in_tree moe-routing-counts 150 tests/test_fused_moe_kernel.py -k "routing or router"
    in_tree moe-combine-norm 80 tests/test_fused_kernels.py -k parts
    in_tree moe-combine-norm 300 tests/test_fused_moe_kernel.py tests/test_moe_gpu.py -k "experts_match or moe_in"
  } | tee "$OUT/moe-tests.log"
  ;;
moe-ab)
  bash bench/ab_versions.sh apply moe-routing-counts moe-routing-counts
  bash bench/ab_versions.sh apply moe-combine-norm moe-combine-norm
  timeout 120 python3 bench/moe_kernels.py --parts --rows 1,64,512,4096 2>&1 | grep "^|" | tee "$OUT/moe-parts.log"
  both moe-routing-counts 150 "$ROOT/bench/moe_kernels.py" --rows 1,8,64,512,4096 --blocks "" | tee "$OUT/moe-route-kernels.log"
  CYCLES=2 BENCH_OUT=/tmp/bench-moe-ab bash bench/ab_versions.sh run head moe-routing-counts moe-combine-norm -- \
    --workload decode --random-model qwen3-30b-a3b --spec-modes off --batch-sizes 1,64,512 --max-running-seqs 512 \
    --prompt-len 128 --output-len 256 2>&1 | tee "$OUT/moe-decode.log" | tail -14
  ;;
split-k)
  timeout 300 python3 bench/probes/split_k_partials.py 2>&1 | grep "^|" | tee "$OUT/split-k-partials.log"
  ;;
esac
