#!/usr/bin/env bash
# The pinned stack on an H200 x2 (torch 2.13 + vLLM 0.32, after bench/stack_setup.sh), as one background job
# in two lanes, one GPU each, then the stages that need both:
#   GPU 0: W1 compiled, W1 with --pack_sequences (and, by LANE0, the weight-sync proof: rollout;
#          the update and log-prob benchmarks on the realistic mix and W1's shape: update_mix, update_w1)
#   GPU 1: tests/test_gpu.py, the demo, the update benchmark (padded vs packed microbatches)
#          (and, by LANE1, the demo's RL padded against the fast path: learning; W1 on the fast path: w1_fast)
#   both:  W1 with the sampler on cuda:1 (device_ids) and the policy on cuda:0 (and, by BOTH, FSDP: x2_fsdp)
#   setsid nohup bash bench/stack_session.sh /tmp/results > /tmp/session.log 2>&1 < /dev/null &
# Each stage appends "<name> <exit code> <time>" to /tmp/results/stages; DONE marks the end.
# LANE0 / LANE1 / BOTH override a lane's stage list (e.g. BOTH="" to skip the two-GPU stages).
set -x
results=${1:-/tmp/results}
mkdir -p "$results"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, vllm, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'cudnn', torch.backends.cudnn.version(), '| vllm', vllm.__version__, '| transformers', transformers.__version__, '| triton', triton.__version__)" > "$results/stack.txt" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$results/stack.txt"
(cd bench && python3 -c "from common import REPO_ROOT, build_checkpoint; build_checkpoint(REPO_ROOT / 'runs' / 'bench' / 'model', False)") > "$results/build_model.log" 2>&1

run_stage() {
  local name=$1
  shift
  "$@" > "$results/$name.log" 2>&1
  echo "$name $? $(date +%T)" >> "$results/stages"
}

stage() {
  case $1 in
    rollout) CUDA_VISIBLE_DEVICES=0 run_stage rollout python3 bench/bench_rollout.py --skip_eager --hf_prompts 32 --out "$results" ;;
    w1) run_stage w1 python3 bench/bench_step.py --gpus 1 --steps 6 --extra=--torch_compile --tag pinned --out "$results" ;;
    w1_packed) run_stage w1_packed python3 bench/bench_step.py --gpus 1 --steps 6 --extra="--torch_compile --pack_sequences" --tag pinned_packed --out "$results" ;;
    gpu_tests) run_stage gpu_tests python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py ;;
    update) run_stage update python3 bench/bench_update.py --repeats 3 --variants fused_sorted_mb32_compile,packed_mb32_compile,packed_mb64_compile \
              --logprob_variants logprob_fused_mb64,logprob_packed_mb64 --profile packed_mb32_compile --out "$results" ;;
    demo) run_stage demo python3 -m alignment.toy.demo --out /tmp/demo --checkpoints /tmp/demo_ckpt
          cp /tmp/demo/summary.json "$results/demo_summary.json" ;;
    w1_fast) run_stage w1_fast python3 bench/bench_step.py --gpus 1 --steps 6 --extra="--torch_compile --pack_sequences --microbatch_tokens 32768" --tag pinned_fast --out "$results" ;;
    update_mix) run_stage update_mix python3 bench/bench_update.py --repeats 3 \
              --variants fused_sorted_mb32_compile,packed_mb32_compile,fused_sorted_tok32k_compile,packed_tok24k_compile,packed_tok32k_compile,packed_tok40k_compile \
              --logprob_variants logprob_fused_mb64,logprob_packed_mb64,logprob_fused_mb64_compile,logprob_packed_mb64_compile,logprob_packed_tok32k_compile,logprob_packed_tok64k_compile \
              --profile packed_tok32k_compile --out "$results" ;;
    update_w1) run_stage update_w1 python3 bench/bench_update.py --shape w1 --repeats 3 --logprob_variants none \
              --variants fused_sorted_mb32_compile,packed_mb32_compile,fused_sorted_tok32k_compile,packed_tok32k_compile --out "$results" ;;
    learning) run_stage learning python3 bench/bench_learning.py --variants demo,demo_fast --out /tmp/learning
          cp /tmp/learning/learning.json "$results/learning.json" ;;
    x2) run_stage x2 python3 bench/bench_step.py --gpus 2 --steps 6 --extra="--torch_compile --sampler_logprobs_every 0" --tag pinned_sync --out "$results" ;;
    x2_fsdp) run_stage x2_fsdp python3 bench/bench_step.py --gpus 2 --fsdp --steps 6 --extra="--torch_compile --sampler_logprobs_every 0" --tag pinned_compiled --out "$results" ;;
  esac
}

lane0() {
  for name in ${LANE0-w1 w1_packed}; do stage "$name"; done
}

lane1() {
  # GPU 1 alone, with compile caches of its own (inside the lane it is cuda:0, like lane 0's GPU)
  export CUDA_VISIBLE_DEVICES=1 VLLM_CACHE_ROOT=/tmp/lane1/vllm TORCHINDUCTOR_CACHE_DIR=/tmp/lane1/inductor TRITON_CACHE_DIR=/tmp/lane1/triton
  for name in ${LANE1-gpu_tests demo update}; do stage "$name"; done
}

lane0 &
lane1 &
wait
for name in ${BOTH-x2}; do stage "$name"; done
date > "$results/DONE"
