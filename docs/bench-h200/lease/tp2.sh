# Issue 18 on the 2-GPU machine (kind nvidia-h200-x2; carry [".whl", ".ab/tp-graphs"]): the tensor-parallel GPU tests
# as main runs them (eager), the same with docs/leads/tp-graphs.patch (decode passes as CUDA graphs holding the NCCL
# all-gathers, .ab/tp-graphs), then the step benchmark from that tree: the 8B shape at TP 1 and TP 2, the 70B shape
# at TP 2 (140 GB of bf16 weights: 70 GB a GPU). Logs and JSON under $OUT. Env: STEPS=0 to stop after the tests.
# Each test run is cut at 200 s so a hung collective cannot take the call.
set -u
source "$(dirname "$0")/common.sh"
nvidia-smi -L
timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_parallel_gpu.py -p no:cacheprovider > "$OUT/tp2-tests-main.log" 2>&1
echo "main (eager) tests rc=$?"; tail -3 "$OUT/tp2-tests-main.log"
G=$PWD/.ab/tp-graphs
(cd "$G" && timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_parallel_gpu.py -p no:cacheprovider) \
  > "$OUT/tp2-tests-graphs.log" 2>&1
echo "graphs tests rc=$?"; tail -3 "$OUT/tp2-tests-graphs.log"
[ "${STEPS:-1}" = 1 ] || exit 0
cd "$G"
for tp in 1 2; do
  python3 -m selfspec.bench.steps --shape llama-3-8b --batch 1 8 32 --verify-tokens 1 5 --storages dense planes \
    --tensor-parallel $tp --json "$OUT/tp-steps-8b-tp$tp.json" > "$OUT/tp-steps-8b-tp$tp.log" 2>&1
  echo "8B TP $tp rc=$?"; grep -E "of the copy-bandwidth bound" "$OUT/tp-steps-8b-tp$tp.log" | head -6
done
python3 -m selfspec.bench.steps --shape llama-3-70b --batch 1 8 32 --verify-tokens 1 5 --storages dense planes \
  --tensor-parallel 2 --json "$OUT/tp-steps-70b-tp2.json" > "$OUT/tp-steps-70b-tp2.log" 2>&1
echo "70B TP 2 rc=$?"; tail -25 "$OUT/tp-steps-70b-tp2.log"
