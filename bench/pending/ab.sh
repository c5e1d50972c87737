#!/usr/bin/env bash
# The next GPU session's measurements of the pending diffs, a stage a device call. The first call of a session carries
# only .devcache/smol.part.aa (the stages marked "no model" run there); the next carries .devcache/smol.part.ab and
# .whl and starts `cat /root/mcache/smol.part.aa .devcache/smol.part.ab > /root/mcache/smol.gguf &&`; every later call
# within 30 s of the last, or the machine is gone with the model. Logs to $OUT. Before a call, check the kernels compile:
# `PYTHONPATH=/tmp/np21:/tmp/triton36:. python bench/probes/compile_for_gpu.py <the diff's kernel tests>` here, on the CPU.
# Each diff applies to this checkout alone: after one lands, rebase the rest (a worktree at the old commit, the diff
# applied and committed, cherry-picked onto the new one, the header kept).
#   first (2 GPUs, no model): allreduce-norm-512's GPU tests over 2 ranks and its latencies (bench/allreduce_latency.py:
#            the all-reduce + norm fused against apart at 16-512 rows, hidden 2,048 and 4,096)
#   allreduce-norm (2 GPUs): TP2 decode in turns, 2 cycles, this checkout against allreduce-norm-512: the Qwen3-30B-A3B
#            shape at b64 and b512, then the 8B shape at b512
#   split-k-tp (2 GPUs): its GPU tests (the kernel's partials over 2 ranks; TP2 in graphs = eager TP1 tokens), then TP2
#            b1 decode in turns, 2 cycles, this checkout against split-k-tp: the 8B shape, then the Qwen3-30B-A3B shape
#   profile (1 GPU): decode steps kernel by kernel (bench/tp_profile.py --kernels, no PDL), the MoE shape at b1 and b512
#   verify (1 GPU, no model): this checkout's MoE engine GPU tests whole (tests/test_moe_gpu.py, ~110 s a test on a fresh
#            machine; 12a4418's picks-into-the-norm engine test has not yet run on a GPU), then the norm and rope
#            kernel tests (their sum of a product's terms is one helper since the review mend; ~580 s)
#   island-tests (1 GPU): split-k-fp32-residual's GPU tests: partial sums and MoE picks into a float32 residual, bitwise;
#            the island's split products keep the engine's tokens (~350 s)
#   split-k-fp32-residual (1 GPU): the 8B shape's decode with --enable-fp32-residual --enable-fp32-lm-head at b1 and
#            b64 in turns, 2 cycles, this checkout against it (~300 s)
#   tma-experts (1 GPU, no model): its GPU kernel tests (TMA tiles = pointer tiles, bitwise; the experts against the
#            reference through the autotuner), then the MoE layer's parts at 1, 64 and 512 rows, retuned, with the
#            tiles chosen (bench/moe_kernels.py --parts --retune), this checkout and tma-experts (~400 s)
#   tma-experts-decode (1 GPU): Qwen3-30B-A3B decode at b1, b64, b512 in turns, 2 cycles, this checkout against
#            tma-experts (~400 s)
#   attention-b1 (1 GPU, no model): decode attention alone at one sequence, the Qwen3-30B-A3B shape's heads, in graphs
#            planned as the engine plans them (8,192 keys: 32 splits and the merge) against 1, 2 and 4 splits, at 128,
#            384, 1,024 and 2,048 keys (bench/probes/attention_tail.py; its b1 step spends 6.0 + 1.8 us a layer there,
#            e32dff6's profile; ~90 s)
#   On 2 GPUs, in this order: first, allreduce-norm, split-k-tp (~1,200 s with the machine's start). On one: verify
#   (its call carries the model's first part), tma-experts then attention-b1 in one call (the second part),
#   tma-experts-decode, island-tests, split-k-fp32-residual (~2,050 s with the machine's start: the last waits if the
#   budget runs out), then profile.
source bench/session_env.sh
case ${1:?first | allreduce-norm | split-k-tp | profile | verify | tma-experts | tma-experts-decode | island-tests \
  | split-k-fp32-residual | attention-b1} in
first)
  bash bench/ab_versions.sh apply allreduce-norm-512 allreduce-norm-512 > /dev/null
  (cd ab/allreduce-norm-512 && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -m gpu -rs \
    tests/test_all_reduce_norm_gpu.py 2>&1 | tail -3; echo "rc=${PIPESTATUS[0]}") | tee "$OUT/allreduce-norm-tests.log"
  (cd ab/allreduce-norm-512 && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m torch.distributed.run \
    --nproc-per-node 2 "$ROOT/bench/allreduce_latency.py" --rows 16,64,256,512 --hidden 2048,4096 2>&1 \
    | grep -e "GPUs in a CUDA graph" -e " against " -e rror) | tee "$OUT/allreduce-norm-latency.log"
  ;;
