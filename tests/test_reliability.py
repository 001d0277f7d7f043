"""Crash safety, resume, and numerical faults (see RELIABILITY.md)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignment import train_rl
from alignment.checkpoint import has_training_state, read_manifest, recover_checkpoint, save_model_atomically
from alignment.errors import UserError
from conftest import REPO_ROOT, kill_train_rl_after_saved_state, make_tiny_task, run_train_rl, steps_log, train_rl_flags


SLOW_SAVE = """
import sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from alignment.checkpoint import save_model_atomically
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
real_save = model.save_pretrained
def slow_save(folder, **kwargs):
    real_save(folder, **kwargs)          # the new weights are half-way into the temp folder
    print("WRITING", flush=True)
    time.sleep(60)                       # killed here
model.save_pretrained = slow_save
save_model_atomically(model, tokenizer, sys.argv[2], "rl_checkpoint")
"""


def weights(path):
    return load_file(str(Path(path) / "model.safetensors"))


def test_kill_mid_save_keeps_the_previous_checkpoint(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tmp_path / "ckpt"
    save_model_atomically(AutoModelForCausalLM.from_pretrained(tiny_checkpoint), AutoTokenizer.from_pretrained(tiny_checkpoint), target, "rl_checkpoint")
    before = weights(target)
    process = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, str(tiny_checkpoint), str(target)], cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert process.stdout.readline().strip() == "WRITING"
    process.send_signal(signal.SIGKILL)
    process.wait()
    leftovers = list(tmp_path.glob(".ckpt.alignment-tmp-*"))
    assert len(leftovers) == 1  # the half-written copy sits beside, never in place
    after = weights(target)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    recover_checkpoint(target)  # under the lock a temp folder made for this path is a dead writer's: it goes
    assert not list(tmp_path.glob(".ckpt.alignment-tmp-*"))


def test_crash_between_the_two_renames_is_recovered(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_model_atomically(AutoModelForCausalLM.from_pretrained(tiny_checkpoint), AutoTokenizer.from_pretrained(tiny_checkpoint), tmp_path / "ckpt", "rl_checkpoint")
    backup = tmp_path / ".ckpt.alignment-old"
    os.rename(tmp_path / "ckpt", backup)  # the first rename of a swap done, the second not
    recover_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").is_file() and not backup.exists()


def test_a_save_stopped_between_its_two_renames_is_finished_not_lost(tiny_checkpoint, tmp_path, monkeypatch):
    """Ctrl-C (or a kill) after the previous folder went to its backup and before the new one, written whole,
    took its place: the next run's recovery finishes the swap, so the newer save is what `path` holds.
    A new folder cut short (a file damaged) is not taken; the backup goes back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignment import checkpoint

    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_checkpoint), AutoTokenizer.from_pretrained(tiny_checkpoint)
    target = tmp_path / "ckpt"
    save_model_atomically(model, tokenizer, target, "rl_checkpoint")
    real_rename = os.rename

    def stopped_at_the_swap(source, destination):
        if Path(destination) == target:
            raise KeyboardInterrupt
        real_rename(source, destination)

    for damaged in (False, True):
        before = weights(target)
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)  # each save holds other weights than the one before
        monkeypatch.setattr(checkpoint.os, "rename", stopped_at_the_swap)
        with pytest.raises(KeyboardInterrupt):
            save_model_atomically(model, tokenizer, target, "rl_checkpoint")
        monkeypatch.setattr(checkpoint.os, "rename", real_rename)
        (temp,) = tmp_path.glob(".ckpt.alignment-tmp-*")
        assert not target.exists() and (tmp_path / ".ckpt.alignment-old").is_dir()
        if damaged:
            with open(temp / "model.safetensors", "r+b") as handle:
                handle.truncate(100)
        recover_checkpoint(target)
        held, attempted = weights(target), {name: tensor for name, tensor in model.state_dict().items() if name in before}
        expected, other = (before, attempted) if damaged else (attempted, before)
        assert held.keys() == before.keys() and all(torch.equal(held[name], expected[name]) for name in held)
        assert not all(torch.equal(held[name], other[name]) for name in held)
        assert {path.name for path in tmp_path.iterdir()} - {".ckpt.alignment-lock"} == {"ckpt"}  # no temp, no backup left
        assert not (target / "alignment_temp.json").exists()
        checkpoint.verify_manifest(target, "")


