# A tree of selfspec (.ab/TREE) on the lent GPU: its GPU kernel tests with that tree's selfspec first on the path,
# then `selfspec.bench.ab` of the GEMM bench with .ab/head as the old side and the tree as the new one. Logs and JSON
# under $OUT. Carry [".whl", ".ab/head", ".ab/TREE"].
#   bash docs/bench-h200/lease/ab_tree.sh TREE
#   env: K (pytest -k), TESTS=0 (no tests), AB=0 (no A/B), TEST_TIMEOUT (s, default 420: a hung kernel ends the
#   tests, not the call), M (rows), MODES, ROUNDS (default 2), SWAP=1 (the tree as the old side
#   and HEAD as the new: a row slower on whichever side is new is the harness's, not the change's)
set -u
source "$(dirname "$0")/common.sh"
tree=$1
T=$PWD/.ab/$tree
K=${K:-"nibble or planes or int4 or w4 or many_tokens or reference_weight or upper"}
# the tree's own tests where it has them (a patch may add some), through a link of a neutral name: pytest's -k
# matches every folder of a test's path too, so K="quartered" would pick every test of .ab/x-quartered-attention
ln -sfn "$tree" .ab/_tree
tests=$PWD/.ab/_tree/tests/gpu/test_gpu_kernels.py
[ -f "$tests" ] || tests=tests/gpu/test_gpu_kernels.py
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-420}" python3 -c "import sys; sys.path.insert(0, '$T'); import pytest, selfspec; \
print(selfspec.__file__); \
sys.exit(pytest.main(['-q', '-m', 'gpu', '$tests', '-k', '''$K''', '-p', 'no:cacheprovider']))" \
    > "$OUT/gpu-tests-$tree.log" 2>&1
  echo "tests rc=$?"; tail -3 "$OUT/gpu-tests-$tree.log"
fi
[ "${AB:-1}" = 1 ] || exit 0
old=.ab/head new=$T
[ "${SWAP:-0}" = 1 ] && { old=$T; new=.ab/head; }
python3 -m selfspec.bench.ab --old "$old" --new "$new" --rounds "${ROUNDS:-2}" --json "$OUT/ab-gemm-$tree.json" -- \
  gemm --m ${M:-256 1024 4096} --modes ${MODES:-w4a16 upper full} > "$OUT/ab-gemm-$tree.log" 2>&1
echo "ab rc=$?"; grep -E "^\|" "$OUT/ab-gemm-$tree.log" | grep -v -E "prompt|cublas-int8" | tail -40
