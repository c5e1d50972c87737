#!/usr/bin/env bash
# The pending diffs' GPU A/B, one stage a device call (H200; the first call of a session carries only
# .devcache/smol.part.aa, the next .devcache/smol.part.ab and .whl, as bench/gpu_session.sh says). Logs to $OUT.
# Device time, estimated: inv-tests ~400 s, inv-ab ~300 s, moe-tiles ~250 s, moe-tiles-ab ~500 s, split-tests ~250 s,
# split-ab ~400 s: ~2,100 s in all, more than a session's 1,800, in this order.
#   inv-tests:   invariant-tma-persistent.diff's kernel tests; invariant-prefill-32rows.diff's attention tests (a 100-token
#                prefill in 32-row blocks against each row decoded alone, bf16 and fp16); deterministic mode's and
#                coupled sampling's engine tests over the two stacked
#   inv-ab:      32 layers' products in one graph (bench/probes/invariant_tma.py --stack 32) here and in the persistent
#                tree; then deterministic mode's speed on the 8B shape b64 (1k prompts), each diff against this checkout,
#                in turns, 2 cycles
#   moe-tiles:   the MoE layer's kernels one by one (bench/moe_kernels.py --parts) here, with the autotuner's tiles
#                (keyed by block of rows: 64 rows take the tile timed at 1 row) and with --retune (chosen at each row
#                count), then in moe-tiles-by-rows' tree (its own moe_kernels.py); its kernel tests, with the routing's
#                (a NaN row of router logits among them: 716d65b, not yet run on a GPU)
#   moe-tiles-ab: the b512 decode step's kernels (bench/tp_profile.py --kernels) here and in moe-tiles-by-rows' tree;
#                the Qwen3-30B-A3B shape's decode at b1/b64/b512, this checkout against it, in turns, 2 cycles
#   split-tests: split-k-norm.diff's kernel tests (partial sums, the norm that adds them up) and its engine tests (2 and 4
#                slices forced against none; PDL on = off with 2 slices)
#   split-ab:    decode b1 in turns, 2 cycles, this checkout against split-k-norm: the 8B shape, the Qwen3-30B-A3B shape,
#                the default model (b1 and b8)
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
case ${1:?inv-tests | inv-ab | moe-tiles | moe-tiles-ab | split-tests | split-ab} in
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
  bash bench/ab_versions.sh apply moe-tiles-by-rows moe-tiles-by-rows
  rm -rf /tmp/mk && mkdir -p /tmp/mk/bench && cp bench/moe_kernels.py /tmp/mk/bench/ &&
    (cd /tmp/mk && git apply --include=bench/moe_kernels.py "$ROOT/bench/pending/moe-tiles-by-rows.diff")
  { for retune in "" --retune; do
      echo "== this checkout $retune"
      timeout 100 python3 bench/moe_kernels.py --parts $retune --rows 1,8,64,512 2>&1 | grep "^|"
    done
    echo "== ab/moe-tiles-by-rows"
    (cd ab/moe-tiles-by-rows && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 /tmp/mk/bench/moe_kernels.py --parts \
      --rows 1,8,64,512 2>&1 | grep "^|")
  } | tee "$OUT/moe-tiles.log"
  in_tree moe-tiles-by-rows 150 tests/test_fused_moe_kernel.py -k "tile or experts_match or overflowed or routing" \
    | tee "$OUT/moe-tiles-tests.log"
  ;;
moe-tiles-ab)
  bash bench/ab_versions.sh apply moe-tiles-by-rows moe-tiles-by-rows
  both moe-tiles-by-rows 200 "$ROOT/bench/tp_profile.py" --shape qwen3-30b-a3b --tp-sizes 1 --batch 512 --kernels 12 \
    | tee "$OUT/moe-tiles-kernels-b512.log"
  CYCLES=2 BENCH_OUT=/tmp/bench-moe-tiles bash bench/ab_versions.sh run head moe-tiles-by-rows -- --workload decode \
    --random-model qwen3-30b-a3b --spec-modes off --batch-sizes 1,64,512 --max-running-seqs 512 --prompt-len 128 \
    --output-len 256 2>&1 | tee "$OUT/moe-tiles-decode.log" | tail -8
  ;;
esac
