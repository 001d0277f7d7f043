"""The peer: TRL's `GRPOTrainer`, on workload W1 (step time) or on GSM8K from a real model (learning).

    python bench/bench_trl.py                                   # W1, one GPU, TRL 1.16 + vLLM colocated
    python bench/bench_trl.py --workload gsm8k --model CKPT     # GSM8K (bench_gsm8k.py runs this beside train_rl)
    python bench/bench_trl.py --tiny --device cpu               # smoke run of this script (HF generation)

TRL is not a dependency of this repo (CI does not run this file): `pip install trl==1.16.0`.

W1 is bench_step.py's workload on the same checkpoint (common.build_checkpoint): 32
prompts x 8 samples = 256 completions of exactly 256 tokens per optimizer step,
temperature 1, top_p 1, microbatch 32 x 8 accumulation steps, no reference model
(beta 0), lr 1e-6, vLLM colocated on the same GPU with 30% of its memory. The reward
is a cheap stand-in (a random model never answers).

GSM8K trains `--model` on the train split with this project's r1_zero reward
(`grade_responses`, the same call train_rl makes) and the settings bench_gsm8k.py
passes: prompts per step, group size, completions per optimizer step (`--train_batch`;
fewer than a round's makes several optimizer steps per generation round, TRL's
`generation_batch_size`), response cap (stop at `</answer>`, kept), temperature,
repetition penalty, learning rate and its schedule (constant, or `--lr_schedule cosine`
to 10% of the peak over the run's optimizer steps, as train_rl's), Adam betas, clip
range (`--epsilon`, `--epsilon_high`), the loss's aggregation (`--loss_type` grpo = train_rl's
`--length_normalization mean`, dr_grpo = `constant` over the response cap) and the
group std (`--scale_rewards` group / none = `--no-use_std_normalization`). TRL's
defaults that would make it another algorithm are set to train_rl's: no importance-
sampling correction of the vLLM/trainer gap (train_rl has none when synchronous), no
gradient checkpointing. `--steps` and `--save_every` count generation rounds (train_rl's
rollout steps); checkpoints, for `alignment.evaluate`, are named by TRL's optimizer step.
`--max_train_minutes` ends the run after the generation round whose training time reaches
it, as train_rl's flag does, and saves that round's checkpoint too.

Numerics are TRL's defaults in both: the policy loaded in fp32 (`model_init_kwargs`
default) and trained under bf16 autocast, i.e. fp32 master weights, as train_rl does.
Each step's wall time, TRL's own timers (generation, weight sync, reward, scoring,
loss), the GPU's peak memory and the logged train reward go to <out>/steps.jsonl (W1: <out>/w1_steps.jsonl), each
row as its step ends (a run stopped early keeps them); the median of steps 2..N is printed.
"""

import argparse
import json
import signal
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path

from common import REPO_ROOT, build_checkpoint, gsm8k_questions, write_result

from alignment.args import _non_negative_int as non_negative_int
from alignment.args import _positive_int as positive_int
from alignment.evaluate import write_jsonl


def earlier_run(out: Path) -> list[str]:
    """What a GSM8K run left in `out` (its checkpoints, its steps log): a new run there would
    mix its checkpoints with these, and bench_gsm8k would evaluate both as one run's."""
    return sorted(path.name for path in Path(out).glob("checkpoint-*")) + (["steps.jsonl"] if (Path(out) / "steps.jsonl").is_file() else [])


