"""Every CLI rejects bad input before loading a model: one line, exit code 2."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from alignment import evaluate, train_rl, train_sft
from alignment.args import parse_rl_args
from alignment.errors import run_cli
from alignment.toy.synthetic_task import write_synthetic_gsm8k
from conftest import REPO_ROOT


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    return write_synthetic_gsm8k(tmp_path_factory.mktemp("data"), num_train=16, num_test=4)


def _fails_with(main, argv, capsys, pattern):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    assert err.startswith("error: ")
    assert pattern in err, err
    return err


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (["--loss_type", "ppo"], "--loss_type: invalid choice: 'ppo'"),
        (["--group_size", "0"], "--group_size: must be a positive integer"),
        (["--rollout_batch_size", "-3"], "--rollout_batch_size: must be a positive integer"),
        (["--learning_rate", "0"], "--learning_rate: must be a positive number"),
        (["--max_train_minutes", "0"], "--max_train_minutes: must be a positive number"),
        (["--sampling_top_p", "0"], "--sampling_top_p: must be in (0, 1]"),
        (["--train_mini_batch_size", "3"], "--train_mini_batch_size 3 must divide --train_batch_size 256"),
        (["--train_batch_size", "100"], "--train_batch_size 100 must divide the 256 rollouts"),
        (["--group_size", "1", "--loss_type", "grpo_clip"], "--group_size 1 with --loss_type grpo_clip"),
        (["--group_size", "1", "--loss_type", "reinforce_with_baseline"], "a group of one has zero advantage"),
        (["--cliprange", "1.5"], "--cliprange 1.5 must be below 1"),
        (["--sampling_min_tokens", "50", "--sampling_max_tokens", "10"], "--sampling_min_tokens 50 exceeds --sampling_max_tokens 10"),
        (["--pack_sequences", "--logprob_chunk_size", "0"], "--pack_sequences runs through the fused log-prob path"),
        (["--pack_sequences", "--gradient_checkpointing"], "--pack_sequences does not combine with --gradient_checkpointing"),
        (["--microbatch_tokens", "4096", "--policy_parallel", "fsdp"], "--microbatch_tokens 4096 gives each FSDP rank its own microbatch count"),
        # the objective flags (GSPO, DAPO, entropy, KL, mismatch corrections, pass@k)
        (["--loss_type", "gspo", "--length_normalization", "constant"], "--loss_type gspo is defined for --length_normalization mean only, not constant"),
        (["--dynamic_sampling", "--rollout_staleness", "1"], "--dynamic_sampling samples extra rounds in step"),
        (["--dynamic_sampling", "--loss_type", "no_baseline"], "--dynamic_sampling drops groups"),
        (["--max_sampling_rounds", "0"], "--max_sampling_rounds: must be a positive integer"),
        (["--dynamic_sampling_prompts", "64"], "--dynamic_sampling_prompts 64 sizes --dynamic_sampling's rounds: add --dynamic_sampling"),
        (["--dynamic_sampling", "--dynamic_sampling_prompts", "16"], "--dynamic_sampling_prompts 16 is below --rollout_batch_size 32"),
        (["--overlong", "penalty"], "--overlong penalty needs --overlong_buffer in [1, --sampling_max_tokens 1024]"),
        (["--overlong", "penalty", "--overlong_buffer", "2000"], "--overlong penalty needs --overlong_buffer"),
        (["--overlong_buffer", "8"], "--overlong_buffer 8 only shapes --overlong penalty"),
        (["--overlong", "drop"], "--overlong: invalid choice"),
        (["--entropy_coef", "-0.1"], "--entropy_coef: must be a number >= 0"),
        (["--kl_in", "reward"], "--kl_in reward shapes the KL penalty: it needs --kl_coef > 0"),
        (["--kl_estimator", "k1"], "--kl_estimator k1 shapes the KL penalty"),
        (["--mismatch_correction", "token_mask"], "--mismatch_correction token_mask corrects rollouts sampled ahead"),
        (["--mismatch_correction", "token_mask", "--rollout_staleness", "1", "--tis_cap", "1"], "it needs --tis_cap c > 1"),
        (["--mismatch_correction", "sequence_tis", "--rollout_staleness", "1"], "--mismatch_correction sequence_tis reweights the REINFORCE losses"),
        (["--eval_pass_k", "4"], "--eval_pass_k 4 needs --eval_samples N >= 4"),
        (["--eval_samples", "2", "--eval_pass_k", "3"], "--eval_pass_k 3 exceeds --eval_samples 2"),
        (["--eval_samples", "2", "--sampling_temperature", "0"], "--eval_samples 2 at temperature 0"),
        # values that used to train the whole run and then overflow the logits, or a traceback (round 4)
        (["--sampling_temperature", "1e-300"], "--sampling_temperature: must be 0 (greedy) or between 0.01 and 100, got 1e-300"),
        (["--eval_temperature", "1e-300"], "--eval_temperature: must be 0 (greedy) or between 0.01 and 100, got 1e-300"),
        (["--scoring_temperature", "1e-300"], "--scoring_temperature: must be between 0.01 and 100, got 1e-300"),
        (["--repetition_penalty", "1e-300"], "--repetition_penalty: must be between 0.01 and 100 (1 = none), got 1e-300"),
        (["--seed", str(2**64)], "--seed: must be an integer in [0, 2^32), got 18446744073709551616"),
        # one step past each bound (the values at the bounds pass: test_a_value_exactly_at_a_bound_is_accepted)
        (["--seed", str(2**32)], "--seed: must be an integer in [0, 2^32), got 4294967296"),
        (["--rollout_staleness", "-1"], "--rollout_staleness: must be >= 0, got -1"),
        (["--learning_rate", "inf"], "--learning_rate: must be a positive number, got inf"),
        (["--scoring_temperature", "0"], "--scoring_temperature: must be between 0.01 and 100, got 0"),  # logits / 0: no greedy scoring
        (["--adam_betas", "0.9", "1"], "--adam_betas: must be in [0, 1), got 1"),
        (["--cliprange", "1"], "--cliprange 1.0 must be below 1"),
    ],
)
def test_rl_flag_validation(flags, pattern, capsys, toy_data):
    _fails_with(train_rl.main, ["--data_dir", str(toy_data)] + flags, capsys, pattern)


def test_rl_paths_devices_and_context(capsys, toy_data, tiny_checkpoint, tmp_path):
    base = ["--data_dir", str(toy_data), "--checkpoint_path", str(tmp_path / "rl")]
    _fails_with(train_rl.main, ["--data_dir", str(tmp_path / "missing")], capsys, "train.jsonl not found")
    _fails_with(train_rl.main, base + ["--sft_checkpoint_path", str(tmp_path / "nope")], capsys, "does not exist; run `python -m alignment.train_sft` first")
    (tmp_path / "empty").mkdir()
    _fails_with(train_rl.main, base + ["--sft_checkpoint_path", str(tmp_path / "empty")], capsys, "is not a checkpoint")
    _fails_with(train_rl.main, base + ["--sft_checkpoint_path", str(tiny_checkpoint), "--sampling_max_tokens", "4096"], capsys, "model's 1024-token context")
    if not os.environ.get("CUDA_VISIBLE_DEVICES") and not __import__("torch").cuda.is_available():
        _fails_with(train_rl.main, base + ["--sft_checkpoint_path", str(tiny_checkpoint), "--sampling_max_tokens", "64", "--eval_max_tokens", "64"], capsys, "--sample_device cuda:7 does not exist: this machine has 0 GPU(s)")


def test_sft_and_eval_validation(capsys, toy_data, tmp_path):
    _fails_with(train_sft.main, ["--data_dir", str(toy_data), "--batch_size", "10", "--microbatch_size", "4"], capsys, "--microbatch_size 4 must divide --batch_size 10")
    _fails_with(train_sft.main, ["--data_dir", str(toy_data), "--model", str(tmp_path / "none")], capsys, "--model")
    _fails_with(evaluate.main, ["--data_dir", str(toy_data), "--model_path", str(tmp_path / "none")], capsys, "--model_path")
    _fails_with(evaluate.main, ["--data_dir", str(toy_data), "--model_path", "x", "--min_tokens", "9", "--max_tokens", "3"], capsys, "--min_tokens 9 exceeds --max_tokens 3")
    _fails_with(evaluate.main, ["--data_dir", str(toy_data), "--model_path", "x", "--samples", "2", "--pass_k", "3"], capsys, "--pass_k 3 exceeds --samples 2")
    _fails_with(evaluate.main, ["--data_dir", str(toy_data), "--model_path", "x", "--temperature", "1e-300"], capsys, "--temperature: must be 0 (greedy) or between")
    _fails_with(evaluate.main, ["--data_dir", str(toy_data), "--model_path", "x", "--seed", "-1"], capsys, "--seed: must be an integer in [0, 2^32)")
    _fails_with(train_sft.main, ["--data_dir", str(toy_data), "--seed", str(2**64)], capsys, "--seed: must be an integer in [0, 2^32)")


@pytest.mark.parametrize("flags, name, value", [
    (["--sampling_top_p", "1"], "sampling_top_p", 1.0),
    (["--eval_top_p", "1"], "eval_top_p", 1.0),
    (["--seed", str(2**32 - 1)], "seed", 2**32 - 1),
    (["--sampling_temperature", "0.01"], "sampling_temperature", 0.01),
    (["--sampling_temperature", "100"], "sampling_temperature", 100.0),
    (["--repetition_penalty", "100"], "repetition_penalty", 100.0),
    (["--adam_betas", "0", "0.999"], "adam_betas", [0.0, 0.999]),
    (["--cliprange", "0.99"], "cliprange", 0.99),
    (["--rollout_staleness", "0"], "rollout_staleness", 0),
    (["--overlong", "penalty", "--overlong_buffer", "1024"], "overlong_buffer", 1024),  # the whole response ramps
    (["--eval_samples", "4", "--eval_pass_k", "4"], "eval_pass_k", 4),  # pass@N from N samples
], ids=["top_p_1", "eval_top_p_1", "largest_seed", "lowest_temperature", "highest_temperature", "highest_penalty", "beta_0",
        "cliprange_below_1", "staleness_0", "overlong_buffer_the_whole_response", "pass_k_equal_to_samples"])
def test_a_value_exactly_at_a_bound_is_accepted(flags, name, value, toy_data):
    """Each range check is exact at its closed end: top_p 1 is the documented default, 2^32 - 1 the largest seed
    torch takes, an overlong buffer of --sampling_max_tokens ramps over the whole response (its help says [1, max])."""
    args = parse_rl_args(["--data_dir", str(toy_data), *flags])
    assert getattr(args, name) == value


def test_rl_defaults_are_the_documented_values(toy_data):
    """The defaults the help texts and README promise (seed values unless noted), as parsed and derived:
    a changed default silently changes every run that leaves the flag out."""
    args = parse_rl_args(["--data_dir", str(toy_data)])
    assert args.adam_betas == (0.9, 0.95)  # not torch's (0.9, 0.999)
    assert (args.learning_rate, args.weight_decay, args.max_grad_norm, args.warmup_steps) == (1e-6, 0.0, 1.0, 0)
    assert (args.seed, args.group_size, args.rollout_batch_size, args.train_mini_batch_size) == (42, 8, 32, 8)
    assert (args.train_batch_size, args.gradient_accumulation_steps) == (256, 32)  # one step per rollout batch
    assert (args.loss_type, args.cliprange, args.cliprange_high, args.old_policy) == ("grpo_clip", 0.2, 0.2, "rollout")
    assert (args.kl_coef, args.kl_estimator, args.kl_in, args.length_normalization) == (0.0, "k3", "loss", "mean")
    assert (args.sampling_temperature, args.scoring_temperature, args.sampling_top_p, args.repetition_penalty) == (1.0, 1.0, 1.0, 1.1)
    assert (args.sampling_min_tokens, args.sampling_max_tokens, args.length_normalization_constant) == (4, 1024, 1024.0)
    assert (args.eval_temperature, args.eval_repetition_penalty, args.eval_samples_temperature) == (0.0, 1.1, 1.0)
    assert (args.dtype, args.fp32_master_weights, args.sampler_logprobs_every, args.logprob_chunk_size) == ("auto", True, 10, 1024)
    assert (args.rollout_sync_every, args.rollout_staleness, args.tis_cap, args.mismatch_correction) == (1, 0, 2.0, "tis")
    assert (args.layout, args.sample_device, args.reference_model_device, args.eval_device) == ("explicit", "cuda:7", "cuda:6", "cuda:5")
    assert args.state_dir == os.path.join("checkpoints", "rl.state")


def test_sft_microbatch_size_need_not_divide_the_batch_when_microbatches_are_cut_by_tokens(toy_data):
    """With --microbatch_tokens the rows per microbatch come from the token budget, so --microbatch_size is unused
    and its divisibility check must not refuse the command (it still does without --microbatch_tokens)."""
    from alignment.args import parse_sft_args
    from alignment.errors import UserError

    args = parse_sft_args(["--data_dir", str(toy_data), "--batch_size", "10", "--microbatch_size", "4", "--microbatch_tokens", "512"])
    assert (args.batch_size, args.microbatch_size, args.microbatch_tokens) == (10, 4, 512)
    with pytest.raises(UserError, match=r"--microbatch_size 4 must divide --batch_size 10"):
        parse_sft_args(["--data_dir", str(toy_data), "--batch_size", "10", "--microbatch_size", "4"])


def test_a_bare_name_that_is_no_folder_is_refused_while_an_org_slash_name_passes_as_a_hub_id(tmp_path, monkeypatch):
    """check_checkpoint: `org/name` with no such folder goes to the hub; a bare name (a typo of a local folder) and
    anything that looks like a path fail at once in one line instead of as a hub download error after the imports."""
    from alignment.args import check_checkpoint
    from alignment.errors import UserError

    monkeypatch.chdir(tmp_path)
    check_checkpoint("Qwen/Qwen2.5-Math-1.5B", "--model_path", "hint")  # a hub id: no error
    for path in ("my_sft_model", "runs/a/b", "./Qwen/Qwen2.5-Math-1.5B"):
        with pytest.raises(UserError, match=rf"^--model_path {path} does not exist; hint$"):
            check_checkpoint(path, "--model_path", "hint")


def test_no_baseline_forces_group_size_one(toy_data):
    args = parse_rl_args(["--data_dir", str(toy_data), "--loss_type", "no_baseline", "--group_size", "8", "--rollout_batch_size", "16"])
    assert args.group_size == 1
    assert args.total_rollouts == 16 and args.train_batch_size == 16
    assert args.gradient_accumulation_steps == 2  # 16 / --train_mini_batch_size 8
    assert args.cliprange_high == args.cliprange == 0.2
    assert args.length_normalization_constant == 1024.0


def test_help_works_without_importing_vllm():
    # one process for the four CLIs (a Python start with torch costs seconds): each prints its
    # usage and exits 0, and vLLM is still not imported after all of them
    code = (
        "import contextlib, io, runpy, sys\n"
        "for module in ['alignment.train_rl', 'alignment.train_sft', 'alignment.evaluate', 'alignment.data']:\n"
        "    sys.argv, out = [module, '--help'], io.StringIO()\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out):\n"
        "            runpy.run_module(module, run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (module, e.code)\n"
        "    assert out.getvalue().startswith('usage: python -m ' + module), (module, out.getvalue()[:200])\n"
        "    print(module, 'VLLM_IMPORTED' if 'vllm' in sys.modules else 'NO_VLLM')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [word for module in ("train_rl", "train_sft", "evaluate", "data") for word in (f"alignment.{module}", "NO_VLLM")]


@pytest.mark.parametrize(
    "flags, device, expected",
    [
        ([], "cpu", (False, False)),  # the CPU demo and CI: the plain path
        ([], "cuda:0", (True, False)),  # a GPU: compiled layers; rows cut by count stay padded
        (["--microbatch_tokens", "32768"], "cuda:0", (True, True)),  # cut by tokens on a GPU: packed too
        (["--microbatch_tokens", "32768"], "cpu", (False, False)),
        (["--microbatch_tokens", "32768", "--gradient_checkpointing"], "cuda:0", (False, False)),
        (["--rollout_backend", "hf"], "cuda:0", (False, False)),  # the hf sampler is the policy itself
        (["--rollout_backend", "hf", "--rollout_sync_every", "2"], "cuda:0", (True, False)),  # its own copy samples
        (["--no-torch_compile", "--microbatch_tokens", "4096", "--no-pack_sequences"], "cuda:0", (False, False)),
        (["--torch_compile", "--pack_sequences"], "cpu", (True, True)),  # explicit flags are kept
    ],
)
def test_speed_flags_default_to_the_fast_path_on_a_gpu(toy_data, flags, device, expected):
    from types import SimpleNamespace

    from alignment.args import resolve_speed_flags

    args = parse_rl_args(["--data_dir", str(toy_data), *flags])
    for name in ("torch_compile", "pack_sequences"):  # left at auto until the device is known
        assert (getattr(args, name) is None) == (f"-{name}" not in " ".join(flags)), name
    speed, line = resolve_speed_flags(args, device, 1, SimpleNamespace(layer_types=["full_attention"]))
    assert (speed["torch_compile"], speed["pack_sequences"]) == expected
    assert line.startswith(f"torch.compile {'on' if expected[0] else 'off'}, packed microbatches {'on' if expected[1] else 'off'}")


def test_packing_stays_off_by_default_for_sliding_window_layers(toy_data):
    from types import SimpleNamespace

    from alignment.args import resolve_speed_flags

    args = parse_rl_args(["--data_dir", str(toy_data), "--microbatch_tokens", "4096"])
    speed, _ = resolve_speed_flags(args, "cuda:0", 1, SimpleNamespace(layer_types=["full_attention", "sliding_attention"]))
    assert speed == {"torch_compile": True, "pack_sequences": False}
    assert args.pack_sequences is None and args.torch_compile is None  # the flags stay as parsed


COLLECTOR_AT_START = (
    "import gc, sys\n"
    "sys.argv[:1], sys.orig_argv = [sys.argv[1]], [sys.executable, *sys.argv[1:]]  # as Python sets them under -m\n"
    "import alignment\n"
    "paused = not gc.isenabled()\n"
    "print(paused, alignment.resume_collector(), gc.isenabled(), gc.get_freeze_count() > 0, alignment.resume_collector())\n"
)


@pytest.mark.parametrize("argv, expected", [
    (["-m", "alignment.train_rl"], "True True True True False"),  # a tool's start: off while it imports, then on, the imports frozen
    (["-m", "somebody_elses.tool"], "False False True False False"),  # imported by another program: left alone
    (["-c", "alignment.train_rl"], "False False True False False"),
])
def test_the_collector_is_off_only_while_a_tool_of_ours_starts(argv, expected):
    done = subprocess.run([sys.executable, "-c", COLLECTOR_AT_START, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == expected, done.stderr[-2000:]


def test_run_cli_turns_the_paused_collector_back_on_and_unfreezes_at_the_end():
    import gc

    import alignment

    seen = []
    frozen_before = gc.get_freeze_count()
    gc.unfreeze()
    try:
        alignment.pause_collector()
        run_cli(lambda argv: seen.append((gc.isenabled(), gc.get_freeze_count() > 0)))
        assert seen == [(True, True)] and gc.isenabled() and gc.get_freeze_count() == 0
        alignment.pause_collector()
        with pytest.raises(SystemExit):
            run_cli(lambda argv: (_ for _ in ()).throw(KeyboardInterrupt))
        assert gc.isenabled() and gc.get_freeze_count() == 0  # on again after a tool that stopped on Ctrl-C too
    finally:
        gc.enable()
        if frozen_before:
            gc.freeze()


def readme_commands() -> list[tuple[str, list[str]]]:
    """(tool, flags) of every `python -m alignment.<tool>` / `torchrun ... -m alignment.<tool>` line in the README's code
    blocks, continuation lines joined and comments dropped; lines with a `...` placeholder are left out."""
    import shlex

    text = (REPO_ROOT / "README.md").read_text()
    commands, pending = [], ""
    for line in text.splitlines():
        if not line.startswith("    "):
            pending = ""
            continue
        pending += line.strip().rstrip("\\") + " "
        if line.rstrip().endswith("\\"):
            continue
        words, pending = shlex.split(pending, comments=True), ""
        if "-m" in words and words[words.index("-m") + 1].startswith("alignment.") and "..." not in words:
            module = words[words.index("-m") + 1]
            commands.append((module.removeprefix("alignment."), words[words.index("-m") + 2:]))
    return commands


def test_every_command_in_the_readme_parses(toy_data):
    """The README's command lines use flags that exist, with values the checks accept (the data folder swapped for a toy one)."""
    from alignment.args import parse_eval_args, parse_rl_args, parse_sft_args

    parsers = {"train_rl": parse_rl_args, "train_sft": parse_sft_args, "evaluate": parse_eval_args}
    commands = [(tool, flags) for tool, flags in readme_commands() if tool in parsers]
    assert {tool for tool, _ in commands} == set(parsers) and len(commands) >= 7
    for tool, flags in commands:
        if flags == ["--help"]:
            continue
        parsers[tool](flags + ["--data_dir", str(toy_data)])


