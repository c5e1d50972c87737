#!/usr/bin/env bash
# The pending diffs' GPU A/B, one stage a device call (H200; the first call of a session carries only
# .devcache/smol.part.aa, the next .devcache/smol.part.ab and .whl, as bench/gpu_session.sh says). Logs to $OUT.
# Device time, estimated: inv-tests ~400 s, inv-ab ~300 s, split-tests ~250 s, split-ab ~400 s, moe-tiles ~120 s: in
# this order.
#   inv-tests:   invariant-tma-persistent.diff's kernel tests; invariant-prefill-32rows.diff's attention tests (a 100-token
#                prefill in 32-row blocks against each row decoded alone, bf16 and fp16); deterministic mode's and
#                coupled sampling's engine tests over the two stacked
#   inv-ab:      32 layers' products in one graph (bench/probes/invariant_tma.py --stack 32) here and in the persistent
#                tree; then deterministic mode's speed on the 8B shape b64 (1k prompts), each diff against this checkout,
#                in turns, 2 cycles
#   split-tests: split-k-norm.diff's kernel tests (partial sums, the norm that adds them up) and its engine tests (2 and 4
#                slices forced against none; PDL on = off with 2 slices)
#   split-ab:    decode b1 in turns, 2 cycles, this checkout against split-k-norm: the 8B shape, the Qwen3-30B-A3B shape,
#                the default model (b1 and b8)
#   moe-tiles:   no diff yet: the MoE products' tiles are autotuned by block of rows, so 64 rows run the tile timed at
#                1 row (and an engine's at its first graph's warm-up, on padding rows' routing); bench/moe_kernels.py
#                --parts with and without --retune says what a tile chosen at each row count would buy (issue 64: b64's
#                3,724 against 3,800; its down product 103 us against an 83 us bound)
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
decode_ab() {  # NAME BENCH-ARGS...: this checkout against split-k-norm in turns
  local name=$1; shift
  CYCLES=2 BENCH_OUT=/tmp/bench-$name bash bench/ab_versions.sh run head split-k-norm -- --workload decode \
    --spec-modes off --prompt-len 128 "$@" 2>&1 | tee "$OUT/split-ab-$name.log" | tail -4
}
case ${1:?inv-tests | inv-ab | split-tests | split-ab | moe-tiles} in
inv-tests)
  bash bench/ab_versions.sh apply invariant-tma-persistent invariant-tma-persistent
  bash bench/ab_versions.sh apply invariant-prefill-32rows invariant-prefill-32rows
  bash bench/ab_versions.sh apply inv-both invariant-tma-persistent invariant-prefill-32rows
  { in_tree invariant-tma-persistent 120 tests/test_fused_kernels.py -k "invariant or tma"
    in_tree invariant-prefill-32rows 150 tests/test_triton_attention.py -k invariant
    in_tree inv-both 300 tests/test_engine_gpu.py tests/test_numerics_gpu.py -k "invariant or deterministic or coupled"
  } | tee "$OUT/inv-tests.log"
  ;;
inv-ab)
  bash bench/ab_versions.sh apply invariant-tma-persistent invariant-tma-persistent
  bash bench/ab_versions.sh apply invariant-prefill-32rows invariant-prefill-32rows
  both invariant-tma-persistent 150 "$ROOT/bench/probes/invariant_tma.py" --stack 32 | tee "$OUT/tma-persistent-stack.log"
  SHAPE=8b VERSIONS="head invariant-tma-persistent invariant-prefill-32rows" CYCLES=2 bash bench/gpu_session.sh \
    deterministic-ab | tail -12
  ;;
split-tests)
  bash bench/ab_versions.sh apply split-k-norm split-k-norm
  { in_tree split-k-norm 100 tests/test_fused_kernels.py -k "split_over_k or rms_norm"
    in_tree split-k-norm 250 tests/test_engine_gpu.py -k "split_over_k or programmatic"
  } | tee "$OUT/split-tests.log"
  ;;
split-ab)
  bash bench/ab_versions.sh apply split-k-norm split-k-norm
  decode_ab 8b --random-model llama3-8b --batch-sizes 1 --output-len 128
  decode_ab moe --random-model qwen3-30b-a3b --batch-sizes 1 --output-len 256
  decode_ab default --batch-sizes 1,8 --output-len 256
  ;;
moe-tiles)
  for retune in "" --retune; do
    timeout 100 python3 bench/moe_kernels.py --parts $retune --rows 1,8,64,512 2>&1 | grep "^|"
  done | tee "$OUT/moe-tiles.log"
  ;;
esac
