# docs/leads/quarter-order.patch (.ab/quarter-order) against HEAD (.ab/head) in one call: its GPU kernel tests for
# the formats it changes, then the GEMM bench of those formats at 1 and 16 rows (the M <= 16 bar) and at 256 / 1,024
# / 4,096 rows (the bars table), ROUNDS old/new runs in turn (default 1), each side's best time and their ratio.
# Logs and JSON under $OUT. Carry [".whl", ".ab/head", ".ab/quarter-order"].
#   bash docs/bench-h200/lease/quarter_order.sh
set -u
K="nibble or planes or int4 or w4 or many_tokens or reference_weight or upper or prompt or scratch" \
  TEST_TIMEOUT=${TEST_TIMEOUT:-150} M="1 16 256 1024 4096" MODES="w4a16 upper full w4a8 w4a4" ROUNDS=${ROUNDS:-1} \
  bash "$(dirname "$0")/ab_tree.sh" quarter-order
