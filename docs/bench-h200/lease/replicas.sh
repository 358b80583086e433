# Issue 18's replica bar on the 2-GPU machine (kind nvidia-h200-x2): 2 engine replicas of the 8B shape against one,
# batch 32 a replica (`selfspec bench replicas`). The machine's image lacks ray[serve]: here first
# `RAY=1 bash docs/bench-h200/lease/prepare.sh` (.ray/1, .ray/2, ...: its wheels as a tar in 40 MB pieces), then on
# the machine one warm call per piece folder but the last (carry [".ray/1"], then [".ray/2"], ...: ignored files stay
# between warm calls; the command can be `ls .ray`), and this script with the last folder and .whl in the carry.
# Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/common.sh"
ls .ray
mkdir -p /tmp/ray-wheels && cat .ray/*/part.* | tar -x -C /tmp/ray-wheels || exit 1
python3 -m pip install -q --no-index --find-links /tmp/ray-wheels/wheels "ray[serve]==2.60.0" \
  > "$OUT/ray-install.log" 2>&1
echo "ray install rc=$?"; tail -3 "$OUT/ray-install.log"
timeout 500 python3 -m selfspec.bench.replicas --shape llama-3-8b --replicas 1 2 --batch 32 --requests 64 \
  --max-new-tokens 128 --prompt-tokens 512 --device cuda --json "$OUT/replicas-8b.json" > "$OUT/replicas-8b.log" 2>&1
echo "replicas rc=$?"; grep -v -i warn "$OUT/replicas-8b.log" | tail -8
