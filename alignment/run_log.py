"""What a train_rl run writes about itself: TensorBoard scalars, steps.jsonl, evals.jsonl, one console line a step.

    <log_dir>/<run_name>/events.*       TensorBoard: train/*, eval/*, perf/*
    <log_dir>/<run_name>/steps.jsonl    one line of the same scalars per step (`python -m alignment.plot`)
    <log_dir>/<run_name>/evals.jsonl    one line per evaluation
    <log_dir>/<run_name>/flags.json     the flags of the command that started (or last resumed) the run

`step_scalars` is a pure function of the step's measurements; `RunLog` writes them.
Only rank 0 writes under torchrun (the other ranks get `RunLog(None, ...)`, which
writes nothing).
"""

import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from alignment.args import PER_RUN_FLAGS, optimizer_steps_per_batch
from alignment.errors import UserError

NAN = float("nan")  # what a step did not measure is n/a: not written to TensorBoard, null in steps.jsonl
STEP_TIMINGS = ("rollout", "reward", "logprobs", "update", "sync", "eval")


@contextmanager
def timed(timings: dict, key: str):
    """Add the seconds the block takes to `timings[key]`."""
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - started


def step_scalars(args, progress: dict, reward_meta: dict, totals: dict, timings: dict, generated_tokens: int, learning_rate: float,
                 peak_flops: float | None, sampled_tokens: int) -> dict:
    """The step's scalars by TensorBoard name (NaN where the step did not measure one).

    `generated_tokens`: the batch's response tokens; `sampled_tokens`: every token the engine
    generated in the step, more than the batch's when --dynamic_sampling dropped groups.

    `totals` are update_policy's sums over the step's microbatches and optimizer steps;
    `timings` the step's seconds by phase (STEP_TIMINGS, "step", and with a sampler process
    "sampler_generate" / "sampler_load", its own times).
    """
    microbatches = totals["microbatches"] or NAN
    loss_steps = optimizer_steps_per_batch(args) if totals["microbatches"] else NAN
    sampler_tokens = totals["sampler_tokens"] or NAN
    scalars = {
        "train/reward": reward_meta["reward_mean"],
        "train/format_reward": reward_meta["format_reward_mean"],
        "train/answer_reward": reward_meta["answer_reward_mean"],
        "train/reward_std": reward_meta["reward_std"],
        "train/fraction_groups_all_equal": reward_meta["fraction_groups_all_equal"],
        "train/fraction_groups_all_right": reward_meta["fraction_groups_all_right"],
        "train/loss": totals["loss"] / loss_steps,
        "train/grad_norm": totals["grad_norm"] / (totals["optimizer_steps"] or NAN),
        "train/entropy": totals["entropy"] / microbatches,
        "train/clip_fraction": totals["clip_fraction"] / microbatches,
        "train/kl_ref": totals["kl_ref"] / microbatches,
        # how far the sampler's log-probs of its own tokens are from the trainer's (0 and 1
        # when on-policy; repetition penalty, top_p, a lagging sampler or bf16 kernels move them)
        "train/sampler_logprob_abs_diff": totals["sampler_abs_diff"] / sampler_tokens,
        "train/sampler_importance_ratio": totals["sampler_ratio"] / sampler_tokens,
        "train/sampler_importance_ratio_max": totals["sampler_ratio_max"] if totals["sampler_tokens"] else NAN,
        # updates between the weights that sampled the batch and the policy, and (one step off)
        # the share of tokens whose importance weight was capped at --tis_cap
        "train/staleness": totals.get("staleness", 0),
        "train/tis_capped_fraction": totals["tis_capped"] / sampler_tokens if args.rollout_staleness else NAN,
        "train/response_length": generated_tokens / args.total_rollouts,
        "train/lr": learning_rate,
        "train/skipped_steps": progress["skipped_steps"],
        "train/zero_signal_batches": progress["zero_signal_batches"],
        "perf/rollout_tokens_per_s": sampled_tokens / max(timings["rollout"], 1e-9),
        "perf/train_tokens_per_s": totals["tokens"] / max(timings["update"], 1e-9),
        "perf/step_seconds": timings["step"],
        # the update's model FLOPs over the policy GPUs' bf16 peak (n/a on a CPU unless --peak_tflops)
        "perf/mfu": totals["flops"] / max(timings["update"], 1e-9) / peak_flops if peak_flops and totals["flops"] else NAN,
        # this process's high-water mark over its GPUs (an in-process vLLM's KV cache included)
        "perf/peak_memory_gib": max((torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())), default=NAN) / 2**30,
    }
    if "entropy_bonus" in totals:  # --entropy_coef: the bonus taken off the loss, coef x mean entropy of the tokens in the loss
        scalars["train/entropy_bonus"] = totals["entropy_bonus"] / microbatches
    if "mismatch_masked" in totals:  # --mismatch_correction *_mask: the share of response tokens whose weight was 0
        scalars["train/mismatch_masked_fraction"] = totals["mismatch_masked"] / microbatches
    for key in STEP_TIMINGS + ("sampler_generate", "sampler_load"):
        scalars[f"perf/{key}_seconds"] = timings.get(key, NAN)
    return scalars


