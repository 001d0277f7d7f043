"""fp32 master weights with bf16 compute, and scoring at the sampling temperature (CPU autocast)."""

import pytest
import torch
from safetensors.torch import load_file

from alignment import train_rl
from alignment.grpo import normalize_group_rewards
from alignment.optim import build_optimizer, build_scheduler
from alignment.policy_update import sequence_lengths, update_policy
from alignment.precision import autocast, describe, master_dtype
from alignment.rollout import load_hf_model, load_tokenizer
from alignment.sft_helpers import get_response_log_probs, tokenize_rollout_ids
from conftest import make_tiny_task, steps_log, train_rl_flags, update_settings


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_tiny_task(tmp_path_factory.mktemp("precision"), num_train=32, num_test=8, seed=1)


def grpo_batch(tokenizer):
    """4 prompts x 4 random responses with group-normalised advantages."""
    generator = torch.Generator().manual_seed(0)
    prompts = [f"User: Ava has {i} apples.\nAssistant: <think>" for i in range(4) for _ in range(4)]
    responses = [torch.randint(0, len(tokenizer) - 1, (int(n),), generator=generator).tolist() for n in torch.randint(8, 24, (16,), generator=generator)]
    raw = (torch.rand(16, generator=generator) > 0.5).float()
    advantages, _ = normalize_group_rewards(raw, 4, 1e-6, True)
    batch = {**tokenize_rollout_ids(prompts, responses, tokenizer), "raw_rewards": raw, "advantages": advantages}
    batch["lengths"] = sequence_lengths(batch["response_mask"])
    return batch


def update_args(chunk_size):
    return update_settings(logprob_chunk_size=chunk_size)


def one_step_delta(checkpoint, batch, weights_dtype, compute_dtype, chunk_size, lr=1e-6):
    """All parameters' change after one AdamW step of update_policy, flattened, in fp32."""
    model = load_hf_model(checkpoint, "cpu", weights_dtype).train()
    before = [p.detach().float().clone() for p in model.parameters()]
    optimizer = build_optimizer(model, lr, 0.0)
    totals = update_policy(model, optimizer, build_scheduler(optimizer, 0, 1), batch, update_args(chunk_size), "cpu", compute_dtype=compute_dtype)
    assert totals["optimizer_steps"] == 1
    assert all(p.dtype == weights_dtype and p.grad is None for p in model.parameters())
    assert all(state["exp_avg"].dtype == weights_dtype for state in optimizer.state.values())
    return torch.cat([(p.detach().float() - b).flatten() for p, b in zip(model.parameters(), before)])


@pytest.mark.parametrize("chunk_size", [0, 5])
def test_fp32_master_weights_with_bf16_compute_follow_the_fp32_update(task, chunk_size):
    """At lr 1e-6, bf16 compute on fp32 master weights moves (nearly) every weight the way fp32 does;
    pure bf16 rounds ~98% of the update away."""
    batch = grpo_batch(load_tokenizer(task.sft))
    reference = one_step_delta(task.sft, batch, torch.float32, torch.float32, chunk_size)
    mixed = one_step_delta(task.sft, batch, torch.float32, torch.bfloat16, chunk_size)
    pure = one_step_delta(task.sft, batch, torch.bfloat16, torch.bfloat16, chunk_size)
    cosine = torch.nn.functional.cosine_similarity
    assert (reference != 0).float().mean() > 0.99
    assert cosine(mixed, reference, dim=0) >= 0.99
    assert (mixed != 0).float().mean() >= 0.99
    assert cosine(pure, reference, dim=0) < 0.5  # measured 0.14 on this model
    assert (pure != 0).float().mean() < 0.1  # measured 2%


def test_autocast_runs_cpu_matmuls_in_the_compute_dtype_and_fp32_is_a_no_op():
    """autocast() picks the device type from the device string: on "cpu" (the demo, CI) a bf16 compute dtype must
    really compute in bf16, or the sampler and the trainer would score in fp32 while --dtype says bf16."""
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with autocast("cpu", torch.bfloat16):
        assert (a @ b).dtype == torch.bfloat16
        assert torch.is_autocast_enabled("cpu")
    with autocast("cpu", torch.float32):
        assert (a @ b).dtype == torch.float32
        assert not torch.is_autocast_enabled("cpu")


def test_the_start_up_line_names_the_master_and_the_compute_dtype():
    """precision.describe, printed by train_rl and train_sft: mixed precision names both dtypes, a pure one says 'all'."""
    assert master_dtype(torch.bfloat16, True) == torch.float32 and master_dtype(torch.bfloat16, False) == torch.bfloat16
    assert describe(torch.float32, torch.bfloat16) == "policy master weights, gradients and AdamW state fp32; forward/backward under autocast bf16"
    assert describe(torch.bfloat16, torch.bfloat16) == "policy weights, gradients, AdamW state and compute all bf16"
    assert describe(torch.float32, torch.float32) == "policy weights, gradients, AdamW state and compute all fp32"


