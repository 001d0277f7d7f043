"""GSM8K loading, the prompt contract and clear errors for bad files."""

import errno
import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from alignment.data import (
    check_held_out,
    R1_ZERO_PROMPT,
    Gsm8kDataset,
    build_sft_completion,
    extract_ground_truth,
    format_r1_zero_prompt,
    load_gsm8k,
    main as data_main,
)
from alignment.errors import UserError

EXPECTED_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. "
    "The reasoning process is enclosed within <think> </think> and answer is enclosed within <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>.\n"
    "User: {question}\n"
    "Assistant: <think>"
)


def test_prompt_file_is_byte_exact():
    from alignment.data import PROMPT_DIR

    raw = (PROMPT_DIR / "r1_zero.prompt").read_bytes()
    assert raw == EXPECTED_PROMPT.encode("utf-8")
    assert not raw.endswith(b"\n")
    assert hashlib.sha256(raw).hexdigest() == "56213732da87e12ace60a2b88a16df0af18280fb0563a957cbecc938a6a2ac0e"
    assert R1_ZERO_PROMPT == EXPECTED_PROMPT


def test_prompt_formatting_keeps_braces_in_questions():
    prompt = format_r1_zero_prompt("What is {x} if x = 2?")
    assert prompt.endswith("User: What is {x} if x = 2?\nAssistant: <think>")


@pytest.mark.parametrize(
    "answer, truth",
    [
        ("so 5 + 7 = 12\n#### 12", "12"),
        ("total 1,080 dollars\n#### 1,080", "1080"),
        ("he owes 5 dollars\n#### -5", "-5"),
        ("#### 1,234,567", "1234567"),
        ("x\n####  3.5 ", "3.5"),
    ],
)
def test_extract_ground_truth(answer, truth):
    assert extract_ground_truth(answer) == truth


def test_extract_ground_truth_requires_marker():
    with pytest.raises(ValueError, match="####"):
        extract_ground_truth("no final answer here")
    with pytest.raises(ValueError, match="empty"):
        extract_ground_truth("reasoning\n#### ")


def test_sft_completion_removes_calculator_annotations():
    answer = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
    assert build_sft_completion(answer) == " Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips. </think> <answer> 72 </answer>"


def test_every_gsm8k_row_parses(gsm8k_dir):
    train, test = load_gsm8k("train", gsm8k_dir), load_gsm8k("test", gsm8k_dir)
    assert (len(train), len(test)) == (7473, 1319)
    truths = [row["ground_truth"] for row in train + test]
    assert all(t.lstrip("-").isdigit() for t in truths)  # all GSM8K answers are integers
    with_commas = [row for row in train if "#### " in row["answer"] and "," in row["answer"].rsplit("####", 1)[1]]
    assert len(with_commas) == 79
    assert all("," not in row["ground_truth"] for row in with_commas)
    assert any(t.startswith("-") for t in truths)
    dataset = Gsm8kDataset("test", gsm8k_dir)
    prompt, completion, truth = dataset[0]
    assert prompt.startswith("A conversation between User and Assistant.") and prompt.endswith("Assistant: <think>")
    assert completion.endswith(f" </think> <answer> {truth} </answer>")
    assert "<<" not in completion


def _write(tmp_path, split, content: bytes):
    (tmp_path / f"{split}.jsonl").write_bytes(content)
    return tmp_path


