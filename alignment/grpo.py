"""The policy-gradient math: group-normalised advantages, the losses, masking.

Pure tensor-in, tensor-out functions: no model, no vLLM, no I/O. Names, argument
orders and return types follow the CS336 assignment-5 convention, so notebooks and
tests written against it work here. Every loss `--loss_type` can name is registered
in `LOSSES` by `@register_loss` (the registrations follow the loss functions): a new
loss is one decorated function in this file, nothing else. Options beyond the seed
are keyword arguments whose defaults reproduce it exactly:

- `length_normalization` (`AGGREGATIONS`): "constant" is Dr. GRPO's sum / constant
  instead of the per-sequence mean, which removes the bias towards long wrong
  answers; "token_mean" is DAPO's sum over the optimizer step's tokens / their count;
- `cliprange_high`: DAPO's asymmetric "clip-higher";
- `kl_coef` with `ref_log_probs`: the GRPO paper's KL penalty, k3 estimator
  (`kl_estimator` k1 / k2: Schulman's others); `sequence_kl` puts it in the reward;
- `loss_type` "gspo" (sequence-level ratio, GSPO) and "cispo" (clipped, detached
  importance weight, MiniMax-M1);
- `entropy_coef` with `token_entropy`: an entropy bonus (TRL, verl, OpenRLHF);
- `overlong_reward`: DAPO's soft length penalty; `mismatch_weights`: the sampler/
  trainer mismatch corrections beyond token TIS (Yao et al. 2025, verl rollout_corr).

Shapes: B sequences, T token positions, N = n_prompts * group_size rollouts.
"""

from dataclasses import dataclass
from typing import Callable

import torch

MISMATCH_CORRECTIONS = ("tis", "token_mask", "sequence_tis", "sequence_mask")
# how a microbatch's (B, T) token losses become one number (grpo_microbatch_train_step; --length_normalization)
AGGREGATIONS = ("mean", "constant", "token_mean")


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
        format and answer reward means, fraction of groups with equal rewards,
        and of groups whose every answer is right.
    """
    scores = [reward_fn(response, truth) for response, truth in zip(rollout_responses, repeated_ground_truths, strict=True)]
    return advantages_from_scores(scores, group_size, advantage_eps, normalize_by_std)


def advantages_from_scores(scores: list[dict[str, float]], group_size: int, advantage_eps: float, normalize_by_std: bool):
    """`compute_group_normalized_rewards` for rewards already graded (in parallel, say)."""
    raw_rewards = torch.tensor([score["reward"] for score in scores], dtype=torch.float32)
    advantages, metadata = normalize_group_rewards(raw_rewards, group_size, advantage_eps, normalize_by_std)  # checks the group size
    right = torch.tensor([score["answer_reward"] == 1 for score in scores]).view(-1, group_size)
    metadata.update(
        reward_mean=raw_rewards.mean().item(),
        reward_std=raw_rewards.std().item() if raw_rewards.numel() > 1 else 0.0,
        reward_max=raw_rewards.max().item(),
        reward_min=raw_rewards.min().item(),
        format_reward_mean=sum(score["format_reward"] for score in scores) / len(scores),
        answer_reward_mean=sum(score["answer_reward"] for score in scores) / len(scores),
        # the tied groups that are tied because every answer was right (the rest: mostly all wrong)
        fraction_groups_all_right=right.all(dim=1).float().mean().item(),
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


def compute_gspo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one importance ratio per response.

    s_i = exp((1/|y_i|) sum_t (logp_it - old_it)) over the response tokens (the length-
    normalised sequence likelihood ratio), clipped per sequence:
    loss_i = -min(s_i * A_i, clip(s_i, 1 - lo, 1 + hi) * A_i), lo = `cliprange`, hi = `cliprange_high`.

    Returned per token in the paper's GSPO-token form (as verl's gspo loss computes it):
    s_it = sg(s_i) * exp(logp_it - sg(logp_it)) equals s_i in value at every position,
    so the per-sequence mean over response tokens (--length_normalization mean) is
    loss_i, and its gradient is GSPO's: -A_i * s_i * (1/|y_i|) sum_t grad logp_it, zero
    for a clipped sequence. A response with no token has s_i = 1 (no 0/0).

    Args:
        advantages: (B, 1); policy_log_probs, old_log_probs: (B, T); response_mask: (B, T).
    Returns:
        loss (B, T), metadata: `clipped` (B, T) (every token of a clipped sequence),
        `ratio` (B, T) = s_i broadcast, `sequence_ratio` (B,).
    """
    mask = response_mask.bool()
    # where, not a product: a NaN or garbage old log-prob off the response never leaks in
    log_ratio = torch.where(mask, policy_log_probs.detach() - old_log_probs, torch.zeros_like(policy_log_probs))
    sequence_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
    # grpo_clip's clipped objective, its per-token "old" log-prob chosen so that exp(logp_it - old_it) = s_it
    loss, metadata = compute_grpo_clip_loss(advantages, policy_log_probs, policy_log_probs.detach() - sequence_log_ratio[:, None], cliprange, cliprange_high)
    return loss, {**metadata, "sequence_ratio": sequence_log_ratio.exp()}


