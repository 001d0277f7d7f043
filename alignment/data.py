"""GSM8K data and the r1_zero prompt contract, shared by SFT, RL and evaluation.

    python -m alignment.data download [--data_dir data/gsm8k]   # fetch openai/gsm8k once
    python -m alignment.data check    [--data_dir data/gsm8k]   # parse every row

Each row of `train.jsonl` / `test.jsonl` has `question` and `answer`; the answer is
worked reasoning with calculator annotations (`<<48/2=24>>`) and ends in
`#### <final answer>`. From a row we build:

- prompt: `alignment/prompts/r1_zero.prompt` with `{question}` filled in; it ends in
  `Assistant: <think>`, so the model continues inside the think block;
- SFT completion: ` <reasoning> </think> <answer> <final> </answer>`, annotations
  removed (a leading space so the text reads `<think> reasoning </think>`);
- ground truth: the final answer with thousands commas removed (`1,080` -> `1080`).
"""

import argparse
import contextlib
import json
import os
import re
from pathlib import Path

from torch.utils.data import Dataset

from alignment.errors import UserError, run_cli

PROMPT_DIR = Path(__file__).parent / "prompts"
DEFAULT_DATA_DIR = "data/gsm8k"
SPLITS = ("train", "test")
ANSWER_MARKER = "#### "
_CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")


def load_prompt_template(name: str = "r1_zero") -> str:
    """The prompt file's exact text (no trailing newline), with a `{question}` slot."""
    return (PROMPT_DIR / f"{name}.prompt").read_text(encoding="utf-8")


R1_ZERO_PROMPT = load_prompt_template("r1_zero")


def format_r1_zero_prompt(question: str) -> str:
    # str.replace, not str.format: questions may contain braces.
    return R1_ZERO_PROMPT.replace("{question}", question)


def extract_ground_truth(answer: str) -> str:
    """`'... #### 1,080'` -> `'1080'`. Raises ValueError when there is no `####`."""
    if ANSWER_MARKER.strip() not in answer:
        raise ValueError("answer has no '####' final-answer marker")
    final = answer.rsplit("####", 1)[1].strip()
    if not final:
        raise ValueError("answer has an empty final answer after '####'")
    if "\n" in final:  # the last `#### 7` cut off, a `####` quoted in the reasoning left: the rest became the ground truth
        raise ValueError("the text after the last '####' runs over several lines, where GSM8K's final answer is one line; "
                         "fix or remove that row")
    return final.replace(",", "")


def build_sft_completion(answer: str) -> str:
    """The target text SFT trains on: reasoning, then the tags the grader checks."""
    reasoning = answer.rsplit("####", 1)[0]
    reasoning = _CALCULATOR_ANNOTATION.sub("", reasoning).strip()
    thoughts = f" {reasoning}" if reasoning else ""
    return f"{thoughts} </think> <answer> {extract_ground_truth(answer)} </answer>"


def split_path(data_dir: str | os.PathLike, split: str) -> Path:
    return Path(data_dir) / f"{split}.jsonl"


def load_gsm8k(split: str, data_dir: str | os.PathLike = DEFAULT_DATA_DIR) -> list[dict]:
    """Read and validate one split; every problem names the file and line.

    Returns rows `{"question", "answer", "ground_truth", "where"}` (where = "file:line").
    """
    if split not in SPLITS:
        raise UserError(f"unknown split '{split}': use one of {', '.join(SPLITS)}")
    path = split_path(data_dir, split)
    if not path.is_file():
        raise UserError(
            f"{path} not found: run `python -m alignment.data download --data_dir {data_dir}` "
            "(or copy GSM8K's train.jsonl/test.jsonl there, or pass --data_dir)"
        )
    try:
        return _read_rows(path)
    except OSError as error:  # EIO, a permission error: the disk or the file, not the data
        raise _unreadable(path, error) from None


def _unreadable(path, error: OSError) -> UserError:
    return UserError(f"{path} cannot be read ({error.strerror or error}); check the disk and the file's permissions")


MAX_ROW_BYTES = 1 << 20  # GSM8K's rows are under 2 KB; a row of a megabyte fits no model's context


