#!/usr/bin/env bash
# The one prepared GPU session: kernels' CUDA checks + benchmark, then the kernel and verify tests natively.
# Run on the lent CUDA machine from the repository root; logs go to $OUT (or ./gpu-logs).
set -o pipefail
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi -L | tee "$OUT/env.log"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/env.log"
rc=0
timeout 280 python3 benchmarks/gpu_kernels.py --timeout 270 2>&1 | tee "$OUT/gpu_kernels.log" || rc=1
timeout 80 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -15 | tee "$OUT/pytest_kernels.log" || rc=1
timeout 110 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_verify.py 2>&1 | tail -15 | tee "$OUT/pytest_verify.log" || rc=1
exit $rc