def compute_cispo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1 technical report, 2025): clip the importance weight, not the update.

    loss = -sg(clip(ratio, 1 - lo, 1 + hi)) * A * logp, ratio = exp(logp - old): the
    weight is clipped and detached, so every token keeps its gradient
    (-clip(ratio) * A), where grpo_clip zeroes the gradient of a clipped token. The
    report clips the high side only (no lower bound); here lo = `cliprange`.

    Args:
        advantages: (B, 1); policy_log_probs, old_log_probs: (B, T).
    Returns:
        loss (B, T), metadata: `clipped` (B, T), True where the weight was clipped
        (the gradient still flows), and `ratio` (B, T).
    """
    high = cliprange if cliprange_high is None else cliprange_high
    ratio = torch.exp(policy_log_probs.detach() - old_log_probs)
    weight = torch.clamp(ratio, 1.0 - cliprange, 1.0 + high)
    return -weight * advantages * policy_log_probs, {"clipped": weight != ratio, "ratio": ratio}


def compute_kl_penalty(policy_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy, r = ref - logp.

    Schulman, "Approximating KL divergence" (2020):
    - k3 (the default; the GRPO paper's): `exp(r) - r - 1`, unbiased and non-negative,
      lower variance than k1;
    - k1: `-r`, unbiased, high variance, negative on some tokens;
    - k2: `r**2 / 2`, biased, low variance.
    As a loss term their gradients differ: k1's is zero in expectation, k2's is the
    gradient of KL(policy || reference), k3's that of KL(reference || policy); in the
    reward (`sequence_kl`) only their values matter. (B, T) in, (B, T) out.
    """
    log_ratio = ref_log_probs - policy_log_probs
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2 or k3")


