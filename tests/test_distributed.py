"""--policy_parallel fsdp: two gloo ranks on the CPU match one process."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, make_tiny_task, process_exited, steps_log, train_rl_flags

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def run(command, timeout=600):
    result = subprocess.run(command, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["in_step", "one_step_off"])
def test_two_rank_fsdp_step_equals_one_process_step(tiny_checkpoint, tmp_path, mode):
    """In step, and one step off (the sampler's log-probs weight each token, truncated at --tis_cap, on each rank's rows)."""
    extra = ["one_step_off"] if mode == "one_step_off" else []
    run([sys.executable, "tests/fsdp_step_check.py", str(tiny_checkpoint), str(tmp_path / "one.pt"), *extra])
    run([*TORCHRUN, "tests/fsdp_step_check.py", str(tiny_checkpoint), str(tmp_path / "two.pt"), *extra])
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    if extra:  # some tokens' weights were capped, on both launches alike
        assert one["tis_capped"] > 0 and one["sampler_ratio_max"] > 1.5
        assert two["tis_capped"] == one["tis_capped"] and two["sampler_ratio_max"] == pytest.approx(one["sampler_ratio_max"], rel=1e-5)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    from safetensors.torch import load_file

    start = load_file(str(tiny_checkpoint / "model.safetensors"))
    assert start.keys() <= one["weights"].keys() and start.keys() <= two["weights"].keys()
    for name in start:
        assert torch.allclose(two["weights"][name], one["weights"][name], atol=1e-5), name
    changed = [name for name in start if not torch.allclose(one["weights"][name], start[name], atol=1e-4)]
    assert len(changed) > len(start) // 2  # the step really moved the weights


CLOSE_CHECK = """
import sys, time
from pathlib import Path
from alignment.distributed import TorchDistributed

ranks, written = TorchDistributed(), Path(sys.argv[1])
if ranks.is_main:  # rank 0 still writing the run's last files
    time.sleep(1.0)
    written.write_text("done")