def test_a_finished_temp_never_brings_back_a_folder_the_user_removed(tiny_checkpoint, tmp_path, monkeypatch):
    """A writer killed after its manifest and before its first rename leaves the new folder whole beside the old one.
    The user then removes the old one to start over: no swap had begun (no backup), so nothing comes back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignment import checkpoint

    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_checkpoint), AutoTokenizer.from_pretrained(tiny_checkpoint)
    target = tmp_path / "ckpt"
    save_model_atomically(model, tokenizer, target, "rl_checkpoint")

    def killed_before_the_swap(folder):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "_fsync_tree", killed_before_the_swap)
    with pytest.raises(KeyboardInterrupt):
        save_model_atomically(model, tokenizer, target, "rl_checkpoint")
    (temp,) = tmp_path.glob(".ckpt.alignment-tmp-*")
    checkpoint.verify_manifest(temp, "")  # written whole
    shutil.rmtree(target)
    recover_checkpoint(target)
    assert {path.name for path in tmp_path.iterdir()} - {".ckpt.alignment-lock"} == set()  # no checkpoint, no temp


def test_a_backup_whose_removal_was_cut_short_is_removed_later_and_saves_go_on(tiny_checkpoint, tmp_path, monkeypatch):
    """The tidy-up after a swap removes the previous folder's manifest last: cut short, the rest still says it is
    the tool's backup, so the next save removes it instead of failing on a folder it may not touch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_checkpoint), AutoTokenizer.from_pretrained(tiny_checkpoint)
    target = tmp_path / "ckpt"
    save_model_atomically(model, tokenizer, target, "rl_checkpoint")
    real_unlink = Path.unlink

    def stopped_at_the_weights(self, *args, **kwargs):
        if self.name == "model.safetensors" and self.parent.name == ".ckpt.alignment-old":
            raise PermissionError(13, "Permission denied")
        real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", stopped_at_the_weights)
    save_model_atomically(model, tokenizer, target, "rl_checkpoint")  # saved; the warning names the backup left
    backup = tmp_path / ".ckpt.alignment-old"
    assert (backup / "model.safetensors").exists() and (backup / "alignment_manifest.json").exists()
    monkeypatch.setattr(Path, "unlink", real_unlink)
    save_model_atomically(model, tokenizer, target, "rl_checkpoint")
    assert not backup.exists()
    weights(target)


def test_folders_beside_a_checkpoint_that_the_tool_did_not_make_for_it_are_never_touched(tmp_path):
    """A user's ckpt.old / ckpt.tmp-backup, a folder at the tool's backup name without its manifest, and a temp
    folder the tool made for another path all stay, whether the checkpoint is there or not."""
    for present in (False, True):
        root = tmp_path / str(present)
        mine = [root / "ckpt.old", root / "ckpt.tmp-backup", root / ".ckpt.alignment-old", root / ".ckpt.alignment-tmp-1-2"]
        for folder in mine:
            folder.mkdir(parents=True)
            (folder / "notes.txt").write_text("mine")
        (mine[-1] / "alignment_temp.json").write_text(json.dumps({"written_by": "alignment", "for": str(root / "other")}))
        if present:
            (root / "ckpt").mkdir()
        recover_checkpoint(root / "ckpt")
        assert all((folder / "notes.txt").read_text() == "mine" for folder in mine)
        assert (root / "ckpt").exists() == present



def test_recovery_takes_and_removes_only_temp_folders_the_tool_made_for_this_path(tmp_path):
    """A swap cut between its renames, with two whole, checked folders at the tool's temp name that were not made for
    this path (one marked for another path, one whose marker this tool did not write): the backup goes back and both
    stay as they are. An empty folder at the temp name (a writer killed between making it and marking it) goes."""
    from alignment import checkpoint

    target = tmp_path / "ckpt"

    def writes(text):
        return lambda folder: (folder / "weights.txt").write_text(text)

    checkpoint.write_atomically(target, writes("previous"), kind="rl_checkpoint")
    others = {".ckpt.alignment-tmp-1-1": {"written_by": "alignment", "for": str(tmp_path / "other")},
              ".ckpt.alignment-tmp-2-2": {"written_by": "someone else", "for": str(target)}}
    for name, marker in others.items():
        checkpoint.write_atomically(tmp_path / "staging", writes(name), kind="rl_checkpoint")  # a manifest that checks out
        os.rename(tmp_path / "staging", tmp_path / name)
        (tmp_path / name / "alignment_temp.json").write_text(json.dumps(marker))
    (tmp_path / ".ckpt.alignment-tmp-3-3").mkdir()
    os.rename(target, tmp_path / ".ckpt.alignment-old")  # the first rename of a swap done, the second not
    recover_checkpoint(target)
    assert (target / "weights.txt").read_text() == "previous" and not (tmp_path / ".ckpt.alignment-old").exists()
    assert all((tmp_path / name / "weights.txt").read_text() == name for name in others)
    assert not (tmp_path / ".ckpt.alignment-tmp-3-3").exists()