GOOD = json.dumps({"question": "q?", "answer": "a\n#### 3"}).encode() + b"\n"


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", r"train.jsonl holds no rows"),
        (GOOD + b'{"question": "q?", "answ', r"train.jsonl:2: not a JSON object .*truncated"),
        (GOOD + b'{"question": "caf\xe9", "answer": "#### 1"}\n', r"train.jsonl:2: not valid UTF-8"),
        (GOOD + GOOD + json.dumps({"question": "q?"}).encode(), r"train.jsonl:3: missing string field 'answer'"),
        # a number where text belongs was reported as a missing field, sending the user to look for a key that is there
        (GOOD + json.dumps({"question": 12, "answer": "#### 1"}).encode() + b"\n", r"train.jsonl:2: 'question' is int, not a string; write it as a JSON string"),
        (GOOD + json.dumps({"question": "q?", "answer": None}).encode() + b"\n", r"train.jsonl:2: 'answer' is null, not a string"),
        (json.dumps({"question": "q?", "answer": "no marker"}).encode(), r"train.jsonl:1: answer has no '####'"),
        (b"[1, 2]\n", r"train.jsonl:1: expected a JSON object"),
        # a JSON escape of a lone surrogate parses, then broke TensorBoard's text after the whole run
        (GOOD + b'{"question": "q?", "answer": "\\udc80 #### 1"}\n', r"train.jsonl:2: 'answer' holds '\\udc80', a lone surrogate escape that is not text"),
        # a 2 MiB row: refused as it is read, before any tokeniser sees it (a 50 MB row took ~100 s and ~10 GB)
        (GOOD + json.dumps({"question": "q" * (2 << 20), "answer": "#### 1"}).encode() + b"\n", r"train.jsonl:2: the row is 2.0 MiB \(at most 1 MiB"),
        # accepted before: a prompt with no question in it, and the text after a `####` quoted in the reasoning (the final
        # `#### 7` cut off) as the ground truth, trained and graded as such
        (GOOD + json.dumps({"question": " ", "answer": "#### 1"}).encode() + b"\n", r"train.jsonl:2: 'question' is empty; fix or remove that row"),
        (GOOD + json.dumps({"question": "q?", "answer": "The sign reads #### 5 on the door.\nSo 3 + 4 = 7"}).encode() + b"\n",
         r"train.jsonl:2: the text after the last '####' runs over several lines"),
    ],
)
def test_malformed_files_name_file_and_line(tmp_path, content, message):
    _write(tmp_path, "train", content)
    with pytest.raises(UserError, match=message):
        load_gsm8k("train", tmp_path)


def test_a_byte_order_mark_and_json_past_pythons_limits_are_read_or_named(tmp_path):
    """A file saved by a Windows editor opens with a byte-order mark: its first row was called truncated, with advice to
    re-download. An integer of more than 4,300 digits, or nesting past the stack, were a traceback from json."""
    _write(tmp_path, "train", b"\xef\xbb\xbf" + GOOD + GOOD)
    assert [row["ground_truth"] for row in load_gsm8k("train", tmp_path)] == ["3", "3"]
    for content, message in ((GOOD + b'{"question": "q?", "answer": "#### 1", "id": ' + b"9" * 5000 + b"}\n", r"train.jsonl:2: not a JSON object \(Exceeds the limit"),
                             (GOOD + b"[" * 200_000 + b"]" * 200_000 + b"\n", r"train.jsonl:2: not a JSON object \(")):
        _write(tmp_path, "train", content)
        with pytest.raises(UserError, match=message):
            load_gsm8k("train", tmp_path)


def test_missing_file_tells_the_download_command(tmp_path):
    with pytest.raises(UserError, match=r"python -m alignment.data download --data_dir"):
        load_gsm8k("test", tmp_path / "nowhere")