ranks.close()
assert written.exists(), f"rank {ranks.rank} left before rank 0 had written its files"
"""


def test_no_rank_leaves_close_before_rank_0_has_written(tmp_path):
    """A rank that exited early once aborted at interpreter shutdown, and torchrun killed rank 0 mid-write."""
    script = tmp_path / "close_check.py"
    script.write_text(CLOSE_CHECK)
    run([*TORCHRUN, str(script), str(tmp_path / "written")])
    assert (tmp_path / "written").read_text() == "done"


def run_flags(task, tmp_path, name, *extra):
    """train_rl flags for a two-step-sized run on the tiny task; `extra` sets backend, layout and steps."""
    return train_rl_flags(task, name, "--train_mini_batch_size", "4", "--sampling_max_tokens", "12", "--eval_max_tokens", "12",
                          "--kl_coef", "0", "--learning_rate", "1e-6", *extra, checkpoint_path=tmp_path / "rl")


@pytest.mark.slow
def test_train_rl_under_torchrun_end_to_end(tmp_path):
    """grpo_clip with two optimizer steps per batch (the old-policy pass ran under inference_mode
    and broke FSDP2's next forward), an odd evaluation set (7 on 2 ranks once graded 6), and bf16
    compute on fp32 master weights (FSDP2's MixedPrecisionPolicy)."""
    task = make_tiny_task(tmp_path, num_train=32, num_test=8, seed=3)
    flags = run_flags(task, tmp_path, "fsdp", "--policy_parallel", "fsdp", "--rollout_backend", "hf", "--eval_num_examples", "7",
                      "--max_steps", "2", "--evaluate_freq", "2", "--kl_coef", "0.05", "--learning_rate", "1e-3", "--save_state_every", "1",
                      "--loss_type", "grpo_clip", "--epochs_per_rollout_batch", "2", "--dtype", "bfloat16")
    out = run([*TORCHRUN, "-m", "alignment.train_rl", *flags])
    assert "each of 2 ranks, FSDP2 policy" in out
    assert "master weights, gradients and AdamW state fp32; forward/backward under autocast bf16" in out
    steps = steps_log(task, "fsdp")
    assert [s["step"] for s in steps] == [1, 2]  # rank 0 alone writes
    final = json.loads((tmp_path / "runs" / "fsdp" / "final_eval_metrics.json").read_text())
    assert final["num_examples"] == 7  # both ranks' shares gathered, every example once
    assert (tmp_path / "rl" / "model.safetensors").is_file()  # a full HF checkpoint from the shards
    from safetensors.torch import load_file

    final_weights, start = load_file(str(tmp_path / "rl" / "model.safetensors")), load_file(str(task.sft / "model.safetensors"))
    assert all(tensor.dtype == torch.float32 for tensor in final_weights.values())  # the fp32 master weights
    changed = torch.cat([(final_weights[k] != start[k]).flatten().float() for k in start]).mean()
    assert changed > 0.99
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "rl")
    # the same launch again: the checkpoint is evaluated (the seed's rule) by rank 0 alone; every rank once
    # evaluated the whole split and wrote the same files (and a TensorBoard file each) through one temp name
    events = sorted((tmp_path / "runs" / "fsdp").glob("events.out.tfevents.*"))
    out = run([*TORCHRUN, "-m", "alignment.train_rl", *flags])
    assert out.count("already holds weights: evaluating it (no training)") == 1 and "rank 1: rank 0 evaluates" in out
    assert json.loads((tmp_path / "runs" / "fsdp" / "eval_only_metrics.json").read_text())["num_examples"] == 7
    assert len(sorted((tmp_path / "runs" / "fsdp").glob("events.out.tfevents.*"))) == len(events) + 1


def processes_mentioning(text: str) -> list[int]:
    """The processes other than this one whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def kill_processes_mentioning(text: str, signal_number, timeout: float = 30.0) -> None:
    """Kill every process whose command line contains `text` (a crash of the whole launch), and any
    that appears meanwhile, then wait until each has exited: a rank holds its run's file locks until then."""
    import time

    deadline = time.time() + timeout
    killed: set[int] = set()
    while alive := sorted(pid for pid in killed | set(processes_mentioning(text)) if not process_exited(pid)):
        for pid in set(alive) - killed:
            try:
                os.kill(pid, signal_number)
            except ProcessLookupError:
                pass
        killed.update(alive)
        assert time.time() < deadline, f"processes {alive} outlived signal {signal_number}"
        time.sleep(0.05)


def wait_until_unlocked(locks, timeout: float = 30.0) -> None:
    """Wait until no process holds any of the run locks `locks` (exclusive flocks); name the holders of one still held after `timeout`."""
    import fcntl
    import time

    deadline = time.time() + timeout
    for lock in locks:
        fd = os.open(lock, os.O_RDONLY)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    break
                except BlockingIOError:
                    assert time.time() < deadline, f"{lock} still locked {timeout} s after its run was killed; open in {lock_holders(lock)}"
                    time.sleep(0.05)
        finally:
            os.close(fd)


def lock_holders(lock) -> list[str]:
    """`pid state command` of each process but this one with `lock` open."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(entry.name) != os.getpid() and any(os.readlink(fd) == str(lock) for fd in (entry / "fd").iterdir()):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                found.append(f"{entry.name} {state} {(entry / 'cmdline').read_bytes().replace(bytes(1), b' ')[:200].decode()}")
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_state_saved_by_two_ranks_resumes_in_one_process(tmp_path, capsys):
    """The training state is full weights + a name-keyed optimizer: any world size resumes it."""
    import signal
    import time

    from alignment import train_rl

    task = make_tiny_task(tmp_path, num_train=32, num_test=4, seed=4)
    flags = run_flags(task, tmp_path, "switch", "--rollout_backend", "hf", "--layout", "auto", "--eval_num_examples", "4",
                      "--max_steps", "3", "--evaluate_freq", "0", "--kl_coef", "0.05", "--learning_rate", "1e-3", "--save_state_every", "1")
    process = subprocess.Popen([*TORCHRUN, "-m", "alignment.train_rl", *flags, "--policy_parallel", "fsdp"], cwd=REPO_ROOT, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    deadline = time.time() + 300
    for line in process.stdout:
        if line.startswith("saved training state at step 1"):
            kill_processes_mentioning(str(tmp_path / "rl"), signal.SIGKILL)  # torchrun's workers run in their own sessions
            break
        assert time.time() < deadline
    process.wait()
    wait_until_unlocked(sorted(tmp_path.rglob("*.alignment-lock")))
    counters = json.loads((tmp_path / "rl.state" / "counters.json").read_text())
    assert counters["step"] == 1 and counters["world_size"] == 2
    capsys.readouterr()
    train_rl.main([*flags, "--resume"])  # in this one process, the seed's layout
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 1" in out
    steps = [s["step"] for s in steps_log(task, "switch")]
    assert steps == [1, 2, 3]
    assert (tmp_path / "rl" / "model.safetensors").is_file() and not (tmp_path / "rl.state").exists()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_train_rl_under_torchrun_with_a_vllm_engine_per_rank(tmp_path):
    """Each rank runs its own in-process vLLM engine inside the ranks' process group."""
    task = make_tiny_task(tmp_path, num_train=32, num_test=8, seed=3)
    flags = run_flags(task, tmp_path, "fsdp_vllm", "--policy_parallel", "fsdp", "--rollout_backend", "vllm", "--vllm_kv_cache_gb", "0.25",
                      "--eval_num_examples", "8", "--max_steps", "2", "--evaluate_freq", "2")
    out = run([*TORCHRUN, "-m", "alignment.train_rl", *flags])
    assert "each of 2 ranks, FSDP2 policy" in out and "vLLM sampler on cpu started" in out
    steps = steps_log(task, "fsdp_vllm")
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["train/response_length"] > 0 for s in steps)  # both engines generated
    final = json.loads((tmp_path / "runs" / "fsdp_vllm" / "final_eval_metrics.json").read_text())
    assert final["num_examples"] == 8  # each engine evaluated its half
    assert (tmp_path / "rl" / "model.safetensors").is_file()


