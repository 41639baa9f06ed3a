#!/bin/bash
# Run kvreuse's benchmarks on two commits, alternating, on this machine, to compare a change with what preceded it:
#   benchmarks/ab_commits.sh BASE_REV NEW_REV OUT_DIR [ROUNDS]
# Each round runs `kvreuse bench prefill`, `bench fusion`, `bench ttft` and `bench restore` on BASE then on NEW
# (worktrees under OUT_DIR, the venv of this checkout); outputs go to OUT_DIR/<bench>-<base|new>-<round>.txt.
# Compare medians over rounds: figures of one code differ by 5-15% between rounds on a 2-core machine.
set -u
BASE_REV=$1; NEW_REV=$2; OUT=$3; ROUNDS=${4:-2}
HERE=$(cd "$(dirname "$0")/.." && pwd); PY=$HERE/.venv/bin/python; D=$HERE/../shared/datasets
mkdir -p "$OUT"
for label in base new; do
  rev=$BASE_REV; [ $label = new ] && rev=$NEW_REV
  [ -d "$OUT/wt-$label" ] || git -C "$HERE" worktree add -q --detach "$OUT/wt-$label" "$rev"
done
kv() { (cd "$1" && shift && $PY -c "import sys; from kvreuse.cli import main; sys.exit(main())" "$@"); }
{ lscpu | grep "Model name"; lscpu | grep -o "avx512_bf16\|amx_bf16\|avx512_vnni" | sort -u; } > "$OUT/cpu.txt"
for round in $(seq 1 "$ROUNDS"); do
  for label in base new; do
    dir=$OUT/wt-$label
    echo "== round $round $label $(git -C "$dir" rev-parse --short HEAD) $(date -u +%T)"
    kv "$dir" bench prefill --lengths 512 2048 4096 --repeats 3 > "$OUT/prefill-$label-$round.txt" 2>&1
    kv "$dir" bench fusion --dataset "$D/hotpotqa.jsonl" --limit 4 --tiers memory,disk --repeats 2 \
      > "$OUT/fusion-$label-$round.txt" 2>&1
    kv "$dir" bench ttft --dataset "$D/hotpotqa.jsonl" --tiers memory --lengths 2000 --chunks 10 --prompts 2 \
      --repeats 2 --peers none --out "$OUT/ttft-$label-$round" > "$OUT/ttft-$label-$round.txt" 2>&1
    kv "$dir" bench restore --tiers memory disk --lengths 1024 2048 --repeats 3 --batch-tiers memory \
      --batch-repeats 5 --batch-io auto most-work > "$OUT/restore-$label-$round.txt" 2>&1
  done
done
echo "done $(date -u +%T)"
