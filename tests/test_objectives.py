"""The objective variants: GSPO, CISPO, DAPO's dynamic sampling and overlong handling, the entropy
bonus, KL estimators and KL in the reward, mismatch corrections, pass@k. Hand-computed values and
gradients on small tensors, the default path against the formula it had before, flag checks, and
two short train_rl runs that put every new flag through the loop."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from alignment import evaluate, train_rl
from alignment.args import RUN_DEFINING_FLAGS, check_resume_flags, parse_eval_args, parse_rl_args
from alignment.distributed import SingleProcess, check_fsdp_sizes
from alignment.errors import UserError
from alignment.evaluate import add_pass_at_k, correct_counts, pass_at_k
from alignment.grpo import (
    compute_cispo_loss,
    compute_grpo_clip_loss,
    compute_gspo_loss,
    compute_kl_penalty,
    compute_policy_gradient_loss,
    grpo_microbatch_train_step,
    mismatch_weights,
    normalize_group_rewards,
    overlong_reward,
    sequence_kl,
)
from alignment.rollout import Generation
from alignment.sampler import extra_prompts, fill_informative_groups, sample_and_grade, truncated_responses
from conftest import make_tiny_task, parity_reward, steps_log, train_rl_flags, update_settings

# ------------------------------------------------------------------ GSPO


def _gspo_case():
    """4 responses in T=3: two tokens (inside the clip), three (clipped high), one token, none."""
    advantages = torch.tensor([[1.0], [1.0], [-1.0], [1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    log_ratio = torch.tensor([[0.1, 0.3, 0.0], [0.4, 0.5, 0.6], [-0.1, 0.0, 0.0], [0.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -0.7, -1.1], [-0.3, float("nan"), float("nan")], [float("nan")] * 3])
    policy = (torch.nan_to_num(old, nan=-1.0) + log_ratio).requires_grad_(True)
    return advantages, policy, old, mask


def test_gspo_ratio_is_the_length_normalised_sequence_ratio_clipped_per_sequence():
    advantages, policy, old, mask = _gspo_case()
    loss, meta = compute_gspo_loss(advantages, policy, old, mask, cliprange=0.2, cliprange_high=0.3)
    s = [math.exp(0.2), math.exp(0.5), math.exp(-0.1), 1.0]  # exp(mean log-ratio); an empty response has s = 1
    assert torch.allclose(meta["sequence_ratio"], torch.tensor(s))
    # every position carries its sequence's loss: -min(s A, clip(s, 0.8, 1.3) A); NaN off the response never leaks
    expected = torch.tensor([-s[0], -1.3, s[2], -1.0])
    assert torch.isfinite(loss).all()
    assert torch.allclose(loss, expected[:, None].expand(4, 3))
    assert meta["clipped"][:, 0].tolist() == [False, True, False, False]


def test_gspo_dispatch_needs_the_response_mask():
    log_probs = torch.tensor([[-1.0, -2.0]])
    with pytest.raises(ValueError, match="loss_type 'gspo' needs response_mask"):
        compute_policy_gradient_loss(log_probs, "gspo", advantages=torch.ones(1, 1), old_log_probs=log_probs, cliprange=0.2)
    loss, meta = compute_policy_gradient_loss(log_probs, "gspo", advantages=torch.ones(1, 1), old_log_probs=log_probs, cliprange=0.2,
                                              response_mask=torch.ones(1, 2, dtype=torch.bool))
    assert torch.equal(loss, -torch.ones(1, 2)) and meta["sequence_ratio"].tolist() == [1.0]  # on policy: s = 1, loss = -A


def test_gspo_gradient_equals_the_sequence_level_objective_and_hand_values():
    advantages, policy, old, mask = _gspo_case()
    grpo_microbatch_train_step(policy, mask, 1, "gspo", advantages=advantages, old_log_probs=old, cliprange=0.2, cliprange_high=0.3)
    # hand: d/dlogp_t of mean_i loss_i = -A_i s_i / |y_i| / B when unclipped, 0 when clipped or masked
    expected = torch.zeros(4, 3)
    expected[0, :2] = -math.exp(0.2) / 2 / 4
    expected[2, 0] = math.exp(-0.1) / 1 / 4  # one token, A = -1
    assert torch.allclose(policy.grad, expected, atol=1e-7)

    # the naive sequence-level GSPO objective through autograd gives the same gradient
    naive_policy = policy.detach().clone().requires_grad_(True)
    losses = []
    for row in range(3):
        s = torch.exp((naive_policy[row][mask[row]] - old[row][mask[row]]).mean())
        losses.append(-torch.minimum(s * advantages[row, 0], s.clamp(0.8, 1.3) * advantages[row, 0]))
    (torch.stack(losses).sum() / 4).backward()
    assert torch.allclose(naive_policy.grad, policy.grad, atol=1e-7)


# ------------------------------------------------------------------ CISPO


def test_cispo_clips_the_detached_weight_and_keeps_every_tokens_gradient():
    ratios = torch.tensor([[1.5, 1.0, 0.5]])
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    policy = (old + ratios.log()).requires_grad_(True)
    advantages = torch.tensor([[2.0]])
    loss, meta = compute_cispo_loss(advantages, policy, old, cliprange=0.2)
    weights = torch.tensor([[1.2, 1.0, 0.8]])
    assert torch.allclose(loss, -weights * 2.0 * policy.detach())
    assert meta["clipped"].tolist() == [[True, False, True]]
    loss.sum().backward()
    assert torch.allclose(policy.grad, -weights * 2.0)  # grpo_clip would give 0 on the first token

    clip_policy = policy.detach().clone().requires_grad_(True)
    compute_grpo_clip_loss(advantages, clip_policy, old, cliprange=0.2)[0].sum().backward()
    assert clip_policy.grad[0, 0] == 0.0


def test_cispo_clip_higher_bounds_the_weight_asymmetrically():
    """Guards: cispo ignoring --cliprange_high (or its sides swapped). Ratios [1.5, 1.25, 0.5], cliprange 0.2,
    cliprange_high 0.28, A = 1: weights clip(ratio, 0.8, 1.28) = [1.28, 1.25, 0.8], the gradient -weight per token,
    clipped [True, False, True] (the high side read from --cliprange would clip 1.25 to 1.2)."""
    ratios = torch.tensor([[1.5, 1.25, 0.5]])
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    policy = (old + ratios.log()).requires_grad_(True)
    loss, meta = compute_cispo_loss(torch.ones(1, 1), policy, old, cliprange=0.2, cliprange_high=0.28)
    loss.sum().backward()
    assert policy.grad[0].tolist() == pytest.approx([-1.28, -1.25, -0.8], rel=1e-6)
    assert meta["clipped"].tolist() == [[True, False, True]]


def test_cispo_on_policy_is_reinforce():
    """One optimizer step on fresh rollouts: the old log-probs are the policy's own, ratio 1."""
    generator = torch.Generator().manual_seed(0)
    log_probs = (-torch.rand(3, 4, generator=generator)).requires_grad_(True)
    advantages = torch.tensor([[1.0], [-0.5], [2.0]])
    cispo, _ = compute_policy_gradient_loss(log_probs, "cispo", advantages=advantages, old_log_probs=log_probs.detach(), cliprange=0.2)
    cispo.sum().backward()
    reinforce_policy = log_probs.detach().clone().requires_grad_(True)
    reinforce, _ = compute_policy_gradient_loss(reinforce_policy, "reinforce_with_baseline", advantages=advantages)
    reinforce.sum().backward()
    assert torch.equal(cispo, reinforce.detach()) and torch.equal(log_probs.grad, reinforce_policy.grad)


