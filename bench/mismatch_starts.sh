#!/usr/bin/env bash
# bf16's mismatch against the float32 trainer by where the trainer's weights start (--trainer-start: the
# checkpoint's own values, the served bf16 ones, or spread over their rounding intervals) and by the engine's
# float32 knobs (none, the two islands, --enable-fp32-activations): bench/RESULTS.md's "What the reference assumes".
# Usage: [BATCH=32] [STARTS="checkpoint served spread"] bash bench/mismatch_starts.sh OUT_DIR [more bench args]
# (the CPU: BATCH=32 --device cpu, ~2 min a row; the H200: BATCH=128)
set -euo pipefail
out=${1:?OUT_DIR}; shift
mkdir -p "$out"
for start in ${STARTS:-checkpoint served spread}; do
  for knobs in "" "--enable-fp32-residual --enable-fp32-lm-head" "--enable-fp32-activations"; do
    # shellcheck disable=SC2086
    python3 -m rollout.tools.cli bench --workload mismatch --spec-modes off --dtypes bfloat16 --batch-sizes "${BATCH:-32}" \
      --n 4 --output-len 256 --trainer-start "$start" $knobs --out "$out" "$@" 2>&1 | grep '^| bfloat16' | tail -1
  done
done | tee "$out/summary.md"
