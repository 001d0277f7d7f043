"""Reliability, round 2: a user's data is never destroyed and a run is never silently discarded.

Owned outputs, unfinished states, resume flag checks, one writer, integrity checks,
one-line errors, signals and safe loading (RELIABILITY.md, second table). The grader's
time bound from threads is in tests/test_grader.py.
"""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from alignment import checkpoint, train_rl, train_sft
from alignment.checkpoint import MANIFEST_NAME, OutputLock, has_training_state, read_manifest, verify_manifest, write_atomically
from alignment.errors import UserError
from conftest import make_tiny_task

REPO_ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_tiny_task(tmp_path_factory.mktemp("outputs"), num_train=48, num_test=8, seed=2)


def flags(pipeline, name, *extra, checkpoint_path=None):
    return [
        "--sft_checkpoint_path", str(pipeline.sft), "--checkpoint_path", str(checkpoint_path or pipeline.root / name / "rl"),
        "--data_dir", str(pipeline.data), "--log_dir", str(pipeline.root / "runs"), "--run_name", name,
        "--layout", "auto", "--rollout_backend", "hf", "--rollout_batch_size", "4", "--group_size", "4",
        "--train_mini_batch_size", "8", "--sampling_max_tokens", "16", "--eval_max_tokens", "16", "--eval_num_examples", "4",
        "--evaluate_freq", "0", "--learning_rate", "1e-3", "--kl_coef", "0.05", "--max_steps", "3", *extra,
    ]


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def interrupted_run(pipeline, name, monkeypatch, *extra):
    """A run stopped right after its step-1 training state was written (as a crash would leave it)."""
    real_save = train_rl.save_training_state

    def save_then_crash(*args, **kwargs):
        real_save(*args, **kwargs)
        raise RuntimeError("crash after the state was saved")

    monkeypatch.setattr(train_rl, "save_training_state", save_then_crash)
    with pytest.raises(RuntimeError, match="crash after"):
        train_rl.main(flags(pipeline, name, "--save_state_every", "1", *extra))
    monkeypatch.setattr(train_rl, "save_training_state", real_save)
    state = pipeline.root / name / "rl.state"
    assert has_training_state(state)
    return state


# ------------------------------------------------------------ 1. owned outputs


def test_a_users_folder_at_an_output_path_is_refused_untouched(pipeline):
    notes = pipeline.root / "notes"
    notes.mkdir()
    (notes / "ideas.txt").write_text("my notes")
    with pytest.raises(UserError, match=r"--checkpoint_path .*notes holds files this tool did not write"):
        train_rl.main(flags(pipeline, "notes_run", checkpoint_path=notes))
    models = pipeline.root / "models"  # a folder holding an SFT checkpoint, as --state_dir
    models.mkdir()
    for file in pipeline.sft.iterdir():
        (models / file.name).write_bytes(file.read_bytes())
    with pytest.raises(UserError, match=r"--state_dir .*models holds files this tool did not write"):
        train_rl.main(flags(pipeline, "models_run", "--state_dir", str(models)))
    with pytest.raises(UserError, match=r"--checkpoint_path .*notes holds files this tool did not write"):
        train_sft.main(["--model", str(pipeline.sft), "--checkpoint_path", str(notes), "--data_dir", str(pipeline.data), "--log_dir", str(pipeline.root / "runs")])
    with pytest.raises(UserError, match="holds files this tool did not write"):
        write_atomically(notes, lambda folder: (folder / "x").write_text("x"), kind="checkpoint")
    assert snapshot(notes) == {"ideas.txt": b"my notes"}
    assert snapshot(models) == snapshot(pipeline.sft)
    assert not (pipeline.root / "runs" / "notes_run" / "steps.jsonl").exists()  # refused before training


def test_a_regular_file_as_checkpoint_path_is_refused_before_training(pipeline):
    target = pipeline.root / "results.txt"
    target.write_text("keep me")
    started = time.perf_counter()
    with pytest.raises(UserError, match=r"--checkpoint_path .*results.txt is a file, not a folder"):
        train_rl.main(flags(pipeline, "file_run", checkpoint_path=target))
    assert time.perf_counter() - started < 10  # at start-up, not after the training
    assert target.read_text() == "keep me" and not (pipeline.root / "results.txt.old").exists()


# ------------------------------------------------- 2. an unfinished run is kept


def test_an_unfinished_training_state_is_never_discarded(pipeline, monkeypatch):
    state = interrupted_run(pipeline, "unfinished", monkeypatch)
    before = snapshot(state)
    with pytest.raises(UserError, match=r"holds the training state of an unfinished run \(step 1\); pass --resume to continue it, or remove .* to start over"):
        train_rl.main(flags(pipeline, "unfinished"))
    assert snapshot(state) == before


# ------------------------------------------------------- 3. resume checks flags