# ------------------------------------------------------------------ KL


def test_kl_estimators_values_and_gradients():
    reference = torch.tensor([[-1.0, -1.0, -1.5]])
    r = torch.tensor([[0.0, 1.0, -1.0]])  # ref - logp
    hand = {
        "k1": (-r, torch.ones(1, 3)),  # d(-r)/dlogp = 1
        "k2": (r**2 / 2, -r),  # d(r^2/2)/dlogp = -r
        "k3": (torch.exp(r) - r - 1, 1 - torch.exp(r)),
    }
    for estimator, (values, gradient) in hand.items():
        policy = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
        kl = compute_kl_penalty(policy, reference, estimator)
        assert torch.allclose(kl, values), estimator
        kl.sum().backward()
        assert torch.allclose(policy.grad, gradient), estimator
    with pytest.raises(ValueError, match="unknown KL estimator"):
        compute_kl_penalty(reference, reference, "k4")


def test_kl_estimator_in_the_loss_and_k3_stays_logged():
    policy = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    reference = torch.tensor([[-1.0, -1.0]])
    loss, meta = compute_policy_gradient_loss(policy, "reinforce_with_baseline", advantages=torch.zeros(1, 1), kl_coef=0.5,
                                              ref_log_probs=reference, kl_estimator="k2")
    assert torch.allclose(loss, torch.tensor([[0.0, 0.5 * 0.5]]))  # 0.5 * r^2 / 2 with r = 1
    assert meta["kl"][0, 1].item() == pytest.approx(math.e - 2.0)  # train/kl_ref logs k3 whichever estimator


