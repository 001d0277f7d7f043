"""A small arithmetic word-problem task in exactly the GSM8K jsonl format.

Used by the CPU demo and the tests: rows `{"question", "answer"}` whose answer is
worked reasoning with GSM8K's calculator annotations and a final `#### N`, so the
same loader, prompt, SFT completion and grader apply unchanged. A problem is a
start value and one change per weekday (gets N more / gives away N), never below
zero; train and test are disjoint (no question appears in both).

Each worked step restates its clause before the arithmetic:

    Q: Mia has 2 stamps. On Monday Mia gets 5 more. On Tuesday Mia gives away 3. ...
    A: On Monday Mia gets 5 more: 2 + 5 = 7. On Tuesday Mia gives away 3: 7 - 3 = 4.

so every operand is copied from right after the same words in the question (the
weekday names each clause once), the kind of copy a tiny transformer learns
first. With bare steps ("2 + 5 = 7. 7 - 3 = 4.") and a learning rate of 3e-3, the
demo's 4-layer model mostly fetched the wrong second operand.
"""

import json
import random
from pathlib import Path

NAMES = ["Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena", "Mia", "Noah", "Omar", "Pia"]
ITEMS = ["apples", "books", "coins", "eggs", "pens", "shells", "stamps", "cards", "marbles", "cookies"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]


def make_problem(rng: random.Random, max_value: int = 20, steps: tuple[int, ...] = (1, 2)) -> dict:
    """One problem: a start value, then `rng.choice(steps)` changes (+/-), never below zero."""
    if max(steps) > len(DAYS):
        raise ValueError(f"at most {len(DAYS)} steps (one per weekday), got {max(steps)}")
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(2, max_value)
    sentences, reasoning = [f"{name} has {value} {item}."], []
    for day in DAYS[: rng.choice(steps)]:
        if rng.random() < 0.5 or value < 2:
            change = rng.randint(1, max_value)
            clause, result, sign = f"On {day} {name} gets {change} more", value + change, "+"
        else:
            change = rng.randint(1, value - 1)
            clause, result, sign = f"On {day} {name} gives away {change}", value - change, "-"
        sentences.append(f"{clause}.")
        reasoning.append(f"{clause}: {value} {sign} {change} = <<{value}{sign}{change}={result}>>{result}")
        value = result
    question = " ".join(sentences) + f" How many {item} does {name} have now?"
    # steps joined by ". " rather than newlines: every number then follows a space and
    # is the same tokens wherever it appears, which a tiny model copies easily (a Qwen2
    # checkpoint's tokenizer loads with Qwen2's pre-tokenizer: a space token, then a digit each)
    answer = ". ".join(reasoning) + f".\n#### {value}"
    return {"question": question, "answer": answer}


def write_synthetic_gsm8k(data_dir, num_train: int = 2000, num_test: int = 200, seed: int = 0, max_value: int = 20, steps: tuple[int, ...] = (1, 2), bare_answer_fraction: float = 0.0) -> Path:
    """Write train.jsonl and test.jsonl with disjoint questions; returns the folder.

    `bare_answer_fraction` of the *train* rows keep only `#### N`, no worked steps,
    like a teacher who sometimes states just the result: SFT then learns to answer
    both with and without reasoning, and RL can discover which pays. Test rows
    always keep their worked steps (evaluation reads only the final answer).
    """
    rng = random.Random(seed)
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    seen, rows = set(), []
    attempts = 0
    while len(rows) < num_train + num_test:
        attempts += 1
        if attempts > 100 * (num_train + num_test):
            raise ValueError(f"cannot draw {num_train + num_test} distinct problems with max_value {max_value}")
        problem = make_problem(rng, max_value, steps)
        if problem["question"] not in seen:
            seen.add(problem["question"])
            rows.append(problem)
    for row in rows[:num_train]:
        if rng.random() < bare_answer_fraction:
            row["answer"] = "#### " + row["answer"].rsplit("#### ", 1)[1]
    for split, part in (("train", rows[:num_train]), ("test", rows[num_train:])):
        with open(data_dir / f"{split}.jsonl", "w", encoding="utf-8") as handle:
            for row in part:
                handle.write(json.dumps(row) + "\n")
    return data_dir


def tokenizer_corpus(data_dir) -> list[str]:
    """Texts to train the demo tokenizer on: prompts and SFT completions of train."""
    from alignment.data import Gsm8kDataset

    dataset = Gsm8kDataset("train", data_dir)
    return [prompt + completion for prompt, completion, _ in dataset]
