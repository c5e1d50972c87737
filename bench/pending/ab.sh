#!/usr/bin/env bash
# The next GPU session's measurements of the pending diffs, a stage a device call. The first call of a session carries
# only .devcache/smol.part.aa (the stages marked "no model" run there); the next carries .devcache/smol.part.ab and
# .whl and starts `cat /root/mcache/smol.part.aa .devcache/smol.part.ab > /root/mcache/smol.gguf &&`; every later call
# within 30 s of the last, or the machine is gone with the model. Logs to $OUT. Before a call, check the kernels compile:
# `PYTHONPATH=/tmp/np21:/tmp/triton36:. python bench/probes/compile_for_gpu.py <the diff's kernel tests>` here, on the CPU.
# Each diff applies to this checkout alone (qkv-split-k and split-k-tp both touch llama.py; split-k-fp32-residual applies
# over qkv-split-k): after one lands, rebase the rest (a worktree at the old commit, the diff applied and committed,
# cherry-picked onto the new one, the header kept).
# Device time, estimated: first ~200 s, allreduce-norm ~420 s, split-k-tp ~400 s, profile ~200 s.
#   first (2 GPUs, no model): allreduce-norm-512's GPU tests over 2 ranks and its latencies (bench/allreduce_latency.py:
#            the all-reduce + norm fused against apart at 16-512 rows, hidden 2,048 and 4,096)
#   allreduce-norm (2 GPUs): TP2 decode in turns, 2 cycles, this checkout against allreduce-norm-512: the Qwen3-30B-A3B
#            shape at b64 and b512, then the 8B shape at b512
#   split-k-tp (2 GPUs): its GPU tests (the kernel's partials over 2 ranks; TP2 in graphs = eager TP1 tokens), then TP2
#            b1 decode in turns, 2 cycles, this checkout against split-k-tp: the 8B shape, then the Qwen3-30B-A3B shape
#   profile (1 GPU): decode steps kernel by kernel (bench/tp_profile.py --kernels, no PDL), the MoE shape at b1 and b512
#   one-tests (1 GPU, no model): qkv-split-k's kernel tests (rope over partial sums, rope bitwise its reference, the
#            partials into the norm), then moe-combine-into-norm's (the picks into the norm), failures printed (~300 s:
#            the first call compiles every specialization)
#   moe-combine-norm (1 GPU): its engine GPU test (the tiny Qwen3-MoE, sampled, the same tokens and logprobs), then
#            Qwen3-30B-A3B decode at b1, b8, b64, b512 in turns, 2 cycles, this checkout against it (~480 s)
#   qkv-split-k (1 GPU): its engine GPU test (the split products keep the tokens), then decode in turns, 2 cycles, this
#            checkout against qkv-split-k: Qwen3-30B-A3B at b1 (~450 s; b64 measured 1.00x in session-20261201g;
#            a run of the MoE shape is ~70 s, most of it making the random model and capturing graphs)
#   qkv-8b (1 GPU): the same A/B on the 8B shape at b1, then split-k-fp32-residual's GPU tests (~400 s)
#   split-k-fp32-residual (1 GPU; over qkv-split-k): the 8B shape's decode with --enable-fp32-residual
#            --enable-fp32-lm-head at b1 and b64 in turns, 2 cycles, qkv-split-k's tree against it (~300 s)
#   On 2 GPUs, in this order: first, allreduce-norm, split-k-tp (~1,200 s with the machine's start). On one: one-tests,
#   qkv-split-k, moe-combine-norm, qkv-8b, split-k-fp32-residual (~1,950 s with two model carries: the last waits for a
#   second session if the budget runs out).
source bench/session_env.sh
case ${1:?first | allreduce-norm | split-k-tp | profile | one-tests | qkv-split-k | moe-combine-norm | qkv-8b | split-k-fp32-residual} in
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
one-tests)
  bash bench/ab_versions.sh apply qkv-split-k qkv-split-k > /dev/null
  (cd ab/qkv-split-k && PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest -q -m gpu -rf --tb=line \
    tests/test_fused_kernels.py -k "partial_sums or split_over_k or rope" 2>&1 | tail -15; echo "rc=${PIPESTATUS[0]}") \
    | tee "$OUT/qkv-split-k-kernel-tests.log"
  bash bench/ab_versions.sh apply moe-combine-into-norm moe-combine-into-norm > /dev/null
  (cd ab/moe-combine-into-norm && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu -rf --tb=line \
    tests/test_fused_moe_kernel.py -k "picks_into_the_norm" 2>&1 | tail -8; echo "rc=${PIPESTATUS[0]}") \
    | tee "$OUT/moe-combine-norm-kernel-tests.log"
  ;;