def test_rank_shares_cover_every_item_once():
    from alignment.distributed import SingleProcess, rank_slice

    class Rank(SingleProcess):
        def __init__(self, rank, world_size):
            self.rank, self.world_size = rank, world_size

    for count in range(0, 12):
        for world_size in (1, 2, 3, 8):
            shares = [rank_slice(list(range(count)), Rank(r, world_size)) for r in range(world_size)]
            assert [item for share in shares for item in share] == list(range(count))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_a_torchrun_launch_without_fsdp_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """Without --policy_parallel fsdp every rank trained a copy of its own; ranks other than 0 took no lock and
    appended their steps to rank 0's steps.jsonl and replaced its checkpoint."""
    from alignment import train_rl
    from alignment.errors import run_cli

    task = make_tiny_task(tmp_path, num_train=8, num_test=4, seed=3)
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exited:
        run_cli(train_rl.main, train_rl_flags(task, "no_fsdp", "--max_steps", "1"))
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: a launch of 2 processes (torchrun) needs --policy_parallel fsdp: with --policy_parallel layers "
                                               "every rank would train a copy of its own and write the same logs and checkpoint; pass "
                                               "--policy_parallel fsdp, or start one process (python -m alignment.train_rl)")
    assert not (tmp_path / "runs" / "no_fsdp").exists() and not (tmp_path / "no_fsdp").exists()


def test_evaluation_under_torchrun_gives_a_frozen_sampler_its_start_weights_back(tmp_path):
    """--rollout_sync_every 0 (the seed): evaluating on the sampler must not leave the policy in it."""
    import copy
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from alignment.data import Gsm8kDataset
    from alignment.distributed import SingleProcess
    from alignment.rollout import HfEngine, load_hf_model, load_tokenizer
    from alignment.sampler import Sampler
    from alignment.train_rl import evaluate_policy

    class TwoRanks(SingleProcess):  # rank 0 of 2: the torchrun branch, without a process group
        world_size = 2

    task = make_tiny_task(tmp_path, num_train=8, num_test=4, seed=7)
    tokenizer = load_tokenizer(task.sft)
    policy = load_hf_model(task.sft, "cpu", torch.float32)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.05)  # the trained policy differs from the start
    engine = HfEngine(copy.deepcopy(policy), tokenizer)
    args = SimpleNamespace(rollout_backend="hf", eval_engine="sampler", rollout_sync_every=0, eval_temperature=0.0, eval_top_p=1.0,
                           eval_min_tokens=0, eval_max_tokens=8, repetition_penalty=1.0, log_dir=str(tmp_path), run_name="frozen")
    roles = {"sample": "cpu", "eval": "cpu"}
    sampler = Sampler(engine, start_weights=task.sft, sync_every=0, version=0)
    metrics, synced = evaluate_policy(args, sampler, policy, tokenizer, Gsm8kDataset("test", task.data), roles, TwoRanks(), step=1)
    assert metrics["num_examples"] == 2 and not synced  # rank 0's share of 4
    start = load_file(str(task.sft / "model.safetensors"))
    sampler = dict(engine.model.named_parameters())
    assert all(torch.equal(sampler[name], tensor) for name, tensor in start.items())


