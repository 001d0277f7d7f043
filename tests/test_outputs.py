"""Reliability, round 2: a user's data is never destroyed and a run is never silently discarded.

Owned outputs, unfinished states, resume flag checks, one writer, integrity checks,
one-line errors, signals and safe loading (RELIABILITY.md, second table). The grader's
time bound from threads is in tests/test_grader.py.
"""

import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from alignment import checkpoint, evaluate, train_rl, train_sft
from alignment.checkpoint import MANIFEST_NAME, OutputLock, file_sha256, has_training_state, read_manifest, unfinished_runs_from, verify_manifest, write_atomically
from alignment.errors import UserError, run_cli
from alignment.interrupts import StopOnSignal, resume_command
from conftest import REPO_ROOT, make_tiny_task, steps_log, train_rl_flags

ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_tiny_task(tmp_path_factory.mktemp("outputs"), num_train=48, num_test=8, seed=2)


def flags(pipeline, name, *extra, checkpoint_path=None):
    return train_rl_flags(pipeline, name, "--max_steps", "3", *extra, checkpoint_path=checkpoint_path)


def train_rl_cli(capsys, argv) -> tuple[int, str]:
    """What `python -m alignment.train_rl <argv>` runs (`run_cli(main)`), here: its exit code and stderr.
    A traceback would be an exception other than SystemExit, and fail the test."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        run_cli(train_rl.main, argv)
    return exited.value.code, capsys.readouterr().err


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_until_a_state_is_saved(monkeypatch, argv) -> None:
    """train_rl.main(argv), stopped right after it writes its next training state (as a crash would leave it)."""
    real_save = train_rl.save_training_state

    def save_then_crash(*args, **kwargs):
        real_save(*args, **kwargs)
        raise RuntimeError("crash after the state was saved")

    monkeypatch.setattr(train_rl, "save_training_state", save_then_crash)
    with pytest.raises(RuntimeError, match="crash after"):
        train_rl.main(argv)
    monkeypatch.setattr(train_rl, "save_training_state", real_save)


def interrupted_run(pipeline, name, monkeypatch, *extra):
    """A run stopped right after its step-1 training state was written."""
    run_until_a_state_is_saved(monkeypatch, flags(pipeline, name, "--save_state_every", "1", *extra))
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
        write_atomically(notes, lambda folder: (folder / "x").write_text("x"), kind="rl_checkpoint")
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
    with pytest.raises(UserError) as refused:
        train_rl.main(flags(pipeline, "unfinished"))
    assert snapshot(state) == before
    logs = pipeline.root / "runs" / "unfinished"
    assert str(refused.value) == (f"{state} holds the training state of an unfinished run (step 1); pass --resume to continue it, "
                                  f"or remove {state} and {logs} to start over from the SFT checkpoint")
    shutil.rmtree(state)  # the advice, followed: the log folder too, which a new run would refuse
    shutil.rmtree(logs)
    train_rl.main(flags(pipeline, "unfinished"))
    assert [json.loads(line)["step"] for line in (logs / "steps.jsonl").read_text().splitlines()] == [1, 2, 3]


# ------------------------------------------------------- 3. resume checks flags


def test_resume_refuses_run_defining_changes_and_applies_safe_ones(pipeline, monkeypatch, capsys):
    state = interrupted_run(pipeline, "changed", monkeypatch)
    with pytest.raises(UserError, match=r"--resume: --seed is 7 but the run was started with 42; pass --seed 42"):
        train_rl.main(flags(pipeline, "changed", "--save_state_every", "1", "--resume", "--seed", "7"))
    with pytest.raises(UserError, match=r"--resume: --rollout_batch_size is 8 but the run was started with 4"):
        train_rl.main(flags(pipeline, "changed", "--save_state_every", "1", "--resume", "--rollout_batch_size", "8"))
    assert read_manifest(state)["step"] == 1  # refused without touching the state
    capsys.readouterr()
    train_rl.main(flags(pipeline, "changed", "--save_state_every", "1", "--resume", "--learning_rate", "2e-3", "--evaluate_at_start"))
    out = capsys.readouterr().out
    assert "resume: --learning_rate 0.002 (the run had 0.001) takes effect" in out
    assert "resume: the learning rate is now 0.002, where the run left it at 0.001: the changed flags plan it anew over the 3 steps" in out
    # a flag that acts only when a run starts is not said to take effect
    assert "resume: --evaluate_at_start True (the run had False) has no effect: step 0 is evaluated when a run starts, not on --resume" in out
    assert "resume: --torch_compile" not in out and "resume: --pack_sequences" not in out  # left at auto both times: no change to report
    assert "resume: --" not in out.replace("resume: --learning_rate", "").replace("resume: --evaluate_at_start", "")  # devices resolved by --layout auto are not reported as changed
    steps = steps_log(pipeline, "changed")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0]["train/lr"] == pytest.approx(1e-3) and steps[2]["train/lr"] == pytest.approx(2e-3)


def test_a_resumed_run_continues_the_warmup_and_its_logs_without_a_second_start_evaluation(pipeline, monkeypatch, capsys):
    """--warmup_steps 4 --learning_rate 1e-3 --evaluate_at_start, stopped after its step-1 state and resumed: the
    schedule goes on where it stopped (train/lr after each step 5e-4, 7.5e-4, 1e-3, as without the stop), the
    start evaluation (step 0) is not run again, and TensorBoard keeps step 1's and step 0's points beside the new ones."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    extra = ("--save_state_every", "1", "--warmup_steps", "4", "--learning_rate", "1e-3", "--evaluate_at_start")
    interrupted_run(pipeline, "warm_resume", monkeypatch, *extra)
    capsys.readouterr()
    train_rl.main(flags(pipeline, "warm_resume", *extra, "--resume"))
    assert "resume: the learning rate is now" not in capsys.readouterr().out  # the same plan: nothing to say
    run_dir = pipeline.root / "runs" / "warm_resume"
    assert [s["train/lr"] for s in steps_log(pipeline, "warm_resume")] == pytest.approx([5e-4, 7.5e-4, 1e-3])
    assert [json.loads(line)["step"] for line in (run_dir / "evals.jsonl").read_text().splitlines()] == [0, 3]
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("train/lr")] == [(1, 5e-4), (2, 7.5e-4), (3, 1e-3)]
    assert [e.step for e in events.Scalars("eval/avg_all_rewards")] == [0, 3]


def test_a_run_stopped_in_its_final_evaluation_resumes_to_that_evaluation_alone(pipeline, monkeypatch):
    """A run of one epoch of 2 steps (8 prompts, 4 a step) with a state every step, killed while it evaluates its final
    policy (minutes on GSM8K): the state of step 2 (epoch 0's last) and the step-2 checkpoint are on disk. --resume
    with the same --max_steps trains no step (the training state is at the last one), evaluates that policy as
    step 2, and finishes as a run does."""
    import torch
    from safetensors.torch import load_file

    argv = flags(pipeline, "final_eval_cut", "--save_state_every", "1", "--max_steps", "2", "--num_train_examples", "8")
    real_evaluate = train_rl.evaluate_policy

    def killed(*args):
        raise RuntimeError("killed during the final evaluation")

    monkeypatch.setattr(train_rl, "evaluate_policy", killed)
    with pytest.raises(RuntimeError, match="killed during the final evaluation"):
        train_rl.main(argv)
    monkeypatch.setattr(train_rl, "evaluate_policy", real_evaluate)
    state, checkpoint = pipeline.root / "final_eval_cut" / "rl.state", pipeline.root / "final_eval_cut" / "rl"
    assert read_manifest(state)["step"] == 2 and read_manifest(checkpoint)["step"] == 2
    assert {key: json.loads((state / "counters.json").read_text())[key] for key in ("step", "epoch")} == {"step": 2, "epoch": 0}
    trained = load_file(str(checkpoint / "model.safetensors"))
    metrics = train_rl.main([*argv, "--resume"])
    run_dir = pipeline.root / "runs" / "final_eval_cut"
    assert [s["step"] for s in steps_log(pipeline, "final_eval_cut")] == [1, 2]  # no step trained again
    final = json.loads((run_dir / "final_eval_metrics.json").read_text())
    assert final["step"] == 2 and final["num_examples"] == metrics["num_examples"] == 4
    assert [json.loads(line)["step"] for line in (run_dir / "evals.jsonl").read_text().splitlines()] == [2]
    assert not has_training_state(state)  # finished: the checkpoint is the result
    after = load_file(str(checkpoint / "model.safetensors"))
    assert all(torch.equal(after[name], trained[name]) for name in trained)


def test_resume_refuses_changed_training_data(tmp_path, monkeypatch):
    task = make_tiny_task(tmp_path, num_train=48, num_test=8, seed=5)
    interrupted_run(task, "data", monkeypatch)
    train_file = task.data / "train.jsonl"
    lines = train_file.read_text().splitlines()
    train_file.write_text("\n".join(reversed(lines)) + "\n")
    with pytest.raises(UserError, match=r"train.jsonl changed since the run started"):
        train_rl.main(flags(task, "data", "--save_state_every", "1", "--resume"))


def test_resume_refuses_another_test_set_under_the_same_curve(tmp_path, monkeypatch):
    """--resume --data_dir <a copy with the same train.jsonl and fewer test rows>: it said "the same files" and the
    run's evaluation curve went on on another test set. Refused; another --eval_split is a flag that takes effect."""
    task = make_tiny_task(tmp_path, num_train=48, num_test=8, seed=5)
    interrupted_run(task, "eval_data", monkeypatch)
    other = tmp_path / "other_data"
    shutil.copytree(task.data, other)
    (other / "test.jsonl").write_text("".join((task.data / "test.jsonl").read_text().splitlines(keepends=True)[:4]))
    with pytest.raises(UserError, match=rf"^--resume: {re.escape(str(other))}/test.jsonl is not the file the run evaluated on \(SHA-256 \w{{12}}, "
                                        r"now \w{12}\), so its evaluation curve would mix two test sets"):
        train_rl.main(flags(task, "eval_data", "--save_state_every", "1", "--resume", "--data_dir", str(other)))


def test_resume_never_saves_over_another_runs_finished_checkpoint(pipeline, monkeypatch):
    """--checkpoint_path may change on resume; a job script that kept a finished run's path (with a shared
    --state_dir) used to resume the other run into it and replace that result with no word."""
    state = pipeline.root / "shared_state"
    train_rl.main(flags(pipeline, "finished_first", "--state_dir", str(state)))
    finished = pipeline.root / "finished_first" / "rl"
    before = snapshot(finished)
    second = ("--save_state_every", "1", "--state_dir", str(state), "--learning_rate", "5e-3")
    run_until_a_state_is_saved(monkeypatch, flags(pipeline, "resumed_second", *second))
    held = read_manifest(finished)["run"]["run_id"][:8]
    with pytest.raises(UserError, match=rf"^--resume --checkpoint_path {re.escape(str(finished))} holds the checkpoint of another run \({held}\), "
                                        rf"which this run's saves would replace; pass this run's own --checkpoint_path "
                                        rf"{re.escape(str(pipeline.root / 'resumed_second' / 'rl'))}$"):
        train_rl.main(flags(pipeline, "resumed_second", *second, "--resume", checkpoint_path=finished))
    assert snapshot(finished) == before and read_manifest(state)["step"] == 1
    train_rl.main(flags(pipeline, "resumed_second", *second, "--resume"))  # its own path: it resumes and finishes
    assert [s["step"] for s in steps_log(pipeline, "resumed_second")] == [1, 2, 3]
    assert snapshot(finished) == before