moe-combine-norm)
  bash bench/ab_versions.sh apply moe-combine-into-norm moe-combine-into-norm > /dev/null
  (cd ab/moe-combine-into-norm && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -m gpu -rf --tb=line \
    tests/test_moe_gpu.py 2>&1 | tail -8; echo "rc=${PIPESTATUS[0]}") | tee "$OUT/moe-combine-norm-engine-tests.log"
  CYCLES=2 BENCH_OUT=/tmp/bench-mcn timeout 390 bash bench/ab_versions.sh run head moe-combine-into-norm -- \
    --workload decode --random-model qwen3-30b-a3b --spec-modes off --batch-sizes 1,8,64,512 --max-running-seqs 512 \
    --prompt-len 128 --output-len 256 2>&1 | tee "$OUT/moe-combine-norm-decode.log" | tail -5
  ;;
qkv-split-k)
  bash bench/ab_versions.sh apply qkv-split-k qkv-split-k > /dev/null
  (cd ab/qkv-split-k && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -m gpu -rf --tb=line \
    tests/test_engine_gpu.py -k "split_over_k" 2>&1 | tail -8; echo "rc=${PIPESTATUS[0]}") \
    | tee "$OUT/qkv-split-k-engine-test.log"
  CYCLES=2 BENCH_OUT=/tmp/bench-qkv-moe timeout 330 bash bench/ab_versions.sh run head qkv-split-k -- \
    --workload decode --random-model qwen3-30b-a3b --spec-modes off --batch-sizes 1 --prompt-len 128 \
    --output-len 256 2>&1 | tee "$OUT/qkv-split-k-moe.log" | tail -3
  ;;
qkv-8b)
  bash bench/ab_versions.sh apply qkv-split-k qkv-split-k > /dev/null
  CYCLES=2 BENCH_OUT=/tmp/bench-qkv-8b timeout 220 bash bench/ab_versions.sh run head qkv-split-k -- \
    --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 1 --prompt-len 128 \
    --output-len 128 2>&1 | tee "$OUT/qkv-split-k-8b.log" | tail -3
  bash bench/ab_versions.sh apply fp32-residual qkv-split-k split-k-fp32-residual > /dev/null
  (cd ab/fp32-residual && PYTHONPATH=/tmp/site:$PWD timeout 250 python3 -m pytest -q -m gpu -rf --tb=line \
    tests/test_fused_kernels.py tests/test_engine_gpu.py -k "split_over_k or partial_sums" 2>&1 | tail -8; \
    echo "rc=${PIPESTATUS[0]}") | tee "$OUT/split-k-fp32-residual-tests.log"
  ;;
split-k-fp32-residual)
  bash bench/ab_versions.sh apply qkv-split-k qkv-split-k > /dev/null
  bash bench/ab_versions.sh apply fp32-residual qkv-split-k split-k-fp32-residual > /dev/null
  CYCLES=2 BENCH_OUT=/tmp/bench-island timeout 300 bash bench/ab_versions.sh run qkv-split-k fp32-residual -- \
    --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 1,64 --prompt-len 128 --output-len 128 \
    --enable-fp32-residual --enable-fp32-lm-head 2>&1 | tee "$OUT/split-k-fp32-residual-8b.log" | tail -4
  ;;
profile)
  MOE_BATCHES="1 512" SKIP_8B=1 bash bench/gpu_session.sh kernel-tables > /dev/null
  tail -n 3 "$OUT"/kernels-*.log
  ;;
esac