def sequence_kl(policy_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, response_mask: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """(N,) per-response sum over response tokens of `compute_kl_penalty`, for KL in the reward.

    --kl_in reward (verl's use_kl_in_reward; the InstructGPT-style penalty):
    reward_i - kl_coef * sequence_kl_i, taken before the group normalisation. No
    gradient (the log-probs are fixed before the update); 0 for an empty response.
    """
    kl = compute_kl_penalty(policy_log_probs.detach(), ref_log_probs.detach(), estimator)
    return torch.where(response_mask.bool(), kl, torch.zeros_like(kl)).sum(-1)


def overlong_reward(response_lengths: torch.Tensor, max_tokens: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", section 3.4), added to the reward.

    With L = `max_tokens`, B = `buffer` and n the response's token count:
    0 for n <= L - B; (L - B - n) / B for L - B < n <= L (linear from 0 down to -1
    at n = L); -1 beyond L. (N,) lengths in, (N,) float rewards in [-1, 0] out.
    """
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"overlong buffer {buffer} must be in [1, {max_tokens}]")
    excess = response_lengths.float() - (max_tokens - buffer)
    return -(excess / buffer).clamp(min=0.0, max=1.0)


def mismatch_weights(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    cap: float,
    reweight: bool = True,
) -> torch.Tensor:
    """(B, T) per-token weights for rollouts the sampler drew from other weights than the trainer's.

    rho_t = exp(trainer - sampler log-prob) per token; rho_seq = exp(mean_t log rho_t)
    over the response tokens, the geometric mean of its token ratios (1 for an empty
    response). c = `cap` (--tis_cap). Yao et al. 2025 ("Your efficient RL framework
    secretly brings you off-policy RL training"; its follow-up on masked IS) and verl's
    rollout_corr:
    - tis: min(rho_t, c), truncated IS per token (train_rl's one-step-off default);
    - token_mask: rho_t * 1[1/c <= rho_t <= c], masked IS per token ("IcePop");
    - sequence_tis: min(rho_seq, c) on every token of the response;
    - sequence_mask: rho_seq * 1[1/c <= rho_seq <= c] on every token of the response.
    `reweight=False` returns only the 0/1 mask of the masking modes: grpo_clip, gspo
    and cispo already take their ratio against the sampler's log-probs. No gradient.
    """
    mask = response_mask.bool()
    log_ratio = torch.where(mask, trainer_log_probs.detach() - sampler_log_probs, torch.zeros_like(trainer_log_probs))
    if mode.startswith("sequence"):
        log_ratio = (log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    if mode in ("tis", "sequence_tis"):
        if not reweight:
            raise ValueError(f"mismatch correction {mode!r} is a reweighting; the ratio losses need a masking mode")
        return ratio.clamp(max=cap)
    if mode not in ("token_mask", "sequence_mask"):
        raise ValueError(f"unknown mismatch correction {mode!r}; use {', '.join(MISMATCH_CORRECTIONS)}")
    inside = (ratio >= 1.0 / cap) & (ratio <= cap)
    return torch.where(inside, ratio if reweight else torch.ones_like(ratio), torch.zeros_like(ratio))


@dataclass(frozen=True)
class LossInputs:
    """What every registered loss is called with, for B sequences of T positions.

    policy_log_probs (B, T), with gradient; signal (B, 1): the advantages, or the raw
    rewards for a loss registered with signal="raw_rewards"; response_mask (B, T) (None
    where a caller has none); old_log_probs (B, T) and the clip range for a loss
    registered with ratio=True (None otherwise).
    """

    policy_log_probs: torch.Tensor
    signal: torch.Tensor
    response_mask: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    cliprange: float | None = None
    cliprange_high: float | None = None


@dataclass(frozen=True)
class Loss:
    """One `--loss_type`: `compute(inputs) -> (per-token loss (B, T), metadata)`, and what it needs."""

    compute: Callable[[LossInputs], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    description: str
    ratio: bool
    signal: str
    aggregations: tuple[str, ...]


LOSSES: dict[str, Loss] = {}


def register_loss(name: str, description: str, *, ratio: bool = False, signal: str = "advantages", aggregations: tuple[str, ...] = AGGREGATIONS):
    """Decorator: the function `loss(inputs: LossInputs) -> (loss (B, T), metadata)` becomes `--loss_type name`.

    - `ratio`: the loss compares the policy with `old_log_probs` (the policy that sampled the
      batch, the frozen reference, or the sampler's own) and gets the clip range; train_rl
      then scores the pre-update policy when a batch takes several optimizer steps;
    - `signal`: "advantages" (group-normalised) or "raw_rewards";
    - `aggregations`: the `length_normalization` modes the loss is defined for.
    A "clipped" (B, T) bool in the metadata becomes train/clip_fraction. Write the arguments
    as literals: args.py reads them from this file's text, so that `--help` imports no torch.
    """
    if name in LOSSES:
        raise ValueError(f"loss_type {name!r} is registered twice")
    if signal not in ("advantages", "raw_rewards") or not set(aggregations) <= set(AGGREGATIONS):
        raise ValueError(f"loss_type {name!r}: signal must be advantages or raw_rewards, aggregations some of {AGGREGATIONS}")

    def add(compute):
        LOSSES[name] = Loss(compute, description, ratio, signal, tuple(aggregations))
        return compute

    return add


# one REINFORCE loss, two signals (decorators apply bottom up: no_baseline is registered first)
@register_loss("reinforce_with_baseline", "-advantage * logp, the group mean as the baseline (seed)")
@register_loss("no_baseline", "-reward * logp, REINFORCE on raw rewards in groups of one (seed)", signal="raw_rewards")
def _reinforce(inputs: LossInputs):
    return compute_naive_policy_gradient_loss(inputs.signal, inputs.policy_log_probs), {}


@register_loss("grpo_clip", "PPO-style clipped ratio against the old policy (seed)", ratio=True)
def _grpo_clip(inputs: LossInputs):
    return compute_grpo_clip_loss(inputs.signal, inputs.policy_log_probs, inputs.old_log_probs, inputs.cliprange, inputs.cliprange_high)


@register_loss("gspo", "one length-normalised ratio per response, clipped per sequence (Zheng et al. 2025, GSPO; they clip at 3e-4 / 4e-4)",
               ratio=True, aggregations=("mean",))
def _gspo(inputs: LossInputs):
    if inputs.response_mask is None:
        raise ValueError("loss_type 'gspo' needs response_mask")
    return compute_gspo_loss(inputs.signal, inputs.policy_log_probs, inputs.old_log_probs, inputs.response_mask, inputs.cliprange, inputs.cliprange_high)


@register_loss("cispo", "-sg(clip(ratio)) * A * logp, every token keeps its gradient (MiniMax-M1, 2025)", ratio=True)
def _cispo(inputs: LossInputs):
    return compute_cispo_loss(inputs.signal, inputs.policy_log_probs, inputs.old_log_probs, inputs.cliprange, inputs.cliprange_high)


def compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    *,
    cliprange_high: float | None = None,
    kl_coef: float = 0.0,
    ref_log_probs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    kl_estimator: str = "k3",
    response_mask: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    token_entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The registered loss `loss_type` (LOSSES), plus the terms every loss shares; per-token loss (B, T) and metadata.

    The loss gets `raw_rewards` or `advantages` (B, 1), as it was registered (no_baseline:
    raw rewards); a ratio loss (grpo_clip, gspo, cispo) also `old_log_probs` (B, T) and
    `cliprange` (gspo also `response_mask`). `importance_weights` (B, T),
    when given, multiply the policy-gradient term per token (truncated importance
    sampling of rollouts drawn by an older policy; no gradient flows through them).
    With `kl_coef > 0`, `kl_coef * KL(policy, reference)` is added per token
    (unweighted; `kl_estimator` k1/k2/k3); metadata["kl"] holds the (detached)
    per-token k3 KL whenever `ref_log_probs` is given. With `entropy_coef > 0`,
    `entropy_coef * token_entropy` (B, T) is subtracted per token: an entropy bonus
    (TRL, verl, OpenRLHF), aggregated like the rest of the loss.
    """
    spec = LOSSES.get(loss_type)
    if spec is None:
        raise ValueError(f"unknown loss_type {loss_type!r}; use {', '.join(LOSSES)}")
    signal = raw_rewards if spec.signal == "raw_rewards" else advantages
    needed = ((spec.signal, signal),) + ((("old_log_probs", old_log_probs), ("cliprange", cliprange)) if spec.ratio else ())
    missing = [name for name, value in needed if value is None]
    if missing:
        raise ValueError(f"loss_type {loss_type!r} needs {', '.join(missing)}")
    inputs = LossInputs(policy_log_probs, signal, response_mask, old_log_probs if spec.ratio else None, cliprange, cliprange_high)
    loss, metadata = spec.compute(inputs)
    metadata = dict(metadata)  # the KL and entropy terms add to it
    if importance_weights is not None:
        loss = loss * importance_weights.detach()
    if kl_coef and ref_log_probs is None:
        raise ValueError("kl_coef > 0 needs ref_log_probs")
    if ref_log_probs is not None:
        kl = compute_kl_penalty(policy_log_probs, ref_log_probs)
        metadata["kl"] = kl.detach()
        if kl_coef:
            loss = loss + kl_coef * (kl if kl_estimator == "k3" else compute_kl_penalty(policy_log_probs, ref_log_probs, kl_estimator))
    if entropy_coef:
        if token_entropy is None:
            raise ValueError("entropy_coef > 0 needs token_entropy")
        loss = loss - entropy_coef * token_entropy
        metadata["entropy_bonus"] = entropy_coef * token_entropy.detach()
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
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    *,
    length_normalization: str = "mean",
    normalize_constant: float | None = None,
    cliprange_high: float | None = None,
    kl_coef: float = 0.0,
    ref_log_probs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    token_entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one microbatch, scaled for gradient accumulation, then `backward()`.

    per-token loss (B, T) -> per sequence: the masked mean over its response tokens
    (`length_normalization="mean"`, the seed), or the masked sum / `normalize_constant`
    ("constant", Dr. GRPO: a fixed constant such as the response cap; "token_mean",
    DAPO: the caller passes the optimizer step's response tokens / its sequences, so
    that the step's loss is its summed token loss over its token count however it is
    cut into microbatches) -> mean over the batch -> / gradient_accumulation_steps.

    A sequence with no response token contributes 0 rather than 0/0 = NaN.

    Returns:
        the scaled loss (scalar, already back-propagated) and metadata:
        `clip_fraction`, `kl`, `entropy_bonus` (means over response tokens, when
        available), `loss_unscaled`.
    """
    per_token, loss_metadata = compute_policy_gradient_loss(
        policy_log_probs, loss_type, raw_rewards, advantages, old_log_probs, cliprange,
        cliprange_high=cliprange_high, kl_coef=kl_coef, ref_log_probs=ref_log_probs, importance_weights=importance_weights,
        kl_estimator=kl_estimator, response_mask=response_mask, entropy_coef=entropy_coef, token_entropy=token_entropy,
    )
    if length_normalization not in AGGREGATIONS:
        raise ValueError(f"unknown length_normalization {length_normalization!r}; use {', '.join(AGGREGATIONS)}")
    if length_normalization not in LOSSES[loss_type].aggregations:
        raise ValueError(f"loss_type {loss_type!r} is defined for length_normalization {' or '.join(LOSSES[loss_type].aggregations)} only")
    mask = response_mask.to(per_token.dtype)
    if length_normalization == "mean":
        per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    else:
        if normalize_constant is None:
            raise ValueError(f"length_normalization {length_normalization!r} needs normalize_constant")
        per_sequence = masked_normalize(per_token, mask, dim=-1, normalize_constant=normalize_constant)
    unscaled = per_sequence.mean()
    loss = unscaled / gradient_accumulation_steps
    loss.backward()

    metadata = {"loss_unscaled": unscaled.detach()}
    token_count = mask.sum().clamp(min=1.0)
    if "clipped" in loss_metadata:
        metadata["clip_fraction"] = (loss_metadata["clipped"].to(mask.dtype) * mask).sum() / token_count
    if "kl" in loss_metadata:
        metadata["kl"] = (loss_metadata["kl"] * mask).sum() / token_count
    if "entropy_bonus" in loss_metadata:
        metadata["entropy_bonus"] = (loss_metadata["entropy_bonus"] * mask).sum() / token_count
    return loss.detach(), metadata
