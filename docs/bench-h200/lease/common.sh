# Sourced by the lease scripts, on the lent machine: the carried wheels on the path, this tree's selfspec importable,
# NVLink multicast off (../shared/DEVICE.md), and the device's name in the log.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || echo "wheel install failed: run docs/bench-h200/lease/prepare.sh here and carry .whl"
export PYTHONPATH=/tmp/site:$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
