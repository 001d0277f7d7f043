#!/usr/bin/env bash
# Device side, after the last part of bench/prepare_gpu_stack_carry.sh: join and check the parts,
# then install the pinned stack into /tmp/site in ONE pip call (a second --upgrade call replaced the
# whole nvidia/ folder in a dry run). Run everything afterwards with PYTHONPATH=/tmp/site:$PWD.
# Do not pipe this into tail: its exit code (a failed checksum) must stop the command after it.
set -euo pipefail
mkdir -p /tmp/p && cp .carry/stack_parts/s* /tmp/p/
cat /tmp/p/s* > /tmp/stack.tar
echo "$(cat .carry/stack_parts/MD5)  /tmp/stack.tar" | md5sum -c
mkdir -p /tmp/w && tar -xf /tmp/stack.tar -C /tmp/w
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl .whl/math_verify-*.whl .whl/latex2sympy2_extended-*.whl .whl/antlr4_python3_runtime-*.whl
PYTHONPATH=/tmp/site python3 -c "import torch, vllm, math_verify; print('torch', torch.__version__, '| vllm', vllm.__version__, '| cuda', torch.version.cuda, '| nccl', torch.cuda.nccl.version(), '| cudnn', torch.backends.cudnn.version(), '| GPUs', torch.cuda.device_count())"
