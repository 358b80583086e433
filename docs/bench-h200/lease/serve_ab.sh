# `selfspec bench serve` on a tree of selfspec (.ab/TREE) and on .ab/head, in turn (new, old; with PAIRS=2 then old,
# new), each in its own process: the JSON of each run and one log under $OUT. Carry [".whl", ".ab/head", ".ab/TREE"].
#   bash docs/bench-h200/lease/serve_ab.sh TREE
#   env: ARGS (bench serve's arguments; default the issue's serving bar, `planes` and `qspec` at batch 32), PAIRS
set -u
source "$(dirname "$0")/common.sh"
tree=$1
ARGS=${ARGS:-"--shape llama-3-8b --device cuda --recipes planes qspec --batch-sizes 32 --requests 64 \
--max-new-tokens 128 --prompt-tokens 512 --no-check"}
order="new old"
[ "${PAIRS:-1}" = 2 ] && order="new old old new"
i=0
for side in $order; do
  i=$((i + 1))
  dir=.ab/head
  [ "$side" = new ] && dir=.ab/$tree
  echo "== $side ($dir)" >> "$OUT/ab-serve-$tree.log"
  (cd "$dir" && PYTHONPATH=$PWD:/tmp/site python3 -m selfspec.cli bench serve $ARGS \
      --out "$OUT/serve-$tree-$side-$i.json") >> "$OUT/ab-serve-$tree.log" 2>&1
  echo "serve $side rc=$?"
done
grep -E "^==|^\| [a-z]" "$OUT/ab-serve-$tree.log" | grep -v "^| recipe"
