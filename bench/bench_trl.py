"""The peer: TRL's `GRPOTrainer` on workload W1, for a side-by-side step time.

    PYTHONPATH=/tmp/site:$PWD python bench/bench_trl.py   # one GPU; TRL 1.16 + vLLM 0.26 carried
    python bench/bench_trl.py --tiny --device cpu         # smoke run of this script (HF generation)

TRL is not a dependency of this repo (CI does not run this file); on the GPU
machine it travels as wheels (bench/prepare_device_carry.sh). The workload is
bench_step.py's W1 on the same checkpoint (common.build_checkpoint): 32 prompts x 8
samples = 256 completions of exactly 256 tokens per optimizer step, temperature 1,
top_p 1, microbatch 32 x 8 accumulation steps, no reference model (beta 0), lr
1e-6, vLLM colocated on the same GPU with 30% of its memory. Numerics are TRL's
defaults: the policy loaded in fp32 (TRL's `model_init_kwargs` default) and
trained under bf16 autocast, i.e. fp32 master weights, as train_rl does by
default. The reward is a cheap stand-in (a random model never answers).
Reports the median wall time of optimizer steps 2..N (step 1 pays warm-up).
"""

import argparse
import statistics
import time

from common import REPO_ROOT, build_checkpoint, gsm8k_questions, write_result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tiny", action="store_true", help="2-layer model, short completions, no vLLM: a smoke run")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for the smoke run")
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench"))
    args = parser.parse_args()

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from transformers import TrainerCallback

    from alignment.data import format_r1_zero_prompt

    checkpoint = build_checkpoint(REPO_ROOT / "runs" / "bench" / ("model_tiny" if args.tiny else "model"), args.tiny)
    prompts = [format_r1_zero_prompt(q) for q in gsm8k_questions()[:64]]
    completions, generations, microbatch = (16, 4, 8) if args.tiny else (256, 8, 32)
    config = GRPOConfig(
        output_dir=str(REPO_ROOT / "runs" / "bench" / "trl_work"),
        per_device_train_batch_size=microbatch, gradient_accumulation_steps=8, num_generations=generations,
        max_completion_length=completions, generation_kwargs={"min_tokens": completions} if not args.tiny else None,
        temperature=1.0, top_p=1.0, beta=0.0, learning_rate=1e-6, bf16=not args.tiny, use_cpu=args.device == "cpu",
        use_vllm=not args.tiny, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, gradient_checkpointing=False,
        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none", seed=0,
    )

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_step_begin(self, *_, **__):
            if not self.marks:
                self.marks.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            self.marks.append(time.perf_counter())

    def cheap_reward(completions, **_):
        return [float(len(text) % 7) / 7 for text in completions]  # varies, so advantages are non-zero

    clock = StepClock()
    trainer = GRPOTrainer(model=str(checkpoint), reward_funcs=cheap_reward, args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[clock])
    print(f"TRL policy dtype {next(trainer.model.parameters()).dtype}, bf16 autocast {config.bf16}", flush=True)
    trainer.train()
    seconds = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    measured = seconds[1:] if len(seconds) > 1 else seconds
    row = {"row": "trl_grpo_w1" + ("_tiny" if args.tiny else ""), "steps": len(seconds), "median_step_seconds": statistics.median(measured),
           "step_seconds": [round(s, 2) for s in seconds], "policy_dtype": str(next(trainer.model.parameters()).dtype)}
    write_result(args.out, row["row"], [row])


if __name__ == "__main__":
    main()
