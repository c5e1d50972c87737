#!/usr/bin/env bash
# The next GPU session's measurements and the pending diff's A/B, one stage a device call (H200; the first call of a
# session carries only .devcache/smol.part.aa, the next .devcache/smol.part.ab and .whl, as bench/gpu_session.sh says;
# every later call within 30 s of the last, or the machine is gone with the model). Logs to $OUT.
# Device time, estimated: tests ~330 s, profile ~300 s, ab ~400 s, moe-prefetch ~120 s, moe-prefetch-ab ~300 s,
# route ~350 s. On 2 x H200 (x2-*: two stages side by side, one a GPU; x2-tp both GPUs), in this order: x2-tests
# ~240 s (no model needed: the first call), x2-tp ~480 s, x2-ab ~420 s, x2-more ~420 s.
#   x2-tests: GPU 0 tests-head (this checkout's MoE kernel tests), GPU 1 tests-pending (split-k-prefetch's, then
#            moe-weight-prefetch's, then moe-router-route + moe-down-combine's kernel tests)
#   x2-tp:   TP1 against TP2 at this checkout, one call: the Qwen3-30B-A3B shape's decode at b1/b64/b512, its b1 decode
#            steps kernel by kernel at TP1 and TP2 (where TP2's b1 step goes), the 8B shape's b1 at TP1 and TP2
#   x2-ab:   GPU 0 ab; GPU 1 moe-prefetch, then route-decode (route without its tests)
#   x2-more: GPU 0 moe-prefetch-ab; GPU 1 profile
#   tests:   this checkout's MoE kernel tests whole (the routing's NaN row among them, not yet run on a GPU), then
#            split-k-prefetch's kernel tests (the prefetch bitwise alike; the partials summed by the norm)
#   profile: decode steps kernel by kernel (bench/tp_profile.py --kernels, no PDL): the Qwen3-30B-A3B shape at b1, b64
#            and b512 (where do b512's ~7 ms outside the expert products go?), the 8B shape at b1 (after split-k-norm);
#            then what a chain of 100-550 tiny kernels costs in one graph, PDL off and on (bench/probes/launch_floor.py:
#            the floor of a b1 step's ~300 (8B) or ~550 (MoE) kernels)
#   ab:      decode b1 in turns, 2 cycles: this checkout, split-k-prefetch, and this checkout without the split
#            (SPLIT_K_CANDIDATES emptied: what split-k-norm gave the MoE shape, unmeasured when it landed); the 8B
#            shape, then the Qwen3-30B-A3B shape
#   moe-prefetch: moe-weight-prefetch's tests (the prefetch changes no bit); the MoE layer's parts
#            (bench/moe_kernels.py --parts, this checkout's script over each tree's code) here and in its tree
#   moe-prefetch-ab: if the parts moved, the Qwen3-30B-A3B shape's decode at b1/b64/b512 in turns, 2 cycles
#   route:   moe-router-route with moe-down-combine over it: their tests (the router and routing in one launch = two,
#            the picks combined in the down product's launch = the combine kernel, bitwise, 20 graph replays each), then
#            the Qwen3-30B-A3B shape's decode at b1 and b8 in turns, 2 cycles: this checkout, route, route + combine
source bench/session_env.sh
side_by_side() {  # $1 on GPU 0 and $2 on GPU 1, each stage's output to $OUT/<stage>-gpuN.out, then both
  CUDA_VISIBLE_DEVICES=0 bash "$0" "$1" > "$OUT/$1-gpu0.out" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 bash "$0" "$2" > "$OUT/$2-gpu1.out" 2>&1
  wait; tail -n 12 "$OUT/$1-gpu0.out" "$OUT/$2-gpu1.out"
}
moe_bench() { timeout "${LIMIT:-200}" python3 -m rollout.tools.cli bench --workload decode --random-model qwen3-30b-a3b \
  --spec-modes off --max-running-seqs 512 --prompt-len 128 "$@" 2>&1 | grep -E "^\| rollout"; }
case ${1:?tests | tests-head | tests-pending | profile | ab | moe-prefetch | moe-prefetch-ab | route | route-decode | x2-tests | x2-tp | x2-ab | x2-more} in
x2-tests) side_by_side tests-head tests-pending ;;
x2-ab) side_by_side ab moe-prefetch-then-ab ;;
moe-prefetch-then-ab) bash "$0" moe-prefetch; bash "$0" moe-prefetch-ab ;;
x2-more) side_by_side profile route-why ;;
x2-route) side_by_side route-only-decode route-only-tests ;;
route-only-tests)
  bash bench/ab_versions.sh apply moe-router-route moe-router-route > /dev/null
  (cd ab/moe-router-route && PYTHONPATH=/tmp/site:$PWD timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_fused_moe_kernel.py -k "one_launch or routing or overflowed" 2>&1 | tail -3; echo "rc=${PIPESTATUS[0]}") \
    | tee "$OUT/route-tests.log" ;;