def test_sequence_kl_sums_response_tokens_without_nan():
    policy = torch.tensor([[-1.0, -2.0, 0.0], [0.0, 0.0, 0.0], [-0.5, 0.0, 0.0]])
    reference = torch.tensor([[-1.0, -1.0, float("nan")], [float("nan")] * 3, [-0.5, float("nan"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    assert torch.allclose(sequence_kl(policy, reference, mask), torch.tensor([math.e - 2.0, 0.0, 0.0]))  # empty, one token
    assert not sequence_kl(policy.requires_grad_(True), reference, mask).requires_grad  # a reward: no gradient into the policy
    assert torch.allclose(sequence_kl(policy, reference, mask, "k1"), torch.tensor([-1.0, 0.0, 0.0]))


def test_kl_in_the_reward_enters_before_the_group_normalisation():
    """A group that ties on the task reward gets advantages from its KL differences alone: with
    std normalisation they are scaled to +-1/sqrt(2) however small the KL (as in verl)."""
    args = SimpleNamespace(group_size=2, advantage_eps=0.0, use_std_normalization=True)
    raw = torch.tensor([1.0, 1.0, 1.0, 0.0])
    batch = {"raw_rewards": raw, "advantages": normalize_group_rewards(raw, 2, 0.0, True)[0]}
    assert batch["advantages"][:2].tolist() == [0.0, 0.0]
    kl = torch.tensor([0.1, 0.3, 0.2, 0.2])
    logged = train_rl.shape_rewards(args, batch, -0.5 * kl, SingleProcess(), "train/kl_reward")
    assert logged["train/kl_reward"] == pytest.approx(-0.1)
    assert torch.allclose(batch["raw_rewards"], torch.tensor([0.95, 0.85, 0.9, -0.1]))
    half = 1 / math.sqrt(2)
    assert torch.allclose(batch["advantages"], torch.tensor([half, -half, half, -half]), atol=1e-5)
    args.use_std_normalization = False
    batch["raw_rewards"] = raw
    train_rl.shape_rewards(args, batch, -0.5 * kl, SingleProcess(), "train/kl_reward")
    assert torch.allclose(batch["advantages"], torch.tensor([0.05, -0.05, 0.5, -0.5]))


# ------------------------------------------------------------------ DAPO


def test_overlong_reward_is_dapos_soft_punishment():
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])
    # L = 10, buffer 4: 0 up to 6 tokens, (6 - n) / 4 after, -1 from 10 on
    assert overlong_reward(lengths, 10, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_reward(torch.tensor([0, 1]), 1, 1).tolist() == [0.0, -1.0]  # the whole response is the buffer
    for buffer in (0, 11):
        with pytest.raises(ValueError, match="overlong buffer"):
            overlong_reward(lengths, 10, buffer)


def test_truncated_means_the_limit_without_stop_string_or_eos():
    eos = 0
    generations = [
        Generation("12 + 3", 8, [5] * 8),  # ran into the limit: truncated
        Generation("15 </answer>", 8, [5] * 8),  # the stop string on the last token: ended
        Generation("15", 8, [5] * 7 + [eos]),  # EOS on the last token: ended
        Generation("15", 5, [5] * 5),  # shorter
        Generation("", 0, []),
    ]
    assert truncated_responses(generations, 8, eos).tolist() == [True, False, False, False, False]
    assert truncated_responses(generations[:1] * 3, 8, eos).all()  # all truncated


def _groups(*rewards_per_group):
    """A sample_round answer: groups of 2 with these rewards (prompts and texts name the group)."""
    prompts = [f"p{i}" for i, rewards in enumerate(rewards_per_group) for _ in rewards]
    scores = [{"reward": float(r)} for rewards in rewards_per_group for r in rewards]
    return prompts, list(prompts), [Generation(p, 1, [1]) for p in prompts], scores, 7


def test_dynamic_sampling_refills_informative_groups_and_keeps_the_batch_size():
    rounds = {0: _groups((1, 1), (0, 1)), 1: _groups((0, 0), (1, 0)), 2: _groups((0, 1), (1, 0))}
    prompts, truths, generations, scores, version, logged = fill_informative_groups(rounds.__getitem__, 2, 2, 3, SingleProcess())
    assert [prompt for prompt in prompts] == ["p1", "p1", "p1", "p1"]  # group 1 of round 0, group 1 of round 1
    assert [s["reward"] for s in scores] == [0.0, 1.0, 1.0, 0.0] and version == 7 and len(generations) == len(truths) == 4
    assert logged == {"train/dynamic_sampling_rounds": 1, "train/dynamic_sampling_informative_fraction": 0.5,
                      "train/dynamic_sampling_sampled_reward": 0.5,  # 4 of the 8 sampled responses right; the kept ones 2 of 4
                      "train/dynamic_sampling_sampled_tokens": 8}  # one token each, both rounds: the engine's work, not the batch's 4

    # bounded: after the last allowed round, tied groups fill the batch to its size
    prompts, _, _, scores, _, logged = fill_informative_groups(rounds.__getitem__, 2, 2, 0, SingleProcess())
    assert len(prompts) == 4 and [s["reward"] for s in scores] == [0.0, 1.0, 1.0, 1.0]
    assert logged["train/dynamic_sampling_rounds"] == 0 and logged["train/dynamic_sampling_sampled_reward"] == 0.75
    assert logged["train/dynamic_sampling_sampled_tokens"] == 4

    # every group ties: the rounds run out, the batch keeps its size
    prompts, _, _, _, _, logged = fill_informative_groups(lambda _: _groups((0, 0), (1, 1)), 2, 2, 2, SingleProcess())
    assert len(prompts) == 4 and logged == {"train/dynamic_sampling_rounds": 2, "train/dynamic_sampling_informative_fraction": 0.0,
                                            "train/dynamic_sampling_sampled_reward": 0.5, "train/dynamic_sampling_sampled_tokens": 12}


class _RecordingSampler:
    """sampler.sample's interface: each call's prompts recorded; response j of a group is "<prompt>#j"."""

    def __init__(self):
        self.calls = []

    def sample(self, step, prompts, truths, group_size, sampling, seed, later):
        self.calls.append(list(prompts))
        grouped = [p for p in prompts for _ in range(group_size)]
        texts = [f"{p}#{j}" for p in prompts for j in range(group_size)]
        return grouped, [t for t in truths for _ in range(group_size)], [Generation(t, 1, [1]) for t in texts], 0


def _informative_if(predicate):
    """A grader: rewards [0, 1] in the group of a prompt that `predicate` takes ("q4" -> 4), [0, 0] in any other."""
    return lambda texts, truths: [{"reward": float(predicate(int(t.split("#")[0][1:])) and t.endswith("#1"))} for t in texts]


def test_dynamic_sampling_prompts_oversample_round_zero_in_one_call():
    class Dataset(SimpleNamespace):
        def __len__(self):
            return len(self.prompts)

    dataset = Dataset(prompts=[f"q{i}" for i in range(40)], ground_truths=[f"a{i}" for i in range(40)])
    args = SimpleNamespace(dynamic_sampling=True, dynamic_sampling_prompts=6, rollout_batch_size=2, group_size=2, max_sampling_rounds=1, seed=3)
    step, own, own_truths = 5, ["q1", "q2"], ["a1", "a2"]

    def run(grade, **changes):
        sampler = _RecordingSampler()
        result = sample_and_grade(SimpleNamespace(**{**vars(args), **changes}), sampler, dataset, step, own, own_truths, None, (),
                                  SingleProcess(), {}, grade)
        return sampler.calls, result

    extra = extra_prompts(dataset, step, args.seed, own, 0, 4)[0]
    # round 0: the step's own prompts first, then 4 drawn apart, in one engine call; the own informative group is kept first
    chosen = extra[1]
    calls, (prompts, truths, _, scores, _, logged) = run(_informative_if(lambda i: i in (2, int(chosen[1:]))))
    assert calls == [own + extra]
    assert prompts == ["q2", "q2", chosen, chosen] and truths[:2] == ["a2", "a2"] and [s["reward"] for s in scores] == [0.0, 1.0, 0.0, 1.0]
    assert logged == {"train/dynamic_sampling_rounds": 0, "train/dynamic_sampling_informative_fraction": 2 / 6,
                      "train/dynamic_sampling_sampled_reward": 2 / 12, "train/dynamic_sampling_sampled_tokens": 12}

    # still short: an extra round draws --dynamic_sampling_prompts; the rounds run out, a tied group fills the batch
    calls, (prompts, *_, logged) = run(_informative_if(lambda i: i == 2))
    assert calls == [own + extra, extra_prompts(dataset, step, args.seed, own, 4, 6)[0]]
    assert prompts == ["q2", "q2", "q1", "q1"] and logged["train/dynamic_sampling_rounds"] == 1
    assert logged["train/dynamic_sampling_sampled_reward"] == 1 / 24  # 12 prompts x 2 responses, one right

    # the default (--rollout_batch_size): round 0 is the step's own batch, an extra round draws as many (DAPO's rounds)
    calls, _ = run(_informative_if(lambda i: i == 2), dynamic_sampling_prompts=2)
    assert calls == [own, extra_prompts(dataset, step, args.seed, own, 0, 2)[0]]
    # without --dynamic_sampling the step's batch is sampled alone and kept as it is
    calls, (prompts, *_, logged) = run(_informative_if(lambda i: i == 2), dynamic_sampling=False)
    assert calls == [own] and prompts == ["q1", "q1", "q2", "q2"] and logged == {}


def test_dynamic_sampling_never_samples_a_prompt_twice_in_a_step():
    """Round 0's extras and every extra round come from one shuffle without the step's own prompts (the
    whole step's, under torchrun): no prompt twice in a step, and the ranks' shares are disjoint."""
    class Dataset(SimpleNamespace):
        def __len__(self):
            return len(self.prompts)

    dataset = Dataset(prompts=[f"q{i}" for i in range(40)], ground_truths=[f"a{i}" for i in range(40)])
    args = SimpleNamespace(dynamic_sampling=True, dynamic_sampling_prompts=8, rollout_batch_size=4, group_size=2, max_sampling_rounds=3, seed=0)
    never = _informative_if(lambda i: False)  # every group tied: all three extra rounds run
    for step in range(1, 31):
        own = [f"q{(step * 7 + k) % 40}" for k in range(4)]
        sampler = _RecordingSampler()
        sample_and_grade(args, sampler, dataset, step, own, [p.replace("q", "a") for p in own], None, (), SingleProcess(), {}, never)
        single = sampler.calls
        drawn = [p for call in single for p in call]
        assert len(drawn) == 4 + 4 + 3 * 8 == len(set(drawn)), (step, drawn)
        # two ranks, two own prompts each: together they draw what one process draws, each extra once
        shares = []
        for rank in (0, 1):
            ranks = SimpleNamespace(rank=rank, world_size=2, gather=lambda items, own=own: list(own), any_true=bool, mean=float, sum=float)
            sampler = _RecordingSampler()
            kept = sample_and_grade(args, sampler, dataset, step, own[2 * rank : 2 * rank + 2], [], None, (), ranks, {}, never)
            shares.append(sampler.calls)
            assert len(kept[0]) == len(kept[2]) == 2 * args.group_size  # this rank's share of the batch, not the whole batch's groups
        assert shares[0][0] == own[:2] + single[0][4:6] and shares[1][0] == own[2:] + single[0][6:]
        assert all(shares[0][k] == single[k][:4] and shares[1][k] == single[k][4:] for k in (1, 2, 3))
    # a split too small for the rounds: the shuffle starts over, each round still has its full count
    small = Dataset(prompts=[f"q{i}" for i in range(10)], ground_truths=[f"a{i}" for i in range(10)])
    sampler = _RecordingSampler()
    sample_and_grade(args, sampler, small, 1, ["q0", "q1", "q2", "q3"], ["a0", "a1", "a2", "a3"], None, (), SingleProcess(), {}, never)
    assert [len(call) for call in sampler.calls] == [8, 8, 8, 8] and not {"q0", "q1", "q2", "q3"} & {p for call in sampler.calls[1:] for p in call}


def test_dynamic_sampling_prompts_split_over_the_ranks():
    ranks = SimpleNamespace(world_size=2)
    args = SimpleNamespace(rollout_batch_size=32, train_batch_size=256, train_mini_batch_size=8, dynamic_sampling=True, dynamic_sampling_prompts=48)
    check_fsdp_sizes(args, ranks)  # 24 prompts a round on each rank
    with pytest.raises(UserError, match="--dynamic_sampling_prompts 33 must be divisible by the 2 ranks"):
        check_fsdp_sizes(SimpleNamespace(**{**vars(args), "dynamic_sampling_prompts": 33}), ranks)
    check_fsdp_sizes(SimpleNamespace(**{**vars(args), "dynamic_sampling_prompts": 33, "dynamic_sampling": False}), ranks)


# ------------------------------------------------------------------ entropy bonus


def test_entropy_bonus_value_and_gradient():
    generator = torch.Generator().manual_seed(0)
    log_probs = (-torch.rand(2, 4, generator=generator)).requires_grad_(True)
    entropy = torch.rand(2, 4, generator=generator).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    advantages = torch.tensor([[1.0], [-1.0]])
    loss, meta = grpo_microbatch_train_step(log_probs, mask, 1, "reinforce_with_baseline", advantages=advantages, entropy_coef=0.1, token_entropy=entropy)
    m = mask.float()
    per_sequence = ((-advantages * log_probs.detach() - 0.1 * entropy.detach()) * m).sum(-1) / m.sum(-1)
    assert loss.item() == pytest.approx(per_sequence.mean().item())
    expected = torch.zeros(2, 4)
    expected[0, :2] = -0.1 / 2 / 2
    expected[1, :] = -0.1 / 4 / 2
    assert torch.allclose(entropy.grad, expected)
    assert meta["entropy_bonus"].item() == pytest.approx(0.1 * (entropy.detach() * m).sum().item() / 6)
    with pytest.raises(ValueError, match="needs token_entropy"):
        compute_policy_gradient_loss(log_probs, "reinforce_with_baseline", advantages=advantages, entropy_coef=0.1)


def test_entropy_path_matches_the_naive_scoring_and_carries_a_gradient(tiny_model_and_tokenizer):
    from alignment.sft_helpers import get_response_log_probs

    model, _ = tiny_model_and_tokenizer
    input_ids = torch.tensor([[1, 5, 9, 3, 7], [2, 4, 6, 8, 10]])
    labels = torch.roll(input_ids, -1, 1)
    # as update_policy asks for it under --entropy_coef: the fused chunk size is overridden
    ours = get_response_log_probs(model, input_ids, labels, return_token_entropy=True, chunk_size=1024, temperature=0.7, entropy_grad=True)
    naive = get_response_log_probs(model, input_ids, labels, return_token_entropy=True, chunk_size=0, temperature=0.7)
    assert torch.allclose(ours["log_probs"], naive["log_probs"], atol=1e-6)
    assert torch.allclose(ours["token_entropy"], naive["token_entropy"], atol=1e-5)
    assert ours["token_entropy"].requires_grad and not naive["token_entropy"].requires_grad
    model.zero_grad()
    ours["token_entropy"].sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad()


# ------------------------------------------------------------------ mismatch corrections


def _mismatch_case():
    ratios = torch.tensor([[3.0, 0.25, 1.5], [4.0, 4.0, 1.0], [1.0, 1.0, 1.0], [0.4, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    sampler = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1], [-1.0, -1.0, -1.0], [-2.0, -1.0, -1.0]])
    trainer = sampler + ratios.log()
    return trainer, torch.where(mask, sampler, trainer), mask  # as update_policy passes it: the trainer's own off the response


def test_mismatch_weights_token_and_sequence_modes():
    trainer, sampler, mask = _mismatch_case()
    weights = {mode: mismatch_weights(trainer, sampler, mask, mode, cap=2.0) for mode in ("tis", "token_mask", "sequence_tis", "sequence_mask")}
    geo = 1.125 ** (1 / 3)  # (3 x 0.25 x 1.5) ** (1/3)
    expected = {
        "tis": [[2.0, 0.25, 1.5], [2.0, 2.0, 1.0], [1.0] * 3, [0.4, 1.0, 1.0]],
        "token_mask": [[0.0, 0.0, 1.5], [0.0, 0.0, 1.0], [1.0] * 3, [0.0, 1.0, 1.0]],  # outside [1/2, 2]: 0
        "sequence_tis": [[geo] * 3, [2.0] * 3, [1.0] * 3, [0.4] * 3],  # geometric mean; an empty response has 1
        "sequence_mask": [[geo] * 3, [0.0] * 3, [1.0] * 3, [0.0] * 3],
    }
    for mode, values in expected.items():
        assert torch.isfinite(weights[mode]).all(), mode
        assert torch.allclose(weights[mode][mask], torch.tensor(values)[mask]), mode
    # the ratio losses take only the mask: 0 or 1
    assert mismatch_weights(trainer, sampler, mask, "token_mask", 2.0, reweight=False)[mask].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="ratio losses need a masking mode"):
        mismatch_weights(trainer, sampler, mask, "sequence_tis", 2.0, reweight=False)


def test_masking_modes_keep_a_ratio_exactly_at_the_bounds():
    """Guards: the mask's bounds made strict (1/c < rho < c). At --tis_cap 1 the only kept ratio is exactly 1, so a
    trainer equal to the sampler keeps weight 1 (and mask 1) on every response token, in both masking modes."""
    trainer, _, mask = _mismatch_case()
    for mode in ("token_mask", "sequence_mask"):
        assert mismatch_weights(trainer, trainer, mask, mode, cap=1.0)[mask].tolist() == [1.0] * int(mask.sum()), mode
        assert mismatch_weights(trainer, trainer, mask, mode, cap=1.0, reweight=False)[mask].tolist() == [1.0] * int(mask.sum()), mode


def test_tis_mode_is_todays_token_tis_bit_for_bit():
    trainer, sampler, mask = _mismatch_case()
    assert torch.equal(mismatch_weights(trainer, sampler, mask, "tis", 2.0), torch.exp(trainer - sampler).clamp(max=2.0))


def test_masked_tokens_carry_no_gradient_and_one_token_sequences_work():
    trainer, sampler, mask = _mismatch_case()
    policy = trainer.clone().requires_grad_(True)
    weights = mismatch_weights(trainer, sampler, mask, "token_mask", 2.0)
    grpo_microbatch_train_step(policy, mask, 1, "reinforce_with_baseline", advantages=torch.ones(4, 1), importance_weights=weights)
    assert (policy.grad[mask & (weights == 0)] == 0).all()
    assert policy.grad[0, 2].item() == pytest.approx(-1.5 / 3 / 4)  # kept with weight rho = 1.5
    assert torch.isfinite(policy.grad).all()


# ------------------------------------------------------------------ the default path


def test_default_flags_give_the_loss_and_gradient_they_gave_before():
    generator = torch.Generator().manual_seed(3)
    weights = -torch.rand(3, 5, generator=generator)
    old = weights + 0.3 * torch.randn(3, 5, generator=generator)
    ref = weights + 0.3 * torch.randn(3, 5, generator=generator)
    mask = torch.rand(3, 5, generator=generator) > 0.3
    mask[2] = False  # an empty response too
    advantages = torch.tensor([[1.0], [-2.0], [0.5]])

    new = weights.clone().requires_grad_(True)
    loss, _ = grpo_microbatch_train_step(new, mask, 2, "grpo_clip", advantages=advantages, old_log_probs=old, cliprange=0.2, kl_coef=0.05, ref_log_probs=ref)
    # the formula as it was: PPO clip + 0.05 x k3 per token, per-sequence mean, batch mean, / 2
    before = weights.clone().requires_grad_(True)
    ratio = torch.exp(before - old)
    per_token = -torch.minimum(ratio * advantages, torch.clamp(ratio, 1.0 - 0.2, 1.0 + 0.2) * advantages)
    log_ratio = ref - before
    per_token = per_token + 0.05 * (torch.exp(log_ratio) - log_ratio - 1.0)
    m = mask.to(per_token.dtype)
    expected = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean() / 2
    expected.backward()
    assert torch.equal(loss, expected.detach()) and torch.equal(new.grad, before.grad)

    # the new keywords at their defaults change nothing
    explicit = weights.clone().requires_grad_(True)
    again, _ = grpo_microbatch_train_step(explicit, mask, 2, "grpo_clip", advantages=advantages, old_log_probs=old, cliprange=0.2, kl_coef=0.05,
                                          ref_log_probs=ref, kl_estimator="k3", entropy_coef=0.0, token_entropy=None, importance_weights=None)
    assert torch.equal(again, loss) and torch.equal(explicit.grad, new.grad)


def test_update_settings_defaults_are_todays_behaviour():
    settings = update_settings()
    assert (settings.kl_estimator, settings.kl_in, settings.entropy_coef, settings.mismatch_correction) == ("k3", "loss", 0.0, "tis")


def _masked_and_alone_steps(base, tokenizer, keep_every_row=False, **changes):
    """update_policy (SGD, lr 1, no clipping) on two rows with row 1 out of the loss (--overlong mask; both in it with
    `keep_every_row`), and on row 0 alone: each run's totals and weight change."""
    import copy

    from alignment.optim import build_scheduler
    from alignment.policy_update import sequence_lengths, update_policy
    from alignment.sft_helpers import tokenize_rollouts

    prompts = ["User: Ava has 3 apples.\nAssistant: <think>", "User: Ben has 9 pens.\nAssistant: <think>"]
    batch = {**tokenize_rollouts(prompts, [" 3 + 2 = 5 </answer>", " 9 9 9 9 9 9"], tokenizer),
             "raw_rewards": torch.tensor([1.0, 0.0]), "advantages": torch.tensor([1.0, -1.0]), "in_loss": torch.tensor([True, keep_every_row])}
    batch["lengths"] = sequence_lengths(batch["response_mask"])
    only_first = {key: value[:1] for key, value in batch.items() if key not in ("lengths", "in_loss")}
    only_first["lengths"] = batch["lengths"][:1]
    results = []
    for rows, one_batch in ((2, batch), (1, only_first)):
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        settings = update_settings(train_batch_size=rows, train_mini_batch_size=rows, loss_type="reinforce_with_baseline", max_grad_norm=1e9, **changes)
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        totals = update_policy(model, optimizer, build_scheduler(optimizer, 0, 1), one_batch, settings, "cpu")
        results.append((totals, torch.cat([p.detach().flatten() for p in model.parameters()]) - before))
    return results


def test_overlong_mask_gives_truncated_rows_zero_loss_weight(tiny_model_and_tokenizer):
    """update_policy with row 1 out of the loss: half of row 0's loss and gradient (the mean is over 2 rows)."""
    (masked, masked_step), (alone, alone_step) = _masked_and_alone_steps(*tiny_model_and_tokenizer)
    assert masked["loss"] == pytest.approx(0.5 * alone["loss"], rel=1e-5)
    assert torch.allclose(masked_step, 0.5 * alone_step, atol=1e-7)
    assert masked["entropy"] > 0  # entropy stays measured on every response token


def test_overlong_mask_keeps_the_logged_entropy_on_every_response_token(tiny_model_and_tokenizer):
    """Guards: train/entropy measured on the loss mask (the rows --overlong mask keeps out of the loss) instead of every
    response token. The same two rows with and without row 1 out of the loss log the same entropy (it is measured before
    the step), while their steps differ."""
    (masked, masked_step), _ = _masked_and_alone_steps(*tiny_model_and_tokenizer)
    (in_loss, in_loss_step), _ = _masked_and_alone_steps(*tiny_model_and_tokenizer, keep_every_row=True)
    assert masked["entropy"] == pytest.approx(in_loss["entropy"], rel=1e-6) and masked["entropy"] > 0
    assert (masked_step - in_loss_step).norm() > 1e-3


def test_overlong_mask_under_token_mean_counts_only_the_tokens_in_the_loss(tiny_model_and_tokenizer):
    """Guards: token_mean's normaliser counting the tokens of rows the --overlong mask keeps out of the loss. The step's
    loss is its summed token loss over its token count in the loss: row 0's tokens only, so the masked two-row step
    equals the row-0-alone step exactly (counting row 1's tokens too would shrink it)."""
    (masked, masked_step), (alone, alone_step) = _masked_and_alone_steps(*tiny_model_and_tokenizer, length_normalization="token_mean")
    assert masked["loss"] == pytest.approx(alone["loss"], rel=1e-5) and alone["loss"] != 0
    assert alone_step.norm() > 1e-3 and torch.allclose(masked_step, alone_step, atol=1e-7)


# ------------------------------------------------------------------ pass@k


def test_pass_at_k_unbiased_estimator():
    # n = 5, c = 2: 1 - C(3, k) / C(5, k)
    assert pass_at_k(5, 2, 1) == pytest.approx(1 - 3 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)
    assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(5, 2, 5) == 1.0  # k > n - c: every draw of k holds a correct one
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    for bad in ((5, 2, 0), (5, 2, 6), (5, 6, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


class _CyclingEngine:
    def __init__(self, texts):
        self.texts, self.seen = texts, []

    def generate(self, prompts, sampling):
        self.seen.append((list(prompts), sampling))
        return [Generation(self.texts[i % len(self.texts)], 3, [1, 2, 3]) for i in range(len(prompts))]


def test_pass_at_k_samples_each_problem_n_times_at_its_own_temperature():
    right, wrong = " 2 + 3 = 5 </think> <answer> 5 </answer>", " 1 </think> <answer> 4 </answer>"
    engine = _CyclingEngine([right, wrong, wrong])
    assert correct_counts(engine, evaluate.r1_zero_reward_fn, ["a", "b"], ["5", "7"], None, 3) == [1, 0]
    args = SimpleNamespace(samples=3, pass_k=2, samples_temperature=0.8, temperature=0.0, top_p=1.0, min_tokens=0, max_tokens=16, repetition_penalty=1.0)
    metrics = add_pass_at_k({"avg_all_rewards": 0.5}, engine, ["a", "b"], ["5", "7"], args, "")
    prompts, sampling = engine.seen[-1]
    assert prompts == ["a", "a", "a", "b", "b", "b"] and sampling.temperature == 0.8
    assert metrics["pass@2"] == pytest.approx((1 - 1 / 3 + 0) / 2)  # pass@2 of (n=3, c=1) and (3, 0)
    assert metrics["sampled_accuracy"] == pytest.approx(1 / 6) and metrics["avg_all_rewards"] == 0.5
    args.samples = 0
    assert add_pass_at_k({"avg_all_rewards": 0.5}, engine, ["a"], ["5"], args, "") == {"avg_all_rewards": 0.5}


def test_pass_at_k_averages_over_every_ranks_problems():
    """Under torchrun each rank samples its share of the problems; the means are over all the gathered counts."""
    right, wrong = " 2 + 3 = 5 </think> <answer> 5 </answer>", " 1 </think> <answer> 4 </answer>"
    args = SimpleNamespace(samples=3, pass_k=2, samples_temperature=0.8, temperature=0.0, top_p=1.0, min_tokens=0, max_tokens=16, repetition_penalty=1.0)
    other_rank = [3, 3]  # its two problems: every sample right
    metrics = add_pass_at_k({}, _CyclingEngine([right, wrong, wrong]), ["a", "b"], ["5", "7"], args, "", gather=lambda counts: counts + other_rank)
    assert metrics["pass@2"] == pytest.approx((1 - 1 / 3 + 0 + 1 + 1) / 4)
    assert metrics["sampled_accuracy"] == pytest.approx((1 + 0 + 3 + 3) / 12)


def test_pass_at_k_grades_each_sample_against_its_own_problems_answer():
    """Problem a's samples all answer 5 (a's truth), problem b's answer 7, 9, 7 (b's truth 7): counts [3, 2], which
    only the truths repeated per problem (a, a, a, b, b, b) give; tiled (a, b, a, b, ...) they give [2, 2]."""
    class AnsweringEngine:
        def generate(self, prompts, sampling):
            answers = {"a": iter("555"), "b": iter("797")}
            return [Generation(f" so </think> <answer> {next(answers[prompt])} </answer>", 3, [1, 2, 3]) for prompt in prompts]

    assert correct_counts(AnsweringEngine(), evaluate.r1_zero_reward_fn, ["a", "b"], ["5", "7"], None, 3) == [3, 2]


# ------------------------------------------------------------------ flags


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_tiny_task(tmp_path_factory.mktemp("objectives"), num_train=16, num_test=4, seed=3)


def test_good_combinations_parse_and_resume_refuses_a_changed_objective(task):
    args = parse_rl_args(["--data_dir", str(task.data), "--loss_type", "cispo", "--dynamic_sampling", "--overlong", "penalty", "--overlong_buffer", "256",
                          "--kl_coef", "0.01", "--kl_in", "reward", "--kl_estimator", "k2", "--entropy_coef", "0.001", "--eval_samples", "8", "--eval_pass_k", "4"])
    assert args.eval_samples_temperature == args.sampling_temperature == 1.0
    new_flags = ("entropy_coef", "kl_estimator", "kl_in", "dynamic_sampling", "max_sampling_rounds", "dynamic_sampling_prompts", "overlong",
                 "overlong_buffer", "mismatch_correction")
    assert set(new_flags) <= set(RUN_DEFINING_FLAGS)
    assert args.dynamic_sampling_prompts == args.rollout_batch_size == 32 and "dynamic_sampling_prompts" in args.derived_flags
    saved = {"flags": {"entropy_coef": 0.0, "kl_in": "reward", "eval_samples": 0}}
    with pytest.raises(UserError, match="--resume: --entropy_coef is 0.001 but the run was started with 0.0"):
        check_resume_flags(saved, args, "sha")
    saved["flags"]["entropy_coef"] = 0.001
    assert check_resume_flags(saved, args, "sha") == ["--eval_samples 8 (the run had 0) takes effect"]  # evaluation may change
    saved["flags"]["run_name"] = "first"  # a new --run_name splits the run's curves in two folders: said so, not only "takes effect"
    assert check_resume_flags(saved, args, "sha")[1] == ("--run_name rl (the run had first) takes effect: the steps from here are logged in the new "
                                                         "folder and the earlier ones stay in the old one; resume with the run's own flag to keep one curve")


def test_evaluate_cli_pass_at_k_flags(task, capsys, tmp_path):
    base = ["--model_path", str(task.sft), "--data_dir", str(task.data)]
    with pytest.raises(SystemExit):
        parse_eval_args(["--help"])
    assert "--pass_k" in capsys.readouterr().out
    metrics = evaluate.main(base + ["--backend", "hf", "--num_examples", "2", "--max_tokens", "6", "--samples", "3", "--pass_k", "2",
                                    "--output_dir", str(tmp_path / "eval")])
    written = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert written["pass@2"] == metrics["pass@2"] and written["pass_at_k_samples"] == 3
    assert 0.0 <= written["sampled_accuracy"] <= written["pass@2"] <= 1.0


# ------------------------------------------------------------------ train_rl end to end


def _parity_of_one(response, ground_truth):
    return parity_reward([response], [ground_truth])[0]


def _informative_for_even_answers(responses, ground_truths, **_):
    """Rewards 1, 0, 1, 0 within a group of a problem with an even answer; 0 for every response to an odd one (a tied group)."""
    return [{"reward": float(index % 2 == 0 and int(truth) % 2 == 0), "format_reward": 1.0, "answer_reward": 0.0}
            for index, truth in enumerate(ground_truths)]


def _flags(task, name, *extra):
    return train_rl_flags(task, name, "--max_steps", "2", "--rollout_batch_size", "2", "--group_size", "4", "--sampling_max_tokens", "10",
                          "--eval_max_tokens", "6", "--eval_num_examples", "2", *extra)


def test_gspo_one_step_off_with_entropy_k2_overlong_penalty_and_pass_at_k(task, monkeypatch):
    monkeypatch.setattr(train_rl, "grade_responses", parity_reward)
    monkeypatch.setattr(train_rl, "r1_zero_reward_fn", _parity_of_one)
    monkeypatch.setattr(evaluate, "r1_zero_reward_fn", _parity_of_one)
    train_rl.main(_flags(task, "gspo", "--loss_type", "gspo", "--rollout_staleness", "1", "--mismatch_correction", "sequence_mask",
                         "--entropy_coef", "0.01", "--kl_estimator", "k2", "--overlong", "penalty", "--overlong_buffer", "4",
                         "--eval_samples", "4", "--eval_pass_k", "2"))
    rows = steps_log(task, "gspo")
    assert [row["train/staleness"] for row in rows] == [0, 1]
    for row in rows:
        assert row["train/entropy_bonus"] == pytest.approx(0.01 * row["train/entropy"], rel=1e-4)  # no mask: the same tokens
        assert 0.0 <= row["train/mismatch_masked_fraction"] <= 1.0
        assert 0.0 <= row["train/truncated_fraction"] <= 1.0 and -1.0 <= row["train/overlong_reward"] <= 0.0
        if row["train/truncated_fraction"] == 1.0:
            assert row["train/overlong_reward"] == -1.0  # every response at the limit
        assert math.isfinite(row["train/loss"]) and row["train/grad_norm"] > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(task.root / "runs" / "gspo"))
    events.Reload()
    assert {"train/entropy_bonus", "train/mismatch_masked_fraction", "train/overlong_reward", "train/truncated_fraction"} <= set(events.Tags()["scalars"])
    assert [event.step for event in events.Scalars("eval/pass@2")] == [2] == [event.step for event in events.Scalars("eval/avg_all_rewards")]
    final = json.loads((task.root / "runs" / "gspo" / "final_eval_metrics.json").read_text())
    evals = [json.loads(line) for line in (task.root / "runs" / "gspo" / "evals.jsonl").read_text().splitlines()]
    assert evals[-1]["pass@2"] == final["pass@2"] and evals[-1]["pass_at_k_samples"] == 4
    assert 0.0 <= final["sampled_accuracy"] <= final["pass@2"] <= 1.0 and final["pass@2"] > 0  # parity: some samples are right


def _recording_update(monkeypatch):
    """train_rl.update_policy, recording each batch it trains on."""
    batches, real_update = [], train_rl.update_policy

    def recording_update(model, optimizer, scheduler, batch, *args, **kwargs):
        batches.append(batch)
        return real_update(model, optimizer, scheduler, batch, *args, **kwargs)

    monkeypatch.setattr(train_rl, "update_policy", recording_update)
    return batches


def test_cispo_with_dynamic_sampling_and_kl_in_the_reward(task, monkeypatch):
    monkeypatch.setattr(train_rl, "grade_responses", _informative_for_even_answers)
    batches = _recording_update(monkeypatch)
    train_rl.main(_flags(task, "cispo", "--loss_type", "cispo", "--dynamic_sampling", "--max_sampling_rounds", "1", "--kl_in", "reward", "--kl_estimator", "k1"))
    rows = steps_log(task, "cispo")
    assert [batch["input_ids"].shape[0] for batch in batches] == [8, 8]  # 2 prompts x 4 responses, refilled or not
    # this seed's steps: step 1 holds one even answer (informative) and one odd, step 2 two odd answers; the extra round
    # draws two odd answers each time, so the batch is filled with tied groups: 1 of 4, then 0 of 4 sampled groups informative
    assert [row["train/dynamic_sampling_rounds"] for row in rows] == [1, 1]
    assert [row["train/dynamic_sampling_informative_fraction"] for row in rows] == [0.25, 0.0]
    assert [row["train/dynamic_sampling_sampled_reward"] for row in rows] == [2 / 16, 0.0]  # every sampled response, both rounds
    for row in rows:  # the engine's throughput counts both rounds' 16 responses, not the 8 the batch kept
        assert row["train/dynamic_sampling_sampled_tokens"] > 8 * row["train/response_length"]
        assert row["perf/rollout_tokens_per_s"] == pytest.approx(row["train/dynamic_sampling_sampled_tokens"] / row["perf/rollout_seconds"], rel=1e-6)
    assert rows[0]["train/kl_reward"] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is the reference
    assert rows[0]["train/grad_norm"] > 0 and rows[1]["train/kl_reward"] < 0  # it moved, and k1 of its own samples is positive here
    # the KL left the loss for the reward: step 2's task rewards all tie at 0, so its rewards are -kl_coef x KL, and
    # its advantages those rewards normalised within each group (KL differences alone, scaled to unit std)
    rewards = batches[1]["raw_rewards"]
    assert rewards.mean().item() == pytest.approx(rows[1]["train/kl_reward"], rel=1e-5) and (rewards != 0).all()
    assert torch.allclose(batches[1]["advantages"], normalize_group_rewards(rewards, 4, 1e-6, True)[0])


def test_overlong_mask_takes_truncated_responses_out_of_the_loss(task, monkeypatch):
    monkeypatch.setattr(train_rl, "grade_responses", parity_reward)
    batches = _recording_update(monkeypatch)
    # one step: masking the loss leaves nothing for a second to add (the random model rarely ends a response)
    train_rl.main(_flags(task, "overlong_mask", "--overlong", "mask", "--max_steps", "1"))
    for row, batch in zip(steps_log(task, "overlong_mask"), batches, strict=True):
        assert 0 < row["train/truncated_fraction"] == pytest.approx(1 - batch["in_loss"].float().mean().item())
        # parity rewards give every group an advantage: the loss is 0 exactly when every response is out of it
        assert (row["train/loss"] == 0.0 and row["train/grad_norm"] == 0.0) == (row["train/truncated_fraction"] == 1.0)


def test_resume_refusals_name_the_flag_as_a_command_gives_it(task):
    """A run started without --model (recorded None) and resumed with it was told to 'pass --model None', which
    the same refusal met again; a switch that was off was told to pass '--dynamic_sampling False'."""
    args = parse_rl_args(["--data_dir", str(task.data), "--model", str(task.sft), "--dynamic_sampling", "--adam_betas", "0.9", "0.95"])
    saved = {"flags": {"model": None}}
    with pytest.raises(UserError, match=r"^--resume: --model is '.*' but the run was started with None; leave --model out to resume it, or"):
        check_resume_flags(saved, args, "sha")
    saved = {"flags": {"dynamic_sampling": False}}
    with pytest.raises(UserError, match=r"but the run was started with False; pass --no-dynamic_sampling to resume it, or"):
        check_resume_flags(saved, args, "sha")
    saved = {"flags": {"adam_betas": [0.9, 0.999]}}
    with pytest.raises(UserError, match=r"pass --adam_betas 0\.9 0\.999 to resume it, or"):
        check_resume_flags(saved, args, "sha")
    from alignment.args import _as_given

    assert _as_given("gradient_checkpointing", False) == "leave --gradient_checkpointing out"  # a store-true switch has no --no- form
    assert _as_given("gradient_checkpointing", True) == "pass --gradient_checkpointing"
    # every switch of the parser, however added: what to type for it off is a form argparse accepts
    import argparse

    from alignment.args import build_rl_parser

    switches = [action for action in build_rl_parser()._actions if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction))]
    assert len(switches) > 10 and {"gradient_checkpointing", "resume"} <= {action.dest for action in switches}
    for action in switches:
        off = _as_given(action.dest, False)
        assert off == (f"pass --no-{action.dest}" if f"--no-{action.dest}" in action.option_strings else f"leave --{action.dest} out"), action.dest