def test_check_command_counts_rows_and_refuses_a_test_split_that_was_trained_on(tmp_path, capsys):
    _write(tmp_path, "train", GOOD * 3)
    _write(tmp_path, "test", json.dumps({"question": "held out?", "answer": "b\n#### 4"}).encode() + b"\n")
    data_main(["check", "--data_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "train.jsonl: 3 rows parse" in out and "test.jsonl: 1 rows parse" in out and "no test problem is a training problem" in out
    _write(tmp_path, "test", GOOD)  # a training row copied into the test split
    with pytest.raises(UserError, match=r"test.jsonl:1: 1 of the 1 evaluation problems are also training problems"):
        data_main(["check", "--data_dir", str(tmp_path)])


def test_a_data_file_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    """EIO (or a permission error for a user who is not root) while reading the rows or the fingerprint of a resumable run."""
    import errno
    import hashlib

    from alignment import data

    _write(tmp_path, "train", GOOD)

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(data, "open", failing, raising=False)
    with pytest.raises(UserError, match=r"train.jsonl cannot be read \(Input/output error\); check the disk"):
        load_gsm8k("train", tmp_path)
    monkeypatch.undo()
    monkeypatch.setattr(hashlib, "file_digest", failing)
    with pytest.raises(UserError, match=r"train.jsonl cannot be read \(Input/output error\)"):
        data.data_fingerprint(tmp_path)


def test_download_keeps_files_the_user_edited_unless_forced(tmp_path, monkeypatch, capsys):
    """A bad-row message says to fix the row; the README's set-up command (`download`) run again later replaced
    the edited train.jsonl without a word, and a training state's --resume then refused the changed file."""
    import datasets

    rows = {"train": [{"question": "1 + 1?", "answer": "2 #### 2"}, {"question": "2 + 3?", "answer": "5 #### 5"}],
            "test": [{"question": "4 - 1?", "answer": "3 #### 3"}]}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config: rows)
    data_main(["download", "--data_dir", str(tmp_path)])
    original = {split: (tmp_path / f"{split}.jsonl").read_bytes() for split in ("train", "test")}
    assert len(load_gsm8k("train", tmp_path)) == 2 and len(load_gsm8k("test", tmp_path)) == 1
    edited = original["train"].splitlines(keepends=True)[0]  # the user removed a row
    (tmp_path / "train.jsonl").write_bytes(edited)
    with pytest.raises(UserError, match=rf"^{re.escape(str(tmp_path / 'train.jsonl'))} already there with other rows than openai/gsm8k's .*"
                                        r"pass --force to replace them, or move them away \(nothing was changed\)$"):
        data_main(["download", "--data_dir", str(tmp_path)])
    assert (tmp_path / "train.jsonl").read_bytes() == edited and (tmp_path / "test.jsonl").read_bytes() == original["test"]
    capsys.readouterr()
    data_main(["download", "--data_dir", str(tmp_path), "--force"])
    assert {split: (tmp_path / f"{split}.jsonl").read_bytes() for split in ("train", "test")} == original
    assert "test.jsonl: already openai/gsm8k's 1 rows, left as it is" in capsys.readouterr().out


def test_download_to_an_unwritable_or_full_data_dir_is_one_line_and_leaves_no_cut_file(tmp_path, monkeypatch):
    """`download --data_dir` under a file, or on a full disk: a traceback, and the full disk left a cut train.jsonl.tmp."""
    import datasets

    rows = {"train": [{"question": "1 + 1?", "answer": "2 #### 2"}], "test": [{"question": "4 - 1?", "answer": "3 #### 3"}]}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config: rows)
    (tmp_path / "afile").write_text("not a folder")
    with pytest.raises(UserError, match=r"^--data_dir .*afile/gsm8k: cannot write .*afile/gsm8k \(Not a directory\); pass a writable --data_dir"):
        data_main(["download", "--data_dir", str(tmp_path / "afile" / "gsm8k")])
    real_write = Path.write_text

    def full_disk(self, text, *args, **kwargs):
        real_write(self, text[:10], *args, **kwargs)  # a part lands, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(UserError, match=r"^--data_dir .*: cannot write .*train.jsonl.tmp \(No space left on device\); pass a writable --data_dir "
                                        r"\(each file there is whole: the earlier one, or openai/gsm8k's\)$"):
        data_main(["download", "--data_dir", str(tmp_path / "full")])
    assert sorted(path.name for path in (tmp_path / "full").iterdir()) == []


def test_a_limited_dataset_is_the_files_first_rows_in_order_with_their_lines(tmp_path):
    """--num_examples N / --eval_num_examples N mean the split's first N problems: the same problems for every
    checkpoint and every run, each still naming its own file:line in error messages."""
    rows = [{"question": f"q{index}?", "answer": f"a\n#### {index}"} for index in range(1, 5)]
    _write(tmp_path, "test", "".join(json.dumps(row) + "\n" for row in rows).encode())
    dataset = Gsm8kDataset("test", tmp_path, limit=2)
    assert dataset.ground_truths == ["1", "2"]
    assert dataset.prompts == [format_r1_zero_prompt("q1?"), format_r1_zero_prompt("q2?")]
    assert dataset.sources == [f"{tmp_path / 'test.jsonl'}:1", f"{tmp_path / 'test.jsonl'}:2"]
    assert len(Gsm8kDataset("test", tmp_path, limit=0)) == 0
    assert Gsm8kDataset("test", tmp_path).ground_truths == ["1", "2", "3", "4"]


def test_a_blank_line_inside_the_file_is_skipped_and_the_rows_after_it_are_read(tmp_path):
    second = json.dumps({"question": "q?", "answer": "b\n#### 7"}).encode() + b"\n"
    _write(tmp_path, "train", GOOD + b"\n   \n" + second)
    rows = load_gsm8k("train", tmp_path)
    assert [(row["ground_truth"], row["where"]) for row in rows] == [("3", f"{tmp_path / 'train.jsonl'}:1"), ("7", f"{tmp_path / 'train.jsonl'}:4")]


