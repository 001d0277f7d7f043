"""Whole GRPO steps through the real `python -m alignment.train_rl` (bench/RESULTS.md, section 3).

    python bench/bench_step.py --gpus 1            # all roles share cuda:0
    python bench/bench_step.py --gpus 2            # vLLM sampler on cuda:1, policy on cuda:0
    python bench/bench_step.py --backend hf --gpus 1
    python bench/bench_step.py --gpus 2 --fsdp     # torchrun, 2 ranks: FSDP2 policy, a vLLM engine per rank
    python bench/bench_step.py --device cpu --tiny # CI smoke

Workload W1 (the TRL comparison; bench_trl.py runs TRL on it): a random-init model of the
Qwen2.5-Math-1.5B shape, trained as train_rl trains by default (fp32 master weights,
bf16 compute; `--extra=--no-fp32_master_weights` for pure bf16); r1_zero prompts from GSM8K test questions; 32
prompts x 8 samples = 256 completions per optimizer step, each exactly 256 new
tokens (min = max), temperature 1, top_p 1; microbatch 32 x 8 accumulation steps,
one optimizer step per rollout batch, no reference model, lr 1e-6. The script runs
train_rl with those flags, then reads runs/<name>/steps.jsonl and reports the
median step time of steps 2..N and its breakdown (rollout, reward, log-probs,
update, sync).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from common import REPO_ROOT, build_checkpoint, write_result

W1_FLAGS = [
    "--rollout_batch_size", "32", "--group_size", "8", "--sampling_min_tokens", "256", "--sampling_max_tokens", "256",
    "--sampling_temperature", "1.0", "--sampling_top_p", "1.0", "--repetition_penalty", "1.0",
    "--train_mini_batch_size", "32", "--learning_rate", "1e-6", "--loss_type", "grpo_clip", "--no-log_reference_kl",
    "--no-skip_zero_signal",  # a random model earns no reward: time the update anyway, as TRL runs it
    "--evaluate_freq", "0", "--eval_num_examples", "32", "--eval_max_tokens", "64",
    "--eval_split", "train",  # the train split is GSM8K's test questions (prepare_data): a timing, not a held-out score
]
TINY_FLAGS = [
    "--rollout_batch_size", "4", "--group_size", "4", "--sampling_min_tokens", "16", "--sampling_max_tokens", "16",
    "--train_mini_batch_size", "8", "--learning_rate", "1e-6", "--no-log_reference_kl", "--no-skip_zero_signal", "--repetition_penalty", "1.0",
    "--evaluate_freq", "0", "--eval_num_examples", "4", "--eval_max_tokens", "16", "--vllm_kv_cache_gb", "0.25", "--eval_split", "train",
]


def prepare_data(folder: Path) -> Path:
    """W1 samples GSM8K *test* questions: a data folder whose train split is test.jsonl (so the runs evaluate with
    --eval_split train: train_rl refuses a test split that shares problems with the train split)."""
    source = REPO_ROOT / "data" / "gsm8k" / "test.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    if source.is_file():
        shutil.copy(source, folder / "train.jsonl")
        shutil.copy(source, folder / "test.jsonl")
    else:  # no GSM8K here: the synthetic task in the same format
        from alignment.toy.synthetic_task import write_synthetic_gsm8k

        write_synthetic_gsm8k(folder, num_train=512, num_test=64)
    return folder


def visible_gpus(count: int, given: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for the run: the first `count` of the caller's (`given`), or 0..count-1 when unset.
    A caller's CUDA_VISIBLE_DEVICES=1 keeps the run on GPU 1, so two benchmarks can run side by side on two GPUs."""
    visible = [gpu.strip() for gpu in given.split(",") if gpu.strip()] if given is not None else [str(i) for i in range(count)]
    if len(visible) < count:
        raise SystemExit(f"--gpus {count}, but CUDA_VISIBLE_DEVICES={given} leaves {len(visible)}: widen it or lower --gpus")
    return ",".join(visible[:count])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the run may use: the first N of CUDA_VISIBLE_DEVICES (default 0..N-1)")
    parser.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for the smoke run")
    parser.add_argument("--fsdp", action="store_true", help="torchrun with one rank per GPU and --policy_parallel fsdp")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--extra", default="", help="more train_rl flags, space-separated")
    parser.add_argument("--tag", default="", help="suffix for the result's name (to keep two runs' rows apart)")
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench"))
    args = parser.parse_args()

    work = Path(args.out) / "step_work"
    checkpoint = build_checkpoint(REPO_ROOT / "runs" / "bench" / ("model_tiny" if args.tiny else "model"), args.tiny)
    data = prepare_data(work / "data")
    name = f"step_{args.backend}_{args.gpus}gpu" + ("_fsdp" if args.fsdp else "") + ("_tiny" if args.tiny else "") + (f"_{args.tag}" if args.tag else "")
    for stale in (work / name, work / "checkpoints" / name, work / "checkpoints" / f"{name}.state"):  # a rerun starts over
        shutil.rmtree(stale, ignore_errors=True)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.gpus)] if args.fsdp else [sys.executable]
    command = [
        *launcher, "-m", "alignment.train_rl", "--sft_checkpoint_path", str(checkpoint),
        "--checkpoint_path", str(work / "checkpoints" / name), "--data_dir", str(data), "--log_dir", str(work), "--run_name", name,
        "--layout", "auto", "--rollout_backend", args.backend, "--max_steps", str(args.steps),
        *(TINY_FLAGS if args.tiny else W1_FLAGS), *(["--policy_parallel", "fsdp"] if args.fsdp else []), *args.extra.split(),
    ]
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env["CUDA_VISIBLE_DEVICES"] = visible_gpus(args.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    print("$ " + " ".join(command), flush=True)
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env)
    if completed.returncode:
        raise SystemExit(f"train_rl failed with exit code {completed.returncode}")

    steps = [json.loads(line) for line in open(work / name / "steps.jsonl")]
    measured = steps[1:] if len(steps) > 1 else steps  # step 1 pays compilation and warm-up
    row = {"row": name, "steps": len(steps), "median_step_seconds": statistics.median(s["perf/step_seconds"] for s in measured)}
    row["flags"] = args.extra
    for part in ("rollout", "reward", "logprobs", "update", "sync"):
        row[f"{part}_seconds"] = statistics.median(s[f"perf/{part}_seconds"] for s in measured)
    row["rollout_share"] = row["rollout_seconds"] / row["median_step_seconds"]
    for part in ("sampler_generate", "sampler_load"):  # --rollout_staleness: the engine process's own times
        values = [s[f"perf/{part}_seconds"] for s in measured if s.get(f"perf/{part}_seconds") is not None]
        if values:
            row[f"{part}_seconds"] = statistics.median(values)
    if "sampler_generate_seconds" in row:  # 1.0: the step takes as long as the slower of generation and update
        row["overlap"] = row["median_step_seconds"] / max(row["sampler_generate_seconds"], row["update_seconds"])
    row["rollout_tokens_per_s"] = statistics.median(s["perf/rollout_tokens_per_s"] for s in measured)
    row["train_tokens_per_s"] = statistics.median(s["perf/train_tokens_per_s"] for s in measured)
    row["first_step_seconds"] = steps[0]["perf/step_seconds"]
    peaks = [s["perf/peak_memory_gib"] for s in steps if s.get("perf/peak_memory_gib") is not None]
    row["peak_memory_gib_rank0"] = max(peaks) if peaks else None
    write_result(args.out, name, [row])


if __name__ == "__main__":
    main()
