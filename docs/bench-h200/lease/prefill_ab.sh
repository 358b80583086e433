# `python -m selfspec.bench.prefill` (eager whole prompts against the cuBLAS + SDPA peer) on a tree of selfspec
# (.ab/TREE) and on .ab/head in turn (new, old, old, new), each in its own process from its own folder: one log under
# $OUT, the table rows of each run. Carry [".whl", ".ab/head", ".ab/TREE"].
#   bash docs/bench-h200/lease/prefill_ab.sh TREE
#   env: ARGS (bench prefill's arguments; default the 8B shape at 1 x 512, 1 x 2048 and 8 x 512, w4a16, upper and
#   full, no HF)
set -u
source "$(dirname "$0")/common.sh"
tree=$1
ARGS=${ARGS:-"--shape llama-3-8b --sizes 1x512 1x2048 8x512 --modes w4a16 upper full --no-hf"}
for side in new old old new; do
  dir=.ab/head
  [ "$side" = new ] && dir=.ab/$tree
  echo "== $side ($dir)" >> "$OUT/ab-prefill-$tree.log"
  (cd "$dir" && PYTHONPATH=$PWD:/tmp/site python3 -m selfspec.bench.prefill $ARGS) >> "$OUT/ab-prefill-$tree.log" 2>&1
  echo "prefill $side rc=$?"
done
grep -E "^==|^\| " "$OUT/ab-prefill-$tree.log" | grep -v -E "^\|[- |]+$"