def test_train_sft_again_keeps_the_start_of_an_unfinished_rl_run(tmp_path, monkeypatch):
    """An RL run stopped with a training state, then train_sft rerun into the SFT checkpoint it started from:
    the checkpoint was replaced, and `train_rl --resume` then refused (another start checkpoint) with the old one gone."""
    task = make_tiny_task(tmp_path, num_train=16, num_test=4, seed=6)
    sft = tmp_path / "checkpoints" / "sft"

    def sft_argv(name):
        return ["--model", str(task.sft), "--checkpoint_path", str(sft), "--data_dir", str(task.data), "--log_dir", str(tmp_path / "runs"),
                "--run_name", name, "--batch_size", "16", "--microbatch_size", "16", "--max_steps", "1", "--eval_num_examples", "2", "--eval_max_tokens", "4"]

    train_sft.main(sft_argv("sft"))
    rl = tmp_path / "checkpoints" / "rl"
    # beside it: an unfinished run from another start, which does not hold the checkpoint
    run_until_a_state_is_saved(monkeypatch, flags(task, "other", "--save_state_every", "1", checkpoint_path=tmp_path / "checkpoints" / "other"))
    train_sft.main(sft_argv("sft_again"))  # nothing starts from it yet: replaced, as a rerun does
    run_until_a_state_is_saved(monkeypatch, flags(task, "rl", "--save_state_every", "1", "--sft_checkpoint_path", str(sft), checkpoint_path=rl))
    before = snapshot(sft)
    with pytest.raises(UserError, match=rf"^--checkpoint_path {re.escape(str(sft))} is the start of an unfinished RL run \(its training state "
                                        rf"{re.escape(str(rl))}.state, step 1\), which cannot resume from another start checkpoint: finish it first "
                                        rf"\(train_rl --resume\), remove {re.escape(str(rl))}.state, or pass another --checkpoint_path$"):
        train_sft.main(sft_argv("sft_third"))
    assert snapshot(sft) == before and not (tmp_path / "runs" / "sft_third").exists()
    train_rl.main(flags(task, "rl", "--save_state_every", "1", "--sft_checkpoint_path", str(sft), "--resume", checkpoint_path=rl))
    assert not has_training_state(Path(f"{rl}.state"))  # finished: the state is gone, and SFT may run again
    train_sft.main(sft_argv("sft_third"))


def test_train_sft_again_keeps_the_start_of_an_unfinished_rl_run_kept_in_another_folder(tmp_path, monkeypatch):
    """The RL run's checkpoint and state in experiments/, the SFT in checkpoints/: train_sft looked for unfinished
    runs only beside the checkpoint, replaced it, and the run could never resume."""
    task = make_tiny_task(tmp_path, num_train=16, num_test=4, seed=7)
    sft = tmp_path / "checkpoints" / "sft"

    def sft_argv(name, learning_rate):
        return ["--model", str(task.sft), "--checkpoint_path", str(sft), "--data_dir", str(task.data), "--log_dir", str(tmp_path / "runs"), "--run_name", name,
                "--batch_size", "16", "--microbatch_size", "16", "--max_steps", "1", "--eval_num_examples", "2", "--eval_max_tokens", "4", "--learning_rate", learning_rate]

    train_sft.main(sft_argv("sft", "1e-4"))
    rl = tmp_path / "experiments" / "rl_lr3e-3"
    rl_argv = flags(task, "rl", "--save_state_every", "1", "--sft_checkpoint_path", str(sft), checkpoint_path=rl)
    run_until_a_state_is_saved(monkeypatch, rl_argv)
    before = snapshot(sft)
    with pytest.raises(UserError, match=rf"^--checkpoint_path {re.escape(str(sft))} is the start of an unfinished RL run \(its training state "
                                        rf"{re.escape(str(rl))}.state, step 1\)"):
        train_sft.main(sft_argv("sft_other_lr", "3e-4"))  # another SFT: the run's start would be gone
    assert snapshot(sft) == before
    train_rl.main([*rl_argv, "--resume"])
    assert [s["step"] for s in steps_log(task, "rl")] == [1, 2, 3]
    assert not (sft.parent / ".sft.alignment-runs").exists()  # the finished run's note is gone with its state
    train_sft.main(sft_argv("sft_other_lr", "3e-4"))  # nothing unfinished starts from it: replaced
    assert snapshot(sft) != before


def test_an_unfinished_run_reached_through_a_link_is_listed_once(tmp_path, monkeypatch):
    """The state beside the checkpoint is found by its path as given, the run's note holds the resolved one: through a
    linked folder the two spellings of one state were listed as two unfinished runs. A link that loops beside them is skipped."""
    real = tmp_path / "real"
    task = make_tiny_task(real, num_train=16, num_test=4, seed=8)
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    sft, rl = tmp_path / "link" / "checkpoints" / "sft", tmp_path / "link" / "checkpoints" / "rl"
    train_sft.main(["--model", str(task.sft), "--checkpoint_path", str(sft), "--data_dir", str(task.data), "--log_dir", str(real / "runs"),
                    "--batch_size", "16", "--microbatch_size", "16", "--max_steps", "1", "--eval_num_examples", "2", "--eval_max_tokens", "4"])
    run_until_a_state_is_saved(monkeypatch, flags(task, "rl", "--save_state_every", "1", "--sft_checkpoint_path", str(sft), checkpoint_path=rl))
    (real / "checkpoints" / "loop").symlink_to("loop")  # a link that loops, beside them and in a note edited by hand: skipped, not resolved
    (real / "checkpoints" / ".sft.alignment-runs" / "edited.json").write_text(json.dumps({"state_dir": str(real / "checkpoints" / "loop")}))
    state = (real / "checkpoints" / "rl.state").resolve()
    for start in (sft, real / "checkpoints" / "sft"):  # either spelling of the start finds the one state, once
        assert [(folder.resolve(), step) for folder, step in unfinished_runs_from(start)] == [(state, 1)]


# ------------------------------------------------------------- 4. one writer


HOLD_LOCK = """
import sys, time
from alignment.checkpoint import OutputLock
with OutputLock([(sys.argv[1], "--checkpoint_path")]):
    print("LOCKED", flush=True)
    time.sleep(120)
"""


def test_a_second_run_on_the_same_paths_exits_naming_the_first(pipeline, capsys):
    target = pipeline.root / "busy" / "rl"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(target)], cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        code, stderr = train_rl_cli(capsys, flags(pipeline, "busy", checkpoint_path=target))  # the first holds the lock in its own process
        assert code == 2
        assert re.search(rf"error: --checkpoint_path .*busy/rl is in use by another run \(pid {holder.pid}", stderr), stderr[-2000:]
        assert "Traceback" not in stderr
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
                write_atomically(target, write, kind="rl_checkpoint")
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
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.alignment-lock", "ckpt"]  # no temp folder or backup left


def test_a_save_whose_old_copy_cannot_be_removed_is_still_a_save(tmp_path, monkeypatch, capsys):
    """The new folder was in place when removing the previous copy failed (a busy NFS file, a permission):
    the save was reported as failed ("could not write ...; the previous ... is intact"), and the run stopped."""
    target = tmp_path / "ckpt"
    write_atomically(target, lambda folder: (folder / "weights.txt").write_text("step 1"), kind="rl_checkpoint")
    real_unlink = Path.unlink

    def busy_backup(path, *args, **kwargs):
        if path.parent.name == ".ckpt.alignment-old":
            raise OSError(16, "Device or resource busy")
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", busy_backup)
    assert write_atomically(target, lambda folder: (folder / "weights.txt").write_text("step 2"), kind="rl_checkpoint") == target
    monkeypatch.undo()
    assert (target / "weights.txt").read_text() == "step 2" and verify_manifest(target, "")["kind"] == "rl_checkpoint"
    assert f"warning: saved {target}, but could not remove the previous copy {tmp_path / '.ckpt.alignment-old'} (Device or resource busy)" in capsys.readouterr().out
    write_atomically(target, lambda folder: (folder / "weights.txt").write_text("step 3"), kind="rl_checkpoint")  # the leftover goes
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.alignment-lock", "ckpt"] and (target / "weights.txt").read_text() == "step 3"


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
    with pytest.raises(UserError, match=rf"rng.pt is missing.*; remove {re.escape(str(state))} and {re.escape(str(pipeline.root / 'runs' / 'damaged'))} to start over"):
        train_rl.main(resume)


def test_a_damaged_final_checkpoint_is_refused_before_evaluation(pipeline):
    train_rl.main(flags(pipeline, "final", "--max_steps", "1"))
    (pipeline.root / "final" / "rl" / "tokenizer.json").unlink()
    with pytest.raises(UserError, match=r"final/rl/tokenizer.json is missing .* remove .*final/rl and .*runs/final to train again"):
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
    # alignment.evaluate alike: it had no check, and the engine's own error (or minutes of HF generation) came instead
    test_file = task.data / "test.jsonl"
    rows = test_file.read_text().splitlines()
    rows[1] = json.dumps({**json.loads(rows[1]), "question": "How many apples? " * 400})  # past the tiny model's context
    test_file.write_text("\n".join(rows) + "\n")
    with pytest.raises(UserError, match=r"test.jsonl:2: the prompt is \d+ tokens; with --max_tokens 16 it does not fit the model's \d+-token context"):
        evaluate.main(["--model_path", str(task.sft), "--backend", "hf", "--data_dir", str(task.data), "--max_tokens", "16",
                       "--output_dir", str(tmp_path / "eval_long")])
    assert not (tmp_path / "eval_long").exists()


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
    with pytest.raises(UserError, match=r"could not write .*full_disk/rl \(No space left on device; [\d.]+ [KMG]iB free there\); the previous .* is intact; free some space"):
        checkpoint.save_model_atomically(*_model_and_tokenizer(pipeline), checkpoint_dir, "rl_checkpoint")
    # train_sft has no --resume to point to: the advice is to train again
    with pytest.raises(UserError, match=r"could not write .*full_disk/sft \(No space left on device; .*\); nothing was at .*full_disk/sft before; "
                                        r"free some space or check the path, and run train_sft again \(it keeps no resumable state\)$"):
        checkpoint.save_model_atomically(*_model_and_tokenizer(pipeline), pipeline.root / "full_disk" / "sft", "sft_checkpoint")
    monkeypatch.setattr(checkpoint, "_fsync_tree", real_fsync)
    assert snapshot(checkpoint_dir) == before
    assert [p.name for p in checkpoint_dir.parent.iterdir() if ".alignment-tmp-" in p.name] == []


def _model_and_tokenizer(pipeline):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(pipeline.sft), AutoTokenizer.from_pretrained(pipeline.sft)


def test_a_torn_last_line_of_steps_log_does_not_block_resume(pipeline, monkeypatch, capsys):
    interrupted_run(pipeline, "torn", monkeypatch)
    torn_log = pipeline.root / "runs" / "torn" / "steps.jsonl"
    with open(torn_log, "a") as handle:
        handle.write('{"step": 2, "train/rew')  # a crash mid-write
    capsys.readouterr()
    train_rl.main(flags(pipeline, "torn", "--save_state_every", "1", "--resume"))
    assert "dropped 1 unreadable line(s)" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in torn_log.read_text().splitlines()] == [1, 2, 3]  # every line whole again


def stop_at_step(command: list[str], step: int, signum) -> tuple[int, list[str]]:
    """Run train_rl's `command` (a 6-step run), send `signum` once it logs step `step`, and check how it stops:
    the exit code, no traceback, a training state of the step it finished, the resume command.
    Returns that step and the resume command's argv, with this interpreter for `python`."""
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in process.stdout:
        if line.startswith(f"step {step}/6"):
            process.send_signal(signum)
            break
    out, err = process.communicate(timeout=300)
    assert process.returncode == 128 + signum, err[-3000:]  # 130 for SIGINT, 143 for SIGTERM
    assert "Traceback" not in err
    stopped = re.search(r"stopped by (SIG\w+) after step (\d+): the training state of step \2 is in (\S+); continue with:\n  (.+)", err)
    assert stopped and stopped.group(1) == signal.Signals(signum).name, err[-2000:]
    finished = int(stopped.group(2))
    assert finished in (step, step + 1) and read_manifest(stopped.group(3))["step"] == finished  # saved although 5 does not divide it
    resume = stopped.group(4)
    assert resume.endswith("--resume") and "--save_state_every 5" in resume
    argv = shlex.split(resume)  # the shell's quoting rules
    assert argv[0] == "python"
    return finished, [sys.executable, *argv[1:]]