def test_a_path_flag_given_as_tilde_names_the_home_folder(toy_data, tmp_path, monkeypatch):
    """`--checkpoint_path=~/ck` (or quoted): no shell expands it, and the writes made a folder named `~` in the working
    folder while the output checks looked at the home folder. Every path flag of the three tools is expanded."""
    from alignment.args import parse_eval_args, parse_rl_args, parse_sft_args

    monkeypatch.setenv("HOME", str(tmp_path))
    home = str(tmp_path)
    rl = parse_rl_args(["--sft_checkpoint_path=~/sft", "--checkpoint_path=~/ck/rl", "--state_dir=~/ck/rl.state", "--tmp_checkpoint_path=~/tmp",
                        "--log_dir=~/runs", "--model=~/tok", "--data_dir", str(toy_data)])
    assert [rl.sft_checkpoint_path, rl.checkpoint_path, rl.state_dir, rl.tmp_checkpoint_path, rl.log_dir, rl.model] == [
        f"{home}/sft", f"{home}/ck/rl", f"{home}/ck/rl.state", f"{home}/tmp", f"{home}/runs", f"{home}/tok"]
    sft = parse_sft_args(["--model=~/base", "--checkpoint_path=~/ck/sft", "--log_dir=~/runs", "--data_dir", str(toy_data)])
    assert [sft.model, sft.checkpoint_path, sft.log_dir] == [f"{home}/base", f"{home}/ck/sft", f"{home}/runs"]
    evaluation = parse_eval_args(["--model_path", "~/a", "Qwen/Qwen2.5-Math-1.5B", "--output_dir", "~/ev_a", "~/ev_b", "--data_dir", str(toy_data)])
    assert [evaluation.model_path, evaluation.output_dir] == [[f"{home}/a", "Qwen/Qwen2.5-Math-1.5B"], [f"{home}/ev_a", f"{home}/ev_b"]]
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))  # the data folder too, as the others
    (tmp_path / "elsewhere").mkdir()
    shutil.copytree(toy_data, tmp_path / "elsewhere" / "gsm8k")
    assert parse_eval_args(["--model_path", "m", "--data_dir=~/gsm8k"]).data_dir == str(tmp_path / "elsewhere" / "gsm8k")


