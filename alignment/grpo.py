"""The policy-gradient math: group-normalised advantages, the three losses, masking.

Pure tensor-in, tensor-out functions: no model, no vLLM, no I/O. Names, argument
orders and return types follow the CS336 assignment-5 convention, so notebooks and
tests written against it work here. Options beyond the seed are keyword arguments
whose defaults reproduce it exactly:

- `length_normalization="constant"`: Dr. GRPO's sum / constant instead of the
  per-sequence mean, which removes the bias towards long wrong answers;
- `cliprange_high`: DAPO's asymmetric "clip-higher";
- `kl_coef` with `ref_log_probs`: the GRPO paper's KL penalty, k3 estimator.

Shapes: B sequences, T token positions, N = n_prompts * group_size rollouts.
"""

from typing import Callable, Literal

import torch

LossType = Literal["no_baseline", "reinforce_with_baseline", "grpo_clip"]


def normalize_group_rewards(
    raw_rewards: torch.Tensor,
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages from raw rewards by subtracting each group's mean.

    Args:
        raw_rewards: (N,) rewards, the `group_size` rollouts of a prompt adjacent.
        normalize_by_std: also divide by (group std + advantage_eps), torch's
            unbiased std. A group with equal rewards gets advantage 0, never
            0 / 0, even when advantage_eps is 0.

    Returns:
        advantages (N,), and metadata with the fraction of groups whose rewards
        are all equal (they carry no learning signal).
    """
    if group_size < 1 or raw_rewards.numel() % group_size:
        raise ValueError(f"{raw_rewards.numel()} rewards cannot be split into groups of {group_size}")
    if normalize_by_std and group_size < 2:
        raise ValueError("normalize_by_std needs group_size >= 2: the std of one reward is undefined")
    grouped = raw_rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    all_equal = (grouped == grouped[:, :1]).all(dim=1)
    if normalize_by_std:
        # a group with equal rewards is exactly 0 / 0 when advantage_eps is 0: keep it 0
        scaled = centred / (grouped.std(dim=1, keepdim=True) + advantage_eps)
        centred = torch.where(all_equal[:, None], torch.zeros_like(centred), scaled)
    return centred.reshape(-1), {"fraction_groups_all_equal": all_equal.float().mean().item()}


def compute_group_normalized_rewards(
    reward_fn: Callable[[str, str], dict[str, float]],
    rollout_responses: list[str],
    repeated_ground_truths: list[str],
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Score each rollout with `reward_fn`, then normalise within its group.

    Returns:
        advantages (N,), raw_rewards (N,), metadata: reward mean/std/max/min,
        format and answer reward means, fraction of groups with equal rewards.
    """
    scores = [reward_fn(response, truth) for response, truth in zip(rollout_responses, repeated_ground_truths, strict=True)]
    return advantages_from_scores(scores, group_size, advantage_eps, normalize_by_std)


def advantages_from_scores(scores: list[dict[str, float]], group_size: int, advantage_eps: float, normalize_by_std: bool):
    """`compute_group_normalized_rewards` for rewards already graded (in parallel, say)."""
    raw_rewards = torch.tensor([score["reward"] for score in scores], dtype=torch.float32)
    advantages, metadata = normalize_group_rewards(raw_rewards, group_size, advantage_eps, normalize_by_std)
    metadata.update(
        reward_mean=raw_rewards.mean().item(),
        reward_std=raw_rewards.std().item() if raw_rewards.numel() > 1 else 0.0,
        reward_max=raw_rewards.max().item(),
        reward_min=raw_rewards.min().item(),
        format_reward_mean=sum(score["format_reward"] for score in scores) / len(scores),
        answer_reward_mean=sum(score["answer_reward"] for score in scores) / len(scores),
    )
    return advantages, raw_rewards, metadata


def compute_naive_policy_gradient_loss(raw_rewards_or_advantages: torch.Tensor, policy_log_probs: torch.Tensor) -> torch.Tensor:
    """REINFORCE per-token loss `-A * log p`.

    Args:
        raw_rewards_or_advantages: (B, 1), one scalar per sequence.
        policy_log_probs: (B, T).
    Returns:
        (B, T) per-token loss.
    """
    return -raw_rewards_or_advantages * policy_log_probs


def compute_grpo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-style clipped objective, per token.

    `ratio = exp(logp - old)`; loss = `-min(ratio * A, clip(ratio, 1 - lo, 1 + hi) * A)`
    with lo = `cliprange`, hi = `cliprange_high` (default `cliprange`).

    Args:
        advantages: (B, 1); policy_log_probs, old_log_probs: (B, T).
    Returns:
        loss (B, T), and metadata: `clipped` (B, T) bool, True where the clipped
        term was the smaller one (that token's gradient is zero), and `ratio` (B, T).
    """
    high = cliprange if cliprange_high is None else cliprange_high
    ratio = torch.exp(policy_log_probs - old_log_probs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - cliprange, 1.0 + high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, {"clipped": clipped < unclipped, "ratio": ratio.detach()}


def compute_kl_penalty(policy_log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): `exp(r) - r - 1`, r = ref - logp.

    Non-negative and unbiased under samples from the policy, with lower variance
    than `-r` (Schulman's "Approximating KL divergence"; used by the GRPO paper).
    (B, T) in, (B, T) out.
    """
    log_ratio = ref_log_probs - policy_log_probs
    return torch.exp(log_ratio) - log_ratio - 1.0


def compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: LossType,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    *,
    cliprange_high: float | None = None,
    kl_coef: float = 0.0,
    ref_log_probs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dispatch to the chosen loss; returns per-token loss (B, T) and metadata.

    no_baseline uses `raw_rewards` (B, 1); reinforce_with_baseline uses
    `advantages` (B, 1); grpo_clip uses `advantages`, `old_log_probs` (B, T) and
    `cliprange`. `importance_weights` (B, T), when given, multiply the policy-gradient
    term per token (truncated importance sampling of rollouts drawn by an older
    policy; no gradient flows through them). With `kl_coef > 0`,
    `kl_coef * k3(policy, reference)` is added per token (unweighted);
    metadata["kl"] holds the (detached) per-token KL whenever `ref_log_probs` is given.
    """
    metadata: dict[str, torch.Tensor] = {}
    if loss_type == "no_baseline":
        if raw_rewards is None:
            raise ValueError("loss_type 'no_baseline' needs raw_rewards")
        loss = compute_naive_policy_gradient_loss(raw_rewards, policy_log_probs)
    elif loss_type == "reinforce_with_baseline":
        if advantages is None:
            raise ValueError("loss_type 'reinforce_with_baseline' needs advantages")
        loss = compute_naive_policy_gradient_loss(advantages, policy_log_probs)
    elif loss_type == "grpo_clip":
        missing = [name for name, value in (("advantages", advantages), ("old_log_probs", old_log_probs), ("cliprange", cliprange)) if value is None]
        if missing:
            raise ValueError(f"loss_type 'grpo_clip' needs {', '.join(missing)}")
        loss, metadata = compute_grpo_clip_loss(advantages, policy_log_probs, old_log_probs, cliprange, cliprange_high)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; use no_baseline, reinforce_with_baseline or grpo_clip")
    if importance_weights is not None:
        loss = loss * importance_weights.detach()
    if kl_coef and ref_log_probs is None:
        raise ValueError("kl_coef > 0 needs ref_log_probs")
    if ref_log_probs is not None:
        kl = compute_kl_penalty(policy_log_probs, ref_log_probs)
        metadata["kl"] = kl.detach()
        if kl_coef:
            loss = loss + kl_coef * kl
    return loss, metadata


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """`sum(tensor * mask, dim) / sum(mask, dim)`; all elements when dim is None."""
    mask = mask.to(tensor.dtype)
    if dim is None:
        return (tensor * mask).sum() / mask.sum()
    return (tensor * mask).sum(dim) / mask.sum(dim)


def masked_normalize(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None, normalize_constant: float = 1.0) -> torch.Tensor:
    """`sum(tensor * mask, dim) / normalize_constant`; all elements when dim is None."""
    mask = mask.to(tensor.dtype)
    if dim is None:
        return (tensor * mask).sum() / normalize_constant
    return (tensor * mask).sum(dim) / normalize_constant


def grpo_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    loss_type: LossType,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    *,
    length_normalization: Literal["mean", "constant"] = "mean",
    normalize_constant: float | None = None,
    cliprange_high: float | None = None,
    kl_coef: float = 0.0,
    ref_log_probs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one microbatch, scaled for gradient accumulation, then `backward()`.

    per-token loss (B, T) -> per-sequence masked mean over response tokens
    (`length_normalization="mean"`, the seed) or masked sum / `normalize_constant`
    ("constant", Dr. GRPO) -> mean over the batch -> / gradient_accumulation_steps.

    A sequence with no response token contributes 0 rather than 0/0 = NaN.

    Returns:
        the scaled loss (scalar, already back-propagated) and metadata:
        `clip_fraction`, `kl` (means over response tokens, when available),
        `loss_unscaled`.
    """
    per_token, loss_metadata = compute_policy_gradient_loss(
        policy_log_probs, loss_type, raw_rewards, advantages, old_log_probs, cliprange,
        cliprange_high=cliprange_high, kl_coef=kl_coef, ref_log_probs=ref_log_probs, importance_weights=importance_weights,
    )
    mask = response_mask.to(per_token.dtype)
    if length_normalization == "mean":
        per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    elif length_normalization == "constant":
        if normalize_constant is None:
            raise ValueError("length_normalization 'constant' needs normalize_constant")
        per_sequence = masked_normalize(per_token, mask, dim=-1, normalize_constant=normalize_constant)
    else:
        raise ValueError(f"unknown length_normalization {length_normalization!r}; use mean or constant")
    unscaled = per_sequence.mean()
    loss = unscaled / gradient_accumulation_steps
    loss.backward()

    metadata = {"loss_unscaled": unscaled.detach()}
    token_count = mask.sum().clamp(min=1.0)
    if "clipped" in loss_metadata:
        metadata["clip_fraction"] = (loss_metadata["clipped"].to(mask.dtype) * mask).sum() / token_count
        metadata["ratio_mean"] = (loss_metadata["ratio"] * mask).sum() / token_count
    if "kl" in loss_metadata:
        metadata["kl"] = (loss_metadata["kl"] * mask).sum() / token_count
    return loss.detach(), metadata
