#!/usr/bin/env bash
# Local side, from the repo root: the pinned GPU stack (requirements.txt: torch 2.13 + vLLM 0.32) for the
# offline H200, in 62 MiB parts (a call carries at most 64 MiB with the working tree). The list,
# bench/gpu-stack-carry.txt, is the image's missing pieces (plan and measurements: bench/gpu_stack_carry.md):
# torch 2.13.0+cu130, triton 3.7.1, NCCL 2.29.7 and cuDNN 9.20 (torch 2.13 needs them; the image's
# CUDA 13 cuBLAS and the rest serve it), vLLM 0.32.0 without its FlashAttention-2 library (Hopper runs
# FA3), and vLLM's pure-Python dependencies. 101 wheels, ~1.6 GB, 25 parts.
# Device side, with the device tool, one call per part, back to back (the machine is released
# ~30 s after a call, and /tmp with it); the parts may arrive in any order:
#   part i:  carry [".carry/stack_parts/sNN"], command: mkdir -p /tmp/p && cp .carry/stack_parts/s* /tmp/p/
#   last:    carry [".carry/stack_parts/sNN", ".carry/stack_parts/MD5", ".whl", "data/gsm8k"],
#            command: bash bench/stack_setup.sh && <benchmarks with PYTHONPATH=/tmp/site:$PWD>
# .whl holds the grader's wheels (bench/prepare_device_carry.sh downloads them).
set -euo pipefail
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
mkdir -p .carry/stack .carry/stack_parts
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_18_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d .carry/stack -r bench/gpu-stack-carry.txt
# FlashAttention-2's library (130 MB): vLLM picks FA3 on Hopper (FA2 only for ALiBi or batch invariance)
if unzip -l .carry/stack/vllm-0.32.0-*.whl | grep -q _vllm_fa2_C; then
  zip -q -d .carry/stack/vllm-0.32.0-*.whl 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so'
fi
(cd .carry/stack && tar -cf ../stack.tar *.whl)
rm -f .carry/stack_parts/*
split -b 62M -d .carry/stack.tar .carry/stack_parts/s
md5sum .carry/stack.tar | cut -d' ' -f1 > .carry/stack_parts/MD5
ls -la .carry/stack_parts
