#!/usr/bin/env bash
# Benchmark several commits side by side in one machine session (drift between sessions is
# larger than most of the effects measured here).
#
#   here:        bash bench/ab_versions.sh prepare REV...    (git archive of each REV's code and tests into ab/REV)
#                bash bench/ab_versions.sh pending NAME...   (ab/NAME: this commit with bench/pending/NAME.diff applied)
#   on the GPU:  bash bench/ab_versions.sh copy NAME CMD...     (ab/NAME: the checkout's code, then CMD run in it, e.g.
#                `patch -s -p1 -i ../../X.diff`: where ab/ does not fit beside a model part, and there is no git)
#   on the GPU:  bash bench/ab_versions.sh apply NAME DIFF...   (ab/NAME: the checkout's code with the code parts of
#                bench/pending/DIFF.diff applied, each on the one before: pending changes stacked, without git)
#   on the GPU:  [CYCLES=N] bash bench/ab_versions.sh run REV... -- <rollout bench args>   (carry: ab)
#
# `run` takes "head" for the checkout itself; each version runs in its own directory, so it
# imports its own code. CYCLES=N runs the versions in turn N times (A B A B ...); it ends with
# bench/ab_summary.py's tables: each mode's same-run ratio to spec off per cycle and their median,
# by version, and each row's median step ms against the first version's. The machine drifts
# within a session (spec off's rounds of identical code moved by 36% between two versions run
# one after the other on 2026-11-26): taking turns spreads
# the drift over every version (the benches' files go to $BENCH_OUT, default /tmp/ab-out: a call
# brings back 8 files). Each cycle draws its own samples (--seed), the versions of a
# cycle the same ones (rollout bench's rounds do the same).
set -uo pipefail
cmd=${1:?prepare | pending | copy | apply | run}; shift
revs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do revs+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
case "$cmd" in
prepare)
  for rev in "${revs[@]}"; do
    rm -rf "ab/$rev" && mkdir -p "ab/$rev" && git archive "$rev" rollout spec kernels weight_sync tests pyproject.toml | tar -x -C "ab/$rev"
    # (the shipped draft head, 9.5 MB, is this checkout's: a call carries 64 MiB, the default model's part 44 of them)
    rm -rf "ab/$rev/rollout/models/default_head" && ln -s ../../../../rollout/models/default_head "ab/$rev/rollout/models/default_head"
  done
  ;;
pending)  # a change waiting for its A/B, kept as a diff (bench/pending/NAME.diff: what it predicts, then the diff; its
  # docs are not in the tree a version runs)
  for name in "${revs[@]}"; do
    bash "$0" prepare HEAD && rm -rf "ab/$name" && mv ab/HEAD "ab/$name" &&
      git apply --directory="ab/$name" --exclude='docs/*' --exclude='bench/*' --exclude='*.md' "bench/pending/$name.diff" || exit 1
  done
  ;;
copy)  # (revs: the name, then the command)
  name=${revs[0]}
  [ -d "ab/$name" ] && exit 0
  mkdir -p "ab/$name" && cp -r rollout spec kernels weight_sync tests pyproject.toml "ab/$name/" &&
    (cd "ab/$name" && "${revs[@]:1}")
  ;;
apply)  # (revs: the name, then the pending diffs in order; rebuilt every time: a warm machine keeps last call's tree)
  name=${revs[0]}
  rm -rf "ab/$name" && mkdir -p "ab/$name" && cp -r rollout spec kernels weight_sync tests pyproject.toml "ab/$name/" || exit 1
  for diff in "${revs[@]:1}"; do  # (a diff's docs, bench and *.md parts are not in the tree a version runs)
    python3 -c 'import re, sys
parts = re.split(r"(?m)^(?=diff --git )", open(sys.argv[1]).read())[1:]
print("".join(p for p in parts if not re.match(r"diff --git a/(docs/|bench/|\S+\.md )", p)), end="")' \
      "bench/pending/$diff.diff" > "/tmp/$diff.code.diff" && patch -s -p1 -d "ab/$name" -i "/tmp/$diff.code.diff" || exit 1
  done
  ;;
run)
  export PYTHONUNBUFFERED=1 ROLLOUT_CACHE=/root/mcache/cache ROLLOUT_DEFAULT_GGUF=/root/mcache/smol.gguf
  for cycle in $(seq "${CYCLES:-1}"); do
    for rev in "${revs[@]}"; do
      root=$PWD/ab/$rev; [ "$rev" = head ] && root=$PWD
      echo "== $rev (cycle $cycle)"
      # the table's rows: with --repeats the medians ("N runs"), else each row once (printed as it
      # ran and again in the table)
      (cd "$root" && PYTHONPATH=/tmp/site:$root python3 -m rollout.tools.cli bench --out "${BENCH_OUT:-/tmp/ab-out}/$rev/$cycle" --seed $((1000000 * cycle)) "$@" 2>&1 |
        grep -E "^\| rollout" | awk '!seen[$0]++ { rows = rows $0 "\n"; if (/ runs\)/) medians = medians $0 "\n" }
          END { printf "%s", (medians != "" ? medians : rows) }')
    done
  done
  python3 bench/ab_summary.py "${BENCH_OUT:-/tmp/ab-out}" "${revs[@]}"
  ;;
esac
