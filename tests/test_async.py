"""train_rl --rollout_staleness: the sampler in its own process, generating ahead of the
policy, and the truncated importance sampling that corrects for it (CPU, tiny model)."""

import re
from types import SimpleNamespace

import pytest
import torch

from alignment import train_rl
from alignment.args import parse_rl_args
from alignment.errors import UserError
from alignment.grpo import grpo_microbatch_train_step
from alignment.rollout import SamplingSettings
from alignment.sampler_process import RolloutsAhead, SamplerProcess
from conftest import child_env, kill_train_rl_after_saved_state, make_tiny_task, process_exited, steps_log, train_rl_flags

SAMPLER_ARGS = SimpleNamespace(hf_batch_size=8, vllm_gpu_memory_utilization=None, vllm_kv_cache_gb=0.25, vllm_enforce_eager=None)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_tiny_task(tmp_path_factory.mktemp("async"), num_train=48, num_test=8, seed=2)


def rl_flags(task, name, *extra):
    return train_rl_flags(task, name, "--sampling_max_tokens", "12", "--eval_max_tokens", "12", "--sampling_temperature", "0.7",
                          "--learning_rate", "1e-6", *extra)


@pytest.mark.parametrize("staleness", [1, 2])
def test_staleness_stays_within_the_bound(task, staleness):
    name = f"ahead_{staleness}"
    train_rl.main(rl_flags(task, name, "--rollout_staleness", str(staleness), "--max_steps", "5", "--learning_rate", "1e-3"))
    steps = steps_log(task, name)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    lags = [s["train/staleness"] for s in steps]
    # the first batch comes from the start weights; the next ones were sent `staleness` steps ahead
    assert lags[0] == 0 and max(lags) == staleness and all(0 <= lag <= staleness for lag in lags), lags
    # the sampler's log-probs come back every step (they weight the gradient)
    assert all(s["train/sampler_importance_ratio"] is not None and s["train/tis_capped_fraction"] is not None for s in steps)
    # the engine process's own times: every batch's generation, and the last weight load, which has
    # finished by step N + 2 (the first load is queued behind batch N + 1, taken at step N + 1)
    assert all(s["perf/sampler_generate_seconds"] > 0 for s in steps)
    assert all(s["perf/sampler_load_seconds"] > 0 for s in steps[staleness + 1 :]), [s["perf/sampler_load_seconds"] for s in steps]
    assert (task.root / name / "rl" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_importance_weights_are_one_when_the_sampler_holds_the_trainers_weights(task, backend):
    # lr so small that no fp32 weight moves: the sampler one step behind holds the same weights
    # (no minimum length and no repetition penalty: those make the sampler's distribution differ)
    name = f"same_weights_{backend}"
    train_rl.main(rl_flags(task, name, "--rollout_staleness", "1", "--max_steps", "3", "--learning_rate", "1e-15", "--rollout_backend", backend,
                           "--vllm_kv_cache_gb", "0.25", "--sampling_min_tokens", "0", "--repetition_penalty", "1.0"))
    steps = steps_log(task, name)
    assert [s["train/staleness"] for s in steps] == [0, 1, 1]
    for s in steps:
        assert s["train/sampler_importance_ratio"] == pytest.approx(1.0, abs=1e-4)
        assert s["train/sampler_importance_ratio_max"] == pytest.approx(1.0, abs=1e-3)
        assert s["train/tis_capped_fraction"] == 0.0


def check_requests_run_in_order(sampler, model_path) -> None:
    """A weight load sent after batch 2 reaches the engine after it; the next request sees the new weights."""
    from safetensors.torch import load_file

    sampling = SamplingSettings(temperature=0.7, max_tokens=8, log_probs=True)
    ahead = RolloutsAhead(sampler)
    ahead.send(2, ["User: 1 + 1?\nAssistant: <think>"] * 2, sampling, seed=5, weights_version=0)
    weights = load_file(str(model_path / "model.safetensors"))
    sampler.load_weights((name, torch.zeros_like(tensor)) for name, tensor in weights.items())
    generations, version = ahead.take(2, ["User: 1 + 1?\nAssistant: <think>"] * 2, sampling, seed=5, weights_version=1)
    assert version == 0 and len(generations) == 2 and all(len(g.log_probs) == g.num_tokens for g in generations)
    assert any(g.num_tokens > 1 for g in generations)  # sampled by the real weights
    zeroed = sampler.generate(["User: 1 + 1?\nAssistant: <think>"], sampling)
    # all-zero weights give uniform logits: every token's log-prob is -log(vocab) / T-scaled alike
    assert len(set(round(lp, 4) for lp in zeroed[0].log_probs)) == 1


def test_sampler_process_runs_requests_in_order(task):
    # HF here; vLLM with its engine core in a process of its own (the weights reach it packed by
    # pack_tensors) in test_a_killed_trainer_leaves_no_sampler_or_engine_process_behind
    sampler = SamplerProcess("hf", task.sft, "cpu", torch.float32, 0, SAMPLER_ARGS)
    try:
        check_requests_run_in_order(sampler, task.sft)
    finally:
        sampler.close()
    assert not sampler._process.is_alive()


@pytest.fixture(scope="module")
def hf_sampler(task):
    """An HF sampler process on the task's checkpoint, in fp32 (the weights it is sent are fp32 too)."""
    sampler = SamplerProcess("hf", task.sft, "cpu", torch.float32, 0, SAMPLER_ARGS)
    yield sampler
    sampler.close()


ONE_PLUS_ONE = ["User: 1 + 1?\nAssistant: <think>", "User: 2 + 3?\nAssistant: <think>"]


def test_the_sampler_process_seeds_each_request(hf_sampler):
    """A batch sent ahead is drawn from its own seed, whatever the engine process generated before it:
    the same seed twice gives the same rollouts, another seed others."""
    sampling = SamplingSettings(temperature=1.0, max_tokens=8)
    tickets = [hf_sampler.submit(ONE_PLUS_ONE * 2, sampling, seed) for seed in (5, 6, 5)]
    first, other, again = ([g.token_ids for g in hf_sampler.result(ticket)] for ticket in tickets)
    assert again == first
    assert other != first


def test_batches_sent_ahead_carry_their_own_steps_seed(task):
    """One step off, step 3 sends the batches of steps 4 and 5 with the seeds those steps would sample
    with in step (rollout_seed of their own step), so a batch's rollouts do not depend on when it was sent."""
    from alignment.data import Gsm8kDataset
    from alignment.sampler import batches_ahead, rollout_batch, rollout_seed

    args = parse_rl_args(rl_flags(task, "seeds_ahead", "--rollout_staleness", "2"))
    dataset = Gsm8kDataset("train", task.data)
    steps_per_epoch = len(dataset) // args.rollout_batch_size
    ahead = batches_ahead(args, dataset, 3, steps_per_epoch, total_steps=20)
    assert [(step, seed) for step, _, seed in ahead] == [(4, rollout_seed(args.seed, 4)), (5, rollout_seed(args.seed, 5))]
    assert [prompts for _, prompts, _ in ahead] == [rollout_batch(dataset, step, steps_per_epoch, args.rollout_batch_size, args.seed)[0] for step in (4, 5)]


def test_the_sampler_process_loads_the_weights_as_they_were_sent(hf_sampler, task):
    """The trainer sends the policy's weights and goes on training them in place while the engine process is
    still busy: the engine loads a copy taken at the send, not what the policy holds by the time it loads."""
    from transformers import AutoModelForCausalLM

    greedy = SamplingSettings(temperature=0.0, max_tokens=8)
    start = AutoModelForCausalLM.from_pretrained(task.sft, dtype=torch.float32)  # the sampler's dtype: no cast that would copy
    policy = AutoModelForCausalLM.from_pretrained(task.sft, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    try:
        start_tokens = [g.token_ids for g in hf_sampler.generate(ONE_PLUS_ONE, greedy)]
        hf_sampler.load_weights(policy.state_dict().items())
        policy_tokens = [g.token_ids for g in hf_sampler.generate(ONE_PLUS_ONE, greedy)]
        assert policy_tokens != start_tokens and all(len(tokens) > 1 for tokens in policy_tokens)
        hf_sampler.load_weights(start.state_dict().items())
        busy = hf_sampler.submit(ONE_PLUS_ONE * 8, SamplingSettings(temperature=1.0, max_tokens=64), seed=0)  # the engine generates meanwhile
        hf_sampler.load_weights(policy.state_dict().items())
        with torch.no_grad():
            for parameter in policy.parameters():
                parameter.zero_()  # the next optimizer step, in place
        hf_sampler.result(busy)
        assert [g.token_ids for g in hf_sampler.generate(ONE_PLUS_ONE, greedy)] == policy_tokens
    finally:
        hf_sampler.load_weights(start.state_dict().items())


def test_truncated_importance_weights_scale_the_policy_gradient():
    log_probs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    weights = torch.tensor([[0.5, 2.0, 7.0]])
    advantages = torch.tensor([[1.5]])
    grpo_microbatch_train_step(log_probs, mask, 1, "reinforce_with_baseline", advantages=advantages, importance_weights=weights)
    # d/dlogp of mean over 2 response tokens of -A * w * logp
    assert torch.allclose(log_probs.grad, torch.tensor([[-1.5 * 0.5 / 2, -1.5 * 2.0 / 2, 0.0]]))


def test_staleness_needs_a_sampler_that_follows_the_policy(task):
    with pytest.raises(UserError, match="--rollout_sync_every 1"):
        parse_rl_args(rl_flags(task, "bad", "--rollout_staleness", "1", "--rollout_sync_every", "0"))


def test_staleness_of_the_seeds_frozen_sampler_counts_every_update(task):
    train_rl.main(rl_flags(task, "frozen", "--rollout_sync_every", "0", "--max_steps", "3", "--learning_rate", "1e-3"))
    assert [s["train/staleness"] for s in steps_log(task, "frozen")] == [0, 1, 2]


def _children(pid: int) -> list[int]:
    import glob

    found = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as handle:
                found += [int(child) for child in handle.read().split()]
        except (FileNotFoundError, ProcessLookupError):  # that thread exited after the listing
            pass
    return found


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="reads /proc (Linux)")
def test_a_killed_trainer_leaves_no_sampler_or_engine_process_behind(task, tmp_path):
    # the sampler process is no daemon (vLLM's engine core is its child): it must notice a
    # trainer killed without a word (SIGKILL, the OOM killer) and end, taking the engine core along
    import signal
    import subprocess
    import sys
    import time

    # Before it is killed, the trainer checks that requests run in order through vLLM's engine core
    # in its own process (one engine start serves both checks).
    script = (
        "import time, torch\n"
        "from pathlib import Path\n"
        "from alignment.sampler_process import SamplerProcess\n"
        "from test_async import SAMPLER_ARGS, check_requests_run_in_order\n"
        f"sampler = SamplerProcess('vllm', {str(task.sft)!r}, 'cpu', torch.float32, 0, SAMPLER_ARGS, engine_process=True)\n"
        f"check_requests_run_in_order(sampler, Path({str(task.sft)!r}))\n"
        "print('IN_ORDER SAMPLER_PID', sampler._process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    log = open(tmp_path / "trainer.log", "w+")  # not a pipe: a full pipe would block the sampler's last words
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path), env=child_env())
    try:
        started = time.monotonic()
        # the whole line: vLLM logs to the same file, and a buffer's flush can end inside it
        while not (line := re.search(r"IN_ORDER SAMPLER_PID (\d+)\n", text := (tmp_path / "trainer.log").read_text())):
            assert trainer.poll() is None and time.monotonic() - started < 300, "the trainer ended before its checks passed:\n" + text[-3000:]
            time.sleep(0.2)
        sampler_pid = int(line.group(1))
        engine_pids = _children(sampler_pid)
        assert engine_pids, "vLLM's engine core should run as the sampler process's child"
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(process_exited(pid) for pid in [sampler_pid, *engine_pids]):
            time.sleep(0.5)
        assert all(process_exited(pid) for pid in [sampler_pid, *engine_pids]), "sampler or engine core outlived the trainer"
        print(f"sampler and engine core gone {time.monotonic() - (deadline - 60):.1f}s after the trainer was killed")
    finally:
        trainer.kill()


@pytest.mark.slow
def test_a_killed_one_step_off_run_resumes_and_restarts_its_pipeline(task):
    # SIGKILL after the step-2 state is saved (batch 3 was already generating), then --resume:
    # the run finishes its 4 steps, and its first resumed batch comes from the resumed weights
    from alignment.checkpoint import has_training_state

    name = "resumed"
    run = rl_flags(task, name, "--rollout_staleness", "1", "--max_steps", "4", "--save_state_every", "1", "--learning_rate", "1e-3")
    kill_train_rl_after_saved_state(run, step=2)
    state_dir = task.root / name / "rl.state"
    assert has_training_state(state_dir)

    train_rl.main([*run, "--resume"])
    steps = steps_log(task, name)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    # steps 1-2 before the kill (0, then one step off); the resumed pipeline starts over at 0
    assert [s["train/staleness"] for s in steps] == [0, 1, 0, 1]
    assert (task.root / name / "rl" / "model.safetensors").is_file() and not state_dir.exists()