def test_the_sft_target_answer_is_the_ground_truth_without_thousands_commas():
    """The tag SFT teaches must be the string the grader compares: `1,080` in the target, `1080` as ground truth."""
    assert build_sft_completion("It costs 1,080 dollars.\n#### 1,080") == " It costs 1,080 dollars. </think> <answer> 1080 </answer>"
    assert build_sft_completion("#### 12") == " </think> <answer> 12 </answer>"


def test_the_question_is_put_into_the_prompt_verbatim():
    question = "  Ann has 3 apples.\nHow many?  "
    assert format_r1_zero_prompt(question) == EXPECTED_PROMPT.replace("{question}", question)


def test_an_unknown_split_is_named_before_any_file_is_looked_for(tmp_path):
    _write(tmp_path, "validation", GOOD)
    for split in ("validation", "dev"):
        with pytest.raises(UserError, match=rf"^unknown split '{split}': use one of train, test$"):
            load_gsm8k(split, tmp_path)


class _BytesTokenizer:
    """One token per UTF-8 byte: the most a byte-level BPE tokenizer gives (check_prompt_lengths' bound)."""

    def __call__(self, text):
        return {"input_ids": list(text.encode("utf-8"))}


def test_a_prompt_is_checked_against_the_context_less_the_new_tokens_in_bytes(tmp_path):
    """A prompt fits when its tokens plus max_new_tokens fit the context; a question of accented letters holds
    two bytes (so up to two tokens) per character."""
    template_bytes = len(EXPECTED_PROMPT.encode()) - len("{question}")
    rows = [{"question": "a" * (950 - template_bytes), "answer": "#### 1"},      # 950 tokens: fits 1000, not 1000 - 100
            {"question": "\u00e9" * 250, "answer": "#### 2"},                     # 250 characters, 500 bytes
            {"question": "a" * (900 - template_bytes), "answer": "#### 3"}]      # exactly 900 tokens: fits
    _write(tmp_path, "test", "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode())
    dataset = Gsm8kDataset("test", tmp_path)
    with pytest.raises(UserError, match=r"test.jsonl:1: the prompt is 950 tokens; with --max_tokens 100 it does not fit the model's 1000-token context"):
        dataset.check_prompt_lengths(_BytesTokenizer(), 1000, 100, "--max_tokens")
    accented = Gsm8kDataset("test", tmp_path, limit=2)
    accented.prompts, accented.sources = accented.prompts[1:], accented.sources[1:]
    tokens = template_bytes + 500
    with pytest.raises(UserError, match=rf"test.jsonl:2: the prompt is {tokens} tokens; with --max_tokens 100 it does not fit the model's {tokens + 50}-token context"):
        accented.check_prompt_lengths(_BytesTokenizer(), tokens + 50, 100, "--max_tokens")
    last = Gsm8kDataset("test", tmp_path)  # the last row alone: exactly at the limit
    last.prompts, last.sources = last.prompts[2:], last.sources[2:]
    last.check_prompt_lengths(_BytesTokenizer(), 1000, 100, "--max_tokens")


def test_download_writes_the_rows_as_utf8_text(tmp_path, monkeypatch):
    """Questions with non-ASCII characters (651 train rows: €, é, ÷) are written as themselves, as openai/gsm8k's own
    jsonl holds them, not as \\u escapes."""
    import datasets

    rows = {"train": [{"question": "Caf\u00e9 sells 2 tea for \u20ac3?", "answer": "3 \u00f7 1 #### 3"}], "test": [{"question": "4 - 1?", "answer": "3 #### 3"}]}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config: rows)
    data_main(["download", "--data_dir", str(tmp_path)])
    assert (tmp_path / "train.jsonl").read_bytes() == '{"question": "Caf\u00e9 sells 2 tea for \u20ac3?", "answer": "3 \u00f7 1 #### 3"}\n'.encode("utf-8")
    assert load_gsm8k("train", tmp_path)[0]["question"] == "Caf\u00e9 sells 2 tea for \u20ac3?"


def test_the_final_answer_is_after_the_last_marker():
    """An answer that quotes `####` in its reasoning still ends in `#### <final answer>` (the SFT target cuts there too)."""
    answer = "The sign reads #### 5 on the door.\nSo 3 + 4 = 7\n#### 7"
    assert extract_ground_truth(answer) == "7"
    assert build_sft_completion(answer) == " The sign reads #### 5 on the door.\nSo 3 + 4 = 7 </think> <answer> 7 </answer>"


