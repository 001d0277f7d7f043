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
def test_two_rank_fsdp_step_equals_one_process_step(tiny_checkpoint, tmp_path):
    run([sys.executable, "tests/fsdp_step_check.py", str(tiny_checkpoint), str(tmp_path / "one.pt")])
    run([*TORCHRUN, "tests/fsdp_step_check.py", str(tiny_checkpoint), str(tmp_path / "two.pt")])
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    from safetensors.torch import load_file

    start = load_file(str(tiny_checkpoint / "model.safetensors"))
    assert start.keys() <= one["weights"].keys() and start.keys() <= two["weights"].keys()
    for name in start:
        assert torch.allclose(two["weights"][name], one["weights"][name], atol=1e-5), name
    changed = [name for name in start if not torch.allclose(one["weights"][name], start[name], atol=1e-4)]
    assert len(changed) > len(start) // 2  # the step really moved the weights


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
