"""Batch evaluation: generate on a GSM8K split, grade with the r1_zero reward.

    python -m alignment.evaluate --model_path checkpoints/rl [--split test] [--num_examples N]
        [--output_dir D] [--backend vllm|hf] [--samples N --pass_k K]

writes `metrics.json` and `samples.jsonl` (one line per example: prompt, response,
ground truth, the three rewards) and prints a table. Defaults are greedy decoding
(temperature 0) with at most 1024 new tokens on the whole test split, so numbers
are deterministic and comparable across checkpoints. `--samples N` adds pass@K
(`--pass_k`) from N samples per problem at `--samples_temperature` (Chen et al.
2021's unbiased estimator, `pass_at_k`); the greedy accuracy stays the headline.
`train_sft` and `train_rl` call `evaluate_math` with their own engines.

    python -m alignment.evaluate --model_path out/checkpoint-40 out/checkpoint-80 --output_dir eval/40 eval/80

evaluates a run's checkpoints with one engine, loading each one's weights into it in
place (greedy: the numbers of separate calls, without an engine start per checkpoint;
torch's generator is seeded with --seed before each checkpoint's generation); checkpoints
one engine cannot hold (another architecture or tokenizer) are evaluated in a child
process per group.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from alignment.args import build_eval_parser, check_checkpoint, model_context_length, parse_eval_args
from alignment.checkpoint import (OutputLock, check_distinct_outputs, check_saved_model, claim_log_folder, folder_copy_identity, log_folder_run_id, read_manifest,
                                  run_logs, same_path, sft_run_in, start_over)
from alignment.data import Gsm8kDataset, data_fingerprint
from alignment.devices import resolve_device, resolve_dtype
from alignment.drgrpo_grader import r1_zero_reward_fn
from alignment.errors import UserError, run_cli
from alignment.rollout import TOKENIZER_FILES, SamplingSettings, build_engine, check_model_folder, checkpoint_tensors, load_tokenizer, repetition_penalty_of


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


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one problem from n samples, c of them correct (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code", eq. 1): 1 - C(n - c, k) / C(n, k), the
    chance that k samples drawn from the n without replacement hold a correct one; 1 when
    n - c < k. Computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i), their numerically stable form."""
    if not 0 < k <= num_samples or not 0 <= num_correct <= num_samples:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n (got n={num_samples}, c={num_correct}, k={k})")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(num_samples - num_correct + 1, num_samples + 1))


def correct_counts(llm, reward_fn, prompts: list[str], ground_truths: list[str], sampling: SamplingSettings, num_samples: int) -> list[int]:
    """How many of `num_samples` responses per prompt earn reward 1 (formatted and right, what
    avg_all_rewards counts); the prompts repeated, one `generate` call."""
    generations = llm.generate([prompt for prompt in prompts for _ in range(num_samples)], sampling)
    rewards = [reward_fn(generation.text, truth)["reward"] for generation, truth in zip(generations, [t for t in ground_truths for _ in range(num_samples)], strict=True)]
    return [sum(reward >= 1.0 for reward in rewards[start : start + num_samples]) for start in range(0, len(rewards), num_samples)]


def add_pass_at_k(metrics: dict, llm, prompts: list[str], ground_truths: list[str], args, prefix: str, gather=list) -> dict:
    """`metrics` plus `pass@K` (the mean over problems) and `sampled_accuracy` (pass@1 of the
    samples), from --{prefix}samples samples per problem at --{prefix}samples_temperature and
    otherwise the evaluation's sampling settings; unchanged when --{prefix}samples is 0.
    `gather` merges every rank's per-problem counts (train_rl under torchrun)."""
    num_samples = getattr(args, f"{prefix}samples", 0)  # callers' hand-made args may predate pass@k
    if not num_samples:
        return metrics
    k = getattr(args, f"{prefix}pass_k")
    started = time.perf_counter()
    sampling = replace(SamplingSettings.from_args(args, prefix), temperature=getattr(args, f"{prefix}samples_temperature"))
    counts = gather(correct_counts(llm, r1_zero_reward_fn, prompts, ground_truths, sampling, num_samples) if prompts else [])
    problems = max(len(counts), 1)
    metrics.update({f"pass@{k}": sum(pass_at_k(num_samples, c, k) for c in counts) / problems, "sampled_accuracy": sum(counts) / (problems * num_samples),
                    "pass_at_k_samples": num_samples, "pass_at_k_seconds": time.perf_counter() - started})
    return metrics