def test_resume_refuses_run_defining_changes_and_applies_safe_ones(pipeline, monkeypatch, capsys):
    state = interrupted_run(pipeline, "changed", monkeypatch)
    with pytest.raises(UserError, match=r"--resume: --seed is 7 but the run was started with 42; pass --seed 42"):
        train_rl.main(flags(pipeline, "changed", "--save_state_every", "1", "--resume", "--seed", "7"))
    with pytest.raises(UserError, match=r"--resume: --rollout_batch_size is 8 but the run was started with 4"):
        train_rl.main(flags(pipeline, "changed", "--save_state_every", "1", "--resume", "--rollout_batch_size", "8"))
    assert read_manifest(state)["step"] == 1  # refused without touching the state
    capsys.readouterr()
    train_rl.main(flags(pipeline, "changed", "--save_state_every", "1", "--resume", "--learning_rate", "2e-3"))
    out = capsys.readouterr().out
    assert "resume: --learning_rate 0.002 (the run had 0.001) takes effect" in out
    assert "resume: --torch_compile" not in out and "resume: --pack_sequences" not in out  # left at auto both times: no change to report
    steps = [json.loads(line) for line in open(pipeline.root / "runs" / "changed" / "steps.jsonl")]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0]["train/lr"] == pytest.approx(1e-3) and steps[2]["train/lr"] == pytest.approx(2e-3)


def test_resume_refuses_changed_training_data(tmp_path, monkeypatch):
    task = make_tiny_task(tmp_path, num_train=48, num_test=8, seed=5)
    interrupted_run(task, "data", monkeypatch)
    train_file = task.data / "train.jsonl"
    lines = train_file.read_text().splitlines()
    train_file.write_text("\n".join(reversed(lines)) + "\n")
    with pytest.raises(UserError, match=r"train.jsonl changed since the run started"):
        train_rl.main(flags(task, "data", "--save_state_every", "1", "--resume"))


# ------------------------------------------------------------- 4. one writer


HOLD_LOCK = """
import sys, time
from alignment.checkpoint import OutputLock
with OutputLock([(sys.argv[1], "--checkpoint_path")]):
    print("LOCKED", flush=True)
    time.sleep(120)
"""