def test_given_flags_are_the_ones_on_the_command_line_whatever_their_value(toy_data):
    """Eval-only checks only the training flags a command gives (check_checkpoint_flags): a flag
    given with its default value counts, a flag left out does not, an abbreviation is its flag."""
    from alignment.args import EVALUATION_SIDE_FLAGS, RUN_DEFINING_FLAGS, build_rl_parser, given_flags

    argv = ["--learning_rate", "3e-6", "--no-skip_zero_signal", "--seed", "42", "--group_si", "8"]
    assert given_flags(build_rl_parser(), argv) == ["group_size", "learning_rate", "seed", "skip_zero_signal"]
    assert given_flags(build_rl_parser(), []) == []
    assert parse_rl_args([*argv, "--data_dir", str(toy_data)]).given_flags == ["data_dir", "group_size", "learning_rate", "seed", "skip_zero_signal"]
    flags = set(vars(build_rl_parser().parse_args([])))
    assert set(EVALUATION_SIDE_FLAGS) <= flags  # a misspelt name would leave its flag checked
    assert not set(EVALUATION_SIDE_FLAGS) & set(RUN_DEFINING_FLAGS)
    for trains in ("learning_rate", "warmup_steps", "num_epochs", "max_steps", "skip_zero_signal", "kl_coef"):
        assert trains not in EVALUATION_SIDE_FLAGS