def write_jsonl(path, rows) -> None:
    _write_through_temp(path, lambda handle: handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def write_json(path, value) -> None:
    _write_through_temp(path, lambda handle: handle.write(json.dumps(value, indent=2) + "\n"))


def _write_through_temp(path, write) -> None:
    """Write `path` whole or not at all: into <path>.tmp, then renamed; a failed write (a full disk) removes the temp."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".tmp")
    try:
        with open(temp, "w", encoding="utf-8") as handle:
            write(handle)
        temp.replace(path)
    except BaseException as error:
        temp.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.filename is None:  # a failed write names no file: this one
            error.filename = str(path)
        raise


def file_error(error: OSError, what: str) -> UserError:
    """One line for a file error that stopped `what` (a full disk or quota, a lost mount), instead of a traceback."""
    where = error.filename or "one of its files"
    return UserError(f"{what} stopped on a file error: {error.strerror or error} ({where}); free space or pass a writable folder, then run again")


def evaluate_in_subprocess(model_path, args, output_dir, device: str) -> dict:
    """Run this module's CLI on `model_path` in a child process (vLLM on `device`, the eval role's).

    `args` carries train_rl's eval flags. Returns the metrics with `samples`.
    """
    repo_root = Path(__file__).resolve().parent.parent
    command = [
        sys.executable, "-m", "alignment.evaluate", "--model_path", str(Path(model_path).resolve()), "--backend", "vllm",
        "--device", device, "--dtype", args.dtype, "--split", args.eval_split, "--data_dir", str(Path(args.data_dir).resolve()),
        "--output_dir", str(Path(output_dir).resolve()), "--seed", str(args.seed),
        "--temperature", str(args.eval_temperature), "--top_p", str(args.eval_top_p),
        "--min_tokens", str(args.eval_min_tokens), "--max_tokens", str(args.eval_max_tokens),
        "--repetition_penalty", str(repetition_penalty_of(args, "eval_")), "--vllm_kv_cache_gb", str(args.vllm_kv_cache_gb),
    ]
    if args.eval_num_examples:
        command += ["--num_examples", str(args.eval_num_examples)]
    if getattr(args, "eval_samples", 0):
        command += ["--samples", str(args.eval_samples), "--pass_k", str(args.eval_pass_k), "--samples_temperature", str(args.eval_samples_temperature)]
    if args.vllm_gpu_memory_utilization:
        command += ["--vllm_gpu_memory_utilization", str(args.vllm_gpu_memory_utilization)]
    if args.vllm_enforce_eager is not None:
        command.append("--vllm_enforce_eager" if args.vllm_enforce_eager else "--no-vllm_enforce_eager")
    result = subprocess.run(command, cwd=repo_root, env=_child_env())
    if result.returncode:
        raise UserError(f"evaluation of {model_path} on {device} failed (exit {result.returncode}); its output is above")
    metrics = json.loads((Path(output_dir) / "metrics.json").read_text())
    with open(Path(output_dir) / "samples.jsonl", encoding="utf-8") as handle:
        metrics["samples"] = [json.loads(line) for line in handle]
    return metrics


def checkpoint_position(path) -> dict:
    """An RL checkpoint's manifest step and its run's last step ({"step", "total_steps"}), or {} for another folder."""
    saved = read_manifest(path) or {}
    return {key: saved[key] for key in ("step", "total_steps") if isinstance(saved.get(key), int)}


def copy_record(identity: str | None) -> dict:
    """What a metrics file records of the copy it graded ({"checkpoint_copy": folder_copy_identity, taken before the
    weights were read}), {} for a hub id: a later evaluation into that file checks that the folder still holds that copy."""
    return {"checkpoint_copy": identity} if identity else {}


def check_same_copy(recorded: dict, model_path, where: str, keep: str, replace: str) -> None:
    """Refuse to overwrite the evaluation of an earlier copy of `model_path` (another SFT run, an epoch's policy later
    replaced by the next) with the copy's now there: the earlier one's results are all that is left of those weights."""
    earlier, now = recorded.get("checkpoint_copy"), folder_copy_identity(model_path)
    if earlier and now and earlier != now:
        step = recorded.get("checkpoint_step")
        of_step = f" (step {step} of {recorded.get('checkpoint_total_steps')})" if isinstance(step, int) else ""
        raise UserError(f"{where} holds the evaluation of an earlier copy of {model_path}{of_step}, whose weights were replaced since: "
                        f"{keep} to keep both, or {replace} (nothing was changed)")


def check_eval_only_folder(run_dir, checkpoint_path, setup: dict) -> None:
    """train_rl's evaluate-only rule writes eval_only_* into --log_dir/--run_name: refused when that folder holds
    another training run's logs (--checkpoint_path rl_seed1 with the default --run_name rl would add its evaluation
    to seed 42's curves), another checkpoint's eval-only evaluation or an earlier copy's, or this checkpoint's on another `setup`
    (eval_only_setup: a 20-example check, or a plain rerun after pass@k sampling, would overwrite it). Raises UserError."""
    run_dir = Path(run_dir)
    trained_by = (read_manifest(checkpoint_path) or {}).get("run") or {}
    owner = log_folder_run_id(run_dir)
    if sft := sft_run_in(run_dir):
        raise UserError(f"--log_dir/--run_name {run_dir} holds the curves of the SFT run that wrote {sft}; pass another --run_name to evaluate "
                        f"{checkpoint_path} (nothing was changed)")
    if trained_by.get("run_id") and owner and owner != trained_by["run_id"] and run_logs(run_dir):
        own = (trained_by.get("flags") or {}).get("run_name")
        raise UserError(f"--log_dir/--run_name {run_dir} holds the logs of another run ({run_logs(run_dir)}) than the one that trained {checkpoint_path}; "
                        f"pass {f'--run_name {own} (its own) or ' if own else ''}another --run_name to evaluate it (nothing was changed)")
    previous = run_dir / "eval_only_metrics.json"
    try:
        recorded = json.loads(previous.read_text())
        evaluated = recorded.get("checkpoint_path")
    except (OSError, ValueError, AttributeError):
        return
    if evaluated and not same_path(evaluated, checkpoint_path):
        raise UserError(f"--log_dir/--run_name {run_dir} holds the evaluation of {evaluated} ({previous.name}); pass another --run_name to evaluate "
                        f"{checkpoint_path} (nothing was changed)")
    check_same_copy(recorded, checkpoint_path, f"--log_dir/--run_name {run_dir} ({previous.name})", "pass another --run_name",
                    f"remove {previous} to evaluate the copy there now")
    changed = changed_setup(recorded, setup)
    if changed:
        raise UserError(f"--log_dir/--run_name {run_dir} holds an evaluation of {checkpoint_path} on {_setup_text(recorded, changed, 'eval_')} "
                        f"({previous.name}); this one is on {_setup_text(setup, changed, 'eval_')}: pass another --run_name to keep both, "
                        f"or remove {previous} to replace it (nothing was changed)")


def eval_only_setup(args) -> dict:
    """What train_rl's evaluate-only run evaluates on (its --eval_* flags), as evaluation_setup records it."""
    return evaluation_setup(args, len(Gsm8kDataset(args.eval_split, args.data_dir, limit=args.eval_num_examples)), prefix="eval_")


