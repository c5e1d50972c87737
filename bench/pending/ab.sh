#!/usr/bin/env bash
# The next GPU session's measurements of the pending diffs, a stage a device call. The first call of a session carries
# only .devcache/smol.part.aa (the stages marked "no model" run there); the next carries .devcache/smol.part.ab and
# .whl and starts `cat /root/mcache/smol.part.aa .devcache/smol.part.ab > /root/mcache/smol.gguf &&`; every later call
# within 30 s of the last, or the machine is gone with the model. Logs to $OUT. Before a call, check the kernels compile:
# `PYTHONPATH=/tmp/np21:/tmp/triton36:. python bench/probes/compile_for_gpu.py <the diff's kernel tests>` here, on the CPU.
# Device time, estimated: first ~250 s, allreduce-norm ~420 s, split-k-tp ~400 s, combine ~420 s, profile ~200 s.
#   first (2 GPUs, no model): allreduce-norm-512's GPU tests over 2 ranks and its latencies (bench/allreduce_latency.py:
#            the all-reduce + norm fused against apart at 16-512 rows, hidden 2,048 and 4,096), beside moe-down-combine's
#            MoE kernel tests on GPU 1 after them
#   allreduce-norm (2 GPUs): TP2 decode in turns, 2 cycles, this checkout against allreduce-norm-512: the Qwen3-30B-A3B
#            shape at b64 and b512, then the 8B shape at b512
#   split-k-tp (2 GPUs): its GPU tests (the kernel's partials over 2 ranks; TP2 in graphs = eager TP1 tokens), then TP2
#            b1 decode in turns, 2 cycles, this checkout against split-k-tp: the 8B shape, then the Qwen3-30B-A3B shape
#   combine (1 GPU): moe-down-prefetch's GPU test (the prefetch changes no bit), then the Qwen3-30B-A3B shape's decode
#            at b1 and b8 in turns, 2 cycles: this checkout, moe-down-combine, moe-down-combine + moe-down-prefetch
#   profile (1 GPU): decode steps kernel by kernel (bench/tp_profile.py --kernels, no PDL), the MoE shape at b1 and b512
#   single (2 GPUs): combine on GPU 0 beside profile on GPU 1
#   skinny-64-tests (1 GPU): skinny-64-rows' GPU tests (the few-row products at 17-64 rows)
#   skinny-64 (1 GPU): decode in turns, 2 cycles, this checkout against skinny-64-rows: the Qwen3-30B-A3B shape at b64,
#            then the 8B shape at b64 (~450 s)
#   On 2 GPUs, in this order: first, allreduce-norm, single, split-k-tp (~1,500 s with the machine's start). On one GPU
#   only: combine-tests (no model), then combine, then profile.
source bench/session_env.sh
case ${1:?first | allreduce-norm | split-k-tp | single | combine | combine-tests | profile | skinny-64-tests | skinny-64} in
single)
  CUDA_VISIBLE_DEVICES=0 bash "$0" combine > "$OUT/combine-gpu0.out" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 bash "$0" profile > "$OUT/profile-gpu1.out" 2>&1
  wait; tail -n 12 "$OUT/combine-gpu0.out" "$OUT/profile-gpu1.out"
  ;;
first)
  bash bench/ab_versions.sh apply allreduce-norm-512 allreduce-norm-512 > /dev/null
  (cd ab/allreduce-norm-512 && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -m gpu -rs \
    tests/test_all_reduce_norm_gpu.py 2>&1 | tail -3; echo "rc=${PIPESTATUS[0]}") | tee "$OUT/allreduce-norm-tests.log"
  (cd ab/allreduce-norm-512 && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m torch.distributed.run \
    --nproc-per-node 2 "$ROOT/bench/allreduce_latency.py" --rows 16,64,256,512 --hidden 2048,4096 2>&1 \
    | grep -e "GPUs in a CUDA graph" -e " against " -e rror) | tee "$OUT/allreduce-norm-latency.log"
  CUDA_VISIBLE_DEVICES=1 bash "$0" combine-tests
  ;;
combine-tests)
  bash bench/ab_versions.sh apply moe-down-combine moe-down-combine > /dev/null
  (cd ab/moe-down-combine && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -m gpu \
    tests/test_fused_moe_kernel.py -k "combines or one_launch or experts_match" 2>&1 | tail -3; \
    echo "rc=${PIPESTATUS[0]}") | tee "$OUT/combine-tests.log"
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
combine)
  bash bench/ab_versions.sh apply moe-down-combine moe-down-combine > /dev/null
  bash bench/ab_versions.sh apply down-prefetch moe-down-combine moe-down-prefetch > /dev/null
  (cd ab/down-prefetch && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m pytest -q -m gpu \
    tests/test_fused_moe_kernel.py -k "prefetch" 2>&1 | tail -2; echo "rc=${PIPESTATUS[0]}") | tee "$OUT/down-prefetch-tests.log"
  CYCLES=2 BENCH_OUT=/tmp/bench-combine timeout 400 bash bench/ab_versions.sh run head moe-down-combine down-prefetch -- \
    --workload decode --random-model qwen3-30b-a3b --spec-modes off --batch-sizes 1,8 --prompt-len 128 \
    --output-len 256 2>&1 | tee "$OUT/combine-decode.log" | tail -6
  ;;
skinny-64-tests)
  bash bench/ab_versions.sh apply skinny-64-rows skinny-64-rows > /dev/null
  (cd ab/skinny-64-rows && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu \
    tests/test_fused_kernels.py -k "skinny_gemm_matches or split_over_k or prefetch" 2>&1 | tail -3; \
    echo "rc=${PIPESTATUS[0]}") | tee "$OUT/skinny-64-tests.log"
  ;;
skinny-64)
  bash bench/ab_versions.sh apply skinny-64-rows skinny-64-rows > /dev/null
  CYCLES=2 BENCH_OUT=/tmp/bench-sk64-moe timeout 330 bash bench/ab_versions.sh run head skinny-64-rows -- \
    --workload decode --random-model qwen3-30b-a3b --spec-modes off --batch-sizes 64 --prompt-len 128 \
    --output-len 256 2>&1 | tee "$OUT/skinny-64-moe.log" | tail -3
  CYCLES=2 BENCH_OUT=/tmp/bench-sk64-8b timeout 240 bash bench/ab_versions.sh run head skinny-64-rows -- \
    --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 64 --prompt-len 128 \
    --output-len 128 2>&1 | tee "$OUT/skinny-64-8b.log" | tail -3
  ;;
profile)
  MOE_BATCHES="1 512" SKIP_8B=1 bash bench/gpu_session.sh kernel-tables > /dev/null
  tail -n 3 "$OUT"/kernels-*.log
  ;;
esac