def manifest_first(listing, name_of):
    """`listing` (os.listdir or os.scandir) with a checkpoint manifest put first, the rest in name order."""

    class Listed(list):  # os.scandir's result is also a context manager
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def close(self):
            pass

    def listed(*args, **kwargs):
        found = listing(*args, **kwargs)
        entries = list(found)
        getattr(found, "close", lambda: None)()
        return Listed(sorted(entries, key=lambda item: (name_of(item) != "alignment_manifest.json", name_of(item))))

    return listed


def test_recovery_removes_a_leftover_backup_its_manifest_last(tmp_path, monkeypatch):
    """A backup left beside a checkpoint in place (a tidy-up cut short) is removed by the next recovery as a save
    removes it: its manifest last, so a removal cut short again still leaves a folder known as the tool's."""
    from alignment import checkpoint

    target = tmp_path / "ckpt"

    def write(folder):
        for index in range(12):
            (folder / f"shard{index}.bin").write_bytes(bytes([index]))

    checkpoint.write_atomically(target, write, kind="rl_checkpoint")
    shutil.copytree(target, tmp_path / ".ckpt.alignment-old")
    real_unlink, removed = os.unlink, []

    def recording(path, *args, **kwargs):
        removed.append(Path(path).name)
        return real_unlink(path, *args, **kwargs)

    # the folder is listed manifest first, so that a removal in listing order (rmtree) cannot end on it by chance
    monkeypatch.setattr(os, "unlink", recording)
    monkeypatch.setattr(os, "listdir", manifest_first(os.listdir, lambda name: name))
    monkeypatch.setattr(os, "scandir", manifest_first(os.scandir, lambda entry: entry.name))
    recover_checkpoint(target)
    monkeypatch.undo()
    assert not (tmp_path / ".ckpt.alignment-old").exists() and (target / "shard0.bin").read_bytes() == bytes([0])
    assert len(removed) == 13 and removed[-1] == "alignment_manifest.json"