def evaluate_checkpoint(args, setup: dict) -> dict:
    """train_rl's rule from the seed: an existing RL checkpoint (--checkpoint_path) is evaluated,
    never retrained; with train_rl's eval flags (pass@k with --eval_samples), written beside its logs."""
    import torch
    from torch.utils.tensorboard import SummaryWriter

    from alignment.devices import resolve_role_devices

    print(f"{args.checkpoint_path} already holds weights: evaluating it (no training)")
    saved_at, graded = checkpoint_position(args.checkpoint_path), copy_record(folder_copy_identity(args.checkpoint_path))
    if len(saved_at) == 2 and saved_at["step"] < saved_at["total_steps"]:
        print(f"note: {args.checkpoint_path} is the policy after step {saved_at['step']} of {saved_at['total_steps']} (an epoch's checkpoint of a run "
              f"that stopped before its end, with no training state to resume): not that run's result; {start_over(Path(args.log_dir) / args.run_name, args.checkpoint_path)} to train from the start")
    # the seed's --eval_device as given (checked: a GPU this machine lacks is one line, not a CUDA error), or the auto layout's
    device = resolve_device(args.eval_device, "--eval_device") if args.layout == "explicit" else resolve_role_devices(args, 1)["eval"]
    engine = build_engine(args.rollout_backend, args.checkpoint_path, device, resolve_dtype(args.dtype, device), args.seed, args)
    eval_set = Gsm8kDataset(args.eval_split, args.data_dir, limit=args.eval_num_examples)
    torch.manual_seed(args.seed)
    metrics = evaluate_math(engine, r1_zero_reward_fn, eval_set.prompts, eval_set.ground_truths, SamplingSettings.from_args(args, "eval_"))
    metrics = add_pass_at_k(metrics, engine, eval_set.prompts, eval_set.ground_truths, args, "eval_")
    engine.close()
    run_dir = Path(args.log_dir) / args.run_name
    write_jsonl(run_dir / "eval_only_samples.jsonl", metrics.pop("samples"))
    write_json(run_dir / "eval_only_metrics.json", {**metrics, "checkpoint_path": str(args.checkpoint_path), **setup,
                                                    **{f"checkpoint_{key}": value for key, value in saved_at.items()}, **graded})
    writer = SummaryWriter(str(run_dir))
    for key in ("avg_all_rewards", "format_reward", "answer_reward", "mean_response_tokens", *(k for k in metrics if k.startswith("pass@"))):
        writer.add_scalar(f"eval_only/{key}", metrics[key], 0)
    writer.close()
    print(format_metrics_table(metrics, f"{args.checkpoint_path} on {args.eval_split}"))
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
    rows[2:2] = [(f"{key} ({metrics['pass_at_k_samples']} samples)", f"{value:.4f}") for key, value in metrics.items() if key.startswith("pass@")]
    width = max(len(name) for name, _ in rows)
    return "\n".join([title] + [f"  {name:<{width}}  {value}" for name, value in rows])