def test_check_refuses_force_and_download_reads_a_tilde_data_dir_as_the_home_folder(tmp_path, monkeypatch, capsys):
    """`check --force` was accepted and did nothing; `download --data_dir=~/gsm8k` (no shell expands it) wrote into a
    folder named `~` in the working folder, where train_rl (which expands it) never looked."""
    import datasets

    _write(tmp_path, "train", GOOD)
    _write(tmp_path, "test", GOOD)
    with pytest.raises(SystemExit) as stopped:
        data_main(["check", "--data_dir", str(tmp_path), "--force"])
    assert stopped.value.code == 2 and "--force applies to download only" in capsys.readouterr().err
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    rows = {"train": [{"question": "1 + 1?", "answer": "2 #### 2"}], "test": [{"question": "4 - 1?", "answer": "3 #### 3"}]}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config: rows)
    data_main(["download", "--data_dir=~/gsm8k"])
    assert sorted(path.name for path in (home / "gsm8k").iterdir()) == ["test.jsonl", "train.jsonl"] and not list(work.iterdir())


def test_download_over_a_file_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    """The file already there is compared with the download's rows before anything is replaced: EIO there was a traceback."""
    import datasets

    rows = {"train": [{"question": "1 + 1?", "answer": "2 #### 2"}], "test": [{"question": "4 - 1?", "answer": "3 #### 3"}]}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config: rows)
    _write(tmp_path, "train", GOOD)

    def failing(self):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(Path, "read_bytes", failing)
    with pytest.raises(UserError, match=r"train.jsonl cannot be read \(Input/output error\); check the disk"):
        data_main(["download", "--data_dir", str(tmp_path)])
    monkeypatch.undo()
    assert (tmp_path / "train.jsonl").read_bytes() == GOOD and not (tmp_path / "test.jsonl").exists()


def test_a_test_split_that_shares_problems_with_the_train_split_is_refused_before_training(tmp_path, monkeypatch, tiny_checkpoint):
    """test.jsonl copied from train.jsonl (or sharing rows with it) passed every check: the run trained on the problems it
    was then graded on. check_held_out names the first shared row and the count; train_sft stops before loading a model."""
    rows = [{"question": f"q{index}?", "answer": f"a\n#### {index}"} for index in range(1, 6)]
    lines = [json.dumps(row) + "\n" for row in rows]
    _write(tmp_path, "train", "".join(lines[:4]).encode())
    _write(tmp_path, "test", "".join([lines[4]] + lines[2:4]).encode())  # q5 held out; q3, q4 also trained on
    train, test = Gsm8kDataset("train", tmp_path), Gsm8kDataset("test", tmp_path)
    with pytest.raises(UserError, match=rf"^{re.escape(str(tmp_path / 'test.jsonl'))}:2: 2 of the 3 evaluation problems are also training problems "
                                        rf"\({re.escape(str(tmp_path / 'train.jsonl'))}\), so the run would be graded on what it trained on"):
        check_held_out(train, test)
    check_held_out(Gsm8kDataset("train", tmp_path, limit=2), test)  # only the problems a run trains on count (--num_train_examples 2)
    check_held_out(train, Gsm8kDataset("test", tmp_path, limit=1))

    from types import SimpleNamespace

    from alignment import train_rl, train_sft

    monkeypatch.setattr(train_sft, "load_tokenizer", lambda *a, **k: pytest.fail("a model was loaded before the data check"))
    with pytest.raises(UserError, match=r"test.jsonl:2: 2 of the 3 evaluation problems are also training problems"):
        train_sft.main(["--model", str(tiny_checkpoint), "--data_dir", str(tmp_path), "--checkpoint_path", str(tmp_path / "sft"),
                        "--log_dir", str(tmp_path / "runs"), "--eval_num_examples", "0", "--device", "cpu"])
    assert not (tmp_path / "sft").exists()
    rl_args = SimpleNamespace(data_dir=tmp_path, num_train_examples=None, eval_split="test", eval_num_examples=None)
    with pytest.raises(UserError, match=r"test.jsonl:2: 2 of the 3 evaluation problems are also training problems"):
        train_rl.load_prompts(rl_args, tokenizer=None, base_model_checkpoint_path=None)
