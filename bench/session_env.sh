# Sourced by a session's script (bench/results/session-*/gpu.sh) on a lent GPU machine, from the repository root:
# $OUT, the environment, the wheels and the default model in place (`gpu_session.sh setup`), this checkout on the
# path, and `quiet` (a bench's output without blank lines, warnings and loading bars).
ROOT=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ROLLOUT_CACHE=/root/mcache/cache ROLLOUT_DEFAULT_GGUF=/root/mcache/smol.gguf
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
bash bench/gpu_session.sh setup > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$ROOT
quiet() { grep -v -i -e "^$" -e warn -e "^Loading"; }