@pytest.mark.slow
def test_one_step_off_under_torchrun_each_rank_samples_its_share_ahead(tmp_path):
    """--rollout_staleness 1 with --policy_parallel fsdp: each rank's sampler process generates the rank's share of
    the next batch while the ranks train; every batch after the first is one update old, and the steps log what a
    one-process one-step-off run logs."""
    from alignment import train_rl

    task = make_tiny_task(tmp_path, num_train=32, num_test=8, seed=3)
    flags = run_flags(task, tmp_path, "fsdp_ahead", "--policy_parallel", "fsdp", "--rollout_backend", "hf", "--rollout_staleness", "1",
                      "--eval_num_examples", "8", "--max_steps", "3", "--evaluate_freq", "0", "--learning_rate", "1e-3", "--kl_coef", "0.05")
    out = run([*TORCHRUN, "-m", "alignment.train_rl", *flags])
    assert "each of 2 ranks, FSDP2 policy" in out and "sampler in its own process" in out
    steps = steps_log(task, "fsdp_ahead")
    assert [s["step"] for s in steps] == [1, 2, 3] and [s["train/staleness"] for s in steps] == [0, 1, 1]
    assert all(s["train/sampler_importance_ratio_max"] > 0 for s in steps)  # the sampler's log-probs came back every step
    final = json.loads((tmp_path / "runs" / "fsdp_ahead" / "final_eval_metrics.json").read_text())
    assert final["num_examples"] == 8 and (tmp_path / "rl" / "model.safetensors").is_file()
    one = run_flags(task, tmp_path, "one_ahead", "--rollout_staleness", "1", "--max_steps", "2", "--learning_rate", "1e-3", "--kl_coef", "0.05")
    one[one.index("--checkpoint_path") + 1] = str(tmp_path / "one_rl")
    train_rl.main(one)
    assert {key for s in steps_log(task, "one_ahead") for key in s} == {key for s in steps for key in s}


def free_port() -> int:
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return listener.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("staleness", ["0", "1"])
def test_two_nodes_of_one_process_each_train_in_step_and_one_step_off(tmp_path, staleness):
    """The multi-node launch (`torchrun --nnodes 2 --node_rank R`), as two "nodes" of one process each on this host."""
    task = make_tiny_task(tmp_path, num_train=32, num_test=8, seed=5)
    flags = run_flags(task, tmp_path, "nodes", "--policy_parallel", "fsdp", "--rollout_backend", "hf", "--rollout_staleness", staleness,
                      "--eval_num_examples", "8", "--max_steps", "2", "--evaluate_freq", "0", "--learning_rate", "1e-3", "--kl_coef", "0.05")
    port = str(free_port())
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1",
                               "--master_addr", "127.0.0.1", "--master_port", port, "-m", "alignment.train_rl", *flags],
                              cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "each of 2 ranks, FSDP2 policy" in outputs[0]
    steps = steps_log(task, "nodes")
    assert [s["step"] for s in steps] == [1, 2] and [s["train/staleness"] for s in steps] == [0, int(staleness)]
    assert json.loads((tmp_path / "runs" / "nodes" / "final_eval_metrics.json").read_text())["num_examples"] == 8


