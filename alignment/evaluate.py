"""Batch evaluation: generate on a GSM8K split, grade with the r1_zero reward.

    python -m alignment.evaluate --model_path checkpoints/rl [--split test] [--num_examples N]
        [--output_dir D] [--backend vllm|hf]

writes `metrics.json` and `samples.jsonl` (one line per example: prompt, response,
ground truth, the three rewards) and prints a table. Defaults are greedy decoding
(temperature 0) with at most 1024 new tokens on the whole test split, so numbers
are deterministic and comparable across checkpoints. `train_sft` and `train_rl`
call `evaluate_math` with their own engines.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from alignment.args import check_checkpoint, parse_eval_args
from alignment.checkpoint import check_distinct_outputs, check_saved_model, claim_log_folder
from alignment.data import Gsm8kDataset
from alignment.devices import resolve_device, resolve_dtype
from alignment.drgrpo_grader import r1_zero_reward_fn
from alignment.errors import UserError, run_cli
from alignment.rollout import SamplingSettings, build_engine


def evaluate_math(llm, reward_fn, prompts: list[str], ground_truths: list[str], sampling_params: SamplingSettings, samples_path=None) -> dict:
    """Generate one response per prompt with `llm`, grade each, return the means.

    Args:
        llm: an engine with `generate(prompts, sampling) -> [Generation]`
            (`VllmEngine`, `HfEngine`, or a stand-in in tests).
        reward_fn: `(response, ground_truth) -> {"format_reward", "answer_reward", "reward"}`.
        samples_path: if given, one JSON line per example is written there.
    Returns:
        avg_all_rewards (mean reward, the seed's key), format_reward,
        answer_reward, num_examples, mean_response_tokens, seconds, and
        `samples` (the per-example dicts).
    """
    started = time.perf_counter()
    generations = llm.generate(list(prompts), sampling_params)
    samples = []
    for prompt, generation, truth in zip(prompts, generations, ground_truths, strict=True):
        scores = reward_fn(generation.text, truth)
        samples.append({"prompt": prompt, "response": generation.text, "ground_truth": truth, "num_tokens": generation.num_tokens, **scores})
    if samples_path is not None:
        write_jsonl(samples_path, samples)
    return summarize_samples(samples, time.perf_counter() - started)


def summarize_samples(samples: list[dict], seconds: float) -> dict:
    """The metrics of graded samples (also used to merge samples from several ranks)."""
    count = max(len(samples), 1)
    return {
        "avg_all_rewards": sum(s["reward"] for s in samples) / count,
        "format_reward": sum(s["format_reward"] for s in samples) / count,
        "answer_reward": sum(s["answer_reward"] for s in samples) / count,
        "num_examples": len(samples),
        "mean_response_tokens": sum(s["num_tokens"] for s in samples) / count,
        "seconds": seconds,
        "samples": samples,
    }


def write_jsonl(path, rows) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".tmp")
    with open(temp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    temp.replace(path)


def write_json(path, value) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(value, indent=2) + "\n")
    temp.replace(path)


def evaluate_in_subprocess(model_path, args, output_dir, device: str) -> dict:
    """Run this module's CLI on `model_path` in a child process (vLLM on `device`, the eval role's).

    `args` carries train_rl's eval flags. Returns the metrics with `samples`.
    """
    repo_root = Path(__file__).resolve().parent.parent
    command = [
        sys.executable, "-m", "alignment.evaluate", "--model_path", str(model_path), "--backend", "vllm",
        "--device", device, "--dtype", args.dtype, "--split", args.eval_split, "--data_dir", str(Path(args.data_dir).resolve()),
        "--output_dir", str(Path(output_dir).resolve()), "--seed", str(args.seed),
        "--temperature", str(args.eval_temperature), "--top_p", str(args.eval_top_p),
        "--min_tokens", str(args.eval_min_tokens), "--max_tokens", str(args.eval_max_tokens),
        "--repetition_penalty", str(args.repetition_penalty), "--vllm_kv_cache_gb", str(args.vllm_kv_cache_gb),
    ]
    if args.eval_num_examples:
        command += ["--num_examples", str(args.eval_num_examples)]
    if args.vllm_gpu_memory_utilization:
        command += ["--vllm_gpu_memory_utilization", str(args.vllm_gpu_memory_utilization)]
    if args.vllm_enforce_eager is not None:
        command.append("--vllm_enforce_eager" if args.vllm_enforce_eager else "--no-vllm_enforce_eager")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo_root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, cwd=repo_root, env=env)
    if result.returncode:
        raise UserError(f"evaluation of {model_path} on {device} failed (exit {result.returncode}); its output is above")
    metrics = json.loads((Path(output_dir) / "metrics.json").read_text())
    with open(Path(output_dir) / "samples.jsonl", encoding="utf-8") as handle:
        metrics["samples"] = [json.loads(line) for line in handle]
    return metrics


def format_metrics_table(metrics: dict, title: str) -> str:
    rows = [
        ("examples", f"{metrics['num_examples']}"),
        ("accuracy (avg_all_rewards)", f"{metrics['avg_all_rewards']:.4f}"),
        ("format rate", f"{metrics['format_reward']:.4f}"),
        ("answer rate", f"{metrics['answer_reward']:.4f}"),
        ("mean response tokens", f"{metrics['mean_response_tokens']:.1f}"),
        ("seconds", f"{metrics['seconds']:.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join([title] + [f"  {name:<{width}}  {value}" for name, value in rows])


def main(argv=None) -> dict:
    args = parse_eval_args(argv)
    check_checkpoint(args.model_path, "--model_path", "pass a folder written by train_sft/train_rl or a hub id")
    output_dir = Path(args.output_dir or Path("runs") / "eval" / Path(args.model_path).name)
    if Path(args.model_path).exists():  # metrics written into a checkpoint would make it a folder the tool no longer owns
        check_distinct_outputs([(args.model_path, "--model_path"), (output_dir, "--output_dir")])
    check_saved_model(args.model_path, "it cannot be evaluated; restore it or pass another --model_path")
    dataset = Gsm8kDataset(args.split, args.data_dir, limit=args.num_examples)
    claim_log_folder(output_dir, "--output_dir")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    engine = build_engine(args.backend, args.model_path, device, dtype, args.seed, args)
    import torch

    torch.manual_seed(args.seed)
    metrics = evaluate_math(engine, r1_zero_reward_fn, dataset.prompts, dataset.ground_truths, SamplingSettings.from_args(args, ""), samples_path=output_dir / "samples.jsonl")
    engine.close()
    metrics.pop("samples")
    metrics.update(model_path=str(args.model_path), split=args.split, backend=args.backend, temperature=args.temperature, max_tokens=args.max_tokens)
    write_json(output_dir / "metrics.json", metrics)
    print(format_metrics_table(metrics, f"{args.model_path} on {args.split} ({args.backend})"))
    print(f"wrote {output_dir / 'metrics.json'} and {output_dir / 'samples.jsonl'}")
    return metrics


if __name__ == "__main__":
    run_cli(main)