def without_flag(argv: list[str], flag: str) -> list[str]:
    """`argv` with every `flag VALUE` pair removed (by the flag's name, not by its value)."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == flag:
            skip = True
        else:
            kept.append(item)
    return kept


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_tiny_task(tmp_path_factory.mktemp("reliability"), num_train=48, num_test=8, seed=2)


def flags(pipeline, name, *extra):
    return train_rl_flags(pipeline, name, "--max_steps", "4", *extra)


@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run(pipeline):
    # Every run in a fresh process, as a user's would be (an in-process run inherits this test
    # process's thread settings and compiled kernels from earlier tests), with a reward the
    # random model earns, so that every step moves the weights and "equal" means something.
    run_train_rl(flags(pipeline, "full"), reward="parity_reward")
    full = steps_log(pipeline, "full")
    assert all(s["train/loss"] is not None and abs(s["train/loss"]) > 0 and s["train/grad_norm"] > 0 for s in full)

    kill_train_rl_after_saved_state(flags(pipeline, "cut", "--save_state_every", "1"), step=2, reward="parity_reward")
    state_dir = pipeline.root / "cut" / "rl.state"
    assert has_training_state(state_dir)
    assert not (pipeline.root / "cut" / "rl" / "model.safetensors").exists()

    run_train_rl(flags(pipeline, "cut", "--save_state_every", "1", "--resume"), reward="parity_reward")
    cut = steps_log(pipeline, "cut")
    assert [s["step"] for s in cut] == [1, 2, 3, 4]
    for mine, theirs in zip(cut, full):
        assert mine["train/loss"] == pytest.approx(theirs["train/loss"], rel=1e-5, abs=1e-7)
        assert mine["train/reward"] == theirs["train/reward"]
    final = json.loads((pipeline.root / "runs" / "cut" / "final_eval_metrics.json").read_text())
    assert final["step"] == 4 and final["num_examples"] == 4
    assert not state_dir.exists()  # finished: the state is gone, the checkpoint is the result
    finished = weights(pipeline.root / "cut" / "rl")
    reference = weights(pipeline.root / "full" / "rl")
    start = weights(pipeline.sft)
    assert max((reference[k] - start[k]).abs().max().item() for k in start) > 1e-3  # four real updates (lr 1e-3)
    assert all(torch.equal(finished[k], reference[k]) for k in reference)  # bit for bit

    # and the seed's rule holds: the finished checkpoint is only evaluated now
    train_rl.main(flags(pipeline, "cut", "--resume"))
    assert json.loads((pipeline.root / "runs" / "cut" / "eval_only_metrics.json").read_text())["num_examples"] == 4


@pytest.mark.slow
def test_a_resume_from_the_last_steps_state_saves_the_policy_before_it_drops_the_state(pipeline):
    """Killed after the last step's training state was saved (its final evaluation cut short), then resumed with another
    --checkpoint_path: no step was left to run, so no save ran either (the epoch's save belonged to the killed process),
    and the run ended with exit 0, its training state removed and nothing at --checkpoint_path: the trained weights lost."""
    epoch = ("--num_train_examples", "8", "--num_epochs", "1", "--max_steps", "2", "--save_state_every", "1")  # 2 steps an epoch
    kill_train_rl_after_saved_state(flags(pipeline, "last", *epoch), step=2, reward="parity_reward")
    state_dir = pipeline.root / "last" / "rl.state"
    assert has_training_state(state_dir)
    trained = weights(state_dir / "policy")
    moved = pipeline.root / "last" / "rl_moved"
    run_train_rl(flags(pipeline, "last", *epoch, "--resume", "--checkpoint_path", str(moved), "--state_dir", str(state_dir)), reward="parity_reward")
    assert not state_dir.exists() and all(torch.equal(weights(moved)[k], trained[k]) for k in trained)
    assert read_manifest(moved)["run"]["flags"]["checkpoint_path"] == str(moved)
    assert json.loads((pipeline.root / "runs" / "last" / "final_eval_metrics.json").read_text())["step"] == 2


@pytest.mark.slow
def test_a_copy_of_a_runs_training_state_is_not_resumed_over(pipeline):
    """A state copied aside (a snapshot to branch from) and resumed with --state_dir <copy>: the resume wrote its
    states over the copy and removed it at the end, while the original stayed as the same run's. Refused, both kept;
    moved instead of copied, the state resumes."""
    kill_train_rl_after_saved_state(flags(pipeline, "branch", "--save_state_every", "1"), step=2, reward="parity_reward")
    state_dir, copy = pipeline.root / "branch" / "rl.state", pipeline.root / "snapshots" / "step2"
    shutil.copytree(state_dir, copy)
    before = {path: sorted(p.name for p in path.rglob("*")) for path in (state_dir, copy)}
    with pytest.raises(UserError, match=rf"^--state_dir {re.escape(str(copy))} is a copy of this run's training state in .*rl.state \(step 2 there\): "
                                        r"a resume writes its states into --state_dir and removes it when the run ends"):
        train_rl.main(flags(pipeline, "branch", "--save_state_every", "1", "--resume", "--state_dir", str(copy), "--learning_rate", "2e-3"))
    assert {path: sorted(p.name for p in path.rglob("*")) for path in (state_dir, copy)} == before
    shutil.rmtree(state_dir)  # moved, not copied: the run continues from it
    run_train_rl(flags(pipeline, "branch", "--save_state_every", "1", "--resume", "--state_dir", str(copy)), reward="parity_reward")
    assert [row["step"] for row in steps_log(pipeline, "branch")] == [1, 2, 3, 4] and not copy.exists()


def test_non_finite_steps_stop_the_run_and_keep_the_last_good_state(pipeline, monkeypatch):
    from alignment import policy_update

    real_step = policy_update.grpo_microbatch_train_step

    def poisoned(*args, **kwargs):
        loss, meta = real_step(*args, **kwargs)
        return loss * float("nan"), meta

    monkeypatch.setattr(policy_update, "grpo_microbatch_train_step", poisoned)
    with pytest.raises(UserError, match="2 optimizer steps in a row had a non-finite loss or gradient"):
        train_rl.main(flags(pipeline, "nan", "--max_skipped_steps", "2", "--save_state_every", "1"))
    logged = steps_log(pipeline, "nan")
    assert logged[-1]["train/skipped_steps"] == 1
    assert not (pipeline.root / "nan" / "rl" / "model.safetensors").exists()
    state = weights(pipeline.root / "nan" / "rl.state" / "policy")
    start = weights(pipeline.sft)
    assert all(torch.equal(state[k], start[k]) for k in start)  # no NaN ever reached the weights


def poison_losses_of_steps(monkeypatch, steps: tuple[int, ...]) -> None:
    """Every microbatch loss of the rollout steps `steps` becomes NaN (train_rl's update sees which step it is in)."""
    from alignment import policy_update

    current, real_update, real_step = {}, train_rl.update_policy, policy_update.grpo_microbatch_train_step

    def update(*args, **kwargs):
        current["step"] = kwargs["step"]
        return real_update(*args, **kwargs)

    def poisoned(*args, **kwargs):
        loss, meta = real_step(*args, **kwargs)
        return (loss * float("nan") if current["step"] in steps else loss), meta

    monkeypatch.setattr(train_rl, "update_policy", update)
    monkeypatch.setattr(policy_update, "grpo_microbatch_train_step", poisoned)


def test_non_finite_steps_apart_are_counted_over_the_run_and_do_not_stop_it(pipeline, monkeypatch):
    """Steps 1 and 3 of 4 have a NaN loss, steps 2 and 4 are good; --max_skipped_steps 2 counts skips in a row,
    so the run finishes. train/skipped_steps is the running total (1, 1, 2, 2) and the final evaluation records 2;
    a skipped step does not change the weights, so the seed's frozen sampler (--rollout_sync_every 0) lags the
    policy by the good updates only: train/staleness 0, 0, 1, 1."""
    poison_losses_of_steps(monkeypatch, (1, 3))
    metrics = train_rl.main(flags(pipeline, "nan_apart", "--max_skipped_steps", "2", "--rollout_sync_every", "0", "--lr_schedule", "cosine",
                                  "--learning_rate", "1e-3"))
    logged = steps_log(pipeline, "nan_apart")
    assert [s["step"] for s in logged] == [1, 2, 3, 4]
    assert logged[-1]["train/lr"] == pytest.approx(1e-4)  # the skipped steps count on the schedule: the cosine ends at its floor
    assert [s["train/skipped_steps"] for s in logged] == [1, 1, 2, 2]
    assert [s["train/staleness"] for s in logged] == [0, 0, 1, 1]
    final = json.loads((pipeline.root / "runs" / "nan_apart" / "final_eval_metrics.json").read_text())
    assert (final["step"], final["skipped_steps"]) == (4, 2) and metrics["num_examples"] == final["num_examples"] == 4


def test_non_finite_steps_in_a_row_are_counted_across_batches_and_over_a_resume(pipeline, monkeypatch):
    """--max_skipped_steps counts optimizer steps: two batches of two optimizer steps, all four non-finite, are four in a
    row (it counted batches: 2, under a limit of 3). A run stopped after one non-finite step and resumed into a second one
    has two in a row (the count started again at 0 on a resume)."""
    real_save = train_rl.save_training_state
    poison_losses_of_steps(monkeypatch, (2, 3))
    with pytest.raises(UserError, match=r"^4 optimizer steps in a row had a non-finite loss or gradient \(step 3\)"):
        train_rl.main(flags(pipeline, "nan_batches", "--max_skipped_steps", "3", "--train_batch_size", "8"))
    assert [s["train/skipped_steps"] for s in steps_log(pipeline, "nan_batches")] == [0, 2]  # step 3 stopped the run before its log line

    def save_then_stop(*args, **kwargs):
        real_save(*args, **kwargs)
        if args[6]["step"] == 2:  # the counters: stopped right after the state of the first non-finite step
            raise RuntimeError("stopped after the step-2 state")

    monkeypatch.setattr(train_rl, "save_training_state", save_then_stop)
    resumable = flags(pipeline, "nan_resumed", "--max_skipped_steps", "2", "--save_state_every", "1")
    with pytest.raises(RuntimeError, match="stopped after the step-2 state"):
        train_rl.main(resumable)
    monkeypatch.setattr(train_rl, "save_training_state", real_save)
    with pytest.raises(UserError, match=r"^2 optimizer steps in a row had a non-finite loss or gradient \(step 3\)"):
        train_rl.main([*resumable, "--resume"])


def test_zero_signal_batches_are_skipped(pipeline):
    no_kl = without_flag(flags(pipeline, "flat"), "--kl_coef") + ["--max_steps", "2"]
    train_rl.main(no_kl)
    logged = steps_log(pipeline, "flat")
    assert all(s["train/fraction_groups_all_equal"] == 1.0 for s in logged)  # a random model earns nothing
    assert logged[-1]["train/zero_signal_batches"] == 2
    assert logged[-1]["train/loss"] is None  # not a fake 0
    final, start = weights(pipeline.root / "flat" / "rl"), weights(pipeline.sft)
    assert all(torch.equal(final[k], start[k]) for k in start)


def test_no_skip_zero_signal_runs_the_update_anyway(pipeline):
    """Benchmarks (and the seed) run the update on a tied batch: zero advantage, real work."""
    no_kl = without_flag(flags(pipeline, "flat_run"), "--kl_coef") + ["--max_steps", "2", "--no-skip_zero_signal"]
    train_rl.main(no_kl)
    logged = steps_log(pipeline, "flat_run")
    assert all(s["train/fraction_groups_all_equal"] == 1.0 for s in logged)
    assert logged[-1]["train/zero_signal_batches"] == 0
    assert all(s["train/loss"] == 0.0 and s["perf/train_tokens_per_s"] > 0 for s in logged)



def test_a_training_state_restores_both_random_generators(tiny_model_and_tokenizer, tmp_path):
    """--resume continues the draws a run would have made: Python's `random` and torch's CPU generator are
    back where they were at the save, whatever was drawn between the save and the load."""
    import random

    from alignment.checkpoint import load_training_state, save_training_state

    model, tokenizer = tiny_model_and_tokenizer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    random.seed(7)
    torch.manual_seed(7)
    random.random(), torch.rand(3)  # the state to restore is not the seed's
    state = save_training_state(tmp_path / "state", model, tokenizer, model.state_dict(), optimizer.state_dict(), scheduler,
                                {"step": 3, "epoch": 0, "batch": 3, "tb_step": 3}, run={"run_id": "r"})
    expected = [random.random() for _ in range(4)], torch.rand(4)
    random.seed(99)
    torch.manual_seed(99)
    assert load_training_state(state, tmp_path / "runs")["step"] == 3
    assert [random.random() for _ in range(4)] == expected[0]
    assert torch.equal(torch.rand(4), expected[1])


def test_a_folder_at_the_backup_name_that_the_tool_did_not_make_is_neither_removed_nor_moved_into_place(tmp_path):
    """A folder of the user's at the hidden backup name (no manifest: recovery leaves it alone) and nothing at the path.
    A save makes no backup of its own, so it must neither remove that folder as its backup when it succeeds nor move it
    to the path as "the previous folder" when it fails."""
    import errno

    from alignment.checkpoint import _backup_path, read_manifest, write_atomically

    path = tmp_path / "ckpt"
    theirs = _backup_path(path)
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")

    def out_of_space(folder):
        (folder / "weights.bin").write_bytes(b"x")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UserError, match=rf"could not write {re.escape(str(path))} \(No space left on device; .*; nothing was at {re.escape(str(path))} before"):
        write_atomically(path, out_of_space, kind="sft_checkpoint")
    assert not path.exists()
    assert (theirs / "notes.txt").read_text() == "mine"

    write_atomically(path, lambda folder: (folder / "weights.bin").write_bytes(b"new"), kind="sft_checkpoint")
    assert (path / "weights.bin").read_bytes() == b"new" and read_manifest(path)["kind"] == "sft_checkpoint"
    assert (theirs / "notes.txt").read_text() == "mine"


def test_a_folder_of_the_users_at_the_backup_name_is_named_before_a_save_that_needs_that_name(tmp_path):
    """With a folder at the path, a save first renames it to the hidden backup name. Something the tool did not write
    there (recovery leaves it) is named in one line before anything is written, and both folders are left as they were
    (it was "Directory not empty" at the rename, after the whole write)."""
    from alignment.checkpoint import _backup_path, write_atomically

    path = tmp_path / "ckpt"
    write_atomically(path, lambda folder: (folder / "weights.bin").write_bytes(b"old"), kind="rl_checkpoint")
    theirs = _backup_path(path)
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    written = []
    with pytest.raises(UserError, match=rf"^{re.escape(str(theirs))}, the name the save of {re.escape(str(path))} keeps its previous copy under "
                                        rf"while it swaps, holds something this tool did not write; move it away and run again"):
        write_atomically(path, lambda folder: written.append(folder), kind="rl_checkpoint")
    assert written == [] and (path / "weights.bin").read_bytes() == b"old" and (theirs / "notes.txt").read_text() == "mine"
    shutil.rmtree(theirs)
    write_atomically(path, lambda folder: (folder / "weights.bin").write_bytes(b"new"), kind="rl_checkpoint")
    assert (path / "weights.bin").read_bytes() == b"new"
