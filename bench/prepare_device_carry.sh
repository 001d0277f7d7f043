#!/usr/bin/env bash
# Local side, run from the repo root: everything the GPU machine lacks, as carried paths.
#   .carry/parts/p00..p06  vLLM 0.26.0 + dependencies (via ../shared/device/prepare_vllm_carry.sh)
#   .whl/                  math-verify and its two pure-Python dependencies (the grader needs them)
#   data/gsm8k/            GSM8K (git-ignored; W1 samples test questions)
# Then, with the device tool (one call per part, back to back: the machine is released
# ~30 s after a call):
#   part 0:    carry [".carry/chunk"] (cp .carry/parts/p00 .carry/chunk first), command: rm -f /tmp/v.tar; cat .carry/chunk >> /tmp/v.tar
#   part 1..6: the same with p01..p06, command: cat .carry/chunk >> /tmp/v.tar
#   last:      carry [".carry/chunk", ".carry/MD5", ".whl", "data/gsm8k"], command: bash bench/device_setup.sh && <benchmark>
# TRL for bench/bench_trl.py: pip download trl==1.16.0 datasets==5.0.0 multiprocess==0.70.19 into .whl too.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
[ -f .carry/parts/MD5 ] || bash ../shared/device/prepare_vllm_carry.sh
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
if [ ! -f data/gsm8k/test.jsonl ] && ls ../shared/data/gsm8k/*.jsonl >/dev/null 2>&1; then
  mkdir -p data/gsm8k && cp ../shared/data/gsm8k/*.jsonl data/gsm8k/
fi
cp .carry/parts/MD5 .carry/MD5
echo "vLLM tar md5: $(cat .carry/MD5) (bench/device_setup.sh checks it; carry .carry/MD5 with the last part)"
ls -la .carry/parts .whl
