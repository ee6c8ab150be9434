#!/usr/bin/env bash
# A/B runs across commits on the GPU machine, whose copy of the repo has no git history: prepare each commit's
# ssmq/ and benchmarks/ (results left out) here, carry them, and run one command in each tree and in the working
# tree, one after the other, in one device call (the same card and clocks for every commit).
#   bash benchmarks/commit_trees.sh prepare .carry/trees cdc5491 6f58c5e       # here: .carry/trees/<commit>/
#   bash benchmarks/commit_trees.sh run .carry/trees -- python3 benchmarks/bench_kv_e2e.py --model llama-3.1-8b \
#       --cases 166:32768 --kv nuq2 --steps 5 --out /tmp/ab                      # there: $OUT/ab_<commit>.log
# (device: run(carry=[".carry"], command="bash benchmarks/commit_trees.sh run .carry/trees -- ...")). Session 36
# bisected nuq2's 166-row step this way (benchmarks/results/kv_e2e_h200/s36/nuq2_bisect/).
set -uo pipefail
mode=${1:-}
dir=${2:-}
case "$mode" in
  prepare)
    shift 2
    [ $# -gt 0 ] || { echo "commit_trees.sh prepare DIR COMMIT...: no commit given"; exit 2; }
    for c in "$@"; do
      git rev-parse --verify -q "$c^{commit}" >/dev/null || { echo "commit_trees.sh: no commit '$c'"; exit 2; }
      rm -rf "${dir:?}/$c" && mkdir -p "$dir/$c"
      git archive "$c" ssmq benchmarks | tar -x -C "$dir/$c" && rm -rf "$dir/$c/benchmarks/results"
    done
    du -sh "$dir" ;;
  run)
    shift 2
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || { echo "commit_trees.sh run DIR -- COMMAND: no command given"; exit 2; }
    out=${OUT:-out}
    mkdir -p "$out"
    root=$PWD
    for tree in "$dir"/*/ "$root/"; do
      name=$(basename "$tree"); [ "$tree" = "$root/" ] && name=worktree
      (cd "$tree" && PYTHONPATH=.:benchmarks PYTHONUNBUFFERED=1 "$@" > "$out/ab_$name.log" 2>&1)
      echo "$name: rc $?, $(tail -n 1 "$out/ab_$name.log")"
    done ;;
  *) echo "commit_trees.sh: mode 'prepare' or 'run', not '$mode'"; exit 2 ;;
esac
