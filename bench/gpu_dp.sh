#!/usr/bin/env bash
# The data-parallel runs behind bench/RESULTS.md (issues 41 and 43), on a lent machine of 2 or 4
# GPUs. Wheels install into /root/mcache/site, which lives as long as the machine stays warm:
#
#   call 1: carry .devcache/smol.part.aa .whl
#           bash bench/gpu_dp.sh setup
#   call 2: carry .devcache/smol.part.ab .whl_dp      (fastapi, starlette, uvicorn, pyzmq, pydantic: the server's)
#           bash bench/gpu_dp.sh setup
#   call 3: carry .whl_router                         (sglang-router 0.3.2, orjson, setproctitle: 31 MB)
#           bash bench/gpu_dp.sh dp                   (SKIP_TESTS=1 once the GPU test passed)
#   call 4: bash bench/gpu_dp.sh push
#           bash bench/gpu_dp.sh router           (a server alone against its twin behind sglang-router, 3 rounds;
#                                                  ROUTER_WORKLOAD=decode: fixed lengths, 5 rounds)
#   bash bench/gpu_dp.sh ceiling   (one engine alone, no HTTP, at rl's batches and their halves and quarters: the
#                             most a perfect split over 2 or 4 replicas could give, spec off and n-gram)
#   or, after setup: bash bench/gpu_dp.sh scaling   (rl under DP1 and DP-all-GPUs: random weights of the Llama-3.1-8B
#                             shape, 256 new tokens, where a step is not launch-bound (H200s); the default model at 256 x 8)
set -uo pipefail
stage=${1:?stage: setup | dp | scaling | ceiling | router | push}
source bench/gpu_env.sh .whl .whl_dp .whl_router
DPS=$([ "$GPUS" -ge 4 ] && echo 1,2,4 || echo 1,2)

case "$stage" in
setup)
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.log"
  ;;
dp)  # DP inside one server (DP1, DP4) against 4 one-GPU servers behind sglang-router, and the router in front of
  # one server, at rl 64 x 8 and 256 x 8, T=0.7, spec on; then spec off, for the second epoch's n-gram speedup
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())" || exit 1
  [ -n "${SKIP_TESTS:-}" ] || timeout 300 python3 -m pytest -q -m gpu -x tests/test_data_parallel_gpu.py 2>&1 \
    | tee "$OUT/dp-gpu-tests.log" | tail -4
  timeout ${LIMIT:-300} python3 bench/dp_runs.py --dp-sizes 1,$((GPUS)) --separate $GPUS --router --specs ngram \
    --batch-sizes ${BATCHES:-512,2048} --repeats ${REPEATS:-2} --out "$OUT/dp" 2>&1 | grep -v -i -e warn -e "^Loading" \
    | tee "$OUT/dp.log" | tail -9
  timeout ${LIMIT_OFF:-200} python3 bench/dp_runs.py --dp-sizes 1,$((GPUS)) --specs off \
    --batch-sizes ${BATCHES:-512,2048} --repeats ${REPEATS:-2} --out "$OUT/dp" 2>&1 | grep -v -i -e warn -e "^Loading" \
    | tee "$OUT/dp-off.log" | tail -7
  ;;
scaling)
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())" >/dev/null || exit 1
  timeout 280 python3 bench/dp_runs.py --random-model llama3-8b --dp-sizes 1,$GPUS --specs ngram --batch-sizes 512 \
    --output-len 256 --repeats 3 --kv-cache-tokens 240000 --out "$OUT/dp8b" 2>&1 \
    | grep -v -i -e warn -e "^Loading" | tee "$OUT/dp8b.log" | tail -4
  timeout 280 python3 bench/dp_runs.py --dp-sizes 1,$GPUS --specs ngram --batch-sizes 2048 --repeats 2 --out "$OUT/dp" 2>&1 \
    | grep -v -i -e warn -e "^Loading" | tee "$OUT/dp.log" | tail -4
  ;;
ceiling)  # a replica of DP-M at rl 64 x 8 (256 x 8) runs a rollout of 64/M (256/M) prompts: each batch alone
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())" >/dev/null || exit 1
  timeout 420 python3 -m rollout.tools.cli bench --workload rl --spec-modes off,ngram --batch-sizes 128,256,512,1024,2048 \
    --n 8 --max-running-seqs 512 --temperature 0.7 --repeats 3 --out "$OUT/ceiling" 2>&1 | grep -v -i -e warn -e "^Loading" \
    | tee "$OUT/ceiling.log" | tail -13
  ;;
router)  # ROUTER_WORKLOAD=decode: every sample runs to 256 tokens, so the rounds differ by speed alone
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())" >/dev/null || exit 1
  if [ "${ROUTER_WORKLOAD:-rl}" = decode ]; then
    timeout 400 python3 bench/dp_runs.py --dp-sizes 1 --router --specs off --workload decode --batch-sizes 512 \
      --output-len 256 --repeats 5 --out "$OUT/router-decode" 2>&1 | grep -v -i -e warn -e "^Loading" \
      | tee "$OUT/router-decode.log" | tail -5
  else
    timeout 400 python3 bench/dp_runs.py --dp-sizes 1 --router --specs ngram --batch-sizes 512,2048 --repeats 3 \
      --out "$OUT/router" 2>&1 | grep -v -i -e warn -e "^Loading" | tee "$OUT/router.log" | tail -6
  fi
  ;;
push)  # one push of the Llama-3.1-8B shape over NCCL, trainer on GPU 0, to a server of 2 (and 3) replicas on the others
  PUSHES="8b --dp-size 2$([ "$GPUS" -ge 4 ] && echo ,8b --dp-size 3)" bash bench/gpu_tp.sh push
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
