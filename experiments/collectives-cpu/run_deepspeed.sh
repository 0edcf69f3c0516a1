#!/bin/bash
# nxdt vs DeepSpeed's shm all-reduce, before (an earlier nxdt, from a `git archive` of BASE, its C extension
# built in place) and after (this checkout), alternating runs, PASSES times; every run interleaves nxdt and
# DeepSpeed inside one set of processes. `uptime` before and after every run goes to OUT.uptime.txt.
# ORDER="before after" reverses the pair; ARGS="--sizes 16mb 64mb" passes options to deepspeed_side_by_side.py. Usage:
#   PY=/path/to/python-with-deepspeed PASSES=3 OUT=deepspeed_r4 \
#     bash experiments/collectives-cpu/run_deepspeed.sh [BASE_COMMIT] [RANKS...]
set -e
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${PY:-python}
passes=${PASSES:-1}
out=${OUT:-deepspeed}
order=${ORDER:-after before}
base=${1:-main}; shift || true
ranks=${@:-2 4}
base_sha=$(git -C "$repo" rev-parse --short "$base")
head_sha=$(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet HEAD -- nxdt || echo +changes)
before=$(mktemp -d)
git -C "$repo" archive "$base_sha" nxdt setup.py pyproject.toml | tar -x -C "$before"
if [ -f "$before/nxdt/comm/_native.c" ]; then  # the earlier code's own native path, not its fallback
  (cd "$before" && "$py" setup.py -q build_ext --inplace >/dev/null 2>&1)
fi
# not from the repo root: the workers' forkserver (started as `python -c`) imports nxdt with its cwd first on
# sys.path, so a checkout's own nxdt/ there would shadow PYTHONPATH and "before" would run this tree's code
cd "$here"
for pass in $(seq 1 "$passes"); do
  for r in $ranks; do
    for label in $order; do
      if [ "$label" = before ]; then path="$before"; sha=$base_sha; else path="$repo"; sha=$head_sha; fi
      echo "$label $r ranks pass $pass start: $(uptime)" >> "$here/${out}.uptime.txt"
      PYTHONPATH="$path" "$py" "$here/deepspeed_side_by_side.py" -r "$r" --label "$label $sha" --json "$here/${out}_${r}ranks.json" $ARGS \
        | grep -v WARNING | tee -a "$here/${out}_${r}ranks.txt"
      echo "$label $r ranks pass $pass end:   $(uptime)" >> "$here/${out}.uptime.txt"
    done
  done
done
rm -rf "$before"
