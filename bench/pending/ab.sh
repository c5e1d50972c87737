#!/usr/bin/env bash
# The next GPU session's measurements and the pending diff's A/B, one stage a device call (H200; the first call of a
# session carries only .devcache/smol.part.aa, the next .devcache/smol.part.ab and .whl, as bench/gpu_session.sh says;
# every later call within 30 s of the last, or the machine is gone with the model). Logs to $OUT.
# Device time, estimated: tests ~330 s, profile ~300 s, ab ~400 s, moe-prefetch ~120 s, moe-prefetch-ab ~300 s,
# route ~350 s.
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
case ${1:?tests | profile | ab | moe-prefetch | moe-prefetch-ab | route} in
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
  for shape in llama3-8b qwen3-30b-a3b; do
    CYCLES=2 BENCH_OUT=/tmp/bench-$shape timeout 280 bash bench/ab_versions.sh run head split-k-prefetch no-split-k -- \
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
  CYCLES=2 BENCH_OUT=/tmp/bench-moe-prefetch timeout 420 bash bench/ab_versions.sh run head moe-weight-prefetch -- \
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
