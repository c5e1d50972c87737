#!/usr/bin/env bash
# The pending diffs' GPU A/B, one stage a device call (H200; the first call of a session carries only
# .devcache/smol.part.aa, the next .devcache/smol.part.ab and .whl, as bench/gpu_session.sh says). Logs to $OUT.
#   inv-tests, inv-ab:  invariant-tma-loads.diff: its kernel tests and deterministic mode's and coupled sampling's GPU
#            tests; deterministic mode's speed on the 8B shape b64 (1k prompts) and on rl 64 x 8 T=1.0 against this checkout
#   moe-tests, moe-ab:  moe-tma-weights.diff (on top of invariant-tma-loads): the MoE kernel and engine GPU tests; one
#            layer's kernels (bench/moe_kernels.py in each tree) and the Qwen3-30B-A3B shape's decode at b1/b64/b512
#            against invariant-tma-loads alone, 2 cycles
#   skinny:  skinny-tma-weights.diff (on top of invariant-tma-loads): its kernel tests, the decode products against cuBLAS
#            in each tree (bench/gemm_choice.py, TP 1 and 2), then the 8B shape's b1 decode and the default model's
#            b1/b8/b64 against invariant-tma-loads alone, 2 cycles
source bench/session_env.sh
bash bench/ab_versions.sh apply invariant-tma-loads invariant-tma-loads
bash bench/ab_versions.sh apply moe-tma-weights invariant-tma-loads moe-tma-weights
bash bench/ab_versions.sh apply skinny-tma-weights invariant-tma-loads skinny-tma-weights
in_tree() {  # VERSION TIMEOUT PYTEST-ARGS...: the version's own GPU tests over its own code
  local root=$ROOT/ab/$1 limit=$2; shift 2
  (cd "$root" && PYTHONPATH=/tmp/site:$root timeout "$limit" python3 -m pytest -q -m gpu "$@" 2>&1 | tail -4)
}
case ${1:?inv-tests | inv-ab | moe-tests | moe-ab | skinny} in
inv-tests)
  { in_tree invariant-tma-loads 120 tests/test_fused_kernels.py -k "invariant or tma"
    in_tree invariant-tma-loads 300 tests/test_engine_gpu.py tests/test_numerics_gpu.py -k "invariant or deterministic or coupled"
  } | tee "$OUT/inv-tma-tests.log"
  ;;
inv-ab)
  for shape in 8b rl; do
    SHAPE=$shape VERSIONS="head invariant-tma-loads" CYCLES=2 bash bench/gpu_session.sh deterministic-ab | tail -8
  done
  ;;
moe-tests)
  in_tree moe-tma-weights 400 tests/test_fused_moe_kernel.py tests/test_moe_gpu.py | tee "$OUT/moe-tma-tests.log"
  ;;
moe-ab)
  for v in invariant-tma-loads moe-tma-weights; do
    echo "== $v"
    (cd "ab/$v" && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 "$ROOT/bench/moe_kernels.py" --rows 1,64,512 --blocks "" |
      grep "^|")
  done | tee "$OUT/moe-tma-kernels.log"
  CYCLES=2 BENCH_OUT=/tmp/bench-moe-tma bash bench/ab_versions.sh run invariant-tma-loads moe-tma-weights -- \
    --workload decode --random-model qwen3-30b-a3b --spec-modes off --batch-sizes 1,64,512 --max-running-seqs 512 \
    --prompt-len 128 --output-len 256 2>&1 | tee "$OUT/moe-tma-decode.log" | tail -12
  ;;
skinny)
  in_tree skinny-tma-weights 120 tests/test_fused_kernels.py -k "tma or skinny or few_row" | tee "$OUT/skinny-tma-tests.log"
  for v in invariant-tma-loads skinny-tma-weights; do
    echo "== $v"
    (cd "ab/$v" && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 "$ROOT/bench/gemm_choice.py" --tp-sizes 1,2 \
      --prefetch-mib 16 2>&1 | grep "^|")
  done | tee "$OUT/skinny-tma-products.log"
  for args in "--random-model llama3-8b --batch-sizes 1" "--batch-sizes 1,8,64"; do
    CYCLES=2 BENCH_OUT=/tmp/bench-skinny-$RANDOM bash bench/ab_versions.sh run invariant-tma-loads skinny-tma-weights -- \
      --workload decode --spec-modes off --prompt-len 128 --output-len 128 $args 2>&1 | tail -8
  done | tee "$OUT/skinny-tma-decode.log"
  ;;
esac
