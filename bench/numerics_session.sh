#!/usr/bin/env bash
# The H200 sessions behind bench/RESULTS.md, as one background job (a call may run 10 minutes;
# this takes ~15-20): the learning table (the 1.5B benchmark model is built beside it), W1 with
# fp32 master weights, TRL's GRPOTrainer on the same checkpoint right after, W1 in pure bf16,
# the update benchmark with a profile, the demo; on nvidia-h200-x2 the sampler log-prob cost
# (GPU 1, beside W1 on GPU 0), W1 synchronous vs one step off, and FSDP with compiled engines.
# After bench/device_setup.sh (TRL's wheels in .whl too), from a copy of the repo:
#   STAGES="learning w1_fp32 trl w1_bf16" setsid nohup bash bench/numerics_session.sh /tmp/results > /tmp/session.log 2>&1 &
# then read /tmp/results/*.log in later calls; /tmp/results/DONE marks the end, and each stage
# leaves its name in /tmp/results/stages as it finishes (with its exit code).
set -x
results=${1:-/tmp/results}
stages=${STAGES:-learning w1_fp32 trl w1_bf16 update demo}  # x2: "sampler_logprobs w1_fp32 x2_async x2_sync x2_fsdp"
variants=${LEARNING_VARIANTS:-}  # empty: all of bench_learning.py's variants
mkdir -p "$results"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1  # the repo itself: the package is not pip-installed there
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$results/gpu.txt"
(cd bench && python3 -c "from common import REPO_ROOT, build_checkpoint; build_checkpoint(REPO_ROOT / 'runs' / 'bench' / 'model', False)") > "$results/build_model.log" 2>&1 &
builder=$!

run_stage() {
  local name=$1
  shift
  "$@" > "$results/$name.log" 2>&1
  echo "$name $? $(date +%T)" >> "$results/stages"
}

for stage in $stages; do
  case $stage in
    learning)
      run_stage learning python3 bench/bench_learning.py --out /tmp/learning ${variants:+--variants $variants}
      cp /tmp/learning/learning.json "$results/" ;;
    w1_fp32)
      wait $builder
      run_stage w1_fp32_master python3 bench/bench_step.py --gpus 1 --steps 6 --extra=--torch_compile --tag fp32_master --out "$results" ;;
    trl)
      wait $builder
      run_stage trl python3 bench/bench_trl.py --steps 6 --out "$results" ;;
    w1_bf16)
      wait $builder
      run_stage w1_pure_bf16 python3 bench/bench_step.py --gpus 1 --steps 6 --extra="--torch_compile --no-fp32_master_weights" --tag pure_bf16 --out "$results" ;;
    update)
      wait $builder
      run_stage update python3 bench/bench_update.py --repeats 3 --variants fused_sorted_mb16,fused_sorted_mb16_compile,fused_sorted_mb32_compile \
        --profile fused_sorted_mb32_compile --out "$results" ;;
    sampler_logprobs)  # on GPU 1, beside a one-GPU stage on GPU 0 (its own compile caches: alignment_cuda1)
      wait $builder
      (CUDA_VISIBLE_DEVICES=0,1 run_stage sampler_logprobs python3 bench/bench_sampler_logprobs.py --device cuda:1 --out "$results") &
      side=$! ;;
    x2_async)  # nvidia-h200-x2 from here: sampler on cuda:1, policy on cuda:0
      wait $builder ${side:-}
      run_stage x2_async python3 bench/bench_step.py --gpus 2 --steps 8 --extra="--torch_compile --rollout_staleness 1" --tag async --out "$results" ;;
    x2_sync)
      wait $builder ${side:-}
      run_stage x2_sync python3 bench/bench_step.py --gpus 2 --steps 6 --extra="--torch_compile --sampler_logprobs_every 0" --tag sync --out "$results" ;;
    x2_fsdp)  # compiled engines under torchrun, each rank with its own compile caches
      wait $builder ${side:-}
      run_stage x2_fsdp python3 bench/bench_step.py --gpus 2 --fsdp --steps 6 \
        --extra="--torch_compile --sampler_logprobs_every 0" --tag compiled --out "$results" ;;
    demo)
      run_stage demo python3 -m alignment.toy.demo --out /tmp/demo --checkpoints /tmp/demo_ckpt
      cp /tmp/demo/summary.json "$results/demo_summary.json" ;;
  esac
done
wait
date > "$results/DONE"
