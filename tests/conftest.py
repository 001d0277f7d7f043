"""Shared fixtures: the GSM8K folder (skip when absent) and a tiny Qwen2 checkpoint."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def find_gsm8k_dir() -> Path | None:
    """GSM8K_DIR if set, else data/gsm8k in the repo; None when the files are absent."""
    candidate = Path(os.environ.get("GSM8K_DIR", REPO_ROOT / "data" / "gsm8k"))
    if (candidate / "train.jsonl").is_file() and (candidate / "test.jsonl").is_file():
        return candidate
    return None


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    found = find_gsm8k_dir()
    if found is None:
        pytest.skip("GSM8K not found: run `python -m alignment.data download` or set GSM8K_DIR (CI copies it to data/gsm8k)")
    return found


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A random 2-layer Qwen2 (hidden 128) with a 512-token byte-level BPE tokenizer."""
    from alignment.toy.tiny_model import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer(tiny_checkpoint):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(tiny_checkpoint)


def make_tiny_task(root: Path, num_train: int, num_test: int, seed: int) -> SimpleNamespace:
    """The synthetic task in GSM8K format plus a tiny Qwen2 whose tokenizer was trained on it.

    Returns root, data (the jsonl folder) and sft (the model, used as the SFT checkpoint).
    """
    from alignment.toy.synthetic_task import tokenizer_corpus, write_synthetic_gsm8k
    from alignment.toy.tiny_model import build_tiny_checkpoint

    data = write_synthetic_gsm8k(root / "data", num_train=num_train, num_test=num_test, seed=seed)
    sft = build_tiny_checkpoint(root / "sft", texts=tokenizer_corpus(data), vocab_size=400)
    return SimpleNamespace(root=root, data=data, sft=sft)


def kill_train_rl_after_saved_state(flags: list[str], step: int, timeout: float = 300.0) -> None:
    """Run `python -m alignment.train_rl <flags>` and SIGKILL it as soon as it reports the
    training state of `step` saved (a crash with no chance to clean up)."""
    import signal
    import subprocess
    import sys
    import time

    process = subprocess.Popen([sys.executable, "-m", "alignment.train_rl", *flags], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    deadline = time.time() + timeout
    for line in process.stdout:
        if line.startswith(f"saved training state at step {step}"):
            process.send_signal(signal.SIGKILL)
            break
        assert time.time() < deadline
    process.wait()