route-only-decode)
  bash bench/ab_versions.sh apply moe-router-route moe-router-route > /dev/null
  CYCLES=2 BENCH_OUT=/tmp/bench-route timeout 300 bash bench/ab_versions.sh run head moe-router-route -- --workload decode \
    --random-model qwen3-30b-a3b --spec-modes off --batch-sizes 1,8 --prompt-len 128 --output-len 256 2>&1 \
    | tee "$OUT/route-decode.log" | tail -8 ;;
route-why)  # the route + combine tree's failing tests, their first failure whole; then the route tree alone's
  bash bench/ab_versions.sh apply moe-route-combine moe-router-route moe-down-combine > /dev/null
  bash bench/ab_versions.sh apply moe-router-route moe-router-route > /dev/null
  for t in moe-route-combine moe-router-route; do echo "== $t"
    (cd ab/$t && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m pytest -q -m gpu -x --tb=short -p no:cacheprovider \
      tests/test_fused_moe_kernel.py -k "one_launch or combines" 2>&1 | tail -40)
  done | tee "$OUT/route-why.log" ;;
x2-tp)
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())" > /dev/null || exit 1
  for tp in 1 2; do
    LIMIT=170 moe_bench --batch-sizes 1,64,512 --output-len 256 --tp-size $tp --out /tmp/bench-moe-tp$tp | sed "s/^/tp$tp /"
  done | tee "$OUT/moe-decode-tp1-tp2.log"
  timeout 150 python3 bench/tp_profile.py --shape qwen3-30b-a3b --tp-sizes 1,2 --tokens 32 --kernels 30 --batch 1 2>&1 \
    | grep "^|" | tee "$OUT/kernels-moe-b1-tp1-tp2.log" | tail -4
  for tp in 1 2; do
    timeout 80 python3 -m rollout.tools.cli bench --workload decode --random-model llama3-8b --spec-modes off \
      --batch-sizes 1 --prompt-len 128 --output-len 128 --repeats 3 --tp-size $tp --out /tmp/bench-8b-tp$tp 2>&1 \
      | grep "^| rollout" | tail -1 | sed "s/^/tp$tp /"
  done | tee "$OUT/decode-8b-b1-tp1-tp2.log"
  cat "$OUT/moe-decode-tp1-tp2.log"
  ;;
tests-head)
  { echo "== this checkout: MoE routing (the overflowed rows first), then the rest of the MoE kernel tests"
    timeout 60 python3 -m pytest -q -m gpu tests/test_fused_moe_kernel.py -k "overflowed or routing" 2>&1 | tail -3; \
      echo "rc=${PIPESTATUS[0]}"
    timeout 170 python3 -m pytest -q -m gpu tests/test_fused_moe_kernel.py -k "not (overflowed or routing)" 2>&1 \
      | tail -3; echo "rc=${PIPESTATUS[0]}"
  } | tee "$OUT/tests-head.log"
  ;;
tests-pending)
  { bash bench/ab_versions.sh apply split-k-prefetch split-k-prefetch > /dev/null
    echo "== split-k-prefetch: its kernel tests"
    (cd ab/split-k-prefetch && PYTHONPATH=/tmp/site:$PWD timeout 80 python3 -m pytest -q -m gpu \
      tests/test_fused_kernels.py -k "prefetch or split_over_k" 2>&1 | tail -3; echo "rc=${PIPESTATUS[0]}")
    bash bench/ab_versions.sh apply moe-weight-prefetch moe-weight-prefetch > /dev/null
    echo "== moe-weight-prefetch: its kernel tests"
    (cd ab/moe-weight-prefetch && PYTHONPATH=/tmp/site:$PWD timeout 70 python3 -m pytest -q -m gpu \
      tests/test_fused_moe_kernel.py -k "prefetch or experts_match" 2>&1 | tail -3; echo "rc=${PIPESTATUS[0]}")
    bash bench/ab_versions.sh apply moe-route-combine moe-router-route moe-down-combine > /dev/null
    echo "== moe-router-route + moe-down-combine: their kernel tests"
    (cd ab/moe-route-combine && PYTHONPATH=/tmp/site:$PWD timeout 80 python3 -m pytest -q -m gpu \
      tests/test_fused_moe_kernel.py -k "one_launch or combines or routing or overflowed" 2>&1 | tail -3; \
      echo "rc=${PIPESTATUS[0]}")
  } | tee "$OUT/tests-pending.log"
  ;;
route-decode)
  bash bench/ab_versions.sh apply moe-router-route moe-router-route > /dev/null
  bash bench/ab_versions.sh apply moe-route-combine moe-router-route moe-down-combine > /dev/null
  CYCLES=2 BENCH_OUT=/tmp/bench-route timeout 300 bash bench/ab_versions.sh run head moe-router-route \
    moe-route-combine -- --workload decode --random-model qwen3-30b-a3b --spec-modes off --batch-sizes 1,8 \
    --prompt-len 128 --output-len 256 2>&1 | tee "$OUT/route-decode.log" | tail -8
  ;;
