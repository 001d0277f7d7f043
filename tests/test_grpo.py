"""alignment/grpo.py: hand-computed cases, gradients and accumulation."""

import math

import pytest
import torch

from alignment.grpo import (
    compute_grpo_clip_loss,
    compute_group_normalized_rewards,
    compute_kl_penalty,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
    grpo_microbatch_train_step,
    masked_mean,
    masked_normalize,
    normalize_group_rewards,
)


def table_reward(response, ground_truth):
    """Reward 1 when the response equals the ground truth; format 1 unless it says 'bad'."""
    correct = float(response == ground_truth)
    formatted = float(response != "bad")
    return {"format_reward": formatted, "answer_reward": correct, "reward": correct}


def test_group_normalized_rewards_with_std():
    responses = ["1", "x", "bad", "1", "y", "y", "y", "y"]
    truths = ["1"] * 4 + ["2"] * 4
    advantages, raw, meta = compute_group_normalized_rewards(table_reward, responses, truths, 4, 0.0, True)
    # group 1: rewards [1,0,0,1], mean 0.5, unbiased std sqrt(1/3); group 2: all 0
    half_over_std = 0.5 / math.sqrt(1 / 3)
    assert raw.tolist() == [1, 0, 0, 1, 0, 0, 0, 0]
    assert torch.allclose(advantages, torch.tensor([half_over_std, -half_over_std, -half_over_std, half_over_std, 0, 0, 0, 0]))
    assert meta["reward_mean"] == pytest.approx(0.25)
    assert meta["reward_std"] == pytest.approx(torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 0]).std().item())
    assert (meta["reward_max"], meta["reward_min"]) == (1.0, 0.0)
    assert meta["format_reward_mean"] == pytest.approx(7 / 8)
    assert meta["answer_reward_mean"] == pytest.approx(2 / 8)
    assert meta["fraction_groups_all_equal"] == pytest.approx(0.5)
    assert meta["fraction_groups_all_right"] == 0.0  # the tied group is all wrong


def test_group_normalized_rewards_without_std_and_eps():
    raw = torch.tensor([3.0, 1.0, 2.0, 2.0])
    advantages, _ = normalize_group_rewards(raw, 2, 0.0, False)
    assert advantages.tolist() == [1.0, -1.0, 0.0, 0.0]
    # eps enters the denominator: group [3, 1] has std sqrt(2)
    advantages, _ = normalize_group_rewards(raw, 2, 0.5, True)
    assert advantages[0].item() == pytest.approx(1.0 / (math.sqrt(2) + 0.5))
    assert advantages[2].item() == 0.0  # equal rewards: 0 / (0 + eps), never NaN


def test_group_normalization_rejects_bad_groups():
    with pytest.raises(ValueError, match="groups of 3"):
        normalize_group_rewards(torch.zeros(4), 3, 1e-6, True)
    with pytest.raises(ValueError, match="group_size >= 2"):
        normalize_group_rewards(torch.zeros(4), 1, 1e-6, True)


def test_naive_policy_gradient_loss():
    rewards = torch.tensor([[2.0], [-1.0]])
    log_probs = torch.tensor([[-1.0, -0.5], [-2.0, -0.25]])
    assert compute_naive_policy_gradient_loss(rewards, log_probs).tolist() == [[2.0, 1.0], [-2.0, -0.25]]


def _clip_case():
    advantages = torch.tensor([[1.0], [-1.0]])
    ratios = torch.tensor([[1.5, 1.0, 0.5], [1.5, 1.0, 0.5]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]])
    policy = (old + ratios.log()).requires_grad_(True)
    return advantages, policy, old


def test_grpo_clip_loss_values_and_clipped_tokens():
    advantages, policy, old = _clip_case()
    loss, meta = compute_grpo_clip_loss(advantages, policy, old, cliprange=0.2)
    # A=+1: min([1.5,1,.5], [1.2,1,.8]) = [1.2,1,.5]; A=-1: min([-1.5,-1,-.5], [-1.2,-1,-.8]) = [-1.5,-1,-.8]
    assert torch.allclose(loss, torch.tensor([[-1.2, -1.0, -0.5], [1.5, 1.0, 0.8]]), atol=1e-6)
    assert meta["clipped"].tolist() == [[True, False, False], [False, False, True]]


def test_grpo_clip_gradient_is_zero_on_clipped_tokens():
    advantages, policy, old = _clip_case()
    loss, _ = compute_grpo_clip_loss(advantages, policy, old, cliprange=0.2)
    loss.sum().backward()
    # unclipped token: d(-ratio*A)/dlogp = -ratio*A
    expected = torch.tensor([[0.0, -1.0, -0.5], [1.5, 1.0, 0.0]])
    assert torch.allclose(policy.grad, expected, atol=1e-6)


def test_grpo_clip_high_is_asymmetric():
    advantages, policy, old = _clip_case()
    loss, meta = compute_grpo_clip_loss(advantages, policy, old, cliprange=0.2, cliprange_high=0.28)
    assert loss[0, 0].item() == pytest.approx(-1.28)
    assert loss[1, 2].item() == pytest.approx(0.8)  # the low side still clips at 0.8


