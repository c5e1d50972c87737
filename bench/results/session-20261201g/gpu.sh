#!/usr/bin/env bash
# This session's calls on one H200 (nvidia-h200; no 2-GPU kind was lent), each a stage of `bash bench/pending/ab.sh`
# at 7c3028b (git holds it). 1,581 s of the 1,800 s budget.
#   call 1  one-tests (.devcache/smol.part.aa)           -> routing-ranks-tests.log (38 passed), skinny-128-tests.log
#                                                           (32 passed)
#   call 2  qkv-split-k (.devcache/smol.part.ab, .whl)   -> qkv-split-k-tests-cut.log: 8 of the 12 rope-over-partial-sums
#           cases failed, then the 150 s limit cut it; qkv-split-k-moe.log, qkv-split-k-8b.log: the limits (260 s,
#           150 s) cut qkv-split-k's second cycle
#   call 3  routing-ranks (.whl)                         -> routing-ranks-decode.log
#   call 4  skinny-128 (.whl)                            -> skinny-128-qwen3-30b-a3b.log, skinny-128-llama3-8b.log
bash bench/pending/ab.sh "${1:?one-tests | qkv-split-k | routing-ranks | skinny-128}"