def children_of(pids) -> list[int]:
    """The processes whose parent is one of `pids` (the sampler processes of the ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) in pids:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


@pytest.mark.slow
def test_one_step_off_under_torchrun_sigterm_saves_a_killed_rank_leaves_no_sampler_and_one_process_resumes(tmp_path, capsys):
    """One step off under torchrun: SIGTERM to the launch finishes the step, saves and prints the resume command; a
    killed rank ends the launch and leaves no rank or sampler process behind (a sampler ends within seconds of its
    rank); the state resumes in one process, one step off, to the end."""
    import signal
    import time

    from alignment import train_rl

    task = make_tiny_task(tmp_path, num_train=32, num_test=4, seed=4)
    flags = run_flags(task, tmp_path, "ahead_stop", "--rollout_backend", "hf", "--layout", "auto", "--rollout_staleness", "1", "--max_steps", "4",
                      "--evaluate_freq", "0", "--kl_coef", "0.05", "--learning_rate", "1e-3", "--save_state_every", "100")

    def launch(*extra):
        return subprocess.Popen([*TORCHRUN, "-m", "alignment.train_rl", *flags, "--policy_parallel", "fsdp", *extra], cwd=REPO_ROOT, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def wait_for(process, prefix):
        deadline = time.time() + 300
        for line in process.stdout:
            if line.startswith(prefix):
                return
            assert time.time() < deadline
        raise AssertionError(f"the launch ended before a line starting {prefix!r}")

    process = launch()  # SIGTERM after step 1: the ranks agree to stop, save the state, exit with the signal's code
    wait_for(process, "step 1/4")
    os.killpg(process.pid, signal.SIGTERM)
    out = process.communicate(timeout=120)[0]
    assert "stopped by SIGTERM after step" in out and "--resume" in out, out[-3000:]
    counters = json.loads((tmp_path / "rl.state" / "counters.json").read_text())
    assert counters["world_size"] == 2 and counters["step"] >= 1

    process = launch("--resume")  # resumed under torchrun, then one rank SIGKILLed: torchrun ends the other, every sampler ends too
    wait_for(process, "step ")
    workers = children_of([process.pid])
    samplers = children_of(workers)
    assert len(workers) == 2 and len(samplers) >= 2  # a sampler process per rank
    os.kill(max(workers), signal.SIGKILL)
    assert process.wait(timeout=120) != 0
    deadline = time.time() + 30
    while not all(process_exited(pid) for pid in workers + samplers):
        assert time.time() < deadline, f"of the ranks {workers} and their samplers {samplers}, some outlived a killed rank"
        time.sleep(0.1)
    wait_until_unlocked(sorted(tmp_path.rglob("*.alignment-lock")))
    step = json.loads((tmp_path / "rl.state" / "counters.json").read_text())["step"]
    capsys.readouterr()
    train_rl.main([*flags, "--resume"])  # in this one process, the seed's layout, still one step off
    assert f"at step {step}" in capsys.readouterr().out
    assert [s["step"] for s in steps_log(task, "ahead_stop")][-1] == 4
    assert (tmp_path / "rl" / "model.safetensors").is_file() and not (tmp_path / "rl.state").exists()


COLLECTIVES_CHECK = """
from alignment.distributed import TorchDistributed

ranks = TorchDistributed()
rank = ranks.rank
assert ranks.world_size == 2 and ranks.local_rank == 0, (ranks.world_size, ranks.local_rank)
assert ranks.is_main == (rank == 0), f"rank {rank} (local rank 0 on its node) thinks is_main={ranks.is_main}"
assert ranks.all_true(rank == 0) is False and ranks.all_true(True) is True
assert ranks.any_true(rank == 1) is True and ranks.any_true(False) is False
assert ranks.mean(1.0 + 2 * rank) == 2.0  # ranks hold 1 and 3
assert ranks.sum(1.0 + 2 * rank) == 4.0
assert ranks.max(1.0 + 2 * rank) == 3.0
assert ranks.gather([f"r{rank}a", f"r{rank}b"]) == ["r0a", "r0b", "r1a", "r1b"]  # rank order, on every rank
ranks.close()
print("collectives ok")
"""


def test_two_nodes_of_one_process_agree_on_every_collective_and_only_global_rank_0_is_main(tmp_path):
    """The reductions train_rl relies on (all/any for stop and skip decisions, mean/sum/max for the logs, gather in rank order
    for evaluation), on two "nodes" of one process each: both have LOCAL_RANK 0, and only global rank 0 may write."""
    script = tmp_path / "collectives_check.py"
    script.write_text(COLLECTIVES_CHECK)
    port = str(free_port())
    processes = [subprocess.Popen([sys.executable, str(script)], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**ENV, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
                 for rank in (0, 1)]
    try:
        outputs = [process.communicate(timeout=120)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    assert [process.returncode for process in processes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert all("collectives ok" in output for output in outputs)


class _TwoRanks:
    """Rank 0 of 2 without a process group: rank 1 saw twice rank 0's values, and `other_items` as its list."""

    rank, world_size, is_main = 0, 2, True

    def __init__(self, other_items=()):
        self.other_items = list(other_items)

    def mean(self, value):
        return (value + 2 * value) / 2

    def sum(self, value):
        return value + 2 * value

    def max(self, value):
        return max(value, 2 * value)

    def gather(self, items):
        return list(items) + self.other_items


