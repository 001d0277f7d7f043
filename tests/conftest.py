"""Shared fixtures: the GSM8K folder (skip when absent) and a tiny Qwen2 checkpoint."""

import gc
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMED_TESTS_FILE = "test_grader.py"  # every test marked timed, run alone by `make test`


def find_gsm8k_dir() -> Path | None:
    """GSM8K_DIR if set, else data/gsm8k in the repo; None when the files are absent."""
    candidate = Path(os.environ.get("GSM8K_DIR", REPO_ROOT / "data" / "gsm8k"))
    if (candidate / "train.jsonl").is_file() and (candidate / "test.jsonl").is_file():
        return candidate
    return None


def pytest_collection_modifyitems(config, items):
    """The slow tests first (stable otherwise): `make test`'s workers take one test at a time from
    the front, so the long ones start early and the short ones fill in behind them, instead of one
    worker ending last on a long test. The after_compiles tests go last: the graphs they compile
    were compiled by a slow test by then, and inductor's on-disk cache holds their C++ kernels (cold
    on a fresh machine, the packed layers' equality test took ~35 s and the update bench ~31 s;
    after the end-to-end --torch_compile run, ~9 s and ~18 s). The tests that time the grader
    live in test_grader.py alone: `make test` runs that file by itself after the rest, without
    collecting the others."""
    for item in items:
        if item.get_closest_marker("timed") and item.path.name != TIMED_TESTS_FILE:
            raise pytest.UsageError(f"{item.nodeid} is marked timed: move it to tests/{TIMED_TESTS_FILE}, the file `make test` times alone")
    items.sort(key=lambda item: 2 if item.get_closest_marker("after_compiles") else int(item.get_closest_marker("slow") is None))


def pytest_collection_finish(session):
    """Freeze what collection imported (torch, transformers, vLLM: ~650,000 objects) out of the cyclic
    collector, as VllmEngine does: each later pass in this worker, automatic or vLLM's own, walked them all."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session):
    gc.unfreeze()  # frozen at exit, nanobind (triton's bindings) prints its objects as leaked


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


def train_rl_flags(task, name: str, *extra: str, checkpoint_path=None) -> list[str]:
    """train_rl flags for a few steps on the tiny task (make_tiny_task) with the HF backend: the
    checkpoint in <root>/<name>/rl, logs in <root>/runs/<name>. `extra` comes last, and argparse
    keeps a flag's last value, so it overrides any of these."""
    return [
        "--sft_checkpoint_path", str(task.sft), "--checkpoint_path", str(checkpoint_path or task.root / name / "rl"),
        "--data_dir", str(task.data), "--log_dir", str(task.root / "runs"), "--run_name", name,
        "--layout", "auto", "--rollout_backend", "hf", "--rollout_batch_size", "4", "--group_size", "4",
        "--train_mini_batch_size", "8", "--sampling_max_tokens", "16", "--eval_max_tokens", "16", "--eval_num_examples", "4",
        "--evaluate_freq", "0", "--learning_rate", "1e-3",
        "--kl_coef", "0.05",  # the random model earns no reward: a KL term keeps the update running (tied batches are skipped)
        *extra,
    ]


def steps_log(task, name: str) -> list[dict]:
    """The rows of a run's steps.jsonl (train_rl_flags' log folder)."""
    from alignment.plot import read_jsonl

    return read_jsonl(task.root / "runs" / name / "steps.jsonl")


def update_settings(**changes):
    """`policy_update.UpdateSettings` for the update tests: one optimizer step of 16 rows in
    microbatches of 8, grpo_clip, the naive log-prob path; `changes` override any field."""
    from dataclasses import replace

    from alignment.policy_update import UpdateSettings

    return replace(UpdateSettings(train_batch_size=16, train_mini_batch_size=8, logprob_chunk_size=0), **changes)