def console_line(step: int, total_steps: int, scalars: dict, skipped_steps: int) -> str:
    """`step 3/40 reward 0.625 format 1.000 ... 2.1s`: what a person watches scroll by."""
    value = scalars.get
    parts = [
        f"step {step}/{total_steps}", f"reward {value('train/reward'):.3f}", f"format {value('train/format_reward'):.3f}",
        f"answer {value('train/answer_reward'):.3f}", f"loss {value('train/loss'):+.4f}",
        "" if math.isnan(value("train/kl_ref")) else f"kl {value('train/kl_ref'):.4f}",  # n/a without a reference model
        f"clip {value('train/clip_fraction'):.3f}",
        "" if math.isnan(value("train/sampler_logprob_abs_diff")) else f"sampler_gap {value('train/sampler_logprob_abs_diff'):.4f}",
        f"resp_tokens {value('train/response_length'):.0f}", f"rollout_tok/s {value('perf/rollout_tokens_per_s'):.0f}",
        f"train_tok/s {value('perf/train_tokens_per_s'):.0f}",
        "" if math.isnan(value("perf/mfu")) else f"mfu {value('perf/mfu'):.1%}",
        f"{value('perf/step_seconds'):.1f}s",
        f"skipped {skipped_steps}" if skipped_steps else "",
    ]
    return " ".join(part for part in parts if part)


HPARAMS_METRICS = ("eval/avg_all_rewards", "eval/format_reward", "train/reward", "train/response_length")


def hparam_values(flags: dict) -> dict:
    """The flags as TensorBoard's HParams table takes them (numbers and strings; a switch or a list as its text),
    without each run's own places."""
    def value(flag):
        return flag if isinstance(flag, (int, float, str)) and not isinstance(flag, bool) else " ".join(map(str, flag)) if isinstance(flag, list) else str(flag)

    return {key: value(flag) for key, flag in sorted(flags.items()) if key not in PER_RUN_FLAGS}


