# An attention lead's tree (.ab/TREE) on the lent GPU in one call: its GPU attention and whole-pass tests, eager
# prefill against .ab/head (1 x 2,048, 1 x 8,192 and 8 x 512, where attention weighs most), and the decode and verify
# steps at batch 1 and 32 against .ab/head. Logs under $OUT. Carry [".whl", ".ab/head", ".ab/TREE"].
#   bash docs/bench-h200/lease/attention_lead.sh TREE
#   env: K (pytest -k, default the attention, prompt, prefill and whole-pass tests: 47 of the GPU kernel module),
#   TEST_TIMEOUT (s, default 300), TESTS=0 / PREFILL=0 / STEPS=0 (skip a part: a call near its 10 minutes splits in
#   two)
set -u
dir=$(dirname "$0")
tree=$1
AB=0 K=${K:-"attention or prompt or prefill or passes"} TEST_TIMEOUT=${TEST_TIMEOUT:-300} bash "$dir/ab_tree.sh" "$tree"
if [ "${PREFILL:-1}" = 1 ]; then
  ARGS="--shape llama-3-8b --sizes 1x2048 1x8192 8x512 --modes bf16 w4a16 --no-hf" bash "$dir/prefill_ab.sh" "$tree"
fi
if [ "${STEPS:-1}" = 1 ]; then
  source "$dir/common.sh" >/dev/null
  python3 -m selfspec.bench.ab --old .ab/head --new ".ab/$tree" --rounds 2 --json "$OUT/ab-steps-$tree.json" -- \
    steps --batch 1 32 --verify-tokens 1 5 --storages planes int4 > "$OUT/ab-steps-$tree.log" 2>&1
  echo "steps rc=$?"; grep -E "^\|" "$OUT/ab-steps-$tree.log" | tail -30
fi
