#!/usr/bin/env bash
# Device side, after the last part: check and unpack vLLM 0.26 and the grader's wheels
# into /tmp/site. Afterwards run benchmarks with PYTHONPATH=/tmp/site (export it in each
# later call on the same warm machine).
set -euo pipefail
expected=${VLLM_TAR_MD5:-a55401073dbde44cf76175b89b5fe43e}   # ../shared/device/vllm-0.26.0 parts
[ -f /tmp/v.tar ] && [ -f .carry/chunk ] && cat .carry/chunk >> /tmp/v.tar
echo "$expected  /tmp/v.tar" | md5sum -c
mkdir -p /tmp/w && tar -xf /tmp/v.tar -C /tmp/w
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl .whl/*.whl
PYTHONPATH=/tmp/site python3 -c "import vllm, math_verify, torch; print('vllm', vllm.__version__, '| torch', torch.__version__, '| GPUs', torch.cuda.device_count())"