class RunLog:
    """The run folder's writers. `writer` is a SummaryWriter, or None on ranks that do not write."""

    def __init__(self, run_dir, writer, resumed_step: int, log_every: int, say=print):
        self.run_dir, self.writer, self.log_every = Path(run_dir), writer, log_every
        if writer is not None:  # a resumed run keeps the lines of the steps it does not run again
            for name in ("steps.jsonl", "evals.jsonl"):
                trim_jsonl(self.run_dir / name, resumed_step, say)

    def flags(self, run: dict, step: int) -> None:
        """The run's flags (`args.run_record`'s, as given before devices are resolved), beside its curves: flags.json for
        scripts (`bench/group_signal.py` reads --group_size there), a TensorBoard text at `step`, and, when the run starts,
        TensorBoard's HParams table (one row a run: its flags beside its latest HPARAMS_METRICS). A resumed run writes
        flags.json and the text again at the step it resumes from; the table keeps the flags the run started with."""
        if self.writer is None:
            return
        record = {"flags": run["flags"], "derived_flags": run.get("derived_flags", [])}
        (self.run_dir / "flags.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        rows = "".join(f"| {key} | {json.dumps(value)}{' (derived)' if key in record['derived_flags'] else ''} |\n"
                       for key, value in sorted(run["flags"].items()))
        self.writer.add_text("run/flags", "| flag | value |\n|---|---|\n" + rows, step)
        if step == 0:
            from torch.utils.tensorboard.summary import hparams

            # the HParams plugin reads each metric's latest value from this run's scalars of that tag; no end status is
            # written (the plugin would show a running run as finished)
            experiment, session_start, _ = hparams(hparam_values(run["flags"]), dict.fromkeys(HPARAMS_METRICS, NAN))
            for summary in (experiment, session_start):
                self.writer.file_writer.add_summary(summary, step)

    def step(self, step: int, total_steps: int, scalars: dict, skipped_steps: int) -> None:
        if self.writer is None:
            return
        for key, value in scalars.items():
            if not math.isnan(value):
                self.writer.add_scalar(key, value, step)
        self._append("steps.jsonl", {"step": step, **{k: (None if math.isnan(v) else v) for k, v in scalars.items()}})
        if step % self.log_every == 0 or step == total_steps:
            print(console_line(step, total_steps, scalars, skipped_steps), flush=True)

    def evaluation(self, step: int, metrics: dict, shown_samples: int) -> None:
        if self.writer is None:
            return
        for key in ("avg_all_rewards", "format_reward", "answer_reward", "mean_response_tokens"):
            self.writer.add_scalar(f"eval/{key}", metrics[key], step)
        for key in (key for key in metrics if key.startswith("pass@") or key == "sampled_accuracy"):  # --eval_samples
            self.writer.add_scalar(f"eval/{key}", metrics[key], step)
        shown = metrics["samples"][:shown_samples]
        if shown:
            self.writer.add_text("eval/samples", "\n\n---\n\n".join(
                f"**reward {s['reward']:.0f}** (truth {s['ground_truth']})\n\n```\n{s['response']}\n```" for s in shown), step)
        pass_at_k = "".join(f"{key} {value:.3f} " for key, value in metrics.items() if key.startswith("pass@"))
        print(f"eval step {step}: accuracy {metrics['avg_all_rewards']:.3f} {pass_at_k}format {metrics['format_reward']:.3f} "
              f"response tokens {metrics['mean_response_tokens']:.0f} ({metrics['num_examples']} examples, {metrics['seconds']:.1f}s)", flush=True)
        self._append("evals.jsonl", {"step": step, **{k: v for k, v in metrics.items() if k != "samples"}})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _append(self, name: str, row: dict) -> None:
        with open(self.run_dir / name, "a") as handle:
            handle.write(json.dumps(row) + "\n")


def trim_jsonl(log: Path, last_step: int, say=print) -> None:
    """Keep a per-step log's lines up to `last_step` (they are not run again); a fresh run starts empty.

    A line cut short by a crash (no valid JSON) is dropped with a note, not an error.
    """
    if not last_step:
        log.unlink(missing_ok=True)
        return
    if not log.exists():
        return
    kept, torn = [], 0
    for line in log.read_text(errors="replace").splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            torn += 1
    if torn:
        say(f"note: dropped {torn} unreadable line(s) of {log} (a crash cut them short)")
    # written beside it, then renamed over it: a full disk or a kill mid-write leaves the old log whole
    temp = log.with_name(f".{log.name}.alignment-tmp")
    try:
        with open(temp, "w") as handle:
            handle.write("".join(line + "\n" for line in kept))
            handle.flush()
            os.fsync(handle.fileno())
        temp.replace(log)
    except OSError as error:
        temp.unlink(missing_ok=True)
        raise UserError(f"cannot rewrite {log} to step {last_step} ({error.strerror or error}); it is unchanged: free some space and run again") from None
