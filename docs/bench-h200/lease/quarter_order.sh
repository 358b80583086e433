# docs/leads/quarter-order.patch (.ab/quarter-order) against HEAD (.ab/head): its GPU kernel tests for the formats it
# changes, then `selfspec.bench.ab` of the GEMM bench of those formats, ROUNDS old/new runs in turn, each side's best
# time and their ratio. Logs and JSON under $OUT. Carry [".whl", ".ab/head", ".ab/quarter-order"].
#   bash docs/bench-h200/lease/quarter_order.sh                    # tests (400 s), then 1, 16 and 96 rows
# The tests' filter picks 199 tests, ~2.2 s each on an H100 (session 33: 67 in 150 s), so in a lease of short calls:
#   TESTS=0 bash docs/bench-h200/lease/quarter_order.sh                          # 1, 16, 96 rows: the M <= 16 bar
#   AB=0 TEST_TIMEOUT=540 bash docs/bench-h200/lease/quarter_order.sh            # the kernel tests alone
#   TESTS=0 M="256 1024 4096" ROUNDS=1 bash docs/bench-h200/lease/quarter_order.sh   # the bars table
# Session 33 ran it once with M="1 16 256 1024 4096" ROUNDS=1 TEST_TIMEOUT=150 (the tests did not finish).
set -u
K="nibble or planes or int4 or w4 or many_tokens or reference_weight or upper or prompt or scratch" \
  TESTS=${TESTS:-1} TEST_TIMEOUT=${TEST_TIMEOUT:-400} M=${M:-1 16 96} MODES="w4a16 upper full w4a8 w4a4" \
  ROUNDS=${ROUNDS:-2} bash "$(dirname "$0")/ab_tree.sh" quarter-order