class RecordingWriter:
    """A TensorBoard SummaryWriter's calls, kept: `scalars` as (key, value, step), `texts` as (key, text, step), and the
    summaries written through its `file_writer` (the HParams plugin's) as (summary, step)."""

    def __init__(self):
        self.scalars, self.texts, self.summaries = [], [], []
        self.file_writer = self

    def add_summary(self, summary, step=None):
        self.summaries.append((summary, step))

    def add_scalar(self, key, value, step):
        self.scalars.append((key, value, step))

    def add_text(self, key, text, step):
        self.texts.append((key, text, step))

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of one scalar, in the order written."""
        return [(step, value) for name, value, step in self.scalars if name == key]

    def close(self):
        pass


def make_tiny_task(root: Path, num_train: int, num_test: int, seed: int) -> SimpleNamespace:
    """The synthetic task in GSM8K format plus a tiny Qwen2 whose tokenizer was trained on it.

    Returns root, data (the jsonl folder) and sft (the model, used as the SFT checkpoint).
    """
    from alignment.toy.synthetic_task import tokenizer_corpus, write_synthetic_gsm8k
    from alignment.toy.tiny_model import build_tiny_checkpoint

    data = write_synthetic_gsm8k(root / "data", num_train=num_train, num_test=num_test, seed=seed)
    sft = build_tiny_checkpoint(root / "sft", texts=tokenizer_corpus(data), vocab_size=400)
    return SimpleNamespace(root=root, data=data, sft=sft)


def parity_reward(responses, ground_truths, **_):
    """A stand-in reward a random tiny model earns: 1 for a response of an even number of
    characters. Deterministic for the same rollouts, and it varies within a group, so every
    update moves the weights (the r1_zero reward is 0 for every rollout of a random model)."""
    return [{"reward": float(len(r) % 2 == 0), "format_reward": 1.0, "answer_reward": float(len(r) % 2 == 0)} for r in responses]


def process_exited(pid: int) -> bool:
    """True once every thread of `pid` has exited (zombies, or gone; Linux /proc). A killed process's
    first thread turns zombie while its other threads still exit and hold its files open, with them
    any file lock (a run's output lock) and any pipe. A thread reaped between the listing and the
    read fails the read with ENOENT or, once its entry is half torn down, ESRCH: both mean it exited."""
    import glob

    for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
        try:
            with open(stat) as handle:
                if handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return False
        except (FileNotFoundError, ProcessLookupError):
            pass
    return True


def train_rl_command(flags: list[str], reward: str | None = None) -> list[str]:
    """`python -m alignment.train_rl <flags>` in a fresh process; `reward` names a function of this
    module that replaces the grader there (e.g. "parity_reward"); run it with `child_env()`."""
    import sys

    # the collector off while it imports, as `python -m alignment.train_rl` starts (alignment/__init__.py)
    script = "import sys\nimport alignment\nalignment.pause_collector()\nfrom alignment import train_rl\nfrom alignment.errors import run_cli\n"
    if reward:
        script += f"import conftest\ntrain_rl.grade_responses = conftest.{reward}\n"
    return [sys.executable, "-c", script + "run_cli(train_rl.main, sys.argv[1:])\n", *flags]


def child_env() -> dict:
    """The environment of a train_rl child process: this folder on its path, so it can import conftest."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(Path(__file__).parent)])}


def run_train_rl(flags: list[str], reward: str | None = None, timeout: float = 300.0) -> None:
    """A whole train_rl run in a fresh process (no state of this test process leaks into it)."""
    import subprocess

    result = subprocess.run(train_rl_command(flags, reward), cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                            env=child_env())
    assert result.returncode == 0, result.stderr[-3000:]


def kill_train_rl_after_saved_state(flags: list[str], step: int, timeout: float = 300.0, reward: str | None = None) -> None:
    """Run train_rl (as `train_rl_command`) and SIGKILL it as soon as it reports the training
    state of `step` saved (a crash with no chance to clean up)."""
    import signal
    import subprocess
    import threading

    process = subprocess.Popen(train_rl_command(flags, reward), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, env=child_env())
    expired = threading.Event()

    def expire():  # a child that hangs without printing ends too: its stdout closes when it dies
        expired.set()
        process.kill()

    timer = threading.Timer(timeout, expire)
    timer.start()
    try:
        for line in process.stdout:
            if line.startswith(f"saved training state at step {step}"):
                process.send_signal(signal.SIGKILL)
                break
    finally:
        timer.cancel()
    process.wait()
    assert not expired.is_set(), f"train_rl printed no 'saved training state at step {step}' within {timeout} s; killed"
