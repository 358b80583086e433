# Issue 18 on the 2-GPU machine (kind nvidia-h200-x2), from a tree of selfspec (.ab/TREE, default head: HEAD's,
# or a lead's tree from prepare.sh; carry [".whl", ".ab/TREE"]): the tensor-parallel GPU tests from that
# tree (TESTS=0: none), then the step benchmark (STEPS=0: none): the 8B shape at TP 1 and TP 2, the 70B shape at
# TP 2 (140 GB of bf16 weights: 70 GB a GPU), and planes' replayed speculation on the 70B shape at TP 2 against its
# own `full` AR (SPEC=0: none). The tests take ~4-5 minutes, the steps ~5, the replay ~3: one call
# each (TESTS=1 STEPS=0 SPEC=0, then TESTS=0 STEPS=1 SPEC=0, then TESTS=0 STEPS=0 SPEC=1). Logs and JSON under
# $OUT. main's own TP tests passed on two H200s in sessions 24 (eager) and 25 (CUDA graphs).
set -u
source "$(dirname "$0")/common.sh"
G=$PWD/.ab/${1:-head}
export PYTHONPATH=/tmp/site:$G
nvidia-smi -L
cd "$G"
if [ "${TESTS:-1}" = 1 ]; then
  # Each test's time, and where a hung one waits (NCCL's teardown hung in session 24 while graphs lived).
  timeout 500 python3 -m pytest -v -m gpu tests/gpu/test_parallel_gpu.py -p no:cacheprovider --durations=0 \
    -o faulthandler_timeout=150 > "$OUT/tp2-tests.log" 2>&1
  echo "tests rc=$?"; grep -E "PASSED|FAILED|ERROR|Timeout|passed|failed" "$OUT/tp2-tests.log" | tail -12
fi
if [ "${STEPS:-1}" = 1 ]; then
for run in 1 2 2-nccl; do  # 2-nccl: TP 2 with NCCL's all-gathers alone (SELFSPEC_TP_PEER=0), for the A/B
  SELFSPEC_TP_PEER=$([ "$run" = 2-nccl ] && echo 0 || echo 1) python3 -m selfspec.bench.steps --shape llama-3-8b \
    --batch 1 8 32 --verify-tokens 1 5 --storages dense planes --tensor-parallel "${run%-nccl}" --profile \
    --json "$OUT/tp-steps-8b-tp$run.json" > "$OUT/tp-steps-8b-tp$run.log" 2>&1
  echo "8B TP $run rc=$?"; grep -E "AR .*ms/step|collectives|^    " "$OUT/tp-steps-8b-tp$run.log" | head -40
done
timeout 300 python3 -m selfspec.bench.steps --shape llama-3-70b --batch 1 8 32 --verify-tokens 1 5 \
  --storages dense planes --tensor-parallel 2 --json "$OUT/tp-steps-70b-tp2.json" > "$OUT/tp-steps-70b-tp2.log" 2>&1
echo "70B TP 2 rc=$?"; tail -25 "$OUT/tp-steps-70b-tp2.log"
fi
if [ "${SPEC:-1}" = 1 ]; then
timeout 240 python3 -m selfspec.bench.spec --shape llama-3-70b --tensor-parallel 2 --gamma 4 \
  --trace selfspec/bench/traces/qwen2.5-coder-1.5b.planes.json --json "$OUT/tp-spec-70b-tp2.json" \
  > "$OUT/tp-spec-70b-tp2.log" 2>&1
echo "70B spec TP 2 rc=$?"; tail -8 "$OUT/tp-spec-70b-tp2.log"
fi
