#!/usr/bin/env bash
# The H200 session behind bench/RESULTS.md's "fp32 master weights" section, as one background
# job (a call may run 10 minutes; this takes ~20): the learning table (the 1.5B benchmark model
# is built beside it), then W1 with fp32 master weights, TRL's GRPOTrainer on the same checkpoint
# right after, W1 in pure bf16, and last the demo as is. After bench/device_setup.sh (TRL's
# wheels in .whl too), from a copy of the repo:
#   setsid nohup bash bench/numerics_session.sh /tmp/results > /tmp/session.log 2>&1 &
# then read /tmp/results/*.log in later calls; /tmp/results/DONE marks the end of the timed part.
set -x
results=${1:-/tmp/results}
mkdir -p "$results"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1  # the repo itself: the package is not pip-installed there
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$results/gpu.txt"
(cd bench && python3 -c "from common import REPO_ROOT, build_checkpoint; build_checkpoint(REPO_ROOT / 'runs' / 'bench' / 'model', False)") > "$results/build_model.log" 2>&1 &
python3 bench/bench_learning.py --out /tmp/learning > "$results/learning.log" 2>&1
wait
cp /tmp/learning/learning.json "$results/"
python3 bench/bench_step.py --gpus 1 --steps 6 --extra=--torch_compile --tag fp32_master --out "$results" > "$results/w1_fp32_master.log" 2>&1
python3 bench/bench_trl.py --steps 6 --out "$results" > "$results/trl.log" 2>&1
python3 bench/bench_step.py --gpus 1 --steps 6 --extra="--torch_compile --no-fp32_master_weights" --tag pure_bf16 --out "$results" > "$results/w1_pure_bf16.log" 2>&1
date > "$results/DONE"
python3 -m alignment.toy.demo --out /tmp/demo --checkpoints /tmp/demo_ckpt > "$results/demo.log" 2>&1
cp /tmp/demo/summary.json "$results/demo_summary.json"