def test_fused_log_probs_under_autocast_give_fp32_gradients_like_the_naive_path(task):
    tokenizer = load_tokenizer(task.sft)
    batch = grpo_batch(tokenizer)
    grads, values = {}, {}
    for chunk_size in (0, 5):
        model = load_hf_model(task.sft, "cpu", torch.float32)
        with autocast("cpu", torch.bfloat16):
            log_probs = get_response_log_probs(model, batch["input_ids"], batch["labels"], chunk_size=chunk_size)["log_probs"]
        assert log_probs.dtype == torch.float32
        (log_probs * batch["response_mask"]).sum().backward()
        head = model.get_output_embeddings().weight
        assert head.grad.dtype == torch.float32
        grads[chunk_size], values[chunk_size] = head.grad.clone(), log_probs.detach()
    # both run the lm_head matmul in bf16: same values and gradient up to bf16 rounding
    assert torch.allclose(values[5], values[0], atol=2e-2)
    assert torch.nn.functional.cosine_similarity(grads[5].flatten(), grads[0].flatten(), dim=0) > 0.999


@pytest.mark.parametrize("chunk_size", [0, 5])
def test_temperature_scaled_log_probs_equal_a_hand_computation(tiny_model_and_tokenizer, chunk_size):
    model, tokenizer = tiny_model_and_tokenizer
    batch = grpo_batch(tokenizer)
    input_ids, labels = batch["input_ids"][:3], batch["labels"][:3]
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.double()
    for temperature in (0.7, 1.3):
        hand = torch.log_softmax(logits / temperature, -1).gather(-1, labels[..., None]).squeeze(-1)
        probs = torch.softmax(logits / temperature, -1)
        hand_entropy = -(probs * probs.log()).sum(-1)
        with torch.no_grad():
            result = get_response_log_probs(model, input_ids, labels, return_token_entropy=True, chunk_size=chunk_size, temperature=temperature)
        assert torch.allclose(result["log_probs"].double(), hand, atol=1e-5)
        assert torch.allclose(result["token_entropy"].double(), hand_entropy, atol=1e-5)
    # the gradient follows the scaling too: d/dlogits of log p(y) at T is (onehot - p_T) / T
    fused = get_response_log_probs(model, input_ids, labels, chunk_size=chunk_size, temperature=0.5)["log_probs"].sum()
    (grad,) = torch.autograd.grad(fused, model.get_output_embeddings().weight)
    naive_logits = model(input_ids=input_ids).logits / 0.5
    naive = torch.log_softmax(naive_logits, -1).gather(-1, labels[..., None]).sum()
    (expected,) = torch.autograd.grad(naive, model.get_output_embeddings().weight)
    assert torch.allclose(grad, expected, atol=1e-5)


def rl_flags(task, name, *extra):
    return train_rl_flags(task, name, "--learning_rate", "1e-5", "--sampling_temperature", "0.7", "--dtype", "bfloat16", "--max_steps", "2", *extra)


def test_bf16_compute_run_saves_and_resumes_fp32_master_weights(task, monkeypatch):
    train_rl.main(rl_flags(task, "full"))
    full = load_file(str(task.root / "full" / "rl" / "model.safetensors"))
    start = load_file(str(task.sft / "model.safetensors"))
    assert all(tensor.dtype == torch.float32 for tensor in full.values())
    # the master weights hold what bf16 cannot: most moved by less than a bf16 step
    moved = torch.cat([(full[k] - start[k]).flatten() for k in start])
    assert (moved != 0).float().mean() > 0.99
    assert any(not torch.equal(t, t.bfloat16().float()) for t in full.values())
    steps = steps_log(task, "full")
    # HF sampler at temperature 0.7 and the trainer scoring at 0.7, both bf16 compute on the same
    # weights; measured on step 1 and every 10th (--sampler_logprobs_every 10), so not on step 2
    assert steps[0]["train/sampler_logprob_abs_diff"] < 0.05
    assert abs(steps[0]["train/sampler_importance_ratio"] - 1) < 0.05
    assert steps[1]["train/sampler_logprob_abs_diff"] is None and steps[1]["train/sampler_importance_ratio"] is None

    # interrupt after the step-1 state is written, then resume: the same weights, bit for bit
    real_save = train_rl.save_training_state

    def save_then_stop(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(train_rl, "save_training_state", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train_rl.main(rl_flags(task, "cut", "--save_state_every", "1"))
    monkeypatch.setattr(train_rl, "save_training_state", real_save)
    state = load_file(str(task.root / "cut" / "rl.state" / "policy" / "model.safetensors"))
    assert all(tensor.dtype == torch.float32 for tensor in state.values())
    train_rl.main(rl_flags(task, "cut", "--save_state_every", "1", "--resume"))
    resumed = load_file(str(task.root / "cut" / "rl" / "model.safetensors"))
    assert all(torch.equal(resumed[k], full[k]) for k in full)


def test_seed_scoring_at_temperature_one_shows_the_gap(task):
    train_rl.main(rl_flags(task, "untempered", "--scoring_temperature", "1", "--max_steps", "1"))
    (step,) = steps_log(task, "untempered")
    assert step["train/sampler_logprob_abs_diff"] > 0.05
