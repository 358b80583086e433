# The engine's GPU tests on SmolLM2 (prefill in chunks, losslessness, batched == solo) with a tree of selfspec
# (.ab/TREE; HEAD where none is named): log under $OUT. Needs the SmolLM2 wheel: carry .sm/1 and .sm/2 in the two
# calls before, and [".whl", ".ab/TREE", ".sm/3"] in this one (smollm2.sh).
#   bash docs/bench-h200/lease/engine_tests.sh TREE
#   env: K (pytest -k; default the prompt, prefill and recipe tests), TEST_TIMEOUT (s, default 300)
set -u
source "$(dirname "$0")/common.sh"
source "$(dirname "$0")/smollm2.sh"
tree=${1:-}
dir=$PWD
[ -n "$tree" ] && dir=$PWD/.ab/$tree
(cd "$dir" && PYTHONPATH=$PWD:/tmp/site timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu \
    tests/gpu/test_prefill_gpu.py tests/gpu/test_lossless_gpu.py tests/gpu/test_engine_gpu.py \
    -k "${K:-prefill or qspec or prompt or planes}" -p no:cacheprovider) > "$OUT/gpu-tests-engine-${tree:-head}.log" 2>&1
echo "engine tests rc=$?"; tail -3 "$OUT/gpu-tests-engine-${tree:-head}.log"