@pytest.mark.slow
def test_a_signal_finishes_the_step_saves_and_prints_the_resume_command(pipeline):
    """Ctrl-C stops a run; its resume command, stopped by SIGTERM, prints another; that one finishes."""
    name = "signals"
    command = [sys.executable, "-m", "alignment.train_rl", *flags(pipeline, name, "--save_state_every", "5", "--max_steps", "6")]
    first, resume = stop_at_step(command, 1, signal.SIGINT)
    second, resume = stop_at_step(resume, first + 1, signal.SIGTERM)
    assert second <= 4
    finished = subprocess.run(resume, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    steps = [s["step"] for s in steps_log(pipeline, name)]
    assert steps == list(range(1, 7))


def quiet(text, **_):
    """StopOnSignal's `say`, kept silent."""


def test_a_first_signal_only_sets_the_flag_and_only_a_second_ctrl_c_stops_at_once():
    """StopOnSignal: SIGTERM, even twice (a scheduler's repeat, or a group's signal on top of torchrun's forward to each
    rank), lets the step finish and exits 143; a second Ctrl-C raises KeyboardInterrupt. Before any signal the exit code
    is SIGTERM's: under torchrun another rank received it."""
    def send(signum):  # a KeyboardInterrupt that escapes a test ends the whole pytest session: make it this test's failure
        try:
            signal.raise_signal(signum)
        except KeyboardInterrupt:
            pytest.fail(f"{signal.Signals(signum).name} stopped at once (KeyboardInterrupt)")

    with StopOnSignal(say=quiet) as stop:
        assert (stop.received, stop.exit_code, stop.name) == (None, 143, "a signal to another rank")
        send(signal.SIGTERM)
        send(signal.SIGTERM)
        assert (stop.received, stop.exit_code, stop.name) == (signal.SIGTERM, 143, "SIGTERM")
    with StopOnSignal(say=quiet) as stop:
        send(signal.SIGINT)
        assert (stop.received, stop.exit_code, stop.name) == (signal.SIGINT, 130, "SIGINT")
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_stop_on_signal_puts_back_the_handlers_it_replaced():
    """After the `with` block (train_rl.main and train_sft.main returned, e.g. a sweep or a notebook calling them in turn)
    each signal has its earlier handler again: a Ctrl-C must not go on setting the flag of a run that is over."""
    before = {signum: signal.getsignal(signum) for signum in StopOnSignal.SIGNALS}

    def mine(signum, frame):
        pass

    try:
        signal.signal(signal.SIGTERM, mine)
        with StopOnSignal(say=quiet) as stop:
            assert all(signal.getsignal(signum) == stop._handle for signum in StopOnSignal.SIGNALS)
        assert signal.getsignal(signal.SIGTERM) is mine
        assert all(signal.getsignal(signum) is before[signum] for signum in StopOnSignal.SIGNALS if signum != signal.SIGTERM)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP (POSIX)")
def test_after_sighup_writes_to_a_terminal_that_is_gone_are_dropped(monkeypatch):
    """A dropped ssh session: SIGHUP, then stdout and stderr fail on every write, as a closed file (ValueError) or a
    broken pipe (OSError). The handler's own message and every later print are dropped; the run exits 129."""
    import io

    class BrokenPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stdout", closed)
    monkeypatch.setattr(sys, "stderr", BrokenPipe())
    with StopOnSignal() as stop:  # says with print, to the stdout that is gone
        signal.raise_signal(signal.SIGHUP)
    assert (stop.received, stop.exit_code, stop.name) == (signal.SIGHUP, 129, "SIGHUP")
    print("after the hang-up", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    assert sys.stdout.write("abc") == 3 and sys.stderr.write("abcd") == 4


def test_the_resume_command_adds_resume_once_and_quotes_for_the_shell():
    """The command a stop prints: the same flags plus one --resume (a resumed run stopped again prints no second one),
    quoted so that it can be pasted into a shell."""
    assert resume_command(["--seed", "1"]) == "python -m alignment.train_rl --seed 1 --resume"
    assert resume_command(["--run_name", "my run", "--resume", "--max_steps", "6"]) == "python -m alignment.train_rl --run_name 'my run' --resume --max_steps 6"
    assert resume_command([], module="alignment.train_sft") == "python -m alignment.train_sft --resume"


def test_an_epochs_checkpoint_of_a_stopped_run_is_not_taken_for_its_result(tmp_path, monkeypatch, capsys):
    """--num_epochs 3, no training state, stopped after the first epoch's save: the stop message said a rerun
    starts over, and the rerun evaluated that checkpoint (the seed's rule) as if it were the run's result."""
    from alignment.errors import RunStopped

    task = make_tiny_task(tmp_path, num_train=8, num_test=4, seed=4)  # 4 prompts a step: 2 steps an epoch
    real_save = train_rl.save_policy

    def save_then_signal(*args):
        real_save(*args)
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, right after epoch 0's save

    monkeypatch.setattr(train_rl, "save_policy", save_then_signal)
    argv = train_rl_flags(task, "epochs", "--num_epochs", "3")
    with pytest.raises(RunStopped, match=r"stopped by SIGTERM after step 2: no training state was saved \(--save_state_every 0\); "
                                         r".*epochs/rl holds the policy of an earlier epoch, which a rerun only evaluates: remove .*epochs/rl and .*runs/epochs to start over"):
        train_rl.main(argv)
    assert {k: read_manifest(task.root / "epochs" / "rl")[k] for k in ("step", "total_steps")} == {"step": 2, "total_steps": 6}
    monkeypatch.setattr(train_rl, "save_policy", real_save)
    capsys.readouterr()
    train_rl.main(argv)
    assert re.search(r"note: .*epochs/rl is the policy after step 2 of 6 \(an epoch's checkpoint of a run that stopped before its end.*"
                     r"not that run's result; remove .*epochs/rl and .*runs/epochs to train from the start", capsys.readouterr().out)
    written = json.loads((task.root / "runs" / "epochs" / "eval_only_metrics.json").read_text())
    assert (written["checkpoint_step"], written["checkpoint_total_steps"]) == (2, 6)
    shutil.rmtree(task.root / "epochs" / "rl")
    shutil.rmtree(task.root / "runs" / "epochs")
    train_rl.main(argv)  # the whole run: its checkpoint is the result
    assert {k: read_manifest(task.root / "epochs" / "rl")[k] for k in ("step", "total_steps")} == {"step": 6, "total_steps": 6}
    # stopped with neither a state nor an epoch's checkpoint: a rerun starts over, and its log folder is this run's
    shutil.rmtree(task.root / "epochs" / "rl")
    args = train_rl.parse_rl_args(argv)
    assert train_rl.resume_hint(args) == (f"no training state was saved (--save_state_every 0), so a rerun starts over: under another "
                                          f"--run_name ({task.root / 'runs' / 'epochs'} keeps this run's logs), or after removing {task.root / 'runs' / 'epochs'}")
    with pytest.raises(UserError, match=r"holds the logs of an earlier run \(steps 1-6 in steps.jsonl\)"):
        train_rl.main(argv)


def test_a_full_disk_under_the_logs_stops_the_run_with_one_line_and_the_resume_command(pipeline, monkeypatch, capsys):
    """The disk holding --log_dir filled during step 3: the run ended in two TensorBoard tracebacks and no resume
    command, though its step-2 training state was intact and --resume worked once space was freed."""
    from alignment import run_log

    real_append = run_log.RunLog._append

    def append_until_full(self, name, row):
        if row.get("step") == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.run_dir / name))
        real_append(self, name, row)

    monkeypatch.setattr(run_log.RunLog, "_append", append_until_full)
    argv = flags(pipeline, "disk_full", "--save_state_every", "2", "--max_steps", "4")
    code, err = train_rl_cli(capsys, argv)
    assert code == 1 and "Traceback" not in err
    assert re.search(r"\nthe run stopped on a file error: No space left on device \(.*runs/disk_full/steps.jsonl\); the training state of step 2 is in "
                     r".*disk_full/rl.state; continue with:\n  python -m alignment.train_rl.* --resume\n$", err), err
    monkeypatch.setattr(run_log.RunLog, "_append", real_append)  # space freed: the command it printed continues the run
    train_rl.main([*argv, "--resume"])
    assert [row["step"] for row in steps_log(pipeline, "disk_full")] == [1, 2, 3, 4]