def _read_rows(path: Path) -> list[dict]:
    rows = []
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            where = f"{path}:{line_number}"
            if len(raw) > MAX_ROW_BYTES:
                raise UserError(f"{where}: the row is {len(raw) / 2**20:.1f} MiB (at most {MAX_ROW_BYTES // 2**20} MiB: GSM8K's are under 2 KB, and no "
                                "model's context holds such a prompt); shorten or remove that row")
            try:
                text = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")  # a byte-order mark (Windows editors) opens the file
            except UnicodeDecodeError as error:
                raise UserError(f"{where}: not valid UTF-8 ({error.reason} at byte {error.start}); re-download the file") from None
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except (ValueError, RecursionError) as error:  # beside bad JSON: an integer past Python's digit limit, nesting past its stack
                reason = error.msg if isinstance(error, json.JSONDecodeError) else str(error).splitlines()[0]
                raise UserError(f"{where}: not a JSON object ({reason}); the file may be truncated, re-download it") from None
            if not isinstance(row, dict):
                raise UserError(f"{where}: expected a JSON object with 'question' and 'answer'")
            for key in ("question", "answer"):
                if key not in row:
                    raise UserError(f"{where}: missing string field '{key}'")
                if not isinstance(row[key], str):  # a bare number or a list: the prompt and the grader read text
                    raise UserError(f"{where}: '{key}' is {type(row[key]).__name__ if row[key] is not None else 'null'}, "
                                    f"not a string; write it as a JSON string, or remove that row")
                if not row[key].strip():  # a prompt with no question in it would be trained and graded as one
                    raise UserError(f"{where}: '{key}' is empty; fix or remove that row")
                try:
                    row[key].encode("utf-8")
                except UnicodeEncodeError as error:  # a JSON escape such as "\udc80": a lone surrogate is no character
                    raise UserError(f"{where}: '{key}' holds {row[key][error.start:error.end]!r}, a lone surrogate escape that is not text; "
                                    "fix or remove that row") from None
            try:
                ground_truth = extract_ground_truth(row["answer"])
            except ValueError as error:
                raise UserError(f"{where}: {error}") from None
            rows.append({"question": row["question"], "answer": row["answer"], "ground_truth": ground_truth, "where": where})
    if not rows:
        raise UserError(f"{path} holds no rows: re-download it with `python -m alignment.data download --force`")
    return rows


def data_fingerprint(data_dir, split: str = "train") -> str:
    """SHA-256 of a split's file (a training state records it: a changed file would shift the data order on --resume)."""
    from alignment.checkpoint import file_sha256

    path = split_path(data_dir, split)
    try:
        return file_sha256(path)
    except OSError as error:
        raise _unreadable(path, error) from None


class Gsm8kDataset(Dataset):
    """Yields `(prompt, sft_completion, ground_truth)` for one split.

    The default DataLoader collation turns a batch into three lists of strings,
    which is what `train_sft` and `train_rl` unpack.
    """

    def __init__(self, split: str = "train", data_dir: str | os.PathLike = DEFAULT_DATA_DIR, limit: int | None = None):
        rows = load_gsm8k(split, data_dir)
        if limit is not None:
            rows = rows[:limit]
        self.prompts = [format_r1_zero_prompt(row["question"]) for row in rows]
        self.completions = [build_sft_completion(row["answer"]) for row in rows]
        self.ground_truths = [row["ground_truth"] for row in rows]
        self.sources = [row["where"] for row in rows]  # file:line of each problem, for error messages

    def check_prompt_lengths(self, tokenizer, context: int | None, max_new_tokens: int, flag: str) -> None:
        """Every prompt plus `max_new_tokens` must fit the model's context: one line naming the row if not.

        Tokenizers give at most one token per UTF-8 byte (plus a few special ones), so only prompts
        near the limit in bytes are tokenised (none, for real GSM8K).
        """
        if not context:
            return
        room = context - max_new_tokens
        for prompt, where in zip(self.prompts, self.sources):
            if len(prompt.encode()) + 8 > room and (tokens := len(tokenizer(prompt)["input_ids"])) > room:
                raise UserError(f"{where}: the prompt is {tokens} tokens; with {flag} {max_new_tokens} it does not fit the model's {context}-token context; shorten or remove that row, or lower {flag}")

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> tuple[str, str, str]:
        return self.prompts[index], self.completions[index], self.ground_truths[index]


