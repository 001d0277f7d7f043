"""train_rl end to end on a tiny Qwen2 (CPU): every loss type, both backends,
resume-or-evaluate, weight sync, and one step's loss against a hand computation."""

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from alignment import evaluate, train_rl
from alignment.errors import UserError
from alignment.flops import update_flops
from alignment.optim import build_optimizer, build_scheduler
from alignment.policy_update import score_with, sequence_lengths, update_policy
from alignment.sft_helpers import tokenize_rollouts
from conftest import make_tiny_task, steps_log, train_rl_flags, update_settings

REQUIRED_TAGS = {
    "train/reward", "train/format_reward", "train/answer_reward", "train/loss", "train/grad_norm", "train/entropy",
    "train/clip_fraction", "train/kl_ref", "train/response_length", "train/lr", "eval/avg_all_rewards",
    "perf/rollout_tokens_per_s", "perf/train_tokens_per_s", "perf/step_seconds", "perf/mfu",
}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_tiny_task(tmp_path_factory.mktemp("rl"), num_train=32, num_test=8, seed=1)


def rl_flags(pipeline, name, *extra):
    return train_rl_flags(pipeline, name, "--tmp_checkpoint_path", str(pipeline.root / name / "rl_tmp"), "--train_mini_batch_size", "4",
                          "--sampling_max_tokens", "24", "--eval_max_tokens", "24", "--eval_num_examples", "8", "--max_steps", "2",
                          "--evaluate_freq", "2", "--vllm_kv_cache_gb", "0.25", "--kl_coef", "0.01",
                          "--peak_tflops", "0.001",  # a CPU has no datasheet peak: give one, so perf/mfu is logged
                          *extra)


def scalar_tags(run_dir) -> dict[str, list]:
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return {tag: accumulator.Scalars(tag) for tag in accumulator.Tags()["scalars"]}