def test_a_second_run_on_the_same_paths_exits_naming_the_first(pipeline):
    target = pipeline.root / "busy" / "rl"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(target)], cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        result = subprocess.run([sys.executable, "-m", "alignment.train_rl", *flags(pipeline, "busy", checkpoint_path=target)],
                                cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert result.returncode == 2
        assert re.search(rf"error: --checkpoint_path .*busy/rl is in use by another run \(pid {holder.pid}", result.stderr), result.stderr[-2000:]
        assert "Traceback" not in result.stderr
    finally:
        holder.kill()
        holder.wait()
    with OutputLock([(target, "--checkpoint_path")]):  # the kernel released the dead holder's lock
        pass


def test_concurrent_atomic_writes_never_raise_and_leave_one_whole_folder(tmp_path):
    target = tmp_path / "ckpt"
    errors = []

    def writer(index):
        def write(folder):
            for part in range(3):
                (folder / f"part{part}.txt").write_text(f"{index}\n" * 1000)
        try:
            for _ in range(5):
                write_atomically(target, write, kind="checkpoint")
        except Exception as error:  # noqa: BLE001 - any failure is what this test looks for
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    verify_manifest(target, "")
    contents = {(target / f"part{part}.txt").read_text() for part in range(3)}
    assert len(contents) == 1  # all three files from one writer, never mixed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.lock"]  # no temp or .old left


# ---------------------------------------------------------- 5. integrity


def _zero_bytes(file: Path, count: int) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(min(count, len(data) - middle))
    file.write_bytes(bytes(data))


def test_damaged_state_files_are_refused_naming_the_file(pipeline, monkeypatch):
    state = interrupted_run(pipeline, "damaged", monkeypatch)
    resume = flags(pipeline, "damaged", "--save_state_every", "1", "--resume")
    pristine = snapshot(state)
    _zero_bytes(state / "policy" / "model.safetensors", 200_000)
    with pytest.raises(UserError, match=r"policy/model.safetensors is damaged: its SHA-256 differs"):
        train_rl.main(resume)
    (state / "policy" / "model.safetensors").write_bytes(pristine["policy/model.safetensors"])
    (state / "optimizer.pt").write_bytes(pristine["optimizer.pt"][:1000])  # truncated
    with pytest.raises(UserError, match=r"optimizer.pt is damaged: 1000 bytes"):
        train_rl.main(resume)
    (state / "optimizer.pt").write_bytes(pristine["optimizer.pt"])
    (state / "rng.pt").unlink()
    with pytest.raises(UserError, match=r"rng.pt is missing"):
        train_rl.main(resume)


def test_a_damaged_final_checkpoint_is_refused_before_evaluation(pipeline):
    train_rl.main(flags(pipeline, "final", "--max_steps", "1"))
    (pipeline.root / "final" / "rl" / "tokenizer.json").unlink()
    with pytest.raises(UserError, match=r"final/rl/tokenizer.json is missing .* remove .*final/rl to train again"):
        train_rl.main(flags(pipeline, "final", "--max_steps", "1"))


# ----------------------------------------------------- 7. one-line errors


def test_a_prompt_longer_than_the_context_names_its_row_before_any_model_loads(tmp_path):
    task = make_tiny_task(tmp_path, num_train=48, num_test=8, seed=6)
    train_file = task.data / "train.jsonl"
    rows = train_file.read_text().splitlines()
    huge = json.loads(rows[2])
    huge["question"] = "How many apples? " * 60_000  # ~1 MB
    rows[2] = json.dumps(huge)
    train_file.write_text("\n".join(rows) + "\n")
    started = time.perf_counter()
    with pytest.raises(UserError, match=r"train.jsonl:3: the prompt is \d+ tokens; with --sampling_max_tokens 16 it does not fit the model's \d+-token context"):
        train_rl.main(flags(task, "long_prompt"))
    assert time.perf_counter() - started < 30


def test_unwritable_output_locations_fail_at_start_up(pipeline):
    blocker = pipeline.root / "a_file"
    blocker.write_text("x")
    with pytest.raises(UserError, match=r"--checkpoint_path .*a_file/rl: .*a_file is a file, so no folder can be made there"):
        train_rl.main(flags(pipeline, "blocked", checkpoint_path=blocker / "rl"))
    try:
        with open("/sys/.alignment-probe", "w"):
            pytest.skip("/sys is writable here")
    except OSError:
        pass
    with pytest.raises(UserError, match=r"--checkpoint_path /sys/alignment/rl: cannot write in /sys"):
        train_rl.main(flags(pipeline, "readonly", checkpoint_path="/sys/alignment/rl"))


def test_disk_full_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(pipeline, monkeypatch):
    train_rl.main(flags(pipeline, "full_disk", "--max_steps", "1"))
    checkpoint_dir = pipeline.root / "full_disk" / "rl"
    before = snapshot(checkpoint_dir)
    real_fsync = checkpoint._fsync_tree

    def no_space(folder):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_fsync_tree", no_space)
    with pytest.raises(UserError, match=r"could not write .*full_disk/rl \(No space left on device\); the previous .* is intact; free some space"):
        checkpoint.save_model_atomically(*_model_and_tokenizer(pipeline), checkpoint_dir)
    monkeypatch.setattr(checkpoint, "_fsync_tree", real_fsync)
    assert snapshot(checkpoint_dir) == before
    assert [p.name for p in checkpoint_dir.parent.iterdir() if ".tmp-" in p.name] == []


def _model_and_tokenizer(pipeline):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(pipeline.sft), AutoTokenizer.from_pretrained(pipeline.sft)


def test_a_torn_last_line_of_steps_log_does_not_block_resume(pipeline, monkeypatch, capsys):
    interrupted_run(pipeline, "torn", monkeypatch)
    steps_log = pipeline.root / "runs" / "torn" / "steps.jsonl"
    with open(steps_log, "a") as handle:
        handle.write('{"step": 2, "train/rew')  # a crash mid-write
    capsys.readouterr()
    train_rl.main(flags(pipeline, "torn", "--save_state_every", "1", "--resume"))
    assert "dropped 1 unreadable line(s)" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in steps_log.read_text().splitlines()] == [1, 2, 3]


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_finishes_the_step_saves_and_prints_the_resume_command(pipeline, signum, code):
    name = f"signal_{code}"
    command = [sys.executable, "-m", "alignment.train_rl", *flags(pipeline, name, "--save_state_every", "5", "--max_steps", "6")]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in process.stdout:
        if line.startswith("step 1/6"):
            process.send_signal(signum)
            break
    out, err = process.communicate(timeout=300)
    assert process.returncode == code, err[-3000:]
    assert "Traceback" not in err
    stopped = re.search(r"stopped by (SIG\w+) after step (\d+): the training state of step \2 is in (\S+); continue with:\n  (.+)", err)
    assert stopped and stopped.group(1) == signal.Signals(signum).name, err[-2000:]
    step = int(stopped.group(2))
    assert step in (1, 2) and read_manifest(stopped.group(3))["step"] == step  # saved although 5 does not divide it
    resume = stopped.group(4)
    assert resume.endswith("--resume") and "--save_state_every 5" in resume
    finished = subprocess.run(resume.replace("python", sys.executable, 1), shell=True, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in open(pipeline.root / "runs" / name / "steps.jsonl")]
    assert steps == list(range(1, 7))


# ----------------------------------------------------------- 8. safe loading


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_training_state_cannot_run_code(pipeline, monkeypatch, tmp_path):
    import torch

    state = interrupted_run(pipeline, "hostile", monkeypatch)
    marker = tmp_path / "pwned"
    torch.save({"python": _Exploit(marker)}, state / "rng.pt")
    manifest = json.loads((state / MANIFEST_NAME).read_text())  # an attacker updates the checksums too
    manifest["files"]["rng.pt"] = {"bytes": (state / "rng.pt").stat().st_size, "sha256": checkpoint.file_sha256(state / "rng.pt")}
    (state / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"hostile/rl.state: UnpicklingError"):
        train_rl.main(flags(pipeline, "hostile", "--save_state_every", "1", "--resume"))
    assert not marker.exists()