def main(argv=None) -> dict | list[dict]:
    """The CLI. One --model_path: its metrics. Several: their metrics in order, evaluated one after another by one
    engine where they share an architecture and tokenizer (each checkpoint's weights loaded into it in place, as
    train_rl's syncs do, instead of a new engine's start of about a minute on a GPU); each is written as soon as it
    is graded, so a failure later keeps the checkpoints evaluated before it."""
    args = parse_eval_args(argv)
    models = args.model_path
    if args.output_dir is not None and len(args.output_dir) != len(models):
        raise UserError(f"--output_dir: {len(args.output_dir)} folder(s) for {len(models)} --model_path; give one folder per checkpoint, "
                        "in the same order, or none for runs/eval/<model folder name>")
    output_dirs = [Path(folder) for folder in args.output_dir] if args.output_dir else [Path("runs") / "eval" / Path(model).name for model in models]
    for model in models:
        check_checkpoint(model, "--model_path", "pass a folder written by train_sft/train_rl or a hub id")
    for model in filter(lambda model: Path(model).exists(), models):  # metrics written into a checkpoint would make it a folder the tool no longer owns
        for output_dir in output_dirs:
            check_distinct_outputs([(model, "--model_path"), (output_dir, "--output_dir")])
    for index, output_dir in enumerate(output_dirs):  # two checkpoints named alike (a/rl, b/rl) share the default folder
        for other in range(index):
            if same_path(output_dir, output_dirs[other]):
                raise UserError(f"--output_dir {output_dir} would hold the evaluations of both {models[other]} and {models[index]}; "
                                "pass one --output_dir per --model_path (nothing was changed)")
    if len(models) > 1:  # no output inside another output (a checkpoint inside another is a trainer's layout), none given twice
        check_distinct_outputs([(folder, "--output_dir") for folder in output_dirs])
        for index, model in enumerate(models):
            if any(same_path(model, other) for other in models[:index]):
                raise UserError(f"--model_path {model} is given twice; pass each checkpoint once (nothing was changed)")
    for model in models:
        check_saved_model(model, "it cannot be evaluated; restore it or pass another --model_path")
        check_model_folder(model, "--model_path")
    dataset = Gsm8kDataset(args.split, args.data_dir, limit=args.num_examples)
    for model in models:  # a prompt that cannot fit is one line naming its row, as in train_rl, not the engine's error
        if context := model_context_length(model):
            dataset.check_prompt_lengths(load_tokenizer(model, "--model_path"), context, args.max_tokens, "--max_tokens")
    groups = engine_groups(models)
    with OutputLock([(output_dir, "--output_dir") for output_dir in output_dirs]):  # two evaluations never write one folder at once
        for model, output_dir in zip(models, output_dirs, strict=True):
            claim_log_folder(output_dir, "--output_dir")
            check_replaceable(output_dir, model, args, len(dataset.prompts), default=args.output_dir is None)
        if len(groups) == 1:
            try:
                return _evaluate_group(args, dataset, models, output_dirs)
            except OSError as error:
                raise file_error(error, "the evaluation") from None
    # checkpoints no one engine can hold: vLLM keeps one engine per process (another, once the first is
    # closed, found the first's GPU memory still taken), so each group runs in a child process, which
    # checks and locks its folders again (they were all checked above, before any evaluation)
    results = [None] * len(models)
    for group in groups:
        group_models, group_outputs = [models[i] for i in group], [output_dirs[i] for i in group]
        print(f"evaluating {', '.join(group_models)} in a child process (another engine)", flush=True)
        code = subprocess.run(_command_for(args, group_models, group_outputs), env=_child_env()).returncode
        if code:
            raise UserError(f"the evaluation of {', '.join(group_models)} failed (exit {code}; its output is above); "
                            "the checkpoints evaluated before it are written")
        for index, output_dir in zip(group, group_outputs, strict=True):
            results[index] = json.loads((output_dir / "metrics.json").read_text())
    return results


