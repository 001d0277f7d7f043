#!/usr/bin/env bash
# Device side, after the last part: check and unpack vLLM 0.26 and the grader's wheels
# into /tmp/site. Afterwards run benchmarks with PYTHONPATH=/tmp/site:$PWD (export it in each
# later call on the same warm machine). Do not pipe this script into tail: its exit code
# (a failed checksum stops it) must stop the command that runs the benchmarks.
set -euo pipefail
# The tar's checksum travels with the last part (.carry/MD5, written by prepare_device_carry.sh):
# wheels re-downloaded on another day tar to other bytes, so no checksum is fixed here.
expected=${VLLM_TAR_MD5:-$(cat .carry/MD5)}
[ -f /tmp/v.tar ] && [ -f .carry/chunk ] && cat .carry/chunk >> /tmp/v.tar
echo "$expected  /tmp/v.tar" | md5sum -c
mkdir -p /tmp/w && tar -xf /tmp/v.tar -C /tmp/w
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl .whl/*.whl
PYTHONPATH=/tmp/site python3 -c "import vllm, math_verify, torch; print('vllm', vllm.__version__, '| torch', torch.__version__, '| GPUs', torch.cuda.device_count())"