def test_kl_penalty_k3():
    policy = torch.tensor([[-1.0, -2.0]])
    reference = torch.tensor([[-1.0, -1.0]])
    kl = compute_kl_penalty(policy, reference)
    assert kl[0, 0].item() == 0.0
    assert kl[0, 1].item() == pytest.approx(math.e - 1.0 - 1.0)


def test_policy_gradient_loss_dispatch_and_errors():
    log_probs = torch.tensor([[-1.0, -2.0]])
    raw, adv = torch.tensor([[1.0]]), torch.tensor([[0.5]])
    loss, _ = compute_policy_gradient_loss(log_probs, "no_baseline", raw_rewards=raw)
    assert loss.tolist() == [[1.0, 2.0]]
    loss, _ = compute_policy_gradient_loss(log_probs, "reinforce_with_baseline", advantages=adv)
    assert loss.tolist() == [[0.5, 1.0]]
    loss, meta = compute_policy_gradient_loss(log_probs, "grpo_clip", advantages=adv, old_log_probs=log_probs, cliprange=0.2)
    assert torch.allclose(loss, torch.tensor([[-0.5, -0.5]]))
    loss, meta = compute_policy_gradient_loss(log_probs, "reinforce_with_baseline", advantages=adv, kl_coef=0.1, ref_log_probs=torch.tensor([[-1.0, -1.0]]))
    assert loss[0, 1].item() == pytest.approx(1.0 + 0.1 * (math.e - 2.0))
    assert meta["kl"][0, 0].item() == 0.0
    with pytest.raises(ValueError, match="needs raw_rewards"):
        compute_policy_gradient_loss(log_probs, "no_baseline", advantages=adv)
    with pytest.raises(ValueError, match="needs advantages"):
        compute_policy_gradient_loss(log_probs, "reinforce_with_baseline", raw_rewards=raw)
    with pytest.raises(ValueError, match="old_log_probs, cliprange"):
        compute_policy_gradient_loss(log_probs, "grpo_clip", advantages=adv)
    with pytest.raises(ValueError, match="unknown loss_type"):
        compute_policy_gradient_loss(log_probs, "ppo", advantages=adv)
    with pytest.raises(ValueError, match="ref_log_probs"):
        compute_policy_gradient_loss(log_probs, "reinforce_with_baseline", advantages=adv, kl_coef=0.1)


def test_masked_mean_and_normalize():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    assert masked_mean(values, mask).item() == pytest.approx((1 + 2 + 6) / 3)
    assert masked_mean(values, mask, dim=1).tolist() == [1.5, 6.0]
    assert masked_mean(values, mask, dim=0).tolist()[:2] == [1.0, 2.0]
    assert masked_normalize(values, mask, dim=1, normalize_constant=2.0).tolist() == [1.5, 3.0]
    assert masked_normalize(values, mask).item() == 9.0


def _two_sequences(seed=0):
    """2 sequences of 4 and 7 response tokens in T=8 positions."""
    generator = torch.Generator().manual_seed(seed)
    log_probs = (-torch.rand(2, 8, generator=generator)).requires_grad_(True)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 2:6] = True
    mask[1, 1:8] = True
    return log_probs, mask


def test_microbatch_step_mean_normalization_matches_hand_gradient():
    log_probs, mask = _two_sequences()
    advantages = torch.tensor([[2.0], [-1.0]])
    loss, meta = grpo_microbatch_train_step(log_probs, mask, 3, "reinforce_with_baseline", advantages=advantages)
    lengths = torch.tensor([4.0, 7.0])
    per_sequence = torch.stack([-(advantages[i, 0] * log_probs[i][mask[i]]).sum() / lengths[i] for i in range(2)])
    assert loss.item() == pytest.approx(per_sequence.mean().item() / 3, rel=1e-6)
    assert meta["loss_unscaled"].item() == pytest.approx(per_sequence.mean().item(), rel=1e-6)  # before the / 3
    expected_grad = torch.zeros(2, 8)
    expected_grad[0, 2:6] = -2.0 / (4 * 2 * 3)
    expected_grad[1, 1:8] = 1.0 / (7 * 2 * 3)
    assert torch.allclose(log_probs.grad, expected_grad)
    assert (log_probs.grad[~mask] == 0).all()  # masked-out positions: exactly zero


def test_microbatch_step_constant_normalization():
    log_probs, mask = _two_sequences()
    raw = torch.tensor([[1.0], [1.0]])
    grpo_microbatch_train_step(log_probs, mask, 1, "no_baseline", raw_rewards=raw, length_normalization="constant", normalize_constant=10.0)
    # every response token gets the same weight, independent of its sequence length
    assert torch.allclose(log_probs.grad[mask], torch.full((11,), -1.0 / (10.0 * 2)))