def engine_groups(models) -> list[list[int]]:
    """The checkpoints' indices, grouped by the engine that can evaluate them (`same_engine_model` with the
    group's first), groups in order of their first checkpoint."""
    fingerprints = [engine_fingerprint(model) for model in models]
    groups = []
    for index, fingerprint in enumerate(fingerprints):
        group = next((group for group in groups if fingerprint is not None and fingerprints[group[0]] == fingerprint), None)
        if group is None:
            groups.append([index])
        else:
            group.append(index)
    return groups


def _command_for(args, models, output_dirs) -> list[str]:
    """This CLI for `models` with every other flag as `args` holds it."""
    command = [sys.executable, "-m", "alignment.evaluate", "--model_path", *map(str, models), "--output_dir", *map(str, output_dirs)]
    for action in build_eval_parser()._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in ("help", "model_path", "output_dir") or value is None:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            command.append(action.option_strings[0 if value else 1])
        else:
            command += [action.option_strings[0], str(value)]
    return command


def _child_env() -> dict:
    """The environment of a child process running this package's CLI: the repo on PYTHONPATH."""
    repo_root = Path(__file__).resolve().parent.parent
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo_root), os.environ.get("PYTHONPATH")]))}


# what an evaluation is of, as metrics.json records it: another value makes it another evaluation
# (metrics.json's key: the flag), "num_examples" being the examples graded and "data_sha256" the split
# file's SHA-256 (another test set of as many rows, or an edited one, is another evaluation too)
EVALUATION_SETUP = {"split": "split", "num_examples": "num_examples", "data_sha256": "data_dir", "temperature": "temperature", "top_p": "top_p",
                    "min_tokens": "min_tokens", "max_tokens": "max_tokens", "repetition_penalty": "repetition_penalty", "pass_at_k_samples": "samples",
                    "pass_at_k_k": "pass_k", "pass_at_k_temperature": "samples_temperature", "sampling_seed": "seed"}