def test_the_evaluation_penalty_follows_the_rollouts_unless_eval_repetition_penalty_sets_its_own(toy_data, tmp_path, monkeypatch):
    """The seed has one --repetition_penalty for rollouts and evaluations; --eval_repetition_penalty sets the evaluations'
    alone (on the sampler, in a fresh engine's child command and in what metrics.json records), so runs that sample with
    other penalties are compared under one evaluation (bench_gsm8k.py's variants)."""
    from alignment.evaluate import evaluate_in_subprocess, evaluation_setup
    from alignment.rollout import SamplingSettings

    seed = parse_rl_args(["--data_dir", str(toy_data), "--repetition_penalty", "1.1"])
    assert SamplingSettings.from_args(seed, "eval_").repetition_penalty == SamplingSettings.from_args(seed, "sampling_").repetition_penalty == 1.1
    apart = parse_rl_args(["--data_dir", str(toy_data), "--repetition_penalty", "1.1", "--eval_repetition_penalty", "1.0"])
    assert SamplingSettings.from_args(apart, "sampling_").repetition_penalty == 1.1
    assert SamplingSettings.from_args(apart, "eval_").repetition_penalty == 1.0
    assert (evaluation_setup(seed, 8, "eval_")["repetition_penalty"], evaluation_setup(apart, 8, "eval_")["repetition_penalty"]) == (1.1, 1.0)
    commands = []

    def child(command, **kwargs):
        commands.append(command)
        raise RuntimeError("not run")

    monkeypatch.setattr(evaluate.subprocess, "run", child)
    for args in (seed, apart):
        with pytest.raises(RuntimeError, match="not run"):
            evaluate_in_subprocess(tmp_path / "rl_tmp", args, tmp_path / "eval", "cpu")
    assert [command[command.index("--repetition_penalty") + 1] for command in commands] == ["1.1", "1.0"]