def test_a_signal_in_the_last_step_keeps_the_trained_policy(pipeline, monkeypatch, capsys):
    """SIGTERM during the last of 3 steps (not an epoch's end, a state every 2): the stop used to come before the
    final save, so the whole run was thrown away and the message said a rerun starts over. The rerun evaluates it;
    with the seed's explicit layout and an --eval_device the machine lacks it is refused in one line (it was a CUDA
    error from deep inside torch)."""
    from alignment.errors import RunStopped

    real_scalars = train_rl.step_scalars

    def scalars_then_signal(args, progress, *rest):
        if progress["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, while the last step runs
        return real_scalars(args, progress, *rest)

    monkeypatch.setattr(train_rl, "step_scalars", scalars_then_signal)
    argv = flags(pipeline, "last_step", "--save_state_every", "2")
    with pytest.raises(RunStopped, match=r"stopped by SIGTERM in the last step \(3\): the trained policy is saved to .*last_step/rl; "
                                         r"its final evaluation did not run: rerun the same command to evaluate it"):
        train_rl.main(argv)
    checkpoint_path = pipeline.root / "last_step" / "rl"
    assert {k: read_manifest(checkpoint_path)[k] for k in ("step", "total_steps")} == {"step": 3, "total_steps": 3}
    assert not has_training_state(pipeline.root / "last_step" / "rl.state")  # the step-2 state: the run is done with it
    monkeypatch.setattr(train_rl, "step_scalars", real_scalars)
    capsys.readouterr()
    train_rl.main(argv)  # what the message says: the seed's rule evaluates it
    written = json.loads((pipeline.root / "runs" / "last_step" / "eval_only_metrics.json").read_text())
    assert (written["checkpoint_step"], written["checkpoint_total_steps"]) == (3, 3)
    assert "not that run's result" not in capsys.readouterr().out
    # the seed's explicit layout evaluates on --eval_device as given: one this machine lacks is one line naming the flag
    code, err = train_rl_cli(capsys, [*argv, "--layout", "explicit", "--eval_device", "cuda:99"])
    assert code == 2 and re.fullmatch(r"error: --eval_device cuda:99 does not exist: this machine has \d+ GPU\(s\); pass a device that exists or --layout auto\n", err)


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


# -------------------------------------------- round 3: ownership that cannot be forged by accident


def _sft_checkpoint_of_ours(pipeline, path):
    """The tiny SFT model saved as train_sft saves it (a manifest of kind sft_checkpoint)."""
    return checkpoint.save_model_atomically(*_model_and_tokenizer(pipeline), path, "sft_checkpoint")


@pytest.mark.parametrize("save_every", ["0", "1"])
def test_a_forged_or_foreign_manifest_never_lets_a_folder_be_deleted(pipeline, save_every):
    forged = pipeline.root / f"forged_{save_every}"
    forged.mkdir()
    (forged / MANIFEST_NAME).write_text('{"written_by":"alignment"}')
    (forged / "thesis.txt").write_text("four years")
    with pytest.raises(UserError, match=r"--state_dir .*forged_\d holds a folder of no known kind this tool wrote, not a training_state"):
        train_rl.main(flags(pipeline, f"forged_run_{save_every}", "--state_dir", str(forged), "--save_state_every", save_every))
    sft = _sft_checkpoint_of_ours(pipeline, pipeline.root / f"sft_as_state_{save_every}")
    (sft / "README.md").write_text("my notes on this checkpoint")
    with pytest.raises(UserError, match=r"--state_dir .*sft_as_state_\d holds a sft_checkpoint this tool wrote, not a training_state"):
        train_rl.main(flags(pipeline, f"sft_as_state_run_{save_every}", "--state_dir", str(sft), "--save_state_every", save_every))
    assert (forged / "thesis.txt").read_text() == "four years" and (sft / "README.md").is_file() and (sft / "model.safetensors").is_file()


def test_a_file_added_to_a_folder_the_tool_wrote_is_never_deleted(pipeline, monkeypatch):
    state = interrupted_run(pipeline, "added", monkeypatch)
    (state / "notes.txt").write_text("what I changed")
    with pytest.raises(UserError, match=r"--state_dir .*added/rl.state holds files its manifest does not list \(notes.txt\)"):
        train_rl.main(flags(pipeline, "added", "--save_state_every", "1", "--resume"))
    assert (state / "notes.txt").read_text() == "what I changed" and has_training_state(state)
    with pytest.raises(UserError, match=r"holds files its manifest does not list \(notes.txt\)"):
        write_atomically(state, lambda folder: (folder / "x").write_text("x"), kind="training_state")
    assert checkpoint.remove_output(state, "training_state") is False and (state / "notes.txt").is_file()


def test_a_training_state_is_removed_only_by_the_run_that_wrote_it(tmp_path):
    state = tmp_path / "rl.state"
    write_atomically(state, lambda folder: (folder / "counters.json").write_text("{}"), kind="training_state", record={"run": {"run_id": "theirs"}})
    assert checkpoint.remove_output(state, "training_state", run_id="mine") is False and state.is_dir()
    assert checkpoint.remove_output(state, "rl_checkpoint") is False and state.is_dir()
    assert checkpoint.remove_output(state, "training_state", run_id="theirs") is True and not state.exists()


def test_a_finished_run_removes_its_own_state_and_the_state_records_its_id(pipeline, monkeypatch):
    state = interrupted_run(pipeline, "own_state", monkeypatch)
    run_id = read_manifest(state)["run"]["run_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", run_id)
    train_rl.main(flags(pipeline, "own_state", "--save_state_every", "1", "--resume"))  # resumed: still that run's state
    assert not state.exists() and (pipeline.root / "own_state" / "rl" / "model.safetensors").is_file()


# ------------------------------------------------------- round 3: one folder, one role


def test_two_roles_on_one_folder_are_refused_before_anything_loads(pipeline):
    shared = pipeline.root / "shared"
    link = pipeline.root / "link_to_rl"
    link.symlink_to(pipeline.root / "linked" / "rl", target_is_directory=True)
    started = time.perf_counter()
    cases = [
        (flags(pipeline, "same", "--state_dir", str(shared), checkpoint_path=shared), r"--state_dir .*shared is the same folder as --checkpoint_path"),
        (flags(pipeline, "rl", "--log_dir", str(pipeline.root / "logs"), checkpoint_path=pipeline.root / "logs" / "rl"),
         r"--log_dir/--run_name .*logs/rl is the same folder as --checkpoint_path"),
        (flags(pipeline, "nested", "--state_dir", str(pipeline.root / "nested" / "rl" / "state")), r"--state_dir .*nested/rl/state is inside --checkpoint_path"),
        # a link is followed first (a save writes the folder it points to), then found to be the checkpoint
        (flags(pipeline, "linked", "--state_dir", str(link)), r"--state_dir .*linked/rl is the same folder as --checkpoint_path"),
        (flags(pipeline, "tmp", "--rollout_backend", "vllm", "--eval_engine", "fresh", "--tmp_checkpoint_path", str(pipeline.root / "tmp" / "rl")),
         r"--tmp_checkpoint_path .*tmp/rl is the same folder as --checkpoint_path"),
        # the default --eval_engine sampler evaluates in a fresh engine too where the rollout engine does not hold the
        # policy's weights at every step (the seed's frozen sampler, or a sync every 2 steps): the same checks, at start-up
        *((flags(pipeline, f"tmp_sync{every}", "--rollout_backend", "vllm", "--rollout_sync_every", every,
                 "--tmp_checkpoint_path", str(pipeline.root / f"tmp_sync{every}" / "rl")),
           rf"--tmp_checkpoint_path .*tmp_sync{every}/rl is the same folder as --checkpoint_path") for every in ("0", "2")),
        (flags(pipeline, "root", checkpoint_path="/"), r"--checkpoint_path / is the root folder"),
    ]
    for command, message in cases:
        with pytest.raises(UserError, match=message):
            train_rl.main(command)
    with pytest.raises(UserError, match=r"--log_dir/--run_name .*sft_logs/sft is the same folder as --checkpoint_path"):
        train_sft.main(["--model", str(pipeline.sft), "--checkpoint_path", str(pipeline.root / "sft_logs" / "sft"), "--data_dir", str(pipeline.data),
                        "--log_dir", str(pipeline.root / "sft_logs")])
    assert time.perf_counter() - started < 20  # all at start-up
    assert not shared.exists() and not (pipeline.root / "logs").exists() and not (pipeline.root / "linked").exists()


def test_sft_never_saves_over_the_model_it_starts_from(pipeline, tmp_path):
    """`train_sft --model X --checkpoint_path X`, X an SFT checkpoint of ours (a copy-pasted path, or "train it a little
    more"): the run trained and its save replaced the weights it started from, so neither the start nor the run could be
    had again. Refused before anything loads, as is a --checkpoint_path that holds the --model folder or sits inside it."""
    start = tmp_path / "models" / "sft"
    common = ["--data_dir", str(pipeline.data), "--num_epochs", "1", "--batch_size", "8", "--microbatch_size", "8", "--eval_num_examples", "0",
              "--log_dir", str(tmp_path / "runs")]
    train_sft.main(["--model", str(pipeline.sft), "--checkpoint_path", str(start), "--run_name", "first", *common])
    before = snapshot(start)
    for output, relation in ((start, "the same folder as"), (tmp_path / "models", "a folder that holds")):
        with pytest.raises(UserError, match=rf"^--checkpoint_path {re.escape(str(output))} is {relation} --model {re.escape(str(start))}, the weights "
                                            r"this run starts from: its save would replace them; pass another --checkpoint_path \(nothing was changed\)$"):
            train_sft.main(["--model", str(start), "--checkpoint_path", str(output), "--run_name", "again", *common])
    with pytest.raises(UserError, match=rf"^--checkpoint_path {re.escape(str(start / 'more'))} is inside --model {re.escape(str(start))}, the folder "
                                        r"this run starts from: the run's files would change it"):
        train_sft.main(["--model", str(start), "--checkpoint_path", str(start / "more"), "--run_name", "again", *common])
    assert snapshot(start) == before and not (tmp_path / "runs" / "again").exists()
    # a new folder is fine: the start stays as it was
    train_sft.main(["--model", str(start), "--checkpoint_path", str(tmp_path / "more"), "--run_name", "more", *common])
    assert snapshot(start) == before and (tmp_path / "more" / "model.safetensors").is_file()


def test_rl_writes_nothing_into_over_or_around_the_folder_it_starts_from(pipeline, tmp_path, capsys):
    """A start model from elsewhere (no manifest) is fingerprinted file by file, its own outputs included: a run whose
    --checkpoint_path or --state_dir sat inside it could not be resumed ("holds other files than when the run started")
    and its rerun was told train_sft had run again. Any output inside, over or holding the start is refused before
    anything loads; so is a --checkpoint_path holding an SFT checkpoint, whose evaluation was reported as the RL result."""
    start = tmp_path / "start"
    shutil.copytree(pipeline.sft, start)
    before = snapshot(start)
    for extra, flag, relation in ((("--checkpoint_path", str(start / "rl")), "--checkpoint_path", "inside"),
                                  (("--state_dir", str(start / "x")), "--state_dir", "inside"),
                                  (("--log_dir", str(start)), "--log_dir/--run_name", "inside"),
                                  (("--checkpoint_path", str(start)), "--checkpoint_path", "the same folder as"),
                                  (("--state_dir", str(tmp_path)), "--state_dir", "a folder that holds")):
        code, err = train_rl_cli(capsys, flags(pipeline, "inside", "--sft_checkpoint_path", str(start), *extra))
        assert code == 2 and err.startswith(f"error: {flag} ") and f" is {relation} --sft_checkpoint_path {start}" in err, err
        assert err.rstrip().endswith("(nothing was changed)") and len(err.strip().splitlines()) == 1, err
    assert snapshot(start) == before and not (pipeline.root / "runs" / "inside").exists()
    # beside it, the run trains and its rerun only evaluates, as the seed's rule says
    for _ in range(2):
        train_rl.main(flags(pipeline, "beside", "--sft_checkpoint_path", str(start), "--max_steps", "1"))
    assert snapshot(start) == before and (pipeline.root / "runs" / "beside" / "eval_only_metrics.json").is_file()
    # an SFT checkpoint of ours at --checkpoint_path is not an RL result to report
    sft = tmp_path / "sft"
    train_sft.main(["--model", str(pipeline.sft), "--checkpoint_path", str(sft), "--data_dir", str(pipeline.data), "--max_steps", "1",
                    "--batch_size", "4", "--microbatch_size", "4", "--eval_num_examples", "0", "--log_dir", str(tmp_path / "runs"), "--run_name", "sft"])
    code, err = train_rl_cli(capsys, flags(pipeline, "sft_as_rl", "--checkpoint_path", str(sft)))
    assert (code, err.strip()) == (2, f"error: --checkpoint_path {sft} holds a sft_checkpoint this tool wrote, not an RL run's checkpoint; pass an "
                                      f"RL run's --checkpoint_path, or evaluate it with `python -m alignment.evaluate --model_path {sft}` (nothing was changed)")
    assert not (pipeline.root / "runs" / "sft_as_rl").exists()


def test_a_users_log_folder_is_refused_and_ours_is_reused(pipeline):
    logs = pipeline.root / "runs" / "users_log"
    logs.mkdir(parents=True)
    (logs / "steps.jsonl").write_text('{"my": "experiment"}\n')
    (logs / "final_eval_metrics.json").write_text("{}")
    with pytest.raises(UserError, match=r"--log_dir/--run_name .*runs/users_log holds files this tool did not write; pass another --log_dir or --run_name"):
        train_rl.main(flags(pipeline, "users_log"))
    with pytest.raises(UserError, match=r"--output_dir .*users_log holds files this tool did not write; pass another --output_dir, or move them away"):
        evaluate.main(["--model_path", str(pipeline.sft), "--backend", "hf", "--data_dir", str(pipeline.data), "--num_examples", "2",
                       "--max_tokens", "4", "--output_dir", str(logs)])
    assert snapshot(logs) == {"steps.jsonl": b'{"my": "experiment"}\n', "final_eval_metrics.json": b"{}"}
    train_rl.main(flags(pipeline, "ours_log", "--max_steps", "1"))
    ours = pipeline.root / "runs" / "ours_log"
    first_run_id = json.loads((ours / checkpoint.LOG_MARKER_NAME).read_text())["run_id"]
    # the same run name again with a new checkpoint (the second seed, --run_name forgotten): its steps.jsonl
    # was emptied and both runs' curves shared one TensorBoard run; now refused, the first run's logs untouched
    (pipeline.root / "ours_log" / "rl").rename(pipeline.root / "ours_log" / "first")
    before = snapshot(ours)
    with pytest.raises(UserError, match=r"--log_dir/--run_name .*runs/ours_log holds the logs of an earlier run \(steps 1-1 in steps.jsonl\); "
                                         r"pass another --run_name, or remove .*ours_log to replace them"):
        train_rl.main(flags(pipeline, "ours_log", "--max_steps", "1", "--seed", "1"))
    assert snapshot(ours) == before
    shutil.rmtree(ours)
    train_rl.main(flags(pipeline, "ours_log", "--max_steps", "1", "--seed", "1"))
    assert json.loads((ours / checkpoint.LOG_MARKER_NAME).read_text())["run_id"] != first_run_id
    assert [row["step"] for row in steps_log(pipeline, "ours_log")] == [1]
    # the first checkpoint evaluated into the same folder (the seed's rule): allowed, it is not a training run
    checkpoint.claim_log_folder(ours, "--log_dir/--run_name")


def test_a_log_folder_continues_only_with_the_run_that_wrote_it(tmp_path):
    """claim_log_folder for a training run: its own id continues; another id, or none, is refused once the folder holds logs."""
    logs = tmp_path / "rl"
    checkpoint.claim_log_folder(logs, "--log_dir/--run_name", "run-a")
    assert json.loads((logs / checkpoint.LOG_MARKER_NAME).read_text())["run_id"] == "run-a"
    checkpoint.claim_log_folder(logs, "--log_dir/--run_name", "run-b")  # nothing logged yet: taken over
    (logs / "events.out.tfevents.1.host").write_bytes(b"x")  # run-b failed before its first step: no logs of a run
    checkpoint.claim_log_folder(logs, "--log_dir/--run_name", "run-c")
    (logs / "evals.jsonl").write_text('{"step": 0, "avg_all_rewards": 0.5}\n')  # run-c's --evaluate_at_start (step 0)
    with pytest.raises(UserError, match=r"holds the logs of an earlier run \(evals.jsonl\)"):
        checkpoint.claim_log_folder(logs, "--log_dir/--run_name", "run-e")
    checkpoint.claim_log_folder(logs, "--log_dir/--run_name", "run-c")  # the run that wrote them, resumed
    (logs / checkpoint.LOG_MARKER_NAME).write_text(json.dumps({"written_by": "alignment", "kind": "log_folder"}))  # before run ids
    (logs / "steps.jsonl").write_text('{"step": 3}\n{"step": 4}\n{"ste')
    with pytest.raises(UserError, match=r"earlier run \(steps 3-4 in steps.jsonl\)"):
        checkpoint.claim_log_folder(logs, "--log_dir/--run_name", "run-d")
    checkpoint.claim_log_folder(logs, "--log_dir/--run_name", "run-d", resuming=True)  # taken as the resumed run's
    assert json.loads((logs / checkpoint.LOG_MARKER_NAME).read_text())["run_id"] == "run-d"


def test_a_training_run_refuses_a_log_folder_holding_a_checkpoints_evaluate_only_results(tmp_path):
    """train_rl only evaluates a --checkpoint_path that holds weights, into --log_dir/--run_name (eval_only_metrics.json
    and eval_only/* curves, marked without a run id). A training run of another checkpoint given that --run_name took the
    folder over, and TensorBoard drew the evaluated checkpoint's results as the new run's; the advice to train again
    named only the checkpoint, not the folder a new run would then refuse."""
    logs = tmp_path / "exp"
    checkpoint.claim_log_folder(logs, "--log_dir/--run_name")  # the evaluate-only run
    (logs / "eval_only_metrics.json").write_text('{"avg_all_rewards": 0.6, "checkpoint_path": "checkpoints/rl_old"}\n')
    with pytest.raises(UserError, match=r"^--log_dir/--run_name .*exp holds the logs of an earlier run \(eval_only_metrics.json\); pass another "
                                        r"--run_name, or remove .*exp to replace them \(nothing was changed\)$"):
        checkpoint.claim_log_folder(logs, "--log_dir/--run_name", "run-new")
    assert checkpoint.log_folder_run_id(logs) == ""  # still the evaluation's
    assert checkpoint.start_over(logs, tmp_path / "rl_old") == f"remove {tmp_path / 'rl_old'} and {logs}"
    checkpoint.claim_log_folder(logs, "--log_dir/--run_name")  # the same checkpoint evaluated again: no run id, still ours


def test_trimming_the_steps_log_on_a_full_disk_keeps_it_whole(tmp_path):
    """--resume rewrites steps.jsonl to the saved step; in place, a full disk left it cut short. Here the file-size limit plays the full disk."""
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps({"step": step, "train/reward": 0.5, "pad": "x" * 200}) + "\n" for step in range(1, 41)))
    before = log.read_bytes()
    child = (f"import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
             f"from pathlib import Path\nfrom alignment.errors import run_cli\nfrom alignment.run_log import trim_jsonl\n"
             f"run_cli(lambda argv: trim_jsonl(Path({str(log)!r}), 30))")
    result = subprocess.run([sys.executable, "-c", child], cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert re.search(r"error: cannot rewrite .*steps.jsonl to step 30 \(File too large\); it is unchanged", result.stderr), result.stderr
    assert log.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["steps.jsonl"]  # no temp file left
    from alignment.run_log import trim_jsonl

    trim_jsonl(log, 30)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(1, 31))