def evaluation_setup(args, num_examples: int, prefix: str = "") -> dict:
    """metrics.json's record of what was evaluated; `prefix` "eval_" reads train_rl's --eval_* flags (its penalty
    --eval_repetition_penalty, which defaults to the rollouts')."""
    split = getattr(args, _flag("split", prefix))
    setup = {key: num_examples if key == "num_examples" else data_fingerprint(args.data_dir, split) if key == "data_sha256"
             else getattr(args, _flag(flag, prefix)) for key, flag in EVALUATION_SETUP.items()}
    if not setup["pass_at_k_samples"]:  # no pass@k samples: their k and temperature change nothing
        setup["pass_at_k_k"] = setup["pass_at_k_temperature"] = None
        if not setup["temperature"]:  # greedy: nor does the seed
            setup["sampling_seed"] = None
    return setup


def changed_setup(recorded: dict, setup: dict) -> list[str]:
    """The settings in which two evaluations differ. One recorded before a setting was (an older metrics.json), or a
    setting that does not apply on one side (None: pass@k's k without samples, the seed of a greedy pass), is not
    compared: a change of the setting that makes it apply is."""
    return [key for key in EVALUATION_SETUP if key in recorded and recorded[key] != setup[key] and None not in (recorded[key], setup[key])]


def _flag(flag: str, prefix: str) -> str:
    return flag if flag in ("data_dir", "seed") else prefix + flag


def check_replaceable(output_dir, model_path, args, num_examples: int, default: bool) -> None:
    """An --output_dir whose metrics.json another evaluation wrote is refused: evaluating there would overwrite it.
    Another model's (two checkpoints named alike, a/rl and b/rl, share the default folder), or the same model's
    on another setup (a 20-example check would replace the whole split's; another --repetition_penalty, a
    plain rerun after pass@k sampling), or of an earlier copy of the same folder (check_same_copy). The same
    evaluation of the same copy again replaces it."""
    try:
        previous = json.loads((Path(output_dir) / "metrics.json").read_text())
    except (OSError, ValueError):
        return
    if not isinstance(previous, dict) or previous.get("model_path") is None:
        return
    where = f"the default --output_dir {output_dir} (runs/eval/<model folder name>)" if default else f"--output_dir {output_dir}"
    if not same_path(previous["model_path"], model_path):
        raise UserError(f"{where} holds the evaluation of {previous['model_path']} (metrics.json); pass another --output_dir to keep both, "
                        f"or remove it to evaluate {model_path} there (nothing was changed)")
    check_same_copy(previous, model_path, f"{where} (metrics.json)", "pass another --output_dir", "remove it to evaluate the copy there now")
    setup = evaluation_setup(args, num_examples)
    changed = changed_setup(previous, setup)
    if changed:
        raise UserError(f"{where} holds an evaluation of {model_path} on {_setup_text(previous, changed)} (metrics.json); this one is on "
                        f"{_setup_text(setup, changed)}: pass another --output_dir to keep both, or remove it to replace it (nothing was changed)")


def _setup_text(values: dict, changed: list[str], prefix: str = "") -> str:
    """'<N> <split> examples' and the other settings that differ, as '--flag value'."""
    shown = [f"--{_flag(EVALUATION_SETUP[key], prefix)} {values[key]}" for key in changed if key not in ("split", "num_examples", "data_sha256")]
    data = f" of a {values['split']}.jsonl with SHA-256 {values['data_sha256'][:12]}" if "data_sha256" in changed and "split" not in changed else ""
    return ", ".join([f"{values['num_examples']} {values['split']} examples{data}", *shown])


