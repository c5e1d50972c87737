#!/usr/bin/env bash
# This session's calls on one H200 (nvidia-h200; no 2-GPU kind was lent), each a stage of `bash bench/pending/ab.sh`
# at 954966d (git holds it). 1,666 s of the 1,800 s budget.
#   call 1  one-tests (.devcache/smol.part.aa)           -> qkv-split-k-kernel-tests.log (48 passed),
#                                                           moe-combine-norm-kernel-tests.log (12 passed)
#   call 2  qkv-split-k (.devcache/smol.part.ab, .whl)   -> qkv-split-k-engine-test.log (2 passed), qkv-split-k-moe.log
#   call 3  moe-combine-norm (.whl)                      -> moe-combine-norm-engine-tests-150s.log (the limit cut it
#                                                           after 1 of 3: each of test_moe_gpu.py's tests takes ~110 s
#                                                           on a fresh machine), moe-combine-norm-decode.log
#   call 4  (.whl) the engine tests again, limit 330 s   -> moe-combine-norm-engine-tests-330s.log (cut after 2 of 3:
#                                                           fp32 graphs = eager = HF, bf16; fp16 unseen);
#           qkv-8b's A/B alone                           -> qkv-split-k-8b.log
#   call 4 was, from the repository root:
#     source bench/session_env.sh
#     (cd ab/moe-combine-into-norm && timeout 330 python3 -m pytest -q -m gpu tests/test_moe_gpu.py)
#     CYCLES=2 timeout 200 bash bench/ab_versions.sh run head qkv-split-k -- --workload decode \
#       --random-model llama3-8b --spec-modes off --batch-sizes 1 --prompt-len 128 --output-len 128
bash bench/pending/ab.sh "${1:?one-tests | qkv-split-k | moe-combine-norm}"
