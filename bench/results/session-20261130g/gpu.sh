#!/usr/bin/env bash
# This session's calls on one H200 (call 1 carries .devcache/smol.part.aa; later calls carry .devcache/smol.part.ab and .whl).
#   probe:   how fast any kernel reads a b1 product's weight (bench/probes/read_ceiling.py), and decode attention by
#            launch choice at rl's tail and the 8B shape's b64; no model needed
#   det:     deterministic inference against the default mode, in turns, 3 cycles a mode (SHAPE=rl: 64 x 8 T=1.0 spec
#            off; SHAPE=8b: the Llama-3.1-8B shape b64, 1k prompts); each cycle draws its own seed, both modes the same
#   coupled: the coupled second epoch after an lr 1e-6 step at T=1.0, float16 with --enable-fp32-activations (n-gram +
#            coupled against spec off with the same seeds, 3 runs)
#   tests:   the engine's and the numerics' GPU tests with 128-key attention tiles
#   tiles:   the batch-invariant product's tiles against cuBLAS at prefill's rows (4,096 and 16,384)
#   stages:  decode attention alone at 512 x 600 keys by stages, then rl 64 x 8 T=1.0 spec off in turns, 2 cycles: head
#            was 1b6da30 (two stages) and ab/decode-stages3-d64 the change `fa6889a` landed (three at heads of 64; it
#            had them in the invariant kernel too); to run it again, `ab_versions.sh prepare 1b6da30` and swap the names
source bench/session_env.sh
case ${1:?probe | det | coupled | tests | tiles | stages} in
probe)
  timeout 200 python3 bench/probes/read_ceiling.py 2>&1 | quiet | tee "$OUT/read-ceiling-8b.log"
  v=default,n64,n256,stages3,stages4,splits2,invariant,invariant-stages3
  { timeout 120 python3 bench/probes/attention_tail.py --layouts interleaved --spread 0.5 --variants $v
    timeout 120 python3 bench/probes/attention_tail.py --layouts interleaved --seqs 64 --keys 1100 --heads 32 \
      --kv-heads 8 --dim 128 --variants $v
  } 2>&1 | quiet | tee "$OUT/attention-probe.log"
  ;;
det)
  case ${SHAPE:-rl} in
  rl) args=(--workload rl --spec-modes off --batch-sizes 512 --n 8 --max-running-seqs 512 --temperature 1.0) ;;
  8b) args=(--workload decode --random-model llama3-8b --spec-modes off --batch-sizes 64 --prompt-len 1024 --output-len 128) ;;
  esac
  for cycle in 1 2 3; do
    for mode in default deterministic; do
      flag=$([ $mode = deterministic ] && echo --enable-deterministic-inference)
      echo "== cycle $cycle $mode"
      timeout 150 python3 -m rollout.tools.cli bench --out /tmp/det-$mode-$cycle --seed $((1000000 * cycle)) \
        "${args[@]}" $flag 2>&1 | grep -E "^\| rollout"
    done
  done | tee "$OUT/deterministic-vs-default-${SHAPE:-rl}.log"
  ;;
coupled)
  DTYPE=float16 ENGINE_FLAGS=--enable-fp32-activations TREES=head BETWEEN=update REPEATS=${REPEATS:-3} LIMIT=540 \
    bash bench/gpu_session.sh coupled 2>&1 | tee "$OUT/coupled-fp16-activations.log" | tail -8
  ;;
tests)
  timeout 560 python3 -m pytest -q -m gpu tests/test_engine_gpu.py tests/test_numerics_gpu.py 2>&1 |
    tee "$OUT/engine-numerics-tests.log" | tail -8
  ;;
tiles)
  timeout 200 python3 bench/invariant_tiles.py --rows 4096,16384 2>&1 | quiet | tee "$OUT/invariant-tiles-prefill.log"
  ;;
stages)
  timeout 60 python3 bench/probes/attention_tail.py --layouts interleaved --seqs 512 --keys 600 --spread 0.5 \
    --variants default,stages3,invariant,invariant-stages3 2>&1 | quiet | tee "$OUT/attention-probe-512.log"
  CYCLES=2 BENCH_OUT=/tmp/ab-st timeout 300 bash bench/ab_versions.sh run head decode-stages3-d64 -- --workload rl \
    --spec-modes off --batch-sizes 512 --n 8 --max-running-seqs 512 --temperature 1.0 2>&1 | tee "$OUT/stages3-ab-rl.log" |
    grep -v "^| rollout"
  ;;
esac