def test_flags_for_a_setting_the_run_does_not_use_are_refused_or_noted(tmp_path, capsys):
    """Each was accepted without a word: a constant for another normalisation (the run is not Dr. GRPO), a TIS cap
    with nothing sampled ahead, a round limit without dynamic sampling, clip flags on a loss without a ratio, greedy
    rollouts (every group ties: nothing to learn), a warm-up longer than the run; and a clip range where the ratio is
    always 1, an epsilon with no division, devices that --layout auto overrode, a fresh vLLM evaluation under the HF
    backend, a sampler/policy gap measured on retokenised text, a pass@k temperature with no pass@k."""
    from alignment.errors import UserError
    from alignment.optim import build_scheduler

    data = write_synthetic_gsm8k(tmp_path / "data", num_train=8, num_test=4, seed=0)
    base = ["--data_dir", str(data)]
    for flags, message in (
        (["--length_normalization", "mean", "--length_normalization_constant", "5"], r"^--length_normalization_constant 5 divides the summed loss under --length_normalization constant only \(got mean\)"),
        (["--tis_cap", "0.5"], r"^--tis_cap 0.5 caps the importance weights of rollouts sampled ahead: it needs --rollout_staleness >= 1"),
        (["--max_sampling_rounds", "7"], r"^--max_sampling_rounds 7 bounds --dynamic_sampling's extra rounds: add --dynamic_sampling"),
        (["--sampling_temperature", "0"], r"^--sampling_temperature 0 samples one greedy response 8 times a prompt \(--group_size\): every group ties"),
    ):
        with pytest.raises(UserError, match=message):
            parse_rl_args(base + flags)
    parse_rl_args(base + ["--length_normalization", "constant", "--length_normalization_constant", "5", "--dynamic_sampling", "--max_sampling_rounds", "7"])
    capsys.readouterr()
    parse_rl_args(base + ["--loss_type", "reinforce_with_baseline", "--cliprange", "0.3", "--cliprange_high", "0.4"])
    assert "note: --cliprange and --cliprange_high act on the ratio losses (" in capsys.readouterr().out
    parse_rl_args(base + ["--cliprange", "0.3", "--train_batch_size", "128"])  # grpo_clip, two optimizer steps a batch: no note
    assert "note" not in capsys.readouterr().out
    # flags that cannot act with the others given: a note where a sweep's variant may keep them, else refused
    parse_rl_args(base + ["--cliprange", "0.3"])  # one optimizer step on each fresh batch: the ratio is 1
    assert capsys.readouterr().out.startswith("note: --cliprange cannot act here: with one optimizer step on each fresh batch (--train_batch_size = the 256 rollouts")
    for unclipped in (["--epochs_per_rollout_batch", "2"], ["--old_policy", "reference"], ["--rollout_staleness", "1"]):
        parse_rl_args(base + ["--cliprange", "0.3", *unclipped])
        assert "cannot act" not in capsys.readouterr().out, unclipped
    parse_rl_args(base + ["--advantage_eps", "0.5", "--no-use_std_normalization"])
    assert capsys.readouterr().out == "note: --advantage_eps 0.5 guards the division by the group's std: --no-use_std_normalization does not divide, so it has no effect\n"
    parse_rl_args(base + ["--advantage_eps", "0.5"])
    assert capsys.readouterr().out == ""
    for flags, message in (
        (["--layout", "auto", "--sample_device", "cuda:3"], r"^--layout auto places the roles on this machine's GPUs itself, over --sample_device: drop --layout auto"),
        (["--rollout_backend", "hf", "--eval_engine", "fresh"], r"^--eval_engine fresh starts a vLLM engine for each evaluation; --rollout_backend hf"),
        (["--rollout_tokens", "text", "--sampler_logprobs_every", "1"], r"^--sampler_logprobs_every 1 compares the sampler's log-probs of its token ids"),
        (["--eval_samples_temperature", "0.7"], r"^--eval_samples_temperature 0.7 is the temperature of --eval_samples' draws: add --eval_samples N"),
    ):
        with pytest.raises(UserError, match=message):
            parse_rl_args(base + flags)
    parse_rl_args(base + ["--layout", "auto", "--policy_devices", "cuda:0", "--rollout_tokens", "text", "--eval_samples", "4", "--eval_samples_temperature", "0.7"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    build_scheduler(optimizer, 1000, 2)
    assert capsys.readouterr().out == "note: --warmup_steps 1000 is longer than the run's 2 optimizer steps: the learning rate ends at 0.2% of its peak\n"
    build_scheduler(optimizer, 2, 2)
    assert capsys.readouterr().out == ""