def test_reduced_totals_average_the_means_and_add_the_counts_over_ranks():
    """Per-rank means (loss, entropy, KL, clip fraction) become global means, while token counts, FLOPs (perf/mfu's numerator)
    and the sampler sums add up over ranks; the largest sampler ratio is the largest of any rank."""
    from alignment.distributed import reduce_totals

    totals = {"loss": 0.2, "entropy": 1.0, "clip_fraction": 0.1, "kl_ref": 0.04, "tokens": 100, "flops": 1e9, "sampler_abs_diff": 5.0,
              "sampler_ratio": 90.0, "sampler_tokens": 80, "tis_capped": 3, "sampler_ratio_max": 1.25, "grad_norm": 0.7}
    reduced = reduce_totals(totals, _TwoRanks())
    assert reduced["loss"] == pytest.approx(0.3) and reduced["entropy"] == pytest.approx(1.5)
    assert reduced["clip_fraction"] == pytest.approx(0.15) and reduced["kl_ref"] == pytest.approx(0.06)
    assert reduced["tokens"] == 300 and reduced["flops"] == pytest.approx(3e9)
    assert (reduced["sampler_abs_diff"], reduced["sampler_ratio"], reduced["sampler_tokens"], reduced["tis_capped"]) == (15.0, 270.0, 240, 9)
    assert reduced["sampler_ratio_max"] == 2.5
    assert reduced["grad_norm"] == 0.7  # already global (FSDP reduced the gradients)
    assert totals["tokens"] == 100  # the rank's own totals are left as they were


def test_reward_statistics_are_over_every_ranks_rollouts():
    """reward_std is the std of all ranks' rewards together (not a mean of per-rank stds); each fraction keeps its own key."""
    import statistics

    from alignment.distributed import reduce_reward_meta

    own, other = [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]
    meta = {"reward_mean": 0.25, "reward_std": 0.5, "reward_max": 1.0, "reward_min": 0.0, "format_reward_mean": 0.5,
            "answer_reward_mean": 0.25, "fraction_groups_all_equal": 0.5, "fraction_groups_all_right": 0.25}
    reduced = reduce_reward_meta(meta, torch.tensor(own), _TwoRanks(other))
    assert reduced["reward_mean"] == pytest.approx(0.5)
    assert reduced["reward_std"] == pytest.approx(statistics.stdev(own + other)) and reduced["reward_std"] == pytest.approx((2 / 7) ** 0.5)
    assert (reduced["reward_max"], reduced["reward_min"]) == (1.0, 0.0)
    assert reduced["format_reward_mean"] == pytest.approx(0.75) and reduced["answer_reward_mean"] == pytest.approx(0.375)
    assert reduced["fraction_groups_all_equal"] == pytest.approx(0.75) and reduced["fraction_groups_all_right"] == pytest.approx(0.375)


def test_batch_sizes_that_do_not_split_into_whole_shares_are_refused():
    """Each rank takes whole prompts and an equal number of sequences per optimizer step."""
    from types import SimpleNamespace

    from alignment.distributed import check_fsdp_sizes
    from alignment.errors import UserError

    ranks = SimpleNamespace(world_size=2)
    fine = SimpleNamespace(rollout_batch_size=4, train_batch_size=16, train_mini_batch_size=4, dynamic_sampling=False, dynamic_sampling_prompts=0)
    check_fsdp_sizes(fine, ranks)
    with pytest.raises(UserError, match="--rollout_batch_size 3 must be divisible by the 2 ranks"):
        check_fsdp_sizes(SimpleNamespace(**{**vars(fine), "rollout_batch_size": 3}), ranks)
    # 9 sequences a step (2 prompts x group 9, two steps a batch) on 2 ranks: 4.5 each, though 9 // 2 is a multiple of 1
    with pytest.raises(UserError, match="--train_batch_size 9 / 2 ranks must be a multiple of --train_mini_batch_size 1"):
        check_fsdp_sizes(SimpleNamespace(**{**vars(fine), "rollout_batch_size": 2, "train_batch_size": 9, "train_mini_batch_size": 1}), ranks)
    with pytest.raises(UserError, match="--train_batch_size 12 / 2 ranks must be a multiple of --train_mini_batch_size 4"):
        check_fsdp_sizes(SimpleNamespace(**{**vars(fine), "train_batch_size": 12}), ranks)


def test_a_diverted_save_never_lands_on_an_existing_folder(tmp_path):
    """<path>.step<N>, then -2, -3, ...: a folder already there (an earlier diverted save, the user's) is never replaced."""
    from alignment.distributed import diverted_path

    path = tmp_path / "rl"
    assert diverted_path(path, 4) == tmp_path / "rl.step4"
    (tmp_path / "rl.step4").mkdir()
    assert diverted_path(path, 4) == tmp_path / "rl.step4-2"
    (tmp_path / "rl.step4-2").write_text("a file")
    assert diverted_path(path, 4) == tmp_path / "rl.step4-3"