tests)
  { echo "== this checkout: MoE routing (the overflowed rows first), then the rest of the MoE kernel tests"
    timeout 100 python3 -m pytest -q -m gpu tests/test_fused_moe_kernel.py -k "overflowed or routing" 2>&1 | tail -3; \
      echo "rc=${PIPESTATUS[0]}"
    timeout 200 python3 -m pytest -q -m gpu tests/test_fused_moe_kernel.py -k "not (overflowed or routing)" 2>&1 \
      | tail -3; echo "rc=${PIPESTATUS[0]}"
    bash bench/ab_versions.sh apply split-k-prefetch split-k-prefetch > /dev/null
    echo "== split-k-prefetch: its kernel tests"
    (cd ab/split-k-prefetch && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m pytest -q -m gpu \
      tests/test_fused_kernels.py -k "prefetch or split_over_k" 2>&1 | tail -3; echo "rc=${PIPESTATUS[0]}")
  } | tee "$OUT/tests.log"
  ;;
profile)
  MOE_BATCHES="1 64 512" SKIP_8B=1 bash bench/gpu_session.sh kernel-tables > /dev/null
  timeout 200 python3 bench/tp_profile.py --tp-sizes 1 --tokens 32 --kernels 25 --batch 1 2>&1 | grep "^|" \
    > "$OUT/kernels-8b-b1.log"
  timeout 60 python3 bench/probes/launch_floor.py 2>&1 | grep "^|" > "$OUT/launch-floor.log"
  tail -n 3 "$OUT"/kernels-*.log; cat "$OUT/launch-floor.log"
  ;;
ab)
  bash bench/ab_versions.sh apply split-k-prefetch split-k-prefetch > /dev/null
  bash bench/ab_versions.sh copy no-split-k sed -i "s/^SPLIT_K_CANDIDATES = (2, 4)/SPLIT_K_CANDIDATES = ()/" \
    kernels/skinny_gemm.py > /dev/null
  grep -q "^SPLIT_K_CANDIDATES = ()" ab/no-split-k/kernels/skinny_gemm.py || { echo "no-split-k: the sed missed"; exit 1; }
  for shape in llama3-8b qwen3-30b-a3b; do  # (the 8B shape's no-split-k was split-k-norm's own A/B)
    trees="head split-k-prefetch $([ $shape = qwen3-30b-a3b ] && echo no-split-k)"
    CYCLES=2 BENCH_OUT=/tmp/bench-$shape timeout 280 bash bench/ab_versions.sh run $trees -- \
      --workload decode --spec-modes off --random-model $shape --batch-sizes 1 --prompt-len 128 --output-len 128 2>&1 \
      | tee "$OUT/ab-$shape.log" | tail -5
  done
  ;;
moe-prefetch)
  bash bench/ab_versions.sh apply moe-weight-prefetch moe-weight-prefetch > /dev/null
  { (cd ab/moe-weight-prefetch && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m pytest -q -m gpu \
      tests/test_fused_moe_kernel.py -k "prefetch or experts_match" 2>&1 | tail -3; echo "rc=${PIPESTATUS[0]}")
    for root in "$ROOT" "$ROOT/ab/moe-weight-prefetch"; do
      echo "== ${root#$ROOT/}"
      (cd "$root" && PYTHONPATH=/tmp/site:$root timeout 100 python3 "$ROOT/bench/moe_kernels.py" --parts \
        --rows 1,8,64,512 2>&1 | grep "^|")
    done
  } | tee "$OUT/moe-prefetch-parts.log"
  ;;
moe-prefetch-ab)
  bash bench/ab_versions.sh apply moe-weight-prefetch moe-weight-prefetch > /dev/null
  CYCLES=2 BENCH_OUT=/tmp/bench-moe-prefetch timeout 400 bash bench/ab_versions.sh run head moe-weight-prefetch -- \
    --workload decode --random-model qwen3-30b-a3b --spec-modes off --batch-sizes 1,64,512 --max-running-seqs 512 \
    --prompt-len 128 --output-len 256 2>&1 | tee "$OUT/moe-prefetch-decode.log" | tail -8
  ;;
route)
  bash bench/ab_versions.sh apply moe-router-route moe-router-route > /dev/null
  bash bench/ab_versions.sh apply moe-route-combine moe-router-route moe-down-combine > /dev/null
  (cd ab/moe-route-combine && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -m gpu \
    tests/test_fused_moe_kernel.py -k "one_launch or combines or routing or overflowed" 2>&1 | tail -3; \
    echo "rc=${PIPESTATUS[0]}") | tee "$OUT/route-tests.log"
  CYCLES=2 BENCH_OUT=/tmp/bench-route timeout 400 bash bench/ab_versions.sh run head moe-router-route \
    moe-route-combine -- --workload decode --random-model qwen3-30b-a3b --spec-modes off --batch-sizes 1,8 \
    --prompt-len 128 --output-len 256 2>&1 | tee "$OUT/route-decode.log" | tail -8
  ;;
esac