def start_steps_log(out, workload: str) -> Path:
    """The file each optimizer step's row goes to, emptied: GSM8K's `<out>/steps.jsonl` (bench_gsm8k reads
    it; main refuses an `out` that holds one already), W1's `<out>/w1_steps.jsonl`, so that a W1 run into
    the default --out never removes the steps log of a GSM8K run there."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    steps_log = out / ("steps.jsonl" if workload == "gsm8k" else f"{workload}_steps.jsonl")
    steps_log.unlink(missing_ok=True)  # W1's own log of an earlier run: a benchmark rerun replaces its numbers
    return steps_log


def add_reward(steps_log: Path, step: int, reward: float) -> bool:
    """Write `reward` into optimizer step `step`'s row of `steps_log` at once (TRL logs it after the row is written), so that
    a run stopped early (bench_gsm8k's deadline, a crash) keeps every reward it logged; the file is replaced whole, never
    left half written. Returns whether that row was there."""
    rows = [json.loads(line) for line in steps_log.read_text().splitlines()] if steps_log.is_file() else []
    found = False
    for row in rows:
        if row["step"] == step:
            row["reward"], found = reward, True
    if found:
        write_jsonl(steps_log, rows)
    return found


def time_box_ends(elapsed_seconds: float, minutes: float | None, step: int, optimizer_steps_per_round: int, max_steps: int) -> bool:
    """--max_train_minutes: whether training ends after optimizer step `step` (TRL's global step).

    Only at the last optimizer step of a generation round (a round is never cut in two), once
    `minutes` of training have passed, and not at the run's last step (it ends and saves anyway)."""
    return bool(minutes) and elapsed_seconds >= 60 * minutes and step % optimizer_steps_per_round == 0 and step < max_steps


def step_clock(steps_log: Path, timers: dict, optimizer_steps_per_round: int, max_train_minutes: float | None, max_steps: int, save_at_end: bool,
               stop: threading.Event | None = None):
    """The TrainerCallback that writes each optimizer step's row to `steps_log` as the step ends: its wall time, TRL's
    timers (`timers`, summed since the last step, then cleared), the GPU's peak memory, and the train reward as soon as
    TRL logs it. A step's time runs from its begin to its end (generation included): what the Trainer does between
    steps, its checkpoint saves above all, is left out of the steps and of the training time, as train_rl leaves out
    its evaluations and saves. It ends training at `max_train_minutes` (`time_box_ends`), or once `stop` is set (main sets it on
    SIGTERM: bench_gsm8k's deadline), after the round's last optimizer step, saving that round when `save_at_end`."""
    stop = stop or threading.Event()
    import torch
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Each optimizer step's row, one JSON line per step."""

        def __init__(self):
            self.step_began, self.trained = None, 0.0
            self.rewards = {}  # a reward logged before its step's row (not what TRL does now): written with the row

        def on_step_begin(self, *_, **__):
            self.step_began = time.perf_counter()

        def on_log(self, _args, state, _control, logs=None, **__):
            if logs and "reward" in logs and not add_reward(steps_log, state.global_step, logs["reward"]):
                self.rewards[state.global_step] = logs["reward"]

        def on_step_end(self, _args, state, control, **__):
            seconds = time.perf_counter() - self.step_began
            self.trained += seconds
            row = {"step": state.global_step, "rollout_step": -(-state.global_step // optimizer_steps_per_round), "step_seconds": seconds, "elapsed_seconds": self.trained,
                   "generate_seconds": timers.get("vLLM.generate", timers.get("transformers.generate")), "sync_seconds": timers.get("sync_weights"),
                   "timers": dict(timers), "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
                   "reward": self.rewards.pop(state.global_step, None)}
            timers.clear()
            with open(steps_log, "a") as handle:
                handle.write(json.dumps(row) + "\n")
            stopped = stop.is_set() and state.global_step % optimizer_steps_per_round == 0
            if stopped or time_box_ends(row["elapsed_seconds"], max_train_minutes, state.global_step, optimizer_steps_per_round, max_steps):
                why = "asked to stop (SIGTERM)" if stopped else f"--max_train_minutes {max_train_minutes:g}"
                print(f"{why}: {row['elapsed_seconds'] / 60:.1f} minutes after optimizer step "
                      f"{state.global_step} (rollout step {row['rollout_step']}); the run ends here", flush=True)
                control.should_training_stop = True
                control.should_save = save_at_end  # the last round's weights, for alignment.evaluate

    return StepClock()


def lr_schedule_settings(schedule: str) -> dict:
    """GRPOConfig's scheduler settings for train_rl's `--lr_schedule`: constant, or transformers' cosine that ends at
    10% of the peak (`cosine_with_min_lr`, `min_lr_rate` 0.1), the decay alignment.optim.build_scheduler makes over
    the same optimizer steps."""
    if schedule == "cosine":
        return {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}
    return {"lr_scheduler_type": "constant"}


def gsm8k_settings(args, use_vllm: bool) -> tuple[dict, int]:
    """GRPOConfig's settings for --workload gsm8k, from the flags bench_gsm8k passes (train_rl's settings), and the
    optimizer steps one generation round makes. ValueError when the batch sizes do not divide."""
    completions = args.prompts_per_step * args.group_size
    train_batch = args.train_batch or completions
    microbatch = min(args.microbatch, train_batch)
    if completions % train_batch or train_batch % microbatch:
        raise ValueError(f"--train_batch {train_batch} must divide the {completions} completions per round, and --microbatch {microbatch} it")
    optimizer_steps_per_round = completions // train_batch
    stop = {"stop": ["</answer>"], "include_stop_str_in_output": True}  # train_rl's SamplingSettings
    settings = dict(
        per_device_train_batch_size=microbatch, gradient_accumulation_steps=train_batch // microbatch, generation_batch_size=completions,
        num_generations=args.group_size, max_completion_length=args.max_tokens,
        generation_kwargs={**stop, "min_tokens": args.min_tokens} if use_vllm else None,
        temperature=args.temperature, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
        beta=0.0, learning_rate=args.learning_rate, **lr_schedule_settings(args.lr_schedule), adam_beta2=args.adam_beta2,
        epsilon=args.epsilon, epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
        loss_type=args.loss_type, scale_rewards=args.scale_rewards, vllm_importance_sampling_correction=False,
        save_strategy="steps" if args.save_every else "no", save_steps=(args.save_every or 500) * optimizer_steps_per_round, save_only_model=True,
    )
    return settings, optimizer_steps_per_round


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["w1", "gsm8k"], default="w1")
    parser.add_argument("--model", default=None, help="gsm8k: the start checkpoint (an HF folder)")
    parser.add_argument("--data_dir", default=str(REPO_ROOT / "data" / "gsm8k"))
    parser.add_argument("--steps", type=positive_int, default=6)
    parser.add_argument("--save_every", type=non_negative_int, default=0, help="gsm8k: save a checkpoint every N steps (0 = none)")
    parser.add_argument("--max_train_minutes", type=float, default=None,
                        help="gsm8k: end after the step whose training time reaches this many minutes, and save its checkpoint (train_rl's flag)")
    parser.add_argument("--tiny", action="store_true", help="small model or batch, short completions, no vLLM: a smoke run")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for the smoke run")
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench"))
    gsm8k = parser.add_argument_group("gsm8k settings (bench_gsm8k.py passes the ones train_rl gets)")
    gsm8k.add_argument("--prompts_per_step", type=positive_int, default=16)
    gsm8k.add_argument("--group_size", type=positive_int, default=8)
    gsm8k.add_argument("--microbatch", type=positive_int, default=32, help="completions per forward/backward")
    gsm8k.add_argument("--max_tokens", type=positive_int, default=512)
    gsm8k.add_argument("--min_tokens", type=non_negative_int, default=4)
    gsm8k.add_argument("--temperature", type=float, default=1.0)
    gsm8k.add_argument("--top_p", type=float, default=1.0)
    gsm8k.add_argument("--repetition_penalty", type=float, default=1.1)
    gsm8k.add_argument("--learning_rate", type=float, default=3e-6)
    gsm8k.add_argument("--lr_schedule", choices=["constant", "cosine"], default="constant",
                       help="train_rl's --lr_schedule: constant, or cosine decay to 10%% of the peak over --steps")
    gsm8k.add_argument("--adam_beta2", type=float, default=0.95)
    gsm8k.add_argument("--train_batch", type=positive_int, default=None, help="completions per optimizer step (default: all of a generation round)")
    gsm8k.add_argument("--epsilon", type=float, default=0.2, help="lower clip range (train_rl --cliprange)")
    gsm8k.add_argument("--epsilon_high", type=float, default=None, help="upper clip range (train_rl --cliprange_high); default --epsilon")
    gsm8k.add_argument("--loss_type", choices=["grpo", "dr_grpo"], default="grpo", help="grpo: per-sequence mean; dr_grpo: sum / max_tokens")
    gsm8k.add_argument("--scale_rewards", choices=["group", "none"], default="group", help="divide by the group's reward std, or not")
    return parser


def main():
    parser = build_parser()
    args = parser.parse_args()
    if args.max_train_minutes is not None and args.max_train_minutes <= 0:
        parser.error(f"--max_train_minutes {args.max_train_minutes:g}: give a positive number of minutes, or drop the flag")
    if args.workload == "gsm8k" and (found := earlier_run(args.out)):
        parser.error(f"--out {args.out} already holds a TRL run ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}); "
                     "its checkpoints would mix with this run's: pass a new --out, or move that folder away")
    use_vllm = args.device == "cuda"
    if args.workload == "gsm8k":  # checked before loading anything
        if not args.model:
            parser.error("--workload gsm8k needs --model")
        try:
            settings, optimizer_steps_per_round = gsm8k_settings(args, use_vllm)
        except ValueError as error:
            parser.error(str(error))

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    if args.workload == "w1":
        from alignment.data import format_r1_zero_prompt

        model = str(build_checkpoint(REPO_ROOT / "runs" / "bench" / ("model_tiny" if args.tiny else "model"), args.tiny))
        dataset = Dataset.from_dict({"prompt": [format_r1_zero_prompt(q) for q in gsm8k_questions()[:64]]})
        completions, generations, microbatch = (16, 4, 8) if args.tiny else (256, 8, 32)
        settings = dict(per_device_train_batch_size=microbatch, gradient_accumulation_steps=8, num_generations=generations,
                        max_completion_length=completions, generation_kwargs={"min_tokens": completions} if use_vllm else None,
                        temperature=1.0, top_p=1.0, beta=0.0, learning_rate=1e-6, save_strategy="no")
        optimizer_steps_per_round = 1

        def reward(completions, **_):
            return [float(len(text) % 7) / 7 for text in completions]  # varies, so advantages are non-zero
    else:
        from alignment.data import Gsm8kDataset
        from alignment.drgrpo_grader import grade_responses

        model = args.model
        train = Gsm8kDataset("train", args.data_dir)
        dataset = Dataset.from_dict({"prompt": train.prompts, "ground_truth": train.ground_truths})

        def reward(completions, ground_truth, **_):
            return [score["reward"] for score in grade_responses(completions, ground_truth)]

    config = GRPOConfig(
        output_dir=str(Path(args.out) if args.workload == "gsm8k" else REPO_ROOT / "runs" / "bench" / "trl_work"),
        bf16=use_vllm, use_cpu=args.device == "cpu", use_vllm=use_vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        gradient_checkpointing=False, max_steps=args.steps * optimizer_steps_per_round, logging_steps=1, report_to="none", seed=0, **settings,
    )

    timers = defaultdict(float)  # TRL's own profiling timers, summed per optimizer step
    original_log = profiling.ProfilingContext._log_metrics

    def record(self, duration):
        timers[self.name.rpartition("GRPOTrainer.")[2]] += duration
        original_log(self, duration)

    profiling.ProfilingContext._log_metrics = record
    steps_log = start_steps_log(args.out, args.workload)

    stop = threading.Event()  # bench_gsm8k's deadline sends SIGTERM: end after this round, with its checkpoint
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    clock = step_clock(steps_log, timers, optimizer_steps_per_round, args.max_train_minutes, config.max_steps, save_at_end=args.workload == "gsm8k", stop=stop)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset, callbacks=[clock])
    print(f"TRL policy dtype {next(trainer.model.parameters()).dtype}, bf16 autocast {config.bf16}", flush=True)
    trainer.train()
    rows = [json.loads(line) for line in steps_log.read_text().splitlines()]
    measured = [row["step_seconds"] for row in rows[1:]] or [row["step_seconds"] for row in rows]
    name = f"trl_grpo_{args.workload}" + ("_tiny" if args.tiny else "")
    write_result(args.out, name, [{"row": name, "steps": len(rows), "median_step_seconds": statistics.median(measured),
                                   "step_seconds": [round(row["step_seconds"], 2) for row in rows],
                                   "policy_dtype": str(next(trainer.model.parameters()).dtype)}])


if __name__ == "__main__":
    main()