allreduce-norm)
  bash bench/ab_versions.sh apply allreduce-norm-512 allreduce-norm-512 > /dev/null
  CYCLES=2 BENCH_OUT=/tmp/bench-arn-moe timeout 330 bash bench/ab_versions.sh run head allreduce-norm-512 -- \
    --workload decode --random-model qwen3-30b-a3b --tp-size 2 --spec-modes off --batch-sizes 64,512 \
    --max-running-seqs 512 --prompt-len 128 --output-len 256 2>&1 | tee "$OUT/allreduce-norm-moe.log" | tail -6
  CYCLES=2 BENCH_OUT=/tmp/bench-arn-8b timeout 200 bash bench/ab_versions.sh run head allreduce-norm-512 -- \
    --workload decode --random-model llama3-8b --tp-size 2 --spec-modes off --batch-sizes 512 --max-running-seqs 512 \
    --prompt-len 128 --output-len 128 2>&1 | tee "$OUT/allreduce-norm-8b.log" | tail -4
  ;;
split-k-tp)
  bash bench/ab_versions.sh apply split-k-tp split-k-tp > /dev/null
  (cd ab/split-k-tp && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu -rs \
    tests/test_all_reduce_norm_gpu.py tests/test_tensor_parallel_gpu.py -k "bitwise or tp2_with_graphs" 2>&1 | tail -3; \
    echo "rc=${PIPESTATUS[0]}") | tee "$OUT/split-k-tp-tests.log"
  for shape in llama3-8b qwen3-30b-a3b; do
    CYCLES=2 BENCH_OUT=/tmp/bench-sktp-$shape timeout 200 bash bench/ab_versions.sh run head split-k-tp -- \
      --workload decode --random-model $shape --tp-size 2 --spec-modes off --batch-sizes 1 --prompt-len 128 \
      --output-len 128 2>&1 | tee "$OUT/split-k-tp-$shape.log" | tail -4
  done
  ;;
verify)
  (timeout 460 python3 -m pytest -q -m gpu -rf --tb=line --durations=5 tests/test_moe_gpu.py 2>&1 | tail -12; \
    echo "rc=${PIPESTATUS[0]}") | tee "$OUT/moe-engine-tests.log"
  (timeout 120 python3 -m pytest -q -m gpu -rf --tb=line tests/test_fused_kernels.py -k "norm or rope" 2>&1 \
    | tail -8; echo "rc=${PIPESTATUS[0]}") | tee "$OUT/norm-rope-tests.log"
  ;;
tma-experts)
  bash bench/ab_versions.sh apply tma-experts tma-experts > /dev/null
  (cd ab/tma-experts && PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m pytest -q -m gpu -rf --tb=line \
    tests/test_fused_moe_kernel.py -k "tma or match_the_reference" 2>&1 | tail -8; echo "rc=${PIPESTATUS[0]}") \
    | tee "$OUT/tma-experts-tests.log"
  for tree in "$ROOT" "$ROOT/ab/tma-experts"; do
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 80 python3 "$ROOT/bench/moe_kernels.py" --parts --retune \
      --rows 1,64,512 2>&1 | grep "^|")
  done | tee "$OUT/tma-experts-parts.log"
  ;;
tma-experts-decode)
  bash bench/ab_versions.sh apply tma-experts tma-experts > /dev/null
  CYCLES=2 BENCH_OUT=/tmp/bench-tma timeout 420 bash bench/ab_versions.sh run head tma-experts -- \
    --workload decode --random-model qwen3-30b-a3b --spec-modes off --batch-sizes 1,64,512 --max-running-seqs 512 \
    --prompt-len 128 --output-len 256 2>&1 | tee "$OUT/tma-experts-decode.log" | tail -4
  ;;
island-tests)
  bash bench/ab_versions.sh apply fp32-residual split-k-fp32-residual > /dev/null
  (cd ab/fp32-residual && PYTHONPATH=/tmp/site:$PWD timeout 400 python3 -m pytest -q -m gpu -rf --tb=line \
    tests/test_fused_kernels.py tests/test_fused_moe_kernel.py tests/test_engine_gpu.py \
    -k "partial_sums or picks_into_the_norm or split_over_k" 2>&1 | tail -8; echo "rc=${PIPESTATUS[0]}") \
    | tee "$OUT/split-k-fp32-residual-tests.log"
  ;;
split-k-fp32-residual)
  bash bench/ab_versions.sh apply fp32-residual split-k-fp32-residual > /dev/null
  CYCLES=2 BENCH_OUT=/tmp/bench-island timeout 400 bash bench/ab_versions.sh run head fp32-residual -- \
    --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 1,64 --prompt-len 128 --output-len 128 \
    --enable-fp32-residual --enable-fp32-lm-head 2>&1 | tee "$OUT/split-k-fp32-residual-8b.log" | tail -4
  ;;
attention-b1)
  for keys in 128 384 1024 2048; do
    timeout 40 python3 bench/probes/attention_tail.py --seqs 1 --keys $keys --heads 32 --kv-heads 4 --dim 128 \
      --max-kv-len 8192 --calls 48 --layers 48 --layouts interleaved --variants default,splits1,splits2,splits4 2>&1 \
      | grep -e "^| interleaved" -e "sequences x"
  done | tee "$OUT/attention-b1.log"
  ;;
profile)
  MOE_BATCHES="1 512" SKIP_8B=1 bash bench/gpu_session.sh kernel-tables > /dev/null
  tail -n 3 "$OUT"/kernels-*.log
  ;;
esac
