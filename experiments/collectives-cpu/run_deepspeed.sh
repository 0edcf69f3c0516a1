#!/bin/bash
# nxdt vs DeepSpeed's shm all-reduce, before (main's nxdt, from a `git archive` of BASE) and after (this checkout),
# alternating runs; every run interleaves nxdt and DeepSpeed inside one set of processes. Usage:
#   bash experiments/collectives-cpu/run_deepspeed.sh [BASE_COMMIT] [RANKS...]
set -e
here=$(cd "$(dirname "$0")" && pwd)
base=${1:-68c1276}; shift || true
ranks=${@:-2 4}
before=$(mktemp -d)
git -C "$here/../.." archive "$base" nxdt | tar -x -C "$before"
for r in $ranks; do
  for label in after before; do
    if [ "$label" = before ]; then path="$before"; else path="$here/../.."; fi
    PYTHONPATH="$path" python "$here/deepspeed_side_by_side.py" -r "$r" --label "$label" --json "$here/deepspeed_${r}ranks.json" \
      | tee -a "$here/deepspeed_${r}ranks.txt"
  done
done
rm -rf "$before"