def _evaluate_group(args, dataset, models, output_dirs) -> dict | list[dict]:
    """Checkpoints one engine can hold (`engine_groups`): it is built for the first, and each later one's weights
    are loaded into it in place. One checkpoint: its metrics; several: theirs, in order."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    # the copy the engine loads: its manifest (its step; None for a folder from elsewhere) and its identity, both read before its weights
    loaded = read_manifest(models[0])
    copy = folder_copy_identity(models[0], loaded)
    engine = build_engine(args.backend, models[0], device, dtype, args.seed, args)
    results = []
    try:
        for index, (model, output_dir) in enumerate(zip(models, output_dirs, strict=True)):
            if index:
                loaded = read_manifest(model)
                copy = folder_copy_identity(model, loaded)
                engine.load_weights(checkpoint_tensors(model))
                print(f"loaded {model} into the engine of {models[0]}", flush=True)
            results.append(_evaluate(args, dataset, model, output_dir, engine, loaded, copy))
    finally:
        engine.close()
    return results[0] if len(results) == 1 else results


def same_engine_model(loaded, other) -> bool:
    """Whether checkpoint `other` can be evaluated by the engine built for `loaded` with its weights loaded in
    place: both local folders with safetensors weights, one architecture (config.json alike but for the fields
    that name the copy, its stored dtype, which the engine's --dtype overrides, and the cache flag), one
    generation_config.json (vLLM stops at its end-of-sequence ids), and one
    tokenizer (its files alike but for padding and truncation: the sides trainers set, and the state of the
    tokenizer's last padded call, which a fast tokenizer saves into tokenizer.json; generation here reads
    neither. TRL's checkpoints pad on the left, and their tokenizer.json holds its last batch's padding)."""
    fingerprint = engine_fingerprint(loaded)
    return fingerprint is not None and fingerprint == engine_fingerprint(other)


def engine_fingerprint(folder):
    """What `same_engine_model` compares of a checkpoint folder; None for a hub id or a folder without safetensors
    weights (in-place loading reads safetensors files), which never shares an engine."""
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.glob("*.safetensors")):
        return None

    def without(path, ignored):
        if not path.is_file():
            return None
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise UserError(f"--model_path {folder}: {path.name} cannot be read as JSON ({getattr(error, 'msg', None) or error}); fix or restore it") from None
        return {key: item for key, item in value.items() if key not in ignored} if isinstance(value, dict) else value

    return (without(folder / "config.json", {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"}),
            without(folder / "generation_config.json", {"transformers_version"}),  # vLLM stops at its eos_token_id too
            {name: without(folder / name, {"padding", "truncation"}) if name == "tokenizer.json" else (folder / name).read_bytes()
             for name in (*TOKENIZER_FILES, "merges.txt") if (folder / name).is_file()},
            [without(folder / name, {"padding_side", "truncation_side"}) for name in ("tokenizer_config.json", "special_tokens_map.json")])


def _evaluate(args, dataset, model_path, output_dir, engine, loaded, copy) -> dict:
    """Grade `engine` (holding `model_path`'s weights, whose manifest was `loaded` and whose copy was `copy` before they
    were read) and write the results."""
    import torch

    torch.manual_seed(args.seed)
    metrics = evaluate_math(engine, r1_zero_reward_fn, dataset.prompts, dataset.ground_truths, SamplingSettings.from_args(args, ""))
    metrics = add_pass_at_k(metrics, engine, dataset.prompts, dataset.ground_truths, args, "")
    # a run of --num_epochs N saved its next epoch there meanwhile, or a run its next training state (a folder without our manifest)
    now = read_manifest(model_path)
    if (loaded is not None and now != loaded) or folder_copy_identity(model_path, now) != copy:
        raise UserError(f"--model_path {model_path} was replaced while it was evaluated (a run saved into it), so these results "
                        f"would be recorded under the new copy's step; evaluate it again (nothing was written)")
    # both files at the end, one after the other: an evaluation stopped in its pass@k sampling (minutes)
    # once left its samples beside the previous evaluation's metrics.json
    write_jsonl(output_dir / "samples.jsonl", metrics.pop("samples"))
    metrics.update(model_path=str(model_path), backend=args.backend, **evaluation_setup(args, metrics["num_examples"]),
                   **{f"checkpoint_{key}": value for key, value in checkpoint_position(model_path).items()}, **copy_record(copy))
    write_json(output_dir / "metrics.json", metrics)
    print(format_metrics_table(metrics, f"{model_path} on {args.split} ({args.backend})"))
    print(f"wrote {output_dir / 'metrics.json'} and {output_dir / 'samples.jsonl'}")
    return metrics


if __name__ == "__main__":
    run_cli(main)