def check_held_out(train: Gsm8kDataset, held_out: Gsm8kDataset) -> None:
    """No problem of the held-out split may be one the run trains on: a test.jsonl copied from train.jsonl (or sharing
    rows with it) was trained on and then graded as held out, and the accuracy read as generalisation."""
    trained = set(train.prompts)
    shared = [where for prompt, where in zip(held_out.prompts, held_out.sources) if prompt in trained]
    if shared:
        raise UserError(f"{shared[0]}: {len(shared)} of the {len(held_out)} evaluation problems are also training problems "
                        f"({train.sources[0].rpartition(':')[0]}), so the run would be graded on what it trained on; remove them from one "
                        "of the two files (nothing was changed)")


def download_gsm8k(data_dir: str | os.PathLike = DEFAULT_DATA_DIR, force: bool = False) -> None:
    """Fetch `openai/gsm8k` (config `main`) with `datasets` and write the jsonl files.

    A file already there with other content (rows the user edited after a bad-row message,
    another copy, the file a run's --resume checks by its SHA-256) is replaced only with
    `force`; one with the same content is left as it is."""
    try:
        from datasets import load_dataset

        dataset = load_dataset("openai/gsm8k", "main")
    except Exception as error:  # network, auth or hub errors: one line, not a traceback
        raise UserError(
            f"could not download openai/gsm8k ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            f"without internet, copy train.jsonl and test.jsonl into {data_dir}"
        ) from None
    texts = {split: "".join(json.dumps({"question": row["question"], "answer": row["answer"]}, ensure_ascii=False) + "\n" for row in dataset[split])
             for split in SPLITS}
    paths = {split: split_path(data_dir, split) for split in SPLITS}
    differing = []
    for split, path in paths.items():
        try:
            if path.is_file() and path.read_bytes() != texts[split].encode("utf-8"):
                differing.append(path)
        except OSError as error:  # EIO, a permission error: nothing is replaced that could not be compared
            raise _unreadable(path, error) from None
    if differing and not force:
        raise UserError(f"{' and '.join(str(path) for path in differing)} already there with other rows than openai/gsm8k's (edited, or another copy; "
                        f"a training state's --resume checks train.jsonl); pass --force to replace them, or move them away (nothing was changed)")
    try:
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        for split, path in paths.items():
            if path.is_file() and path not in differing:
                print(f"{path}: already openai/gsm8k's {len(dataset[split])} rows, left as it is")
                continue
            temp = path.with_suffix(".jsonl.tmp")
            try:
                temp.write_text(texts[split], encoding="utf-8")
                os.replace(temp, path)
            finally:
                with contextlib.suppress(OSError):
                    temp.unlink(missing_ok=True)  # a full disk's cut copy is not left beside the file
            print(f"wrote {len(dataset[split])} rows to {path}")
    except OSError as error:  # a read-only or full disk, a file where the folder should be
        raise UserError(f"--data_dir {data_dir}: cannot write {error.filename or data_dir} ({error.strerror or error}); pass a writable --data_dir "
                        f"(each file there is whole: the earlier one, or openai/gsm8k's)") from None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m alignment.data", description="Fetch or check the GSM8K jsonl files.")
    parser.add_argument("command", choices=["download", "check"], help="download: fetch openai/gsm8k; check: parse every row")
    parser.add_argument("--data_dir", default=DEFAULT_DATA_DIR, help="folder for train.jsonl and test.jsonl")
    parser.add_argument("--force", action="store_true", help="download: replace files there that hold other rows (kept otherwise)")
    args = parser.parse_args(argv)
    if args.force and args.command != "download":
        parser.error("--force applies to download only (check reads the files and changes nothing)")
    args.data_dir = os.path.expanduser(args.data_dir)  # `--data_dir=~/gsm8k` (no shell expands it) names the home folder, as train_rl reads it
    if args.command == "download":
        download_gsm8k(args.data_dir, args.force)
    for split in SPLITS:
        print(f"{split_path(args.data_dir, split)}: {len(load_gsm8k(split, args.data_dir))} rows parse")
    check_held_out(Gsm8kDataset("train", args.data_dir), Gsm8kDataset("test", args.data_dir))  # what train_sft and train_rl refuse
    print("no test problem is a training problem")


if __name__ == "__main__":
    run_cli(main)