# -------------------------------------------------------- round 3: no damaged weights used


def _flip_bytes(file: Path) -> None:
    data = bytearray(file.read_bytes())
    for index in range(len(data) // 2, len(data) // 2 + 64):
        data[index] ^= 0xFF
    file.write_bytes(bytes(data))


def test_damaged_weights_are_refused_by_evaluate_and_as_the_rl_start(pipeline):
    rl = pipeline.root / "flipped_rl"
    _sft_checkpoint_of_ours(pipeline, rl)  # any folder this tool wrote, with its checksums
    _flip_bytes(rl / "model.safetensors")
    evaluate_flags = ["--backend", "hf", "--data_dir", str(pipeline.data), "--num_examples", "2", "--max_tokens", "4"]
    with pytest.raises(UserError, match=r"flipped_rl/model.safetensors is damaged: its SHA-256 differs .* cannot be evaluated"):
        evaluate.main(["--model_path", str(rl), *evaluate_flags, "--output_dir", str(pipeline.root / "eval_flipped")])
    sft = _sft_checkpoint_of_ours(pipeline, pipeline.root / "flipped_sft")
    _flip_bytes(sft / "model.safetensors")
    with pytest.raises(UserError, match=r"flipped_sft/model.safetensors is damaged: its SHA-256 differs from when it was written; RL cannot start from it"):
        train_rl.main([*flags(pipeline, "flipped_start"), "--sft_checkpoint_path", str(sft)])
    with pytest.raises(UserError, match=r"flipped_sft/model.safetensors is damaged: its SHA-256 differs from when it was written; SFT cannot start from it"):
        train_sft.main(["--model", str(sft), "--checkpoint_path", str(pipeline.root / "sft_from_flipped"), "--data_dir", str(pipeline.data),
                        "--log_dir", str(pipeline.root / "runs"), "--run_name", "sft_from_flipped"])
    foreign = pipeline.root / "truncated_foreign"  # no manifest (as from the Hub): its safetensors header still tells its length
    foreign.mkdir()
    for file in pipeline.sft.iterdir():
        (foreign / file.name).write_bytes(file.read_bytes())
    data = (foreign / "model.safetensors").read_bytes()
    (foreign / "model.safetensors").write_bytes(data[: len(data) - 4096])
    with pytest.raises(UserError, match=rf"truncated_foreign/model.safetensors is damaged: {len(data) - 4096} bytes, its header describes {len(data)}"):
        train_rl.main([*flags(pipeline, "truncated_start"), "--sft_checkpoint_path", str(foreign)])
    with pytest.raises(UserError, match=r"truncated_foreign/model.safetensors is damaged"):
        evaluate.main(["--model_path", str(foreign), *evaluate_flags, "--output_dir", str(pipeline.root / "eval_truncated")])


# ------------------------------------------------------- round 3: one line, whatever fails


def test_a_serialiser_failure_during_a_save_is_one_line_and_leaves_no_temp_folder(pipeline, monkeypatch):
    import torch

    state = interrupted_run(pipeline, "torch_full", monkeypatch)
    before = snapshot(state)

    def full_disk(*args, **kwargs):  # what torch.save raises when the disk fills mid-write
        raise RuntimeError("[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(UserError, match=r"could not write .*torch_full/rl.state \(\[enforce fail .* file write failed; [\d.]+ [KMG]iB free there\); the previous .* is intact"):
        train_rl.main(flags(pipeline, "torch_full", "--save_state_every", "1", "--resume"))
    assert snapshot(state) == before
    assert [p.name for p in state.parent.iterdir() if ".alignment-tmp-" in p.name] == []


def test_damaged_configs_and_bad_betas_are_one_line(pipeline, tmp_path, capsys):
    for name, text, message in (("not_json", "{oops", "is not readable JSON"), ("a_list", "[1, 2]", "is not a JSON object"),
                                ("no_layers", '{"model_type": "qwen2"}', "has no positive num_hidden_layers")):
        broken = tmp_path / name
        broken.mkdir()
        for file in pipeline.sft.iterdir():
            (broken / file.name).write_bytes(file.read_bytes())
        (broken / "config.json").write_text(text)
        with pytest.raises(UserError, match=rf"--sft_checkpoint_path .*{name}: .*config.json {message}"):
            train_rl.main([*flags(pipeline, name), "--sft_checkpoint_path", str(broken)])
        with pytest.raises(UserError, match=rf"--model_path .*{name}: .*config.json {message}"):
            evaluate.main(["--model_path", str(broken), "--backend", "hf", "--data_dir", str(pipeline.data)])
    code, stderr = train_rl_cli(capsys, [*flags(pipeline, "betas"), "--adam_betas", "2", "-1"])
    assert code == 2 and "error: argument --adam_betas: must be in [0, 1), got 2" in stderr and "Traceback" not in stderr


def test_a_resume_refusal_names_the_flag_the_user_changed_not_a_derived_one(pipeline, monkeypatch):
    interrupted_run(pipeline, "derived", monkeypatch)
    with pytest.raises(UserError, match=r"--resume: --sampling_max_tokens is 24 but the run was started with 16; pass --sampling_max_tokens 16"):
        train_rl.main(flags(pipeline, "derived", "--save_state_every", "1", "--resume", "--sampling_max_tokens", "24"))


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups (POSIX)")
def test_sigterm_to_the_process_group_one_step_off_saves_and_prints_the_resume_command(pipeline):
    command = [sys.executable, "-m", "alignment.train_rl", *flags(pipeline, "group_term", "--rollout_staleness", "1", "--save_state_every", "5", "--max_steps", "6")]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in process.stdout:
        if line.startswith("step 1/6"):
            os.killpg(process.pid, signal.SIGTERM)  # what Slurm and `kill -TERM -<pgid>` send: every process of the group
            break
    out, err = process.communicate(timeout=300)
    assert process.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "SamplerProcessError" not in err
    stopped = re.search(r"stopped by SIGTERM after step (\d+): the training state of step \1 is in (\S+); continue with:\n  (.+--resume)", err)
    assert stopped, err[-2000:]
    assert read_manifest(stopped.group(2))["step"] == int(stopped.group(1))


# -------------------------------------------------------- round 4: the tool's own names, recovery under the lock


def _users_folders(root: Path, name: str) -> list[Path]:
    """A user's backups beside a checkpoint, named as people name them."""
    folders = [root / f"{name}.old", root / f"{name}.tmp-backup"]
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "notes.txt").write_text("my backup")
    return folders


def test_a_users_old_and_tmp_folders_beside_the_checkpoint_are_never_touched(pipeline):
    """train_rl, with and without a checkpoint there (the evaluate-only path and the training path)."""
    root = pipeline.root / "users_backups"
    users = _users_folders(root, "rl")
    train_rl.main(flags(pipeline, "users_backups", "--max_steps", "1", checkpoint_path=root / "rl"))  # no rl yet: trains
    train_rl.main(flags(pipeline, "users_backups_eval", "--max_steps", "1", checkpoint_path=root / "rl"))  # rl holds weights: evaluates
    assert all(snapshot(folder) == {"notes.txt": b"my backup"} for folder in users)
    lone = pipeline.root / "lone_backup"
    _users_folders(lone, "rl")
    with pytest.raises(UserError):  # the SFT start is missing: refused, and the user's rl.old is not made rl on the way
        train_rl.main([*flags(pipeline, "lone", checkpoint_path=lone / "rl"), "--sft_checkpoint_path", str(lone / "missing")])
    assert not (lone / "rl").exists() and snapshot(lone / "rl.old") == {"notes.txt": b"my backup"}


def test_train_sft_leaves_a_users_moved_checkpoint_alone(pipeline):
    """`mv sft sft.old` keeps a backup: the next train_sft writes a new sft beside it and never renames it back."""
    root = pipeline.root / "sft_backup"
    common = ["--model", str(pipeline.sft), "--data_dir", str(pipeline.data), "--log_dir", str(root / "runs"), "--max_steps", "1",
              "--batch_size", "2", "--microbatch_size", "2", "--eval_num_examples", "1", "--eval_max_tokens", "4"]
    train_sft.main([*common, "--checkpoint_path", str(root / "sft")])
    (root / "sft").rename(root / "sft.old")
    before = snapshot(root / "sft.old")
    train_sft.main([*common, "--checkpoint_path", str(root / "sft"), "--learning_rate", "1e-2"])
    assert snapshot(root / "sft.old") == before
    assert snapshot(root / "sft")["model.safetensors"] != before["model.safetensors"]


HOLD_LOCK_WITH_TEMP = """
import json, sys, time
from pathlib import Path
from alignment.checkpoint import OutputLock
target = Path(sys.argv[1])
with OutputLock([(target, "--checkpoint_path")]):
    temp = target.with_name(f".{target.name}.alignment-tmp-999999-1")  # a writer on another node: its pid is not visible here
    temp.mkdir(parents=True)
    (temp / "alignment_temp.json").write_text(json.dumps({"written_by": "alignment", "for": str(target.absolute()), "pid": 999999}))
    (temp / "model.safetensors").write_bytes(b"half written")
    print("WRITING", flush=True)
    time.sleep(120)
"""


def test_a_live_writers_temp_folder_survives_a_second_command_on_its_paths(pipeline, capsys):
    """A run mid-save whose pid this host cannot see: a second command is refused by the lock before it recovers anything."""
    target = pipeline.root / "live_writer" / "rl"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK_WITH_TEMP, str(target)], cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    temp = target.with_name(".rl.alignment-tmp-999999-1")
    try:
        assert holder.stdout.readline().strip() == "WRITING"
        code, stderr = train_rl_cli(capsys, flags(pipeline, "live_writer", checkpoint_path=target))
        assert code == 2 and "is in use by another run" in stderr, stderr[-2000:]
        assert (temp / "model.safetensors").read_bytes() == b"half written"
    finally:
        holder.kill()
        holder.wait()
    with OutputLock([(target, "--checkpoint_path")]):  # once the writer is gone, its leftover goes under the lock
        checkpoint.recover_checkpoint(target)
    assert not temp.exists()


def test_lock_files_are_the_tools_own(pipeline, capsys):
    """A user's `rl.lock` (or `<run>.lock`) is never written; a foreign file at the tool's lock name is refused in one line."""
    root = pipeline.root / "lock_names"
    root.mkdir()
    (root / "rl.lock").write_text("my lock notes")
    (pipeline.root / "runs" / "lock_names.lock").parent.mkdir(parents=True, exist_ok=True)
    (pipeline.root / "runs" / "lock_names.lock").write_text("mine too")
    train_rl.main(flags(pipeline, "lock_names", "--max_steps", "1", checkpoint_path=root / "rl"))
    assert (root / "rl.lock").read_text() == "my lock notes" and (pipeline.root / "runs" / "lock_names.lock").read_text() == "mine too"
    assert (root / ".rl.alignment-lock").read_text().startswith("alignment lock, pid ")
    (pipeline.root / "foreign_lock").mkdir()
    (pipeline.root / "foreign_lock" / ".rl.alignment-lock").write_text("a file of mine")
    code, stderr = train_rl_cli(capsys, flags(pipeline, "foreign_lock", checkpoint_path=pipeline.root / "foreign_lock" / "rl"))
    assert code == 2 and "alignment-lock is not a lock file this tool wrote; move it away" in stderr and "Traceback" not in stderr
    assert (pipeline.root / "foreign_lock" / ".rl.alignment-lock").read_text() == "a file of mine"


def test_evaluate_keeps_a_whole_split_evaluation_from_a_quick_check_of_the_same_model(pipeline, monkeypatch):
    """`--num_examples 20` on a checkpoint evaluated on the whole split: the default --output_dir is the same
    (runs/eval/<name>), and the quick check replaced the full evaluation's metrics.json and samples.jsonl."""
    monkeypatch.chdir(pipeline.root)
    model = pipeline.root / "quick" / "checked"
    _sft_checkpoint_of_ours(pipeline, model)
    common = ["--model_path", str(model), "--backend", "hf", "--data_dir", str(pipeline.data)]
    evaluate.main([*common, "--max_tokens", "4"])
    folder = pipeline.root / "runs" / "eval" / "checked"
    written = snapshot(folder)
    assert json.loads(written["metrics.json"])["num_examples"] == 8
    # another test set of as many rows (GSM-Hard has GSM8K's 1,319), here one answer changed: another evaluation
    other_data = pipeline.root / "other_data"
    shutil.copytree(pipeline.data, other_data)
    rows = (other_data / "test.jsonl").read_text().splitlines()
    first = json.loads(rows[0])
    rows[0] = json.dumps({**first, "answer": first["answer"].rsplit("####", 1)[0] + "#### 12345"})
    (other_data / "test.jsonl").write_text("\n".join(rows) + "\n")
    ours, theirs = (file_sha256(data / "test.jsonl")[:12] for data in (pipeline.data, other_data))
    for other, before, setup in ((["--num_examples", "2", "--max_tokens", "4"], "8 test examples", "2 test examples"),
                                 (["--max_tokens", "4", "--data_dir", str(other_data)], f"8 test examples of a test.jsonl with SHA-256 {ours}",
                                  f"8 test examples of a test.jsonl with SHA-256 {theirs}"),
                                 (["--max_tokens", "6"], "8 test examples, --max_tokens 4", "8 test examples, --max_tokens 6"),
                                 (["--split", "train", "--num_examples", "8", "--max_tokens", "4"], "8 test examples", "8 train examples"),
                                 (["--max_tokens", "4", "--repetition_penalty", "1.0"], "8 test examples, --repetition_penalty 1.1",
                                  "8 test examples, --repetition_penalty 1.0"),
                                 (["--max_tokens", "4", "--samples", "2", "--pass_k", "2"], "8 test examples, --samples 0", "8 test examples, --samples 2")):
        with pytest.raises(UserError, match=rf"^the default --output_dir runs/eval/checked \(runs/eval/<model folder name>\) holds an evaluation of "
                                            rf".*quick/checked on {before} \(metrics.json\); this one is on {setup}: "
                                            r"pass another --output_dir to keep both, or remove it to replace it \(nothing was changed\)$"):
            evaluate.main([*common, *other])
        assert snapshot(folder) == written
    recorded = json.loads(written["metrics.json"])
    assert {key: recorded[key] for key in ("top_p", "min_tokens", "repetition_penalty", "pass_at_k_samples")} == {
        "top_p": 1.0, "min_tokens": 0, "repetition_penalty": 1.1, "pass_at_k_samples": 0}
    evaluate.main([*common, "--max_tokens", "4", "--seed", "3"])  # the same evaluation again: replaced
    evaluate.main([*common, "--num_examples", "2", "--max_tokens", "4", "--output_dir", "runs/eval/quick_check"])
    assert json.loads(snapshot(folder)["metrics.json"])["num_examples"] == 8
    # pass@k: another k, sample temperature or seed is another evaluation (pass@4 at T=1 was replaced by pass@2 at T=0.5)
    sampled = ["--max_tokens", "4", "--samples", "2", "--pass_k", "2", "--samples_temperature", "1.0", "--output_dir", "runs/eval/sampled"]
    evaluate.main([*common, *sampled])
    written = snapshot(pipeline.root / "runs" / "eval" / "sampled")
    for other, before, setup in ((["--pass_k", "1"], "--pass_k 2", "--pass_k 1"), (["--samples_temperature", "0.5"], "--samples_temperature 1.0",
                                  "--samples_temperature 0.5"), (["--seed", "1"], "--seed 0", "--seed 1")):
        with pytest.raises(UserError, match=rf"^--output_dir runs/eval/sampled holds an evaluation of .*quick/checked on 8 test examples, {before} "
                                            rf"\(metrics.json\); this one is on 8 test examples, {setup}: pass another --output_dir to keep both"):
            evaluate.main([*common, *sampled, *other])
        assert snapshot(pipeline.root / "runs" / "eval" / "sampled") == written


def test_an_evaluation_that_cannot_write_its_results_says_so_in_one_line_and_leaves_no_cut_file(pipeline, tmp_path):
    """A full disk (here a file-size limit) when the samples are written, after the whole evaluation (hours with pass@k):
    a traceback, and a cut samples.jsonl.tmp left in the folder."""
    out = tmp_path / "eval"
    command = shlex.join([sys.executable, "-m", "alignment.evaluate", "--model_path", str(pipeline.sft), "--backend", "hf", "--device", "cpu",
                          "--data_dir", str(pipeline.data), "--max_tokens", "16", "--output_dir", str(out)])
    result = subprocess.run(["bash", "-c", f"ulimit -f 1; exec {command}"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.fullmatch(rf"error: the evaluation stopped on a file error: File too large \({re.escape(str(out))}/\w+\.jsonl?\); free space or pass "
                        r"a writable folder, then run again\n", result.stderr.splitlines(keepends=True)[-1]), result.stderr[-2000:]
    assert not list(out.glob("*.tmp"))
    # train_rl's evaluate-only rerun of a finished run, the same way
    train_rl.main(flags(pipeline, "full_disk", "--max_steps", "1"))
    result = subprocess.run(["bash", "-c", f"ulimit -f 1; exec {shlex.join([sys.executable, '-m', 'alignment.train_rl', *flags(pipeline, 'full_disk', '--max_steps', '1')])}"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    run_dir = pipeline.root / "runs" / "full_disk"
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith(f"error: the evaluation of {pipeline.root / 'full_disk' / 'rl'} stopped on a file error: File too large ("), result.stderr[-2000:]
    assert not list(run_dir.glob("*.tmp"))  # each file whole or not there (which one the limit stops depends on the responses' length)


HOLD_EVAL_LOCK = """
import sys, time
from alignment.checkpoint import OutputLock
with OutputLock([(sys.argv[1], "--output_dir")]):
    print("LOCKED", flush=True)
    time.sleep(120)
"""


def test_evaluate_keeps_another_models_metrics_and_one_writer_per_folder(pipeline, monkeypatch):
    """Two checkpoints named alike share the default --output_dir (runs/eval/<name>): the second is refused, not written over
    the first; the same model again replaces its own; a folder another evaluation is writing is refused by its lock."""
    monkeypatch.chdir(pipeline.root)
    first, second = pipeline.root / "a" / "rl", pipeline.root / "b" / "rl"
    for path in (first, second):
        _sft_checkpoint_of_ours(pipeline, path)
    common = ["--backend", "hf", "--data_dir", str(pipeline.data), "--num_examples", "2", "--max_tokens", "4"]
    evaluate.main(["--model_path", str(first), *common])
    written = snapshot(pipeline.root / "runs" / "eval" / "rl")
    with pytest.raises(UserError, match=r"the default --output_dir runs/eval/rl .* holds the evaluation of .*a/rl \(metrics.json\); pass another --output_dir"):
        evaluate.main(["--model_path", str(second), *common])
    assert snapshot(pipeline.root / "runs" / "eval" / "rl") == written
    evaluate.main(["--model_path", str(first), *common])  # the same model: its own evaluation is replaced
    passk = ["--model_path", str(first), *common, "--samples", "4", "--output_dir", "runs/eval/passk"]
    evaluate.main(passk)
    written = snapshot(pipeline.root / "runs" / "eval" / "passk")

    def stopped(*args):
        raise KeyboardInterrupt  # Ctrl-C during pass@k sampling

    def graded_again(*args):  # samples that differ from the first evaluation's (greedy would repeat them)
        metrics = real_evaluate_math(*args)
        return {**metrics, "samples": [{**sample, "evaluation": "second"} for sample in metrics["samples"]]}

    real_evaluate_math = evaluate.evaluate_math
    monkeypatch.setattr(evaluate, "evaluate_math", graded_again)
    monkeypatch.setattr(evaluate, "add_pass_at_k", stopped)
    with pytest.raises(KeyboardInterrupt):
        evaluate.main(passk)
    assert snapshot(pipeline.root / "runs" / "eval" / "passk") == written  # samples and metrics of one evaluation, not two
    monkeypatch.undo()
    monkeypatch.chdir(pipeline.root)
    evaluate.main(["--model_path", str(second), *common, "--output_dir", "runs/eval/b_rl"])
    holder = subprocess.Popen([sys.executable, "-c", HOLD_EVAL_LOCK, "runs/eval/busy"], cwd=pipeline.root, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        with pytest.raises(UserError, match=r"--output_dir runs/eval/busy is in use by another run"):
            evaluate.main(["--model_path", str(first), *common, "--output_dir", "runs/eval/busy"])
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_sighup_from_a_dropped_session_saves_the_state_though_the_terminal_is_gone(pipeline, tmp_path):
    """An ssh drop: SIGHUP, and every later write to the terminal fails (here: stdout's reader closed, EPIPE).
    The run finishes the step, saves its training state and exits 129, as for SIGTERM."""
    name = "hangup"
    command = [sys.executable, "-m", "alignment.train_rl", *flags(pipeline, name, "--save_state_every", "5", "--max_steps", "6")]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=stderr, text=True)
        for line in process.stdout:
            if line.startswith("step 1/6"):
                process.send_signal(signal.SIGHUP)
                break
        process.stdout.close()  # the terminal is gone: the run's next writes to stdout fail
        assert process.wait(timeout=300) == 129
    err = (tmp_path / "stderr.txt").read_text()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-3000:]
    stopped = re.search(r"stopped by SIGHUP after step (\d+): the training state of step \1 is in (\S+); continue with", err)
    assert stopped, err[-2000:]
    assert read_manifest(stopped.group(2))["step"] == int(stopped.group(1))


def test_a_symlinked_checkpoint_path_is_written_where_it_points_and_a_loop_is_one_line(pipeline, capsys):
    """A link to a folder elsewhere (dangling until the first save), as --checkpoint_path and as --state_dir: the run
    writes the folder it points to and the link stays a link. A link loop fails at start-up in one line."""
    elsewhere, link = pipeline.root / "big_disk" / "rl", pipeline.root / "linked_rl"
    elsewhere.parent.mkdir()
    link.symlink_to(elsewhere)  # dangling: elsewhere/rl does not exist yet
    train_rl.main(flags(pipeline, "linked", "--max_steps", "1", checkpoint_path=link))
    assert link.is_symlink() and (elsewhere / "model.safetensors").is_file()
    assert "linked_rl is a symbolic link: writing to" in capsys.readouterr().out
    (pipeline.root / "linked_state").symlink_to(pipeline.root / "big_disk" / "state")
    train_rl.main(flags(pipeline, "linked_2", "--max_steps", "1", "--save_state_every", "1", "--state_dir", str(pipeline.root / "linked_state"),
                        checkpoint_path=pipeline.root / "linked_rl_2"))
    assert (pipeline.root / "linked_state").is_symlink() and not (pipeline.root / "big_disk" / "state").exists()  # finished: its state removed
    loop = pipeline.root / "loop"
    loop.symlink_to(loop)
    code, stderr = train_rl_cli(capsys, flags(pipeline, "loop", checkpoint_path=loop))
    assert code == 2 and "--checkpoint_path" in stderr and "is a symbolic link that cannot be followed" in stderr and "Traceback" not in stderr


def _rewrite_in_state(state: Path, name: str, change) -> None:
    """What an older version (or another tool) left: `change(text)` applied to a state file, its manifest entry kept in step."""
    file = state / name
    file.write_text(change(file.read_text()))
    manifest = json.loads((state / MANIFEST_NAME).read_text())
    manifest["files"][name] = {"bytes": file.stat().st_size, "sha256": checkpoint.file_sha256(file)}
    (state / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_resume_refuses_what_would_silently_change_the_run(pipeline, monkeypatch):
    """Round 4: a start checkpoint with other weights (the KL reference would be another model), --max_steps below the
    state's step (the final metrics would name a step the weights passed), a state without its run record or with
    counters an older version wrote (a KeyError traceback)."""
    import shutil

    from safetensors.torch import load_file, save_file

    start = pipeline.root / "own_sft"
    shutil.copytree(pipeline.sft, start)
    state = interrupted_run(pipeline, "inputs", monkeypatch, "--sft_checkpoint_path", str(start))
    resume = flags(pipeline, "inputs", "--save_state_every", "1", "--resume", "--sft_checkpoint_path", str(start))
    weights = load_file(str(start / "model.safetensors"))
    save_file({name: tensor + 0.01 for name, tensor in weights.items()}, str(start / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"--resume: the start checkpoint \(--sft_checkpoint_path .*own_sft\) holds other files than when the run started"):
        train_rl.main(resume)
    save_file(weights, str(start / "model.safetensors"), metadata={"format": "pt"})
    run_until_a_state_is_saved(monkeypatch, resume)  # the same weights back: it resumes, and stops after saving step 2
    assert read_manifest(state)["step"] == 2
    with pytest.raises(UserError, match=r"--resume --max_steps 1: the training state in .* is at step 2 already; pass --max_steps 2 or more"):
        train_rl.main([*resume, "--max_steps", "1"])
    old = interrupted_run(pipeline, "old_state", monkeypatch)
    _rewrite_in_state(old, "counters.json", lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "policy_version"}))
    with pytest.raises(UserError, match=r"has no policy_version in its counters.json \(an older version wrote it\); start a new run with another "
                                        r"--checkpoint_path and --run_name, or remove .*old_state/rl.state and .*runs/old_state to start over"):
        train_rl.main(flags(pipeline, "old_state", "--save_state_every", "1", "--resume"))
    manifest = json.loads((old / MANIFEST_NAME).read_text())
    manifest.pop("run")
    (old / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"--resume: the training state in .*old_state.* records no flags \(an older version wrote it\).* "
                                        r"--checkpoint_path and --run_name, or remove .*old_state/rl.state and .*runs/old_state to start over"):
        train_rl.main(flags(pipeline, "old_state", "--save_state_every", "1", "--resume"))


def _broken_model_folders(pipeline) -> dict[str, Path]:
    """Copies of the tiny model, each broken as a model folder from elsewhere gets broken."""
    import shutil

    def config_change(**changes):
        def change(folder):
            config = json.loads((folder / "config.json").read_text())
            config.update({key: value(config) if callable(value) else value for key, value in changes.items()})
            (folder / "config.json").write_text(json.dumps(config))
        return change

    def missing_shard(folder):  # sharded (with its index), then one shard gone
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder)
        (folder / "model.safetensors").unlink()
        model.save_pretrained(folder, max_shard_size="100KB")
        sorted(folder.glob("model-*.safetensors"))[-1].unlink()

    breaks = {
        "no_tokenizer": lambda folder: [file.unlink() for file in folder.glob("*token*")],
        "missing_shard": missing_shard,
        "vocab_size": config_change(vocab_size=lambda config: config["vocab_size"] + 7),
        "other_shape": config_change(intermediate_size=lambda config: config["intermediate_size"] * 2),
        "model_type": config_change(model_type="qwen9"),
        "truncated_tokenizer": lambda folder: (folder / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes()[:3000]),
    }
    folders = {}
    for name, breaking in breaks.items():
        folders[name] = pipeline.root / "broken_models" / name
        if not folders[name].exists():
            shutil.copytree(pipeline.sft, folders[name])
            breaking(folders[name])
    return folders


BROKEN_MODEL_MESSAGES = {
    "no_tokenizer": r"has no tokenizer \(tokenizer.json or tokenizer.model or vocab.json\); save the tokenizer beside the weights",
    "missing_shard": r"its safetensors files hold no [\w.]+( \(nor \d+ more weights\))?; a shard is missing or incomplete: restore the checkpoint",
    "vocab_size": r"model.safetensors holds model.embed_tokens.weight of shape \[\d+, \d+\], but its config.json makes it \[\d+, \d+\]",
    "other_shape": r"model.safetensors holds model.layers.0.mlp.\w+.weight of shape .* the weights and config.json come from different models",
    "model_type": r"its config.json does not load \(.*model type `qwen9`.*\); restore it, or install a transformers that knows its model_type",
    "truncated_tokenizer": r"its tokenizer does not load \(\w+: .*\); restore the tokenizer files",
}


def test_a_broken_model_folder_is_one_line_before_any_engine_loads_it(pipeline):
    """A folder without tokenizer files, with a shard missing, with a wrong vocab_size, with weights of another shape, an unknown
    model_type, a truncated tokenizer.json: as evaluate's --model_path, train_rl's --sft_checkpoint_path and train_sft's --model."""
    for name, folder in _broken_model_folders(pipeline).items():
        message = BROKEN_MODEL_MESSAGES[name]
        with pytest.raises(UserError, match=rf"--model_path .*{name}(: | ){message}"):
            evaluate.main(["--model_path", str(folder), "--backend", "vllm", "--data_dir", str(pipeline.data), "--output_dir", str(pipeline.root / "eval_broken")])
        with pytest.raises(UserError, match=rf"--sft_checkpoint_path .*{name}(: | ){message}"):
            train_rl.main([*flags(pipeline, f"broken_{name}"), "--sft_checkpoint_path", str(folder), "--rollout_backend", "vllm"])
        with pytest.raises(UserError, match=rf"--model .*{name}(: | ){message}"):
            train_sft.main(["--model", str(folder), "--checkpoint_path", str(pipeline.root / f"sft_{name}"), "--data_dir", str(pipeline.data),
                            "--log_dir", str(pipeline.root / "runs")])


def test_a_save_refused_by_a_file_added_mid_run_goes_beside_the_checkpoint(tmp_path, monkeypatch, capsys):
    """A file added to the checkpoint folder after epoch 0's save made every later save refuse the folder: the run
    exited after all its training, and the steps since the last save were gone (no state: all of them)."""
    from alignment.errors import RunStopped

    task = make_tiny_task(tmp_path, num_train=8, num_test=4, seed=4)  # 4 prompts a step: 2 steps an epoch
    checkpoint_path = task.root / "added" / "rl"
    real_save = train_rl.save_policy

    def save_then_add_a_file(ranks, model, tokenizer, path, step, *rest):
        saved_to = real_save(ranks, model, tokenizer, path, step, *rest)
        if step == 2:
            (checkpoint_path / "notes.txt").write_text("the user's\n")
        return saved_to

    monkeypatch.setattr(train_rl, "save_policy", save_then_add_a_file)
    with pytest.raises(RunStopped, match=r"the trained policy \(step 6\) is saved to .*added/rl\.step6, not to --checkpoint_path .*added/rl, "
                                         r"which changed during the run") as stopped:
        train_rl.main(train_rl_flags(task, "added", "--num_epochs", "3"))
    assert stopped.value.exit_code == 1
    out = capsys.readouterr().out
    assert "epoch 1 done: saved policy to " + str(checkpoint_path) + ".step4" in out
    assert re.search(r"warning: .*added/rl holds files its manifest does not list \(notes\.txt\).*after step 4 was not saved there", out)
    # the user's file and epoch 0's weights stay; each refused save went to its own sibling, the last one the run's result
    assert (checkpoint_path / "notes.txt").read_text() == "the user's\n" and read_manifest(checkpoint_path)["step"] == 2
    for step in (4, 6):
        diverted = checkpoint_path.with_name(f"rl.step{step}")
        assert {k: read_manifest(diverted)[k] for k in ("kind", "step", "total_steps")} == {"kind": "rl_checkpoint", "step": step, "total_steps": 6}
        verify_manifest(diverted, "the diverted checkpoint")
    assert json.loads((task.root / "runs" / "added" / "final_eval_metrics.json").read_text())["step"] == 6


def test_a_run_from_a_downloaded_model_resumes_after_hidden_files_appear_in_it(tmp_path, monkeypatch, capsys):
    """A start folder this tool did not write (`hf download --local-dir`, no manifest) is fingerprinted by its files: the
    download notes under .cache/ and a file browser's .DS_Store changed that, and --resume refused the run. A state an
    earlier version wrote (its fingerprint counted those files) resumes as well, and changed weights are still refused."""
    task = make_tiny_task(tmp_path / "exp", num_train=16, num_test=4, seed=6)
    assert not (task.sft / MANIFEST_NAME).exists()  # a model folder from elsewhere, as a download is
    (task.sft / ".cache" / "huggingface").mkdir(parents=True)
    (task.sft / ".cache" / "huggingface" / "config.json.metadata").write_text("abc\n1.0\n")
    state = interrupted_run(task, "downloaded", monkeypatch)
    (task.sft / ".cache" / "huggingface" / "config.json.metadata").write_text("abc\n2.0\n")  # the download run again
    (task.sft / ".DS_Store").write_bytes(b"\0")
    train_rl.main(flags(task, "downloaded", "--save_state_every", "1", "--resume"))
    assert [s["step"] for s in steps_log(task, "downloaded")] == [1, 2, 3]
    # the same run's state as an earlier version recorded it: the fingerprint of every file, hidden ones in
    state = interrupted_run(task, "earlier", monkeypatch)
    earlier = hashlib.sha256(json.dumps(checkpoint._file_table(task.sft), sort_keys=True).encode()).hexdigest()
    manifest = json.loads((state / MANIFEST_NAME).read_text())
    assert manifest["run"]["start_checkpoint_sha256"] != earlier
    manifest["run"]["start_checkpoint_sha256"] = earlier
    (state / MANIFEST_NAME).write_text(json.dumps(manifest))
    train_rl.main(flags(task, "earlier", "--save_state_every", "1", "--resume"))
    assert [s["step"] for s in steps_log(task, "earlier")] == [1, 2, 3]
    # its finished checkpoint, as the earlier version recorded it, is evaluated by the same command again (not refused)
    result = task.root / "earlier" / "rl"
    manifest = json.loads((result / MANIFEST_NAME).read_text())
    manifest["run"]["start_checkpoint_sha256"] = earlier
    (result / MANIFEST_NAME).write_text(json.dumps(manifest))
    capsys.readouterr()
    train_rl.main(flags(task, "earlier", "--save_state_every", "1"))
    assert "rl already holds weights: evaluating it" in capsys.readouterr().out
    interrupted_run(task, "edited", monkeypatch)
    (task.sft / "config.json").write_text((task.sft / "config.json").read_text().replace("{", '{"note": 1, ', 1))
    with pytest.raises(UserError, match=r"--resume: the start checkpoint .* holds other files than when the run started"):
        train_rl.main(flags(task, "edited", "--save_state_every", "1", "--resume"))


def test_a_stopped_run_resumes_after_its_folders_moved(tmp_path, monkeypatch, capsys):
    """The start checkpoint's and the data's paths were compared as strings: after `mv exp exp_moved` (or a cluster's new
    mount point) --resume was refused, and its advice (pass the old path) named a folder that no longer exists."""
    from types import SimpleNamespace

    task = make_tiny_task(tmp_path / "exp", num_train=16, num_test=4, seed=6)
    interrupted_run(task, "moved", monkeypatch)
    shutil.move(tmp_path / "exp", tmp_path / "exp_moved")
    moved = SimpleNamespace(root=tmp_path / "exp_moved", data=tmp_path / "exp_moved" / "data", sft=tmp_path / "exp_moved" / "sft")
    capsys.readouterr()
    train_rl.main(flags(moved, "moved", "--save_state_every", "1", "--resume"))
    out = capsys.readouterr().out
    assert re.search(r"resume: --sft_checkpoint_path .*exp_moved/sft \(the run had .*exp/sft; the same files\) takes effect", out)
    assert re.search(r"resume: --data_dir .*exp_moved/data \(the run had .*exp/data; the same files\) takes effect", out)
    assert [s["step"] for s in steps_log(moved, "moved")] == [1, 2, 3]
    # a moved folder with other contents is still another input
    interrupted_run(moved, "edited", monkeypatch)
    shutil.move(moved.data, tmp_path / "data2")
    train_file = tmp_path / "data2" / "train.jsonl"
    train_file.write_text("\n".join(reversed(train_file.read_text().splitlines())) + "\n")
    with pytest.raises(UserError, match=r"--resume: --data_dir is '.*data2' but the run was started with '.*exp_moved/data'"):
        train_rl.main([*flags(moved, "edited", "--save_state_every", "1", "--resume"), "--data_dir", str(tmp_path / "data2")])


def test_a_removal_cut_short_leaves_a_folder_the_tool_still_knows_and_removes_later(tmp_path, monkeypatch, capsys):
    """A kill or a busy file part way through removing a training state: what is left keeps its manifest (removed last),
    so it is neither refused as a user's folder nor left for ever; the warning names the folder and the cause."""
    state = tmp_path / "rl.state"

    def write(folder):
        for name in ("a.bin", "b.bin", "c.bin"):
            (folder / name).write_bytes(name.encode())

    write_atomically(state, write, kind="training_state")
    real_unlink, removed = Path.unlink, []

    def busy_after_one(path, *args, **kwargs):
        if path.parent == state and removed:
            raise OSError(16, "Device or resource busy")
        removed.append(path.name)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", busy_after_one)
    assert checkpoint.remove_output(state, "training_state") is False
    assert f"warning: could not remove {state} (Device or resource busy)" in capsys.readouterr().out
    monkeypatch.setattr(Path, "unlink", real_unlink)
    left = sorted(file.name for file in state.iterdir())
    assert len(left) == 3 and checkpoint.MANIFEST_NAME in left and removed[0] not in left  # one file gone, the manifest kept
    assert checkpoint.ownership_problem(state, "training_state") is None
    assert checkpoint.remove_output(state, "training_state") is True and not state.exists()


def test_an_empty_log_folder_is_taken_and_marked(tmp_path):
    """`mkdir runs/rl` before a run (a habit): an empty folder holds nothing of anyone's, so it is taken and marked with
    the run's id like a new one, not refused as a user's."""
    empty = tmp_path / "runs" / "rl"
    empty.mkdir(parents=True)
    checkpoint.claim_log_folder(empty, "--log_dir/--run_name", run_id="mine")
    assert checkpoint.log_folder_run_id(empty) == "mine"


# ------------------------------------------- the writer, the locks and the run notes, called directly


def _lock_is_free(lock: Path, shared: bool = False) -> bool:
    """Whether another process could take `lock` now (exclusively, or `shared`): flock treats another open file
    description of it as another holder."""
    import fcntl

    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_save_holds_its_paths_lock_against_other_processes_while_it_writes(tmp_path):
    """The swap is serialised across processes by an exclusive flock on the path's lock file (the concurrency test
    above runs threads of one process, which the thread lock alone keeps apart): while a save writes, no other holder
    can take even a shared lock, and a save waits while another process holds the lock."""
    import fcntl

    target, lock = tmp_path / "ckpt", tmp_path / ".ckpt.alignment-lock"
    seen = []

    def write(folder):
        seen.append(_lock_is_free(lock, shared=True))
        (folder / "weights.txt").write_text("step 1")

    write_atomically(target, write, kind="rl_checkpoint")
    assert seen == [False]
    other = os.open(lock, os.O_RDWR)  # another process's writer, mid-swap
    fcntl.flock(other, fcntl.LOCK_EX)
    saved = threading.Event()
    thread = threading.Thread(target=lambda: (write_atomically(target, lambda folder: (folder / "weights.txt").write_text("step 2"), kind="rl_checkpoint"), saved.set()))
    thread.start()
    try:
        assert not saved.wait(0.5) and (target / "weights.txt").read_text() == "step 1"  # it waits
    finally:
        os.close(other)
    thread.join(30)
    assert saved.is_set() and (target / "weights.txt").read_text() == "step 2"


def test_a_runs_locks_are_held_for_real_and_given_back_whole(tmp_path):
    """OutputLock holds each path's flock until it is released, takes it again after that in the same process, and
    gives back every lock it took when a later one is refused (a process that goes on, a notebook or a test, would
    otherwise keep the first path from every other run). The lock file names its holder alone, however long the pid
    an earlier holder wrote there."""
    a, b = tmp_path / "a", tmp_path / "b"
    lock_a = tmp_path / ".a.alignment-lock"
    lock_a.write_text("alignment lock, pid 123456789\n")
    (tmp_path / ".b.alignment-lock").write_text("a file of mine")
    with pytest.raises(UserError, match=r"--state_dir .*b: .*\.b\.alignment-lock is not a lock file this tool wrote"):
        OutputLock([(a, "--checkpoint_path"), (b, "--state_dir")])
    assert _lock_is_free(lock_a)
    for _ in range(2):
        with OutputLock([(a, "--checkpoint_path")]):
            assert not _lock_is_free(lock_a)
            assert lock_a.read_text() == f"alignment lock, pid {os.getpid()}\n"
        assert _lock_is_free(lock_a)


def test_a_save_whose_last_rename_fails_puts_the_previous_folder_back(tmp_path, monkeypatch):
    """The previous folder went to its backup and the new one could not be renamed into place (a permission, a busy
    mount): the previous folder is at the path again when the error says it is intact, with no backup left."""
    target = tmp_path / "ckpt"
    write_atomically(target, lambda folder: (folder / "weights.txt").write_text("step 1"), kind="rl_checkpoint")
    real_rename = os.rename

    def refused(source, destination):
        if Path(destination) == target and ".alignment-tmp-" in Path(source).name:
            raise OSError(errno.EACCES, "Permission denied")
        real_rename(source, destination)

    monkeypatch.setattr(checkpoint.os, "rename", refused)
    with pytest.raises(UserError, match=rf"could not write {re.escape(str(target))} \(Permission denied; .*\); the previous {re.escape(str(target))} is intact"):
        write_atomically(target, lambda folder: (folder / "weights.txt").write_text("step 2"), kind="rl_checkpoint")
    monkeypatch.undo()
    assert (target / "weights.txt").read_text() == "step 1" and verify_manifest(target, "")["kind"] == "rl_checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.alignment-lock", "ckpt"]


def test_a_run_removes_no_state_without_its_id_and_no_empty_folder(tmp_path):
    """A run removes only a state whose manifest records its own id: a state that records no run stays, and so does an
    empty --state_dir made before the run (returned as not removed, not an AttributeError after the whole training)."""
    state = tmp_path / "rl.state"
    write_atomically(state, lambda folder: (folder / "counters.json").write_text("{}"), kind="training_state")
    assert checkpoint.remove_output(state, "training_state", run_id="mine") is False and (state / "counters.json").is_file()
    empty = tmp_path / "empty.state"
    empty.mkdir()
    assert checkpoint.remove_output(empty, "training_state", run_id="mine") is False and empty.is_dir()
    assert checkpoint.remove_output(empty, "training_state") is False and empty.is_dir()


def test_hidden_files_and_files_in_subfolders_count_as_the_users(tmp_path):
    """A folder holding only hidden entries (a `.git`) is not empty, and a file added inside a subfolder of a folder the
    tool wrote (a state's policy/) is the user's: both refused, named, and left as they were."""
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    with pytest.raises(UserError, match=r"--checkpoint_path .*repo holds files this tool did not write"):
        checkpoint.check_output_path(repo, "--checkpoint_path", "rl_checkpoint")
    with pytest.raises(UserError, match="holds files this tool did not write"):
        write_atomically(repo, lambda folder: (folder / "x").write_text("x"), kind="rl_checkpoint")
    assert checkpoint.remove_output(repo, "rl_checkpoint") is False
    assert snapshot(repo) == {".git/HEAD": b"ref: refs/heads/main\n"}
    state = tmp_path / "rl.state"

    def write(folder):
        (folder / "policy").mkdir()
        (folder / "policy" / "config.json").write_text("{}")

    write_atomically(state, write, kind="training_state")
    (state / "policy" / "notes.txt").write_text("mine")
    assert checkpoint.ownership_problem(state, "training_state") == "holds files its manifest does not list (policy/notes.txt), added after this tool wrote it"
    assert checkpoint.remove_output(state, "training_state") is False and (state / "policy" / "notes.txt").read_text() == "mine"


def test_outputs_are_told_apart_however_their_paths_are_spelled(tmp_path):
    """`..` in a path, a folder reached through a linked parent, and an output that holds one named before it: each is
    refused in one line naming both flags, as the same folder or one holding the other."""
    (tmp_path / "exp").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "exp", target_is_directory=True)
    rl = tmp_path / "exp" / "rl"
    cases = [
        ([(rl, "--checkpoint_path"), (tmp_path / "exp" / "runs" / ".." / "rl", "--state_dir")], r"--state_dir .* is the same folder as --checkpoint_path"),
        ([(rl, "--checkpoint_path"), (tmp_path / "link" / "rl", "--state_dir")], r"--state_dir .*link/rl is the same folder as --checkpoint_path"),
        ([(rl / "state", "--state_dir"), (rl, "--checkpoint_path")], r"--checkpoint_path .*exp/rl is a folder that holds --state_dir"),
    ]
    for outputs, message in cases:
        with pytest.raises(UserError, match=message):
            checkpoint.check_distinct_outputs(outputs)


def test_a_start_folder_from_elsewhere_is_fingerprinted_by_its_model_files_not_its_hidden_ones(tmp_path):
    """`hf download --local-dir` keeps download notes under .cache/ in the folder and a file browser leaves .DS_Store:
    either changed the start model's fingerprint, and --resume refused a run from an unchanged model."""
    hub = tmp_path / "models" / "qwen"
    (hub / "nested").mkdir(parents=True)
    (hub / "config.json").write_text('{"model_type": "qwen2"}')
    (hub / "nested" / "model.safetensors").write_bytes(b"weights")
    before = checkpoint.folder_fingerprint(hub)
    (hub / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (hub / ".cache" / "huggingface" / "download" / "config.json.metadata").write_text("abc\n1796690000.0\n")
    (hub / ".DS_Store").write_bytes(b"\0\0")
    assert checkpoint.folder_fingerprint(hub) == before
    # a run recorded by an earlier version, whose fingerprint counted the hidden files: the same folder as it recorded
    table = checkpoint._file_table(hub)
    earlier = hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()
    assert earlier != before and checkpoint.folder_fingerprint(hub, recorded=earlier) == earlier
    assert checkpoint.folder_fingerprint(hub, recorded="another") == before
    (hub / "nested" / "model.safetensors").write_bytes(b"other weights")  # the model's own files still count, at any depth
    assert checkpoint.folder_fingerprint(hub) != before and checkpoint.folder_fingerprint(hub, recorded=earlier) not in (before, earlier)


def test_the_notes_of_unfinished_runs_find_each_state_and_outlive_a_sibling_run(tmp_path, monkeypatch):
    """Runs from one start checkpoint note where they keep their states: a relative --state_dir is noted as the folder
    it names (read from anywhere), one run finishing leaves the others' notes, a state that records no start checkpoint
    is not taken for a run from this one, and a start folder this tool did not write gets no note beside it."""
    sft = tmp_path / "checkpoints" / "sft"
    write_atomically(sft, lambda folder: (folder / "model.safetensors").write_bytes(b"weights"), kind="sft_checkpoint")
    fingerprint = checkpoint.folder_fingerprint(sft)
    exp = tmp_path / "exp"
    for name, start in (("a", fingerprint), ("b", fingerprint), ("c", None)):
        run = {"run_id": name, **({"start_checkpoint_sha256": start} if start else {})}
        write_atomically(exp / f"{name}.state", lambda folder: (folder / "counters.json").write_text("{}"), kind="training_state", record={"run": run, "step": 1})
    monkeypatch.chdir(exp)
    for name in ("a", "b", "c"):
        checkpoint.record_run_from(sft, name, f"{name}.state")  # relative, as typed
    monkeypatch.chdir(tmp_path)
    assert sorted((folder.resolve(), step) for folder, step in unfinished_runs_from(sft)) == [((exp / "a.state").resolve(), 1), ((exp / "b.state").resolve(), 1)]
    checkpoint.forget_run_from(sft, "a")  # run a finished: its state and its note go
    shutil.rmtree(exp / "a.state")
    assert [(folder.resolve(), step) for folder, step in unfinished_runs_from(sft)] == [((exp / "b.state").resolve(), 1)]
    hub = tmp_path / "models" / "hub_model"
    hub.mkdir(parents=True)
    (hub / "config.json").write_text("{}")
    checkpoint.record_run_from(hub, "d", exp / "b.state")
    assert sorted(p.name for p in hub.parent.iterdir()) == ["hub_model"]