def test_microbatch_step_reports_clip_fraction_and_kl():
    log_probs, mask = _two_sequences()
    old = log_probs.detach().clone()
    old[0, 2] -= 1.0  # ratio e > 1.2 on one token with positive advantage: clipped
    old[~mask] -= 1.0  # and on the 5 positions off the response (prompt, padding): the clip fraction must not count them
    reference = log_probs.detach().clone()
    reference[~mask] -= 1.0  # off the response only (prompt and padding): the logged KL must not see it
    _, meta = grpo_microbatch_train_step(
        log_probs, mask, 1, "grpo_clip", advantages=torch.tensor([[1.0], [1.0]]), old_log_probs=old, cliprange=0.2,
        ref_log_probs=reference,
    )
    assert meta["clip_fraction"].item() == pytest.approx(1 / 11)
    assert meta["kl"].item() == 0.0


def test_gradient_accumulation_equals_one_big_batch():
    torch.manual_seed(1)
    weights = torch.randn(4, 6)
    mask = torch.rand(4, 6) > 0.3
    mask[:, 0] = True
    advantages = torch.randn(4, 1)

    big = weights.clone().requires_grad_(True)
    grpo_microbatch_train_step(big, mask, 1, "reinforce_with_baseline", advantages=advantages)

    small = weights.clone().requires_grad_(True)
    for rows in (slice(0, 2), slice(2, 4)):
        # slicing a leaf keeps the graph, so the gradient accumulates into `small`
        grpo_microbatch_train_step(small[rows], mask[rows], 2, "reinforce_with_baseline", advantages=advantages[rows])
    assert torch.allclose(big.grad, small.grad, atol=1e-7)


def test_empty_response_contributes_zero_not_nan():
    log_probs = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[True, True, False], [False, False, False]])
    loss, _ = grpo_microbatch_train_step(log_probs, mask, 1, "no_baseline", raw_rewards=torch.ones(2, 1))
    assert torch.isfinite(loss)
    assert torch.isfinite(log_probs.grad).all()


def test_a_microbatch_with_no_response_token_reports_zero_not_nan():
    """Guards: the logged metrics divided by an unclamped token count. A microbatch whose every row is out of the loss
    (--overlong mask keeps truncated rows out) has no response token: its loss, clip fraction, KL and entropy bonus
    are 0, not 0 / 0 = NaN (a NaN would poison train/clip_fraction and train/kl_ref for the whole step)."""
    log_probs = torch.full((2, 3), -1.0, requires_grad=True)
    loss, meta = grpo_microbatch_train_step(
        log_probs, torch.zeros(2, 3, dtype=torch.bool), 1, "grpo_clip", advantages=torch.ones(2, 1), old_log_probs=torch.full((2, 3), -2.0),
        cliprange=0.2, ref_log_probs=torch.full((2, 3), -2.0), entropy_coef=0.1, token_entropy=torch.ones(2, 3),
    )
    assert loss.item() == 0.0
    assert {key: meta[key].item() for key in ("clip_fraction", "kl", "entropy_bonus")} == {"clip_fraction": 0.0, "kl": 0.0, "entropy_bonus": 0.0}
    assert (log_probs.grad == 0).all()


def test_fraction_of_groups_all_right_counts_groups_solved_by_every_rollout():
    # groups of 2: both right, one right, both wrong, both right -> 3 of 4 tied, 2 of 4 tied at right
    responses = ["1", "1", "1", "x", "x", "y", "2", "2"]
    truths = ["1", "1", "1", "1", "1", "1", "2", "2"]
    _, _, meta = compute_group_normalized_rewards(table_reward, responses, truths, 2, 1e-6, False)
    assert meta["fraction_groups_all_equal"] == pytest.approx(0.75)
    assert meta["fraction_groups_all_right"] == pytest.approx(0.5)


def test_importance_weights_multiply_the_policy_gradient_term_only_not_the_kl():
    """Guards: the KL term scaled by `importance_weights` too (or the PG term weighted twice). Hand values, one
    sequence of 2 tokens, A = 1, weights [0.5, 2], kl_coef 0.5, ref [-1, -1] (r = ref - logp = [0, 1]):
    per token 0.5 x 1 + 0 = 0.5 and 2 x 2 + 0.5 x (e - 1 - 1) = 4.3591409; mean over 2 tokens 2.4295705.
    d/dlogp: -A x w / 2 = [-0.25, -1] plus 0.5 x (1 - e^r) / 2 = [0, -0.4295705]."""
    log_probs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    weights = torch.tensor([[0.5, 2.0]], requires_grad=True)  # a caller's weights with a graph: still no gradient flows into them
    loss, _ = grpo_microbatch_train_step(log_probs, torch.ones(1, 2, dtype=torch.bool), 1, "reinforce_with_baseline", advantages=torch.tensor([[1.0]]),
                                         kl_coef=0.5, ref_log_probs=torch.tensor([[-1.0, -1.0]]), importance_weights=weights)
    assert weights.grad is None
    assert loss.item() == pytest.approx((0.5 + 4.0 + 0.5 * (math.e - 2.0)) / 2, rel=1e-6)  # 2.4295705
    assert log_probs.grad[0].tolist() == pytest.approx([-0.25, -1.0 + 0.5 * (1.0 - math.e) / 2], rel=1e-6)  # [-0.25, -1.4295705]