def weights_digest(path) -> str:
    return hashlib.sha256((Path(path) / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("backend", ["hf", "vllm"])
@pytest.mark.parametrize("loss_type", ["no_baseline", "reinforce_with_baseline", "grpo_clip"])
def test_two_step_run_logs_every_tag(pipeline, backend, loss_type):
    name = f"{backend}_{loss_type}"
    metrics = train_rl.main(rl_flags(pipeline, name, "--rollout_backend", backend, "--loss_type", loss_type))
    run_dir = pipeline.root / "runs" / name
    tags = scalar_tags(run_dir)
    assert REQUIRED_TAGS <= tags.keys(), REQUIRED_TAGS - tags.keys()
    assert [event.step for event in tags["train/reward"]] == [1, 2]
    assert all(0.0 <= event.value <= 1.0 for event in tags["train/format_reward"])
    assert (pipeline.root / name / "rl" / "model.safetensors").is_file()
    final = json.loads((run_dir / "final_eval_metrics.json").read_text())
    assert final["num_examples"] == 8 and final["step"] == 2
    assert metrics["avg_all_rewards"] == final["avg_all_rewards"]
    # main returns the final metrics as written, without the per-example samples (those are in final_eval_samples.jsonl)
    assert metrics == {key: value for key, value in final.items() if key not in ("step", "skipped_steps")}
    assert len((run_dir / "final_eval_samples.jsonl").read_text().splitlines()) == 8


def test_existing_checkpoint_is_only_evaluated(pipeline, capsys):
    name = "resume_or_evaluate"
    train_rl.main(rl_flags(pipeline, name, "--rollout_backend", "hf", "--max_steps", "1"))
    checkpoint = pipeline.root / name / "rl"
    before = weights_digest(checkpoint)
    capsys.readouterr()
    metrics = train_rl.main(rl_flags(pipeline, name, "--rollout_backend", "hf", "--max_steps", "1"))
    out = capsys.readouterr().out
    assert "already holds weights: evaluating it (no training)" in out
    assert "step 1/1" not in out  # no optimizer step ran
    assert weights_digest(checkpoint) == before
    written = json.loads((pipeline.root / "runs" / name / "eval_only_metrics.json").read_text())
    assert written["num_examples"] == 8 and written["avg_all_rewards"] == metrics["avg_all_rewards"]
    # alignment.evaluate on it records which step's policy it graded, as the eval-only run does
    evaluate.main(["--model_path", str(checkpoint), "--backend", "hf", "--data_dir", str(pipeline.data), "--max_tokens", "24",
                   "--output_dir", str(pipeline.root / "runs" / "evaluate_rl")])
    graded = json.loads((pipeline.root / "runs" / "evaluate_rl" / "metrics.json").read_text())
    assert (graded["checkpoint_step"], graded["checkpoint_total_steps"]) == (1, 1) and graded["avg_all_rewards"] == metrics["avg_all_rewards"]


def test_a_checkpoint_is_not_evaluated_for_a_run_with_other_training_flags(pipeline, capsys):
    """A sweep `--learning_rate X --run_name X` into one --checkpoint_path: the second command found the
    first run's weights and evaluated them as its own result (the seed's rule), for every X."""
    from alignment.checkpoint import MANIFEST_NAME

    name = "sweep"
    flags = ("--rollout_backend", "hf", "--max_steps", "1", "--checkpoint_path", str(pipeline.root / name / "rl"))
    train_rl.main(rl_flags(pipeline, "sweep_lr_1e-4", *flags, "--learning_rate", "1e-4"))
    checkpoint = pipeline.root / name / "rl"
    before = weights_digest(checkpoint)
    with pytest.raises(UserError, match=r"^--learning_rate is 3e-05 but the policy in .*sweep/rl was trained with 0.0001, and train_rl only "
                                        r"evaluates a checkpoint that exists: pass another --checkpoint_path \(and --run_name\) to train "
                                        r"this run, or --learning_rate 0.0001 to evaluate that policy$"):
        train_rl.main(rl_flags(pipeline, "sweep_lr_3e-5", *flags, "--learning_rate", "3e-5"))
    with pytest.raises(UserError, match=r"^--seed is 2 but .* was trained with 42"):  # a seed sweep alike
        train_rl.main(rl_flags(pipeline, "sweep_seed_2", *flags, "--learning_rate", "1e-4", "--seed", "2"))
    assert not (pipeline.root / "runs" / "sweep_lr_3e-5").exists() and not (pipeline.root / "runs" / "sweep_seed_2").exists()
    assert weights_digest(checkpoint) == before
    # the flags it was trained with, other evaluation flags, or no training flag at all: evaluated
    capsys.readouterr()
    train_rl.main(rl_flags(pipeline, "sweep_again", *flags, "--learning_rate", "1e-4", "--eval_num_examples", "4", "--layout", "auto"))
    assert "already holds weights: evaluating it (no training)" in capsys.readouterr().out
    assert json.loads((pipeline.root / "runs" / "sweep_again" / "eval_only_metrics.json").read_text())["num_examples"] == 4
    plain = ["--checkpoint_path", str(checkpoint), "--sft_checkpoint_path", str(pipeline.sft), "--data_dir", str(pipeline.data),
             "--log_dir", str(pipeline.root / "runs"), "--run_name", "sweep_plain", "--rollout_backend", "hf", "--layout", "auto",
             "--eval_num_examples", "4", "--eval_max_tokens", "24"]
    train_rl.main(plain)
    assert (pipeline.root / "runs" / "sweep_plain" / "eval_only_metrics.json").is_file()
    # a checkpoint an older version wrote records no run: evaluated, with a note that the flags went unchecked
    manifest_path = checkpoint / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    assert manifest["run"]["flags"]["learning_rate"] == 1e-4
    del manifest["run"]
    manifest_path.write_text(json.dumps(manifest))
    capsys.readouterr()
    train_rl.main(rl_flags(pipeline, "sweep_old", *flags, "--learning_rate", "3e-5"))
    assert re.search(r"note: .*sweep/rl records no training flags \(an older version wrote it\), so --.*--learning_rate.* could not be checked",
                     capsys.readouterr().out)


def test_a_checkpoint_is_not_evaluated_as_the_result_of_another_start_or_other_data(pipeline, capsys):
    """train_sft run again into the same folder (or train.jsonl edited), then the same train_rl command: it found
    the earlier run's weights and reported the policy trained from the old SFT model (old data) as its result."""
    import shutil

    from transformers import AutoModelForCausalLM

    root = pipeline.root / "new_start"
    shutil.copytree(pipeline.sft, root / "sft")
    shutil.copytree(pipeline.data, root / "data")
    flags = ("--rollout_backend", "hf", "--max_steps", "1", "--checkpoint_path", str(root / "rl"), "--sft_checkpoint_path", str(root / "sft"),
             "--data_dir", str(root / "data"))
    train_rl.main(rl_flags(pipeline, "new_start", *flags))
    before = weights_digest(root / "rl")
    # the same start and data: evaluated, as the seed's rule says
    capsys.readouterr()
    train_rl.main(rl_flags(pipeline, "new_start", *flags))
    assert "already holds weights: evaluating it (no training)" in capsys.readouterr().out
    # another SFT model in the start folder
    model = AutoModelForCausalLM.from_pretrained(root / "sft")
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    model.save_pretrained(root / "sft")
    evaluated = (pipeline.root / "runs" / "new_start" / "eval_only_metrics.json").read_bytes()
    with pytest.raises(UserError, match=r"^the policy in .*new_start/rl was trained from other weights than --sft_checkpoint_path .*new_start/sft holds "
                                        r"now \(train_sft ran again\?\), and train_rl only evaluates a checkpoint that exists: pass another "
                                        r"--checkpoint_path \(and --run_name\) to train from them, or evaluate that policy with "
                                        r"`python -m alignment.evaluate --model_path .*new_start/rl`$"):
        train_rl.main(rl_flags(pipeline, "new_start", *flags))
    shutil.rmtree(root / "sft")
    shutil.copytree(pipeline.sft, root / "sft")  # the start it trained from, back
    # other training data
    rows = (root / "data" / "train.jsonl").read_text().splitlines(keepends=True)
    (root / "data" / "train.jsonl").write_text("".join(rows[:-1]))
    with pytest.raises(UserError, match=r"^the policy in .*new_start/rl was trained on another .*new_start/data/train.jsonl than the one there now"):
        train_rl.main(rl_flags(pipeline, "new_start", *flags))
    assert weights_digest(root / "rl") == before
    assert (pipeline.root / "runs" / "new_start" / "eval_only_metrics.json").read_bytes() == evaluated  # nothing written


def test_an_evaluation_only_rerun_on_another_setup_keeps_the_first(pipeline):
    """A finished run evaluated again with pass@k (hours on a whole split), then with fewer examples or without
    --eval_samples: each later evaluate-only command replaced eval_only_metrics.json, which recorded no setup."""
    name = "eval_setups"
    flags = ("--rollout_backend", "hf", "--max_steps", "1")
    train_rl.main(rl_flags(pipeline, name, *flags))
    run_dir = pipeline.root / "runs" / name
    pass_at_k = ("--eval_samples", "2", "--eval_pass_k", "2")
    train_rl.main(rl_flags(pipeline, name, *flags, *pass_at_k))
    first = (run_dir / "eval_only_metrics.json").read_bytes()
    recorded = json.loads(first)
    assert (recorded["num_examples"], recorded["pass_at_k_samples"], recorded["split"], recorded["max_tokens"], recorded["repetition_penalty"]) == \
        (8, 2, "test", 24, 1.1)
    with pytest.raises(UserError, match=r"^--log_dir/--run_name .*eval_setups holds an evaluation of .*eval_setups/rl on 8 test examples "
                                        r"\(eval_only_metrics.json\); this one is on 4 test examples: pass another --run_name to keep both, or remove "
                                        r".*eval_setups/eval_only_metrics.json to replace it \(nothing was changed\)$"):
        train_rl.main(rl_flags(pipeline, name, *flags, *pass_at_k, "--eval_num_examples", "4"))
    with pytest.raises(UserError, match=r"on 8 test examples, --eval_samples 2 \(eval_only_metrics.json\); this one is on 8 test examples, --eval_samples 0:"):
        train_rl.main(rl_flags(pipeline, name, *flags))
    with pytest.raises(UserError, match=r"on 8 test examples, --eval_max_tokens 24 .*; this one is on 8 test examples, --eval_max_tokens 16:"):
        train_rl.main(rl_flags(pipeline, name, *flags, *pass_at_k, "--eval_max_tokens", "16"))
    with pytest.raises(UserError, match=r"on 8 test examples, --eval_repetition_penalty 1.1 .*; this one is on 8 test examples, --eval_repetition_penalty 1.0:"):
        train_rl.main(rl_flags(pipeline, name, *flags, *pass_at_k, "--eval_repetition_penalty", "1.0"))
    assert (run_dir / "eval_only_metrics.json").read_bytes() == first
    train_rl.main(rl_flags(pipeline, name, *flags, *pass_at_k))  # the same evaluation again replaces it
    assert json.loads((run_dir / "eval_only_metrics.json").read_text())["pass_at_k_samples"] == 2


def test_an_evaluation_only_run_keeps_another_runs_logs_and_evaluation(pipeline):
    """The README's second seed evaluated again without its --run_name (`--checkpoint_path checkpoints/rl_seed1`,
    default --run_name rl): its eval_only_* went into seed 42's log folder, beside seed 42's curves."""
    def snapshot(folder):
        return {path.name: path.read_bytes() for path in sorted(Path(folder).iterdir()) if path.is_file()}

    flags = ("--rollout_backend", "hf", "--max_steps", "1")
    checkpoints = {name: pipeline.root / "own" / name for name in ("a", "b")}
    for name, checkpoint in checkpoints.items():
        train_rl.main(rl_flags(pipeline, f"own_{name}", *flags, "--checkpoint_path", str(checkpoint)))
    runs = pipeline.root / "runs"
    before = snapshot(runs / "own_a")
    with pytest.raises(UserError, match=rf"^--log_dir/--run_name {re.escape(str(runs / 'own_a'))} holds the logs of another run \(steps 1-1 in "
                                        rf"steps.jsonl\) than the one that trained .*own/b; pass --run_name own_b \(its own\) or another --run_name "
                                        r"to evaluate it \(nothing was changed\)$"):
        train_rl.main(rl_flags(pipeline, "own_a", *flags, "--checkpoint_path", str(checkpoints["b"])))
    assert snapshot(runs / "own_a") == before
    train_rl.main(rl_flags(pipeline, "own_b", *flags, "--checkpoint_path", str(checkpoints["b"])))  # its own folder: evaluated
    train_rl.main(rl_flags(pipeline, "own_eval", *flags, "--checkpoint_path", str(checkpoints["b"])))  # a new one too
    evaluated = snapshot(runs / "own_eval")
    with pytest.raises(UserError, match=r"^--log_dir/--run_name .*own_eval holds the evaluation of .*own/b \(eval_only_metrics.json\); "
                                        r"pass another --run_name to evaluate .*own/a \(nothing was changed\)$"):
        train_rl.main(rl_flags(pipeline, "own_eval", *flags, "--checkpoint_path", str(checkpoints["a"])))
    assert snapshot(runs / "own_eval") == evaluated
    train_rl.main(rl_flags(pipeline, "own_eval", *flags, "--checkpoint_path", str(checkpoints["b"])))  # the same checkpoint again: replaced


def test_evaluate_at_start_evaluates_the_start_weights_as_step_0(pipeline, monkeypatch):
    """--evaluate_at_start: one evaluation before the first update, logged as step 0, of the SFT checkpoint's weights (on the synced vLLM sampler)."""
    from safetensors.torch import load_file

    start = load_file(str(pipeline.sft / "model.safetensors"))
    evaluated = []  # (step, whether the policy still held the start weights)

    def recording(args, sampler, model, *rest):
        held = {name: tensor for name, tensor in model.state_dict().items() if name in start}
        evaluated.append((rest[-1], all(torch.equal(held[name], start[name]) for name in held)))
        return real(args, sampler, model, *rest)

    real = train_rl.evaluate_policy
    monkeypatch.setattr(train_rl, "evaluate_policy", recording)
    name = "evaluate_at_start"
    train_rl.main(rl_flags(pipeline, name, "--rollout_backend", "vllm", "--max_steps", "2", "--evaluate_freq", "1", "--evaluate_at_start",
                               "--entropy_coef", "0.1"))  # the random model earns no reward: the entropy bonus moves the weights
    assert evaluated == [(0, True), (1, False), (2, False)]
    evals = [json.loads(line) for line in (pipeline.root / "runs" / name / "evals.jsonl").read_text().splitlines()]
    assert [row["step"] for row in evals] == [0, 1, 2] and evals[0]["num_examples"] == 8
    assert [event.step for event in scalar_tags(pipeline.root / "runs" / name)["eval/avg_all_rewards"]] == [0, 1, 2]


@pytest.mark.parametrize("max_steps", ["2", "4"])  # mid-epoch (--max_steps) and at the epoch's end (8 prompts a step, 32 prompts)
def test_the_final_weights_are_saved_before_the_final_evaluation(pipeline, monkeypatch, max_steps):
    """A run that has trained keeps its weights whatever happens during the last evaluation (a SIGKILL after
    a scheduler's grace period): when it starts, the checkpoint already holds the policy's final weights."""
    seen = []

    def recording(args, sampler, model, tokenizer, eval_set, roles, ranks, step):
        saved = Path(args.checkpoint_path) / "model.safetensors"
        if saved.is_file():
            from safetensors.torch import load_file

            on_disk = load_file(str(saved))
            seen.append((step, all(torch.equal(on_disk[name], tensor) for name, tensor in model.state_dict().items() if name in on_disk)))
        else:
            seen.append((step, False))
        return real(args, sampler, model, tokenizer, eval_set, roles, ranks, step)

    real = train_rl.evaluate_policy
    monkeypatch.setattr(train_rl, "evaluate_policy", recording)
    name = f"save_before_eval_{max_steps}"
    train_rl.main(rl_flags(pipeline, name, "--rollout_backend", "hf", "--max_steps", max_steps, "--evaluate_freq", "1", "--rollout_batch_size", "8",
                           "--entropy_coef", "0.1"))  # the entropy bonus moves the weights every step
    assert seen[-1] == (int(max_steps), True)
    assert [step for step, _ in seen] == list(range(1, int(max_steps) + 1))


def test_max_train_minutes_ends_the_run_with_its_save_and_final_evaluation(pipeline, monkeypatch, capsys):
    """A clock that moves 25 s at each of train_rl's readings: every step trains 25 s, so a 1-minute limit is
    reached in step 3 of 5; that step saves and evaluates as a last step does, and is evaluated once. A 3-step run
    reaches the limit in its own last step: it ends there anyway, and the limit is not reported as cutting it short."""
    from types import SimpleNamespace

    clock = iter(range(0, 10**6, 25))
    monkeypatch.setattr(train_rl, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    name = "time_limit"
    train_rl.main(rl_flags(pipeline, name, "--rollout_backend", "hf", "--max_steps", "5", "--evaluate_freq", "1", "--max_train_minutes", "1",
                           "--entropy_coef", "0.1", "--lr_schedule", "cosine", "--learning_rate", "1e-3"))
    run_dir = pipeline.root / "runs" / name
    out = capsys.readouterr().out
    # the cosine planned over 5 steps is cut at step 3: the rate the last step left, as logged, is said beside the 10% it planned
    rate = steps_log(pipeline, name)[-1]["train/lr"]
    assert 1e-4 < rate < 1e-3
    assert (f"--max_train_minutes 1: 1.2 minutes of training after step 3; the run ends here, before its cosine decay ends: the rate is "
            f"{rate:.2g}, {rate / 1e-3:.0%} of --learning_rate, where the schedule planned 10% at step 5") in out
    # each step's console line counts toward the run's end: 5 steps, until the limit made step 3 the last
    assert re.findall(r"^step (\d+/\d+) ", out, re.MULTILINE) == ["1/5", "2/5", "3/3"]
    assert [row["step"] for row in steps_log(pipeline, name)] == [1, 2, 3]
    assert [json.loads(line)["step"] for line in (run_dir / "evals.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert json.loads((run_dir / "final_eval_metrics.json").read_text())["step"] == 3
    assert (pipeline.root / name / "rl" / "model.safetensors").is_file()
    flags = json.loads((run_dir / "flags.json").read_text())["flags"]  # the run's flags beside its curves, as given
    assert (flags["max_train_minutes"], flags["lr_schedule"], flags["run_name"]) == (1.0, "cosine", name) and "resume" not in flags
    # a run whose last step reaches the limit ends where it would have: nothing is cut short, nothing to say
    train_rl.main(rl_flags(pipeline, "time_limit_at_the_end", "--rollout_backend", "hf", "--max_steps", "3", "--evaluate_freq", "0",
                           "--max_train_minutes", "1"))
    out = capsys.readouterr().out
    assert re.findall(r"^step (\d+/\d+) ", out, re.MULTILINE) == ["1/3", "2/3", "3/3"] and "--max_train_minutes" not in out


def test_a_steps_seconds_hold_all_its_phases_its_evaluation_too(pipeline, monkeypatch):
    """perf/step_seconds is the whole step: every phase it logs (perf/<phase>_seconds) fits in it, the periodic
    evaluation's too. A clock that moves 1 s at each reading, and an evaluation that takes 1000 s of it."""
    from types import SimpleNamespace

    from alignment import run_log

    now = [0.0]

    def perf_counter():
        now[0] += 1.0
        return now[0]

    def slow_evaluation(*args):
        now[0] += 1000.0
        return real(*args)

    real = train_rl.evaluate_policy
    monkeypatch.setattr(train_rl, "time", SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(run_log, "time", SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(train_rl, "evaluate_policy", slow_evaluation)
    name = "step_seconds"
    train_rl.main(rl_flags(pipeline, name, "--rollout_backend", "hf", "--max_steps", "2", "--evaluate_freq", "1"))
    rows = steps_log(pipeline, name)
    assert rows[0]["perf/eval_seconds"] > 1000 and rows[1]["perf/eval_seconds"] == 0.0  # the last step's evaluation is the final one
    for row in rows:
        phases = sum(row[f"perf/{phase}_seconds"] for phase in ("rollout", "reward", "logprobs", "update", "sync", "eval"))
        assert phases < row["perf/step_seconds"] < phases + 50, row  # and a few readings of the clock outside them


def test_batch_sizes_beyond_the_training_prompts_are_named(pipeline):
    with pytest.raises(UserError, match="--rollout_batch_size 40 exceeds the 32 training prompts"):
        train_rl.main(rl_flags(pipeline, "too_many", "--rollout_backend", "hf", "--rollout_batch_size", "40"))
    with pytest.raises(UserError, match="--dynamic_sampling_prompts 40 exceeds the 32 training prompts"):
        train_rl.main(rl_flags(pipeline, "too_many", "--rollout_backend", "hf", "--dynamic_sampling", "--dynamic_sampling_prompts", "40"))


def test_an_update_that_makes_the_weights_non_finite_stops_before_anything_saves_them(pipeline, monkeypatch):
    """--learning_rate 1e308 passes the loss and gradient checks; the weights it writes are inf. The run stops at that
    step with one line, and the training state saved the step before stays the last good one."""
    from safetensors.torch import load_file

    name = "absurd_lr"
    flags = rl_flags(pipeline, name, "--rollout_backend", "hf", "--save_state_every", "1", "--entropy_coef", "0.1", "--evaluate_freq", "0", "--max_steps", "3")
    with pytest.raises(UserError, match=r"the optimizer step of rollout step 1 made the policy's weights non-finite \(--learning_rate 1e\+308"):
        train_rl.main([*flags, "--learning_rate", "1e308"])
    state = pipeline.root / name / "rl.state"
    assert not (state / "policy").exists()  # nothing was saved
    real_update, calls = train_rl.update_policy, []

    def absurd_from_step_2(model, optimizer, *rest, **kwargs):  # a good step 1 (saved), then the absurd rate
        calls.append(1)
        if len(calls) == 2:
            for group in optimizer.param_groups:
                group["lr"] = 1e308
        return real_update(model, optimizer, *rest, **kwargs)

    monkeypatch.setattr(train_rl, "update_policy", absurd_from_step_2)
    with pytest.raises(UserError, match=r"rollout step 2 made the policy's weights non-finite"):
        train_rl.main(flags)
    assert json.loads((state / "counters.json").read_text())["step"] == 1
    assert all(torch.isfinite(tensor).all() for tensor in load_file(str(state / "policy" / "model.safetensors")).values())


@pytest.mark.slow
def test_fresh_eval_engine_runs_in_a_child_process(pipeline, monkeypatch):
    """--eval_engine fresh: the seed's save-then-temporary-vLLM path. The child runs in the repo's folder:
    a relative --tmp_checkpoint_path must still name the folder this process saved (it was read there:
    a failed evaluation, or a stale folder of that name in the repo graded as this step)."""
    name = "fresh_eval"
    monkeypatch.chdir(pipeline.root)
    train_rl.main(rl_flags(pipeline, name, "--rollout_backend", "vllm", "--eval_engine", "fresh", "--max_steps", "2",
                           "--tmp_checkpoint_path", f"{name}/rl_tmp"))
    eval_dir = pipeline.root / "runs" / name / "eval_step_2"
    assert json.loads((eval_dir / "metrics.json").read_text())["num_examples"] == 8
    # the fresh engine evaluated the policy saved at --tmp_checkpoint_path: step 2's, the final checkpoint's weights
    assert weights_digest(pipeline.root / name / "rl_tmp") == weights_digest(pipeline.root / name / "rl")


def test_a_resumed_run_replaces_its_own_fresh_evaluation_of_a_step(tmp_path, monkeypatch):
    """--eval_engine fresh writes eval_step_N/ through alignment.evaluate, which refuses to replace an evaluation on
    another setup. A run resumed with other eval flags (they may change on --resume) evaluates again a step its first
    attempt had evaluated after its last state: that stale evaluation is this run's own, and goes first."""
    from argparse import Namespace

    step_dir = tmp_path / "runs" / "resumed" / "eval_step_3"
    step_dir.mkdir(parents=True)
    (step_dir / "metrics.json").write_text(json.dumps({"model_path": str(tmp_path / "rl_tmp"), "num_examples": 50}))
    (step_dir / "samples.jsonl").write_text("{}\n")
    seen = []

    def child(model_path, args, output_dir, device):
        seen.append(sorted(path.name for path in Path(output_dir).iterdir()))
        return {"avg_all_rewards": 0.5}

    monkeypatch.setattr(train_rl, "save_model_atomically", lambda *args, **kwargs: None)
    monkeypatch.setattr(train_rl, "evaluate_in_subprocess", child)
    args = Namespace(eval_engine="fresh", rollout_backend="vllm", rollout_sync_every=1, log_dir=str(tmp_path / "runs"), run_name="resumed",
                     tmp_checkpoint_path=str(tmp_path / "rl_tmp"), eval_temperature=0.0, eval_top_p=1.0, eval_min_tokens=0, eval_max_tokens=8,
                     repetition_penalty=1.0, seed=0)
    from alignment.distributed import SingleProcess

    metrics, synced = train_rl.evaluate_policy(args, None, None, None, None, {"eval": "cpu"}, SingleProcess(), 3)
    assert seen == [[]] and metrics == {"avg_all_rewards": 0.5} and not synced


def test_one_step_loss_equals_hand_computation(pipeline):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pipeline.sft)
    model = AutoModelForCausalLM.from_pretrained(pipeline.sft, dtype=torch.float32)
    prompts = ["User: Ava has 3 apples. Ava gets 2 more.\nAssistant: <think>"] * 2 + ["User: Ben has 9 pens.\nAssistant: <think>"] * 2
    responses = [" 3 + 2 = 5 </think> <answer> 5 </answer>", " 6 </think> <answer> 6 </answer>", " 9 </think> <answer> 9 </answer>", " 1 </answer>"]
    raw = torch.tensor([1.0, 0.0, 1.0, 0.0])
    advantages = torch.tensor([1.0, -0.5, 2.0, 0.25])  # not group-centred, so the loss is far from 0
    batch = {**tokenize_rollouts(prompts, responses, tokenizer), "raw_rewards": raw, "advantages": advantages}
    batch["lengths"] = sequence_lengths(batch["response_mask"])
    batch["ref_log_probs"] = score_with(model, batch, 2, "cpu", 0)

    # hand computation: naive log_softmax+gather, per-sequence mean of -A * logp, batch mean
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=batch["input_ids"]).logits, -1).gather(-1, batch["labels"][..., None]).squeeze(-1)
    mask = batch["response_mask"].float()
    per_sequence = (-(advantages[:, None]) * logp * mask).sum(-1) / mask.sum(-1)
    expected_loss = per_sequence.mean().item()

    args = update_settings(train_batch_size=4, train_mini_batch_size=2, loss_type="reinforce_with_baseline", logprob_chunk_size=3, max_grad_norm=1e9)
    optimizer = build_optimizer(model, 1e-3, 0.0)
    totals = update_policy(model, optimizer, build_scheduler(optimizer, 0, 1), batch, args, "cpu")
    assert totals["loss"] == pytest.approx(expected_loss, rel=1e-5, abs=1e-7)
    assert totals["optimizer_steps"] == 1 and totals["microbatches"] == 2 and totals["skipped_steps"] == 0
    assert totals["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # reference == policy before the step
    assert totals["flops"] == pytest.approx(update_flops(model.config, batch["lengths"], batch["response_mask"].sum(-1).tolist()))


def test_non_finite_gradient_skips_the_step(pipeline):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pipeline.sft)
    model = AutoModelForCausalLM.from_pretrained(pipeline.sft, dtype=torch.float32)
    prompts = ["User: Ava has 3 apples.\nAssistant: <think>"] * 2
    batch = {**tokenize_rollouts(prompts, [" 3 </answer>", " 4 </answer>"], tokenizer),
             "raw_rewards": torch.tensor([1.0, 0.0]), "advantages": torch.tensor([float("nan"), 0.0])}
    batch["lengths"] = sequence_lengths(batch["response_mask"])
    batch["ref_log_probs"] = torch.zeros(batch["labels"].shape)
    args = update_settings(train_batch_size=2, train_mini_batch_size=2, loss_type="reinforce_with_baseline")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, 1e-3, 0.0)
    totals = update_policy(model, optimizer, build_scheduler(optimizer, 0, 1), batch, args, "cpu")
    assert totals["skipped_steps"] == 1 and totals["optimizer_steps"] == 0
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())


def test_the_sampler_gap_is_measured_on_the_batchs_first_optimizer_step_only(pipeline):
    """train/sampler_logprob_abs_diff compares the sampler with the weights that sampled: only the rows of a batch's
    first optimizer step are scored before any update. Counting later steps too mixed in what the update changed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pipeline.sft)
    prompts = [f"User: Ava has {i} apples.\nAssistant: <think>" for i in range(8)]
    batch = {**tokenize_rollouts(prompts, [f" {i} plus {i} </answer>"[: 8 + i] for i in range(8)], tokenizer),
             "raw_rewards": torch.zeros(8), "advantages": torch.linspace(-1, 1, 8)}
    batch["lengths"] = sequence_lengths(batch["response_mask"])
    model = AutoModelForCausalLM.from_pretrained(pipeline.sft, dtype=torch.float32)
    start = score_with(model, batch, 8, "cpu", 0)
    batch["sampler_log_probs"] = start - 0.25  # the sampler 0.25 nats/token below the start weights, on every token
    args = update_settings(train_batch_size=4, train_mini_batch_size=2, loss_type="reinforce_with_baseline", max_grad_norm=1e9)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the second step's rows score far from the start
    totals = update_policy(model, optimizer, build_scheduler(optimizer, 0, 2), batch, args, "cpu")
    first_step_tokens = int(batch["response_mask"][:4].sum())
    assert totals["optimizer_steps"] == 2 and first_step_tokens < int(batch["response_mask"].sum())
    assert totals["sampler_tokens"] == first_step_tokens
    assert totals["sampler_abs_diff"] == pytest.approx(0.25 * first_step_tokens, rel=1e-4)
    assert totals["sampler_ratio_max"] == pytest.approx(float(torch.exp(torch.tensor(0.25))), rel=1e-4)


def test_each_rollout_batch_gets_its_own_shuffle(pipeline):
    """With several optimizer steps per batch, the rows of each step come from a per-step order."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pipeline.sft)
    prompts = [f"User: Ava has {i} apples.\nAssistant: <think>" for i in range(8)]
    batch = {**tokenize_rollouts(prompts, [f" {i} </answer>" for i in range(8)], tokenizer),
             "raw_rewards": torch.zeros(8), "advantages": torch.linspace(-1, 1, 8)}
    batch["lengths"] = sequence_lengths(batch["response_mask"])
    args = update_settings(epochs_per_rollout_batch=2, train_batch_size=2, train_mini_batch_size=2, loss_type="reinforce_with_baseline", max_grad_norm=1e9)
    finals = []
    for step in (1, 1, 2):
        model = AutoModelForCausalLM.from_pretrained(pipeline.sft, dtype=torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        update_policy(model, optimizer, build_scheduler(optimizer, 0, 1), batch, args, "cpu", step=step)
        finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(finals[0], finals[1])  # same step, same order: reproducible
    assert not torch.allclose(finals[0], finals[2])  # another step, another order


def test_each_pass_over_a_rollout_batch_gets_its_own_shuffle(monkeypatch):
    """Guards: the shuffle re-seeded at every pass (--epochs_per_rollout_batch 2 would cut the batch into the same
    optimizer steps twice). 8 rows, steps of 2: each pass splits the rows into 4 pairs, all 8 rows once, and the
    second pass's pairs are not the first's, at every rollout step."""
    from alignment import policy_update

    seen = []

    def record(model, batch, rows, *args):  # no forward: only which rows each microbatch gets
        seen.append(tuple(sorted(rows)))
        return torch.ones((), dtype=torch.bool)

    monkeypatch.setattr(policy_update, "_train_microbatch", record)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = {"input_ids": torch.zeros(8, 1, dtype=torch.long), "response_mask": torch.ones(8, 1, dtype=torch.bool), "lengths": [1] * 8}
    args = update_settings(epochs_per_rollout_batch=2, train_batch_size=2, train_mini_batch_size=2)
    for step in (0, 1, 2):
        seen.clear()
        update_policy(model, optimizer, build_scheduler(optimizer, 0, 1), batch, args, "cpu", step=step)
        first, second = set(seen[:4]), set(seen[4:])
        assert len(seen) == 8 and sorted(sum(first, ())) == sorted(sum(second, ())) == list(range(8))
        assert first != second, f"step {step}: both passes cut the batch into the same optimizer steps {sorted(first)}"


def test_a_tokenizer_source_other_than_the_checkpoints_is_refused(tmp_path):
    """--model (the tokenizer source) was never checked: a folder without a tokenizer gave a traceback from
    transformers, and another model's tokenizer trained the policy and was saved beside weights it does not fit."""
    task = make_tiny_task(tmp_path / "a", num_train=8, num_test=4, seed=1)
    other = make_tiny_task(tmp_path / "b", num_train=8, num_test=4, seed=2)
    from alignment.toy.synthetic_task import tokenizer_corpus
    from alignment.toy.tiny_model import build_tiny_checkpoint

    wider = build_tiny_checkpoint(tmp_path / "wider", texts=tokenizer_corpus(other.data), vocab_size=416)
    with pytest.raises(UserError, match=r"^--model .*wider: its tokenizer \(416 tokens\) differs from the one saved with .*a/sft \(400 tokens\); "
                                        r"leave --model out"):
        train_rl.main(train_rl_flags(task, "wider", "--model", str(wider)))
    with pytest.raises(UserError, match=r"^cannot load a tokenizer from --model .*a/data: .*; pass a folder or hub id that holds one$"):
        train_rl.main(train_rl_flags(task, "no_tokenizer", "--model", str(task.data)))
    assert not (task.root / "wider" / "rl").exists() and not (task.root / "no_tokenizer" / "rl").exists()
    from alignment.rollout import check_same_tokenizer, load_tokenizer

    check_same_tokenizer(load_tokenizer(task.sft), task.sft, task.sft, "--model")  # its own tokenizer passes


def test_max_steps_beyond_the_epochs_is_noted(tmp_path, capsys):
    """--max_steps 5 with 2 steps an epoch and --num_epochs 1: the run ended at step 2 without a word."""
    from alignment.rollout import load_tokenizer

    task = make_tiny_task(tmp_path, num_train=8, num_test=4, seed=1)
    args = train_rl.parse_rl_args(train_rl_flags(task, "capped", "--max_steps", "5", "--num_epochs", "1"))
    capsys.readouterr()
    assert train_rl.load_prompts(args, load_tokenizer(task.sft), task.sft)[2:] == (2, 2)
    assert capsys.readouterr().out == ("note: --max_steps 5 is more than --num_epochs 1 x 2 steps an epoch (8 prompts / --rollout_batch_size 4): "
                                       "the run ends at step 2; raise --num_epochs to train longer\n")
    args = train_rl.parse_rl_args(train_rl_flags(task, "capped", "--max_steps", "5", "--num_epochs", "3"))
    assert train_rl.load_prompts(args, load_tokenizer(task.sft), task.sft)[2:] == (2, 5) and "note" not in capsys.readouterr().out
    args = train_rl.parse_rl_args(train_rl_flags(task, "capped", "--max_steps", "2", "--num_epochs", "1"))  # exactly the epoch: nothing to note
    assert train_rl.load_prompts(args, load_tokenizer(task.sft), task.sft)[2:] == (2, 2) and "note" not in capsys.readouterr().out


def test_an_epoch_is_the_whole_batches_its_prompts_fill(tmp_path, capsys):
    """6 prompts, --rollout_batch_size 4: an epoch is 1 step (the 2 prompts left over make no short batch; the next
    epoch's shuffle draws a whole batch again), so --num_epochs 3 plans 3 steps, not 6."""
    from alignment.rollout import load_tokenizer

    task = make_tiny_task(tmp_path, num_train=8, num_test=4, seed=1)
    args = train_rl.parse_rl_args(train_rl_flags(task, "leftover", "--num_train_examples", "6", "--num_epochs", "3"))
    assert train_rl.load_prompts(args, load_tokenizer(task.sft), task.sft)[2:] == (1, 3)
    args = train_rl.parse_rl_args(train_rl_flags(task, "leftover", "--num_train_examples", "6", "--num_epochs", "3", "--max_steps", "4"))
    capsys.readouterr()
    assert train_rl.load_prompts(args, load_tokenizer(task.sft), task.sft)[2:] == (1, 3)
    assert "--num_epochs 3 x 1 steps an epoch (6 prompts / --rollout_batch_size 4): the run ends at step 3" in capsys.readouterr().out


def test_the_schedule_spans_every_optimizer_step_of_the_run(tmp_path, capsys):
    """3 rollout steps of 16 rollouts, --train_batch_size 8 and --epochs_per_rollout_batch 2: 12 optimizer steps, the
    length the warm-up is measured against (a schedule of 3 or 6 steps would end the warm-up early or late)."""
    task = make_tiny_task(tmp_path, num_train=8, num_test=4, seed=1)
    args = train_rl.parse_rl_args(train_rl_flags(task, "schedule", "--train_batch_size", "8", "--epochs_per_rollout_batch", "2",
                                                 "--warmup_steps", "16"))
    capsys.readouterr()
    optimizer, scheduler = train_rl.optimizer_and_schedule(args, torch.nn.Linear(2, 1), 3, None, print)
    assert capsys.readouterr().out == ("note: --warmup_steps 16 is longer than the run's 12 optimizer steps: "
                                       "the learning rate ends at 75.0% of its peak\n")
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 16)  # --learning_rate, at the first warm-up step


def _flag_args(**flags):
    """Rollout and evaluation flags set apart, so that one read in the other's place shows."""
    from argparse import Namespace

    return Namespace(sampling_temperature=1.0, sampling_top_p=0.9, sampling_min_tokens=4, sampling_max_tokens=12,
                     eval_temperature=0.0, eval_top_p=1.0, eval_min_tokens=0, eval_max_tokens=20, repetition_penalty=1.1, eval_repetition_penalty=1.0,
                     **flags)


def test_in_process_evaluations_sample_with_the_eval_flags_not_the_rollouts(monkeypatch):
    """Greedy evaluations (--eval_temperature 0) beside rollouts at temperature 1: both in-process paths (the HF
    engine, and the rollout engine given the policy's weights) hand evaluate_math the --eval_ settings."""
    from types import SimpleNamespace

    from alignment.distributed import SingleProcess

    seen = []
    monkeypatch.setattr(train_rl, "evaluate_math", lambda engine, reward_fn, prompts, truths, sampling: seen.append(sampling) or {"samples": []})
    monkeypatch.setattr(train_rl, "HfEngine", lambda *args, **kwargs: "hf engine")
    eval_set = SimpleNamespace(prompts=["p"], ground_truths=["1"])
    args = _flag_args(rollout_backend="hf", eval_engine="sampler", rollout_sync_every=1, hf_batch_size=2, dtype="float32")
    train_rl.evaluate_policy(args, None, None, None, eval_set, {"sample": "cpu"}, SingleProcess(), 1)
    args.rollout_backend = "vllm"
    loaded = []
    sampler = SimpleNamespace(engine=SimpleNamespace(load_weights=lambda weights: loaded.append(dict(weights))))
    metrics, synced = train_rl.evaluate_policy(args, sampler, torch.nn.Linear(2, 1), None, eval_set, {"sample": "cpu"}, SingleProcess(), 1)
    assert synced and set(loaded[0]) == {"weight", "bias"}
    assert [(s.temperature, s.top_p, s.min_tokens, s.max_tokens, s.repetition_penalty) for s in seen] == [(0.0, 1.0, 0, 20, 1.0)] * 2


def test_the_rollout_engine_evaluates_only_weights_it_may_keep_and_a_frozen_one_gets_its_start_back(monkeypatch, tmp_path):
    """The vLLM sampler evaluates the policy when it follows it every step (--rollout_sync_every 1), and under torchrun
    always; the seed's frozen sampler (0) gets its start weights back after, and says it does not hold the policy.
    In one process a sampler that lags by design (--rollout_sync_every 2) is left alone: a fresh engine evaluates."""
    from types import SimpleNamespace

    from alignment.distributed import SingleProcess

    class OneRank(SingleProcess):
        def full_weights(self, model):
            return "policy weights"

    class TwoRanks(OneRank):  # rank 0 of 2: half the examples here, the other half's samples "gathered" as copies
        rank, world_size = 0, 2

        def gather(self, items):
            return items + items

    loaded, fresh = [], []
    monkeypatch.setattr(train_rl, "evaluate_math", lambda engine, reward_fn, prompts, truths, sampling: {"samples": [
        {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0, "response": "r", "ground_truth": t, "num_tokens": 3} for t in truths]})
    monkeypatch.setattr(train_rl, "checkpoint_tensors", lambda folder: f"start weights of {folder}")
    monkeypatch.setattr(train_rl, "save_model_atomically", lambda *args, **kwargs: None)
    monkeypatch.setattr(train_rl, "evaluate_in_subprocess", lambda model_path, args, output_dir, device: fresh.append(model_path) or {"avg_all_rewards": 0.5})
    sampler = SimpleNamespace(engine=SimpleNamespace(load_weights=loaded.append), start_weights="sft")
    eval_set = SimpleNamespace(prompts=["p1", "p2"], ground_truths=["1", "2"])

    def evaluate(sync_every, ranks):
        loaded.clear(), fresh.clear()
        args = _flag_args(rollout_backend="vllm", eval_engine="sampler", rollout_sync_every=sync_every, log_dir=str(tmp_path), run_name="routes",
                          tmp_checkpoint_path=str(tmp_path / "rl_tmp"), seed=0)
        metrics, synced = train_rl.evaluate_policy(args, sampler, None, None, eval_set, {"eval": "cpu"}, ranks, 4)
        return synced, list(loaded), list(fresh), metrics.get("num_examples")

    assert evaluate(1, OneRank()) == (True, ["policy weights"], [], 2)
    assert evaluate(2, OneRank()) == (False, [], [str(tmp_path / "rl_tmp")], None)
    assert evaluate(0, OneRank()) == (False, [], [str(tmp_path / "rl_tmp")], None)
    assert evaluate(1, TwoRanks()) == (True, ["policy weights"], [], 2)
    assert evaluate(0, TwoRanks()) == (False, ["policy weights", "start weights of sft"], [], 2)


def test_a_fresh_evaluation_is_asked_for_with_the_eval_flags(monkeypatch, tmp_path):
    import subprocess

    commands = []

    def child(command, **kwargs):
        commands.append(command)
        (tmp_path / "metrics.json").write_text(json.dumps({"avg_all_rewards": 0.25}))
        (tmp_path / "samples.jsonl").write_text("{}\n")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(evaluate.subprocess, "run", child)
    args = _flag_args(dtype="float32", eval_split="test", data_dir=str(tmp_path), seed=3, vllm_kv_cache_gb=1.0, eval_num_examples=0,
                      vllm_gpu_memory_utilization=None, vllm_enforce_eager=None)
    assert evaluate.evaluate_in_subprocess(tmp_path / "model", args, tmp_path, "cpu")["avg_all_rewards"] == 0.25
    command = commands[0]
    given = {flag: command[command.index(flag) + 1] for flag in ("--temperature", "--top_p", "--min_tokens", "--max_tokens", "--repetition_penalty")}
    assert given == {"--temperature": "0.0", "--top_p": "1.0", "--min_tokens": "0", "--max_tokens": "20", "--repetition_penalty": "1.0"}
    args.eval_split, args.eval_num_examples, args.eval_top_p, args.eval_samples, args.eval_pass_k, args.eval_samples_temperature = "train", 3, 0.95, 4, 2, 0.8
    evaluate.evaluate_in_subprocess(tmp_path / "model", args, tmp_path, "cpu")
    command = commands[1]
    given = {flag: command[command.index(flag) + 1] for flag in ("--split", "--num_examples", "--top_p", "--samples", "--pass_k", "--samples_temperature")}
    assert given == {"--split": "train", "--num_examples": "3", "--top_p": "0.95", "--samples": "4", "--pass_k": "2", "--samples_temperature": "0.8"}


def test_overlong_judges_and_penalises_the_response_against_the_rollouts_token_limit():
    """--overlong counts a response truncated at --sampling_max_tokens (12 here, evaluations 20), and its
    penalty reads the response's own token count, not prompt + response."""
    from alignment.distributed import SingleProcess
    from alignment.grpo import overlong_reward
    from alignment.rollout import Generation

    generations = [Generation("a b c", 12, [5] * 12), Generation("a </answer>", 12, [5] * 12), Generation("a", 9, [5] * 9), Generation("a", 3, [5] * 3)]
    args = _flag_args(overlong="mask", overlong_buffer=4, group_size=2, advantage_eps=1e-6, use_std_normalization=False)
    batch = {"raw_rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]), "lengths": torch.tensor([30, 30, 27, 21])}
    logged = train_rl.handle_overlong(args, batch, generations, eos_token_id=0, ranks=SingleProcess())
    assert batch["in_loss"].tolist() == [False, True, True, True] and logged["train/truncated_fraction"] == 0.25
    args.overlong = "penalty"
    logged = train_rl.handle_overlong(args, batch, generations, eos_token_id=0, ranks=SingleProcess())
    penalty = overlong_reward(torch.tensor([12, 12, 9, 3]), 12, 4)
    assert penalty.tolist() == [-1.0, -1.0, -0.25, 0.0]
    assert torch.equal(batch["raw_rewards"], torch.tensor([1.0, 0.0, 1.0, 0.0]) + penalty)
    assert batch["advantages"].tolist() == [0.5, -0.5, 0.375, -0.375] and logged["train/overlong_reward"] == pytest.approx(-0.5625)


def test_each_epoch_reshuffles_the_rows_and_keeps_each_question_with_its_answer():
    from types import SimpleNamespace

    class Rows(SimpleNamespace):
        def __len__(self):
            return len(self.prompts)

    dataset = Rows(prompts=[f"q{i}" for i in range(10)], ground_truths=[f"a{i}" for i in range(10)])
    epochs = [[train_rl.rollout_batch(dataset, epoch * 3 + index, 3, 3, seed=5) for index in (1, 2, 3)] for epoch in range(3)]
    for batches in epochs:
        prompts = [p for batch_prompts, _ in batches for p in batch_prompts]
        assert len(set(prompts)) == 9  # every row at most once an epoch
        assert all(truth == prompt.replace("q", "a") for batch_prompts, truths in batches for prompt, truth in zip(batch_prompts, truths))
    orders = [[p for batch_prompts, _ in batches for p in batch_prompts] for batches in epochs]
    assert orders[0] != orders[1] != orders[2] != orders[0]  # each epoch its own shuffle, as the seed's DataLoader
    assert orders[0] != [p for index in (1, 2, 3) for p in train_rl.rollout_batch(dataset, index, 3, 3, seed=6)[0]]
