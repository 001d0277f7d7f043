"""Shared pieces of the GPU benchmarks: the model, the batch, timing, FLOPs, output.

Every benchmark builds a random-init model with the exact Qwen2.5-Math-1.5B shape
(no download) or, with --tiny, a 2-layer stand-in so the same code runs on a CPU
in seconds (what CI runs). Tokenizer: a byte-level BPE trained on GSM8K text, so
r1_zero prompts come out near Qwen's ~150 tokens.
"""

import importlib.util
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

if importlib.util.find_spec("alignment") is None:  # the benchmarks import the package installed from this checkout
    raise SystemExit("bench: the alignment package is not importable by this Python: run `pip install --no-deps -e .` in the "
                     "checkout, or set PYTHONPATH to the checkout")

import torch  # noqa: E402
from transformers import Qwen2Config  # noqa: E402

from alignment.toy.tiny_model import tiny_qwen2_config, train_byte_level_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


def qwen2_5_math_1_5b_config() -> Qwen2Config:
    """The shape of Qwen2.5-Math-1.5B, for random-init GPU benchmarks (no download)."""
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=151643,
        eos_token_id=151643,
        pad_token_id=151643,
    )


def gsm8k_questions(data_dir=None, limit=2000) -> list[str]:
    """GSM8K test questions when the data is there, else synthetic word problems."""
    from alignment.data import load_gsm8k

    for folder in filter(None, [data_dir, REPO_ROOT / "data" / "gsm8k"]):
        if (Path(folder) / "test.jsonl").is_file():
            return [row["question"] for row in load_gsm8k("test", folder)][:limit]
    from alignment.toy.synthetic_task import make_problem
    import random

    rng = random.Random(0)
    return [make_problem(rng)["question"] for _ in range(limit)]


def build_checkpoint(path, tiny: bool, data_dir=None, seed: int = 0) -> Path:
    """A random-init model + BPE tokenizer saved as an HF folder (cached by path)."""
    from transformers import AutoModelForCausalLM

    from alignment.data import format_r1_zero_prompt

    path = Path(path).resolve() if Path(path).is_symlink() else Path(path)  # the folder a link names: a rename onto a link fails
    if (path / "config.json").is_file():
        return path
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise SystemExit(f"{path} is not a model folder (no config.json) and not empty: the random-init model is built in a new or "
                         "empty folder; pass another path, or move that one away")
    questions = gsm8k_questions(data_dir)
    texts = [format_r1_zero_prompt(q) for q in questions]
    tokenizer = train_byte_level_tokenizer(texts, vocab_size=512 if tiny else 8192)
    if not tiny:
        # The 1.5B model has 151,936 embedding rows. Fill the tokenizer up to that with
        # placeholder tokens, so (almost) every id a random model samples decodes to
        # text that re-tokenises to the same id: responses keep their length through
        # the seed's text round trip, as they would with Qwen's own tokenizer.
        from tokenizers import AddedToken

        missing = qwen2_5_math_1_5b_config().vocab_size - len(tokenizer)
        tokenizer.backend_tokenizer.add_tokens([AddedToken(f"<|x{i}|>", normalized=False, special=False) for i in range(missing)])
    if tiny:
        config = tiny_qwen2_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, max_position_embeddings=2048)
        dtype = torch.float32
    else:
        config = qwen2_5_math_1_5b_config()
        config.eos_token_id = config.bos_token_id = config.pad_token_id = tokenizer.eos_token_id
        dtype = torch.bfloat16
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # built beside `path` and renamed into place: a build cut short never counts as the cache
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        partial.chmod(0o777 & ~umask)  # mkdtemp's 0700 would stay with the model folder: the mode a mkdir would give
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / "generation_config.json").write_text(json.dumps({"eos_token_id": tokenizer.eos_token_id}))
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        try:
            partial.rename(path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
            # another benchmark built the same seeded model at the same time: its copy is the cache
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone after the rename; a build cut short leaves nothing
    return path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(function, device: str, repeats: int = 3, warmup: int = 1) -> tuple[float, list[float]]:
    """Median seconds of `function()` over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        function()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times), times


def matmul_ceiling_tflops(device: str, size: int = 8192) -> float:
    """Measured bf16 matmul rate on this GPU: the MFU denominator."""
    if not device.startswith("cuda"):
        return float("nan")
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    seconds, _ = timed(lambda: a @ b, device, repeats=10, warmup=3)
    return 2 * size**3 / seconds / 1e12


def response_lengths(count: int, seed: int, low: int = 50, high: int = 1024, mean: float = 300.0) -> list[int]:
    """GRPO-like response lengths: low + exponential tail, clipped to high (mean ~300)."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.empty(count).exponential_(1.0 / (mean - low), generator=generator)
    return [int(min(high, low + d)) for d in draws.tolist()]


def synthetic_grpo_batch(tokenizer, count: int, seed: int, tiny: bool, data_dir=None, response_length: int | None = None) -> dict:
    """A batch shaped like train_rl's: prompts from GSM8K, random response tokens
    (`response_length` tokens each, as W1's min = max sampling gives, else a spread of lengths)."""
    from alignment.data import format_r1_zero_prompt
    from alignment.policy_update import sequence_lengths

    questions = gsm8k_questions(data_dir)
    prompts = [tokenizer(format_r1_zero_prompt(questions[i % len(questions)]))["input_ids"] for i in range(count)]
    lengths = [response_length] * count if response_length else response_lengths(count, seed, high=64 if tiny else 1024, low=8 if tiny else 50, mean=24 if tiny else 300)
    generator = torch.Generator().manual_seed(seed)
    total = max(len(p) + n for p, n in zip(prompts, lengths))
    full = torch.full((count, total), tokenizer.eos_token_id, dtype=torch.long)
    mask = torch.zeros((count, total), dtype=torch.bool)
    for row, (prompt, n) in enumerate(zip(prompts, lengths)):
        full[row, : len(prompt)] = torch.tensor(prompt)
        full[row, len(prompt) : len(prompt) + n] = torch.randint(0, len(tokenizer) - 1, (n,), generator=generator)
        mask[row, len(prompt) : len(prompt) + n] = True
    batch = {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": mask[:, 1:]}
    batch["lengths"] = sequence_lengths(batch["response_mask"])
    batch["advantages"] = torch.randn(count, generator=generator)
    batch["raw_rewards"] = (batch["advantages"] > 0).float()
    batch["prompt_lengths"] = [len(p) for p in prompts]
    return batch


def write_result(out, name: str, rows: list[dict]) -> None:
    """Print the newest row as a table line and save all rows as JSON (after every row,
    so a run cut short still leaves what it measured)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(" | ".join(f"{k}={_fmt(v)}" for k, v in rows[-1].items() if k != "times"), flush=True)


def _fmt(value):
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)
