#!/usr/bin/env bash
# The data-parallel runs behind bench/RESULTS.md (issues 41 and 43), on a lent machine of 2 or 4
# GPUs. Wheels install into /root/mcache/site, which lives as long as the machine stays warm:
#
#   call 1: carry .devcache/smol.part.aa .whl
#           bash bench/gpu_dp.sh setup
#   call 2: carry .devcache/smol.part.ab .whl_dp      (fastapi, starlette, uvicorn, pyzmq, pydantic: the server's)
#           bash bench/gpu_dp.sh dp
#   call 3: carry .whl_router                         (sglang-router 0.3.2, orjson, setproctitle: 31 MB)
#           bash bench/gpu_dp.sh router
set -uo pipefail
stage=${1:?stage: setup | dp | router}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /root/mcache/site
export PYTHONUNBUFFERED=1 ROLLOUT_CACHE=/root/mcache/cache ROLLOUT_DEFAULT_GGUF=/root/mcache/smol.gguf
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
wheels=$(ls .whl/*.whl .whl_dp/*.whl .whl_router/*.whl 2>/dev/null)
[ -z "$wheels" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /root/mcache/site $wheels || exit 1
export PYTHONPATH=/root/mcache/site:$PWD PATH=/root/mcache/site/bin:$PATH
[ -f .devcache/smol.part.aa ] && cp .devcache/smol.part.aa /root/mcache/
[ -f .devcache/smol.part.ab ] && cat /root/mcache/smol.part.aa .devcache/smol.part.ab > /root/mcache/smol.gguf
GPUS=$(nvidia-smi -L | wc -l)
DPS=$([ "$GPUS" -ge 4 ] && echo 1,2,4 || echo 1,2)

case "$stage" in
setup)
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.log"
  ;;
dp)  # DP1 against DP2 (and DP4) at rl 64 x 8 and 256 x 8, T=0.7, spec on and off; a push to DP2 and DP3
  python3 -c "from rollout.models.default_model import ensure_default_model as e; print(e())" || exit 1
  timeout 300 python3 -m pytest -q -m gpu -x tests/test_data_parallel_gpu.py 2>&1 | tee "$OUT/dp-gpu-tests.log" | tail -4
  timeout ${LIMIT:-420} python3 bench/dp_runs.py --dp-sizes $DPS --specs ngram,off --batch-sizes ${BATCHES:-512,2048} \
    --repeats ${REPEATS:-3} --out "$OUT/dp" 2>&1 | grep -v -i -e warn -e "^Loading" | tee "$OUT/dp.log" | tail -16
  ;;
router)  # sglang-router in front of one replica against the replica itself; one push to DP2 (and DP3), 8B shape
  timeout 240 python3 bench/dp_runs.py --dp-sizes 1 --specs ngram --router --batch-sizes 512 --repeats 3 \
    --out "$OUT/router" 2>&1 | grep -v -i -e warn -e "^Loading" | tee "$OUT/router.log" | tail -6
  for dp in 2 $([ "$GPUS" -ge 4 ] && echo 3); do
    timeout 200 python3 recipes/bench_weight_sync.py --models 8b --methods distributed --dp-size $dp --repeats 3 2>&1 \
      | grep -v -i warn | tail -3
  done | tee "$OUT/push-dp.log"
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
