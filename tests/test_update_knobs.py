"""Every flag that changes the update, shown to act: each test asserts the quantity its flag controls, on a tiny
model, through train_rl or update_policy with settings parsed from the command line, and fails when the flag stops
working (each was checked by planting that defect by hand; bench/RESULTS.md lists the flags and their tests).

The tiny random model never answers right, so the train_rl runs here grade with `parity_reward` (1 for a response of
an even number of characters): rewards differ within groups and every update moves the weights.
"""

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from alignment import grpo, policy_update, train_rl
from alignment.args import optimizer_steps_per_batch, parse_rl_args
from alignment.optim import build_optimizer, build_scheduler
from alignment.policy_update import UpdateSettings, sequence_lengths, update_policy
from alignment.sft_helpers import tokenize_rollouts
from conftest import make_tiny_task, parity_reward, steps_log, train_rl_flags, update_settings


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_tiny_task(tmp_path_factory.mktemp("knobs"), num_train=16, num_test=4, seed=4)


def run(task, monkeypatch, name, *extra):
    """A 2-step train_rl run (2 prompts x 4 responses, one microbatch of 8 rows) graded by parity."""
    monkeypatch.setattr(train_rl, "grade_responses", parity_reward)
    train_rl.main(train_rl_flags(task, name, "--max_steps", "2", "--rollout_batch_size", "2", "--group_size", "4", "--sampling_max_tokens", "10",
                                 "--eval_max_tokens", "4", "--eval_num_examples", "1", "--kl_coef", "0", "--no-log_reference_kl", *extra))
    return steps_log(task, name)


def record_clip_calls(monkeypatch) -> list[dict]:
    """What grpo_clip's loss is given at each call: the ratio it sees and the log-probs it compares against."""
    calls, real = [], grpo.compute_grpo_clip_loss

    def recording(advantages, policy_log_probs, old_log_probs, cliprange, cliprange_high=None):
        loss, metadata = real(advantages, policy_log_probs, old_log_probs, cliprange, cliprange_high)
        calls.append({"ratio": metadata["ratio"].clone(), "old": old_log_probs.detach().clone(), "cliprange": cliprange, "high": cliprange_high})
        return loss, metadata

    monkeypatch.setattr(grpo, "compute_grpo_clip_loss", recording)
    return calls


def record_updates(monkeypatch) -> list[dict]:
    """Each batch train_rl's update gets, with the learning rate, betas and weight decay its optimizer holds then, the rollout step
    it is told (it seeds the shuffle of the batch's rows) and the totals it returns."""
    updates, real = [], train_rl.update_policy

    def recording(model, optimizer, scheduler, batch, *args, **kwargs):
        group = optimizer.param_groups[0]
        update = {"batch": batch, "lr": group["lr"], "betas": group["betas"], "weight_decay": group["weight_decay"], "step": kwargs.get("step")}
        updates.append(update)
        update["totals"] = real(model, optimizer, scheduler, batch, *args, **kwargs)
        return update["totals"]

    monkeypatch.setattr(train_rl, "update_policy", recording)
    return updates


def test_epochs_per_rollout_batch_give_grpo_clip_a_ratio_against_the_pre_update_policy(task, monkeypatch):
    """--epochs_per_rollout_batch 2: the second pass compares against the policy before the batch's first step (the
    old-policy scoring pass), so its ratio leaves 1; the first pass's is 1 (same weights)."""
    calls = record_clip_calls(monkeypatch)
    run(task, monkeypatch, "two_epochs", "--epochs_per_rollout_batch", "2", "--learning_rate", "1e-2")
    assert len(calls) == 4  # 2 steps x 2 passes x 1 microbatch
    for first, second in (calls[0:2], calls[2:4]):
        assert (first["ratio"] - 1).abs().max() < 1e-5
        assert (second["ratio"] - 1).abs().max() > 1e-3
        # both passes compare against the same stored log-probs (the second pass in another row order)
        assert torch.equal(first["old"].sum(-1).sort().values, second["old"].sum(-1).sort().values)


def test_old_policy_reference_compares_against_the_frozen_reference(task, monkeypatch):
    """--old_policy reference (the seed): grpo_clip's old log-probs are the reference model's, so once the policy has
    moved (step 2) its ratio leaves 1 even with one optimizer step per batch."""
    calls, updates = record_clip_calls(monkeypatch), record_updates(monkeypatch)
    run(task, monkeypatch, "reference_ratio", "--old_policy", "reference", "--learning_rate", "1e-2")
    assert len(calls) == 2
    for call, update in zip(calls, updates):
        mask = update["batch"]["response_mask"]
        reference = update["batch"]["ref_log_probs"]
        assert torch.allclose(call["old"][mask], reference[mask])
    assert (calls[1]["ratio"] - 1).abs().max() > 1e-3


def test_cliprange_and_cliprange_high_reach_the_loss(task, monkeypatch):
    calls = record_clip_calls(monkeypatch)
    run(task, monkeypatch, "clip_ranges", "--cliprange", "0.1", "--cliprange_high", "0.28")
    assert {(call["cliprange"], call["high"]) for call in calls} == {(0.1, 0.28)}


def test_warmup_and_learning_rate_set_each_steps_rate_and_betas_reach_adamw(task, monkeypatch):
    """--warmup_steps 2 --learning_rate 1e-3: rates 5e-4, then 1e-3, in the optimizer at each update and in the log."""
    updates = record_updates(monkeypatch)
    rows = run(task, monkeypatch, "warmup", "--warmup_steps", "2", "--learning_rate", "1e-3", "--adam_betas", "0.8", "0.9", "--weight_decay", "0.01")
    assert [update["lr"] for update in updates] == pytest.approx([5e-4, 1e-3])
    assert [update["step"] for update in updates] == [1, 2]  # each rollout step its own shuffle of the rows
    assert [row["train/lr"] for row in rows] == pytest.approx([1e-3, 1e-3])  # logged after the step's scheduler step
    assert {update["betas"] for update in updates} == {(0.8, 0.9)} and {update["weight_decay"] for update in updates} == {0.01}



def test_cosine_schedule_decays_toward_a_tenth_of_the_peak_over_the_runs_steps(task, monkeypatch):
    """--lr_schedule cosine over a 3-step run: step k (from 0) at 0.1 + 0.45 (1 + cos(pi k / 3)) of 1e-3, so the rate
    reaches a tenth as the planned steps end; the default holds the peak (the seed's constant rate). With two optimizer
    steps a rollout step, the decay is planned over the optimizer steps."""
    updates = record_updates(monkeypatch)
    run(task, monkeypatch, "cosine", "--lr_schedule", "cosine", "--learning_rate", "1e-3", "--max_steps", "3")
    assert [update["lr"] for update in updates] == pytest.approx([1e-3, 7.75e-4, 3.25e-4])
    updates.clear()
    run(task, monkeypatch, "constant", "--learning_rate", "1e-3", "--max_steps", "3")
    assert [update["lr"] for update in updates] == pytest.approx([1e-3, 1e-3, 1e-3])
    # two optimizer steps a rollout step (the GSM8K recipe's two batches of 128, or two passes over the batch): the decay
    # is planned over the run's 4 optimizer steps, so it is halfway (0.55) after step 1 and at its tenth as step 2 ends
    for name, flags in (("cosine_two_batches", ("--train_batch_size", "4", "--train_mini_batch_size", "4")),
                        ("cosine_two_passes", ("--epochs_per_rollout_batch", "2"))):
        updates.clear()
        rows = run(task, monkeypatch, name, "--lr_schedule", "cosine", "--learning_rate", "1e-3", *flags)
        assert [update["totals"]["optimizer_steps"] for update in updates] == [2, 2]
        assert [update["lr"] for update in updates] == pytest.approx([1e-3, 5.5e-4])
        assert [row["train/lr"] for row in rows] == pytest.approx([5.5e-4, 1e-4])

def test_train_batch_size_and_microbatches_set_the_steps_and_the_forward_passes(task, monkeypatch):
    """8 rollouts a batch: --train_batch_size 4 gives 2 optimizer steps; --train_mini_batch_size 2 gives 2 microbatches
    per step; --microbatch_tokens 1 (below one row) cuts one row per microbatch instead."""
    updates = record_updates(monkeypatch)
    run(task, monkeypatch, "batch_sizes", "--train_batch_size", "4", "--train_mini_batch_size", "2")
    assert [(u["totals"]["optimizer_steps"], u["totals"]["microbatches"]) for u in updates] == [(2, 4), (2, 4)]
    updates.clear()
    run(task, monkeypatch, "token_budget", "--train_batch_size", "4", "--train_mini_batch_size", "4", "--microbatch_tokens", "1")
    assert [(u["totals"]["optimizer_steps"], u["totals"]["microbatches"]) for u in updates] == [(2, 8), (2, 8)]


# ------------------------------------------------------------ through update_policy, settings from the flags


def settings_and_args(task, *flags):
    args = parse_rl_args(["--data_dir", str(task.data), "--rollout_batch_size", "2", "--group_size", "2", "--train_mini_batch_size", "4",
                          "--logprob_chunk_size", "0", *flags])
    return UpdateSettings.from_args(args), args


def small_batch(tokenizer):
    prompts = ["User: Ava has 3 apples.\nAssistant: <think>"] * 2 + ["User: Ben has 9 pens.\nAssistant: <think>"] * 2
    responses = [" 3 + 2 = 5 </answer>", " 6 </answer>", " 9 </answer>", " 1 2 3 </answer>"]
    batch = {**tokenize_rollouts(prompts, responses, tokenizer), "raw_rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
             "advantages": torch.tensor([0.7, -0.7, 0.7, -0.7])}
    batch["lengths"] = sequence_lengths(batch["response_mask"])
    return batch


def trainer_log_probs(model, batch) -> torch.Tensor:
    return policy_update.score_with(model, batch, 4, "cpu", chunk_size=0)


def test_tis_cap_bounds_every_importance_weight(tiny_model_and_tokenizer, task, monkeypatch):
    """One step off (--rollout_staleness 1) with --tis_cap 1.5: rollouts the sampler scored one nat below the trainer
    (ratio e) get weight 1.5 on every token; none more."""
    base, tokenizer = tiny_model_and_tokenizer
    settings, args = settings_and_args(task, "--rollout_staleness", "1", "--tis_cap", "1.5", "--loss_type", "reinforce_with_baseline")
    batch = small_batch(tokenizer)
    batch["sampler_log_probs"] = torch.where(batch["response_mask"], trainer_log_probs(base, batch) - 1.0, torch.tensor(float("nan")))
    weights, real = [], policy_update.grpo_microbatch_train_step

    def recording(*step_args, importance_weights=None, **kwargs):
        weights.append(importance_weights)
        return real(*step_args, importance_weights=importance_weights, **kwargs)

    monkeypatch.setattr(policy_update, "grpo_microbatch_train_step", recording)
    model = copy.deepcopy(base)
    optimizer = build_optimizer(model, args.learning_rate, args.weight_decay, args.adam_betas)
    totals = update_policy(model, optimizer, build_scheduler(optimizer, 0, 1), batch, settings, "cpu")
    mask = batch["response_mask"]  # (the microbatch's rows are length-sorted; off the response the weight is 1)
    assert len(weights) == 1 and set(weights[0].unique().tolist()) == {1.0, 1.5} and (weights[0] == 1.5).sum() == mask.sum()
    assert totals["tis_capped"] == mask.sum().item() and totals["sampler_ratio_max"] == pytest.approx(torch.e, rel=1e-4)


def test_max_grad_norm_clips_the_step(tiny_model_and_tokenizer, task):
    """--max_grad_norm 0.05 with plain SGD at lr 1: the weights move by exactly the clipped gradient, norm 0.05,
    while the gradient itself (logged as train/grad_norm) is larger."""
    base, tokenizer = tiny_model_and_tokenizer
    settings, _ = settings_and_args(task, "--max_grad_norm", "0.05", "--loss_type", "reinforce_with_baseline")
    model = copy.deepcopy(base)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    totals = update_policy(model, optimizer, build_scheduler(optimizer, 0, 1), small_batch(tokenizer), settings, "cpu")
    moved = (torch.cat([p.detach().flatten() for p in model.parameters()]) - before).norm().item()
    assert totals["grad_norm"] > 0.1 and moved == pytest.approx(0.05, rel=1e-4)
    assert all(p.grad is None for p in model.parameters())  # left over, they would add into the next rollout step's gradient


class RecordingSGD(torch.optim.SGD):
    """SGD that records the learning rate each step() runs with."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rates = []

    def step(self, closure=None):
        self.rates.append(self.param_groups[0]["lr"])
        return super().step(closure)


def test_each_optimizer_step_runs_at_its_scheduled_rate(tiny_model_and_tokenizer, task):
    """4 rollouts, --train_batch_size 2: two optimizer steps, warm-up over 2 steps at peak 1e-3. The rate each
    optimizer.step() runs with is 5e-4, then 1e-3 (a scheduler stepped before the optimizer would give 1e-3 twice)."""
    base, tokenizer = tiny_model_and_tokenizer
    settings, _ = settings_and_args(task, "--train_batch_size", "2", "--train_mini_batch_size", "2", "--loss_type", "reinforce_with_baseline")
    model = copy.deepcopy(base)
    optimizer = RecordingSGD(model.parameters(), lr=1e-3)
    totals = update_policy(model, optimizer, build_scheduler(optimizer, 2, 10), small_batch(tokenizer), settings, "cpu")
    assert totals["optimizer_steps"] == 2 and optimizer.rates == pytest.approx([5e-4, 1e-3])


def cosine_factors(warmup_steps: int, total_steps: int, steps: int) -> list[float]:
    """The factor of the peak rate each of `steps` optimizer steps runs at under --lr_schedule cosine."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = build_scheduler(optimizer, warmup_steps, total_steps, "cosine")
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"] / 2.0)
        optimizer.step()
        scheduler.step()
    return rates


def test_cosine_schedule_decays_to_a_tenth_of_the_peak():
    """--lr_schedule cosine, 2 warm-up steps of 12: the factor rises 0.5, 1, then follows the half cosine from 1
    to 0.1 over the 10 steps after warm-up (0.55 halfway), and stays at 0.1 past the end."""
    rates = cosine_factors(2, 12, 16)
    assert rates[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert rates[7] == pytest.approx(0.55) and rates[12:] == pytest.approx([0.1] * 4)
    assert all(a > b for a, b in zip(rates[2:12], rates[3:13]))


def test_cosine_schedule_with_a_warm_up_as_long_as_the_run_ends_at_the_peak():
    """Guards: the cosine branch taken when the warm-up fills the run (progress 0 / 0). --lr_schedule cosine with
    --warmup_steps 2 of 2 optimizer steps: factors 0.5, 1, then the peak held (nothing left to decay over)."""
    assert cosine_factors(2, 2, 4) == pytest.approx([0.5, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("defect", ["nan_loss_in_the_first_microbatch", "nan_loss_in_the_last_microbatch", "infinite_gradient"])
def test_a_non_finite_loss_or_gradient_skips_the_step_and_leaves_the_weights(tiny_model_and_tokenizer, task, monkeypatch, defect):
    """An optimizer step of two microbatches, one of whose loss is NaN while its gradient stays finite (either one: the
    finite check spans the step), or whose loss is finite with an infinite gradient: the step is skipped (counted), the
    weights do not move, and no gradient is left behind. (Guards: only the last microbatch's loss checked; the
    gradient norm left unchecked, which writes NaN into the weights.)"""
    base, tokenizer = tiny_model_and_tokenizer
    settings, _ = settings_and_args(task, "--loss_type", "reinforce_with_baseline", "--train_mini_batch_size", "2")
    model = copy.deepcopy(base)
    real, calls = policy_update.grpo_microbatch_train_step, []

    def defective(*args, **kwargs):
        loss, meta = real(*args, **kwargs)
        calls.append(defect)
        if defect == "infinite_gradient" and len(calls) == 1:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        elif defect == f"nan_loss_in_the_{('first', 'last')[len(calls) - 1]}_microbatch":
            loss = loss * float("nan")
        return loss, meta

    monkeypatch.setattr(policy_update, "grpo_microbatch_train_step", defective)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    totals = update_policy(model, optimizer, build_scheduler(optimizer, 0, 1), small_batch(tokenizer), settings, "cpu")
    assert len(calls) == 2 and (totals["skipped_steps"], totals["optimizer_steps"]) == (1, 0)
    assert all(torch.equal(p.detach(), old) for p, old in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


def test_a_skipped_step_counts_on_the_schedule_and_a_good_step_ends_the_skips_in_a_row(tiny_model_and_tokenizer, monkeypatch):
    """Guards: the schedule not advanced over a skipped (non-finite) step, and --max_skipped_steps' count of skips in a
    row not reset by a good step. 4 rollouts in 2 optimizer steps, warm-up over 2 steps to 1e-3: step 1's loss is NaN
    (skipped), so step 2 runs at the plan's second rate, 1e-3 (not the first's 5e-4), and ends the run of skips."""
    base, tokenizer = tiny_model_and_tokenizer
    settings = update_settings(loss_type="reinforce_with_baseline", train_batch_size=2, train_mini_batch_size=2)
    real, calls = policy_update.grpo_microbatch_train_step, []

    def nan_first(*args, **kwargs):
        loss, meta = real(*args, **kwargs)
        calls.append(loss)
        return (loss * float("nan") if len(calls) == 1 else loss), meta

    monkeypatch.setattr(policy_update, "grpo_microbatch_train_step", nan_first)
    model = copy.deepcopy(base)
    optimizer = RecordingSGD(model.parameters(), lr=1e-3)
    scheduler = build_scheduler(optimizer, 2, 10)
    totals = update_policy(model, optimizer, scheduler, small_batch(tokenizer), settings, "cpu")
    assert (totals["skipped_steps"], totals["optimizer_steps"], totals["skipped_since_last_step"]) == (1, 1, 0)
    assert optimizer.rates == pytest.approx([1e-3]) and scheduler.last_epoch == 2


def test_weight_decay_reaches_adamw(tiny_model_and_tokenizer, task):
    """--weight_decay 0.5 at lr 0.1 on a batch whose advantages are all 0 (no gradient): every weight shrinks by exactly 5%."""
    base, tokenizer = tiny_model_and_tokenizer
    settings, args = settings_and_args(task, "--weight_decay", "0.5", "--learning_rate", "0.1", "--loss_type", "reinforce_with_baseline")
    batch = small_batch(tokenizer)
    batch["advantages"] = torch.zeros(4)
    model = copy.deepcopy(base)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = build_optimizer(model, args.learning_rate, args.weight_decay, args.adam_betas)
    update_policy(model, optimizer, build_scheduler(optimizer, 0, 1), batch, settings, "cpu")
    assert all(torch.allclose(p.detach(), 0.95 * old, atol=1e-7) for p, old in zip(model.parameters(), before))


def record_microbatch_steps(monkeypatch) -> list[dict]:
    """The keyword arguments of each grpo_microbatch_train_step call (the loss options the update passes)."""
    calls, real = [], policy_update.grpo_microbatch_train_step

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(policy_update, "grpo_microbatch_train_step", recording)
    return calls


def test_length_normalization_and_kl_options_reach_the_loss(task, monkeypatch):
    calls = record_microbatch_steps(monkeypatch)
    run(task, monkeypatch, "loss_options", "--length_normalization", "constant", "--kl_coef", "0.05", "--kl_estimator", "k2")
    assert {(c["length_normalization"], c["normalize_constant"], c["kl_coef"], c["kl_estimator"]) for c in calls} == {("constant", 10.0, 0.05, "k2")}
    assert all(c["ref_log_probs"] is not None for c in calls)
    calls.clear()
    run(task, monkeypatch, "kl_in_reward", "--kl_coef", "0.05", "--kl_in", "reward")
    assert {c["kl_coef"] for c in calls} == {0.0}  # the KL left the loss for the rewards


def test_scoring_temperature_scores_the_distribution_that_was_sampled(task, monkeypatch):
    """--sampling_temperature 0.5 (and no repetition penalty): the HF sampler's log-probs of its tokens equal the update's
    on step 1 (same weights), because the update divides the logits by the same temperature."""
    rows = run(task, monkeypatch, "temperature", "--sampling_temperature", "0.5", "--repetition_penalty", "1.0")
    assert rows[0]["train/sampler_logprob_abs_diff"] < 0.01  # (~1e-3: generate's cached, left-padded forward); scored at 1.0: ~0.5


def test_advantage_normalisation_flags_shape_the_advantages(task, monkeypatch):
    """--no-use_std_normalization: reward minus the group mean (Dr. GRPO); with std: divided by (std + --advantage_eps)."""
    updates = record_updates(monkeypatch)
    run(task, monkeypatch, "no_std", "--no-use_std_normalization")
    run(task, monkeypatch, "eps", "--advantage_eps", "0.5")
    for update, use_std in zip(updates, (False, False, True, True)):
        rewards = update["batch"]["raw_rewards"].view(-1, 4)
        centred = rewards - rewards.mean(1, keepdim=True)
        expected = centred / (rewards.std(1, keepdim=True) + 0.5) if use_std else centred
        assert torch.allclose(update["batch"]["advantages"], expected.flatten(), atol=1e-6)


def test_skip_zero_signal_skips_a_batch_whose_groups_all_tie(task, monkeypatch):
    """Every reward 0: skipped (and counted) by default; --no-skip_zero_signal runs the update anyway, as the seed did.
    A skipped batch still counts on the learning-rate schedule: a cosine over two optimizer steps a batch ends at its
    floor, at the rates of the run that updates; an entropy bonus has a gradient of its own, so it is never skipped."""
    updates = record_updates(monkeypatch)
    tied = lambda responses, truths, **_: [{"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0} for _ in responses]  # noqa: E731
    monkeypatch.setattr(train_rl, "grade_responses", tied)
    common = ("--max_steps", "2", "--rollout_batch_size", "2", "--group_size", "4", "--kl_coef", "0", "--no-log_reference_kl", "--eval_num_examples", "1",
              "--eval_max_tokens", "4", "--lr_schedule", "cosine", "--learning_rate", "1e-3", "--train_batch_size", "4", "--train_mini_batch_size", "4")
    train_rl.main(train_rl_flags(task, "tied", *common))
    assert updates == [] and [row["train/zero_signal_batches"] for row in steps_log(task, "tied")] == [1, 2]
    train_rl.main(train_rl_flags(task, "tied_run", *common, "--no-skip_zero_signal"))
    assert len(updates) == 2
    # 4 planned optimizer steps: after 2 the cosine is halfway (0.55 of the peak), after 4 at its floor (0.1)
    planned = [pytest.approx(5.5e-4), pytest.approx(1e-4)]
    assert [row["train/lr"] for row in steps_log(task, "tied")] == [row["train/lr"] for row in steps_log(task, "tied_run")] == planned
    train_rl.main(train_rl_flags(task, "tied_entropy", *common, "--entropy_coef", "0.01"))
    assert len(updates) == 4 and [row["train/zero_signal_batches"] for row in steps_log(task, "tied_entropy")] == [0, 0]


@pytest.mark.slow
def test_mismatch_correction_masks_one_step_off(task, monkeypatch):
    """--rollout_staleness 1 --mismatch_correction token_mask, grpo_clip: its ratio already holds the sampler's log-probs, so
    the correction is a 0/1 mask per token (IcePop), passed to the loss; the masked fraction is logged. (tis passes none.)"""
    calls = record_microbatch_steps(monkeypatch)
    rows = run(task, monkeypatch, "token_mask", "--rollout_staleness", "1", "--mismatch_correction", "token_mask")
    assert calls and all(c["importance_weights"] is not None and set(c["importance_weights"].unique().tolist()) <= {0.0, 1.0} for c in calls)
    assert all(row["train/mismatch_masked_fraction"] is not None and 0.0 <= row["train/mismatch_masked_fraction"] <= 1.0 for row in rows)


def test_each_rollout_step_samples_with_its_own_seed(task, monkeypatch):
    """The same prompts at steps 1 and 2 with weights that do not move (lr 1e-12 rounds away in fp32): the HF sampler's
    rollouts still differ, each step seeded by (--seed, step); the same run again draws the same ones."""
    same_prompts = train_rl.rollout_batch(train_rl.Gsm8kDataset("train", task.data), 1, 8, 2, 42)
    monkeypatch.setattr(train_rl, "rollout_batch", lambda *args, **kwargs: same_prompts)
    runs = []
    for name in ("seeded", "seeded_again"):
        drawn = []

        def grading(responses, truths, **kwargs):
            drawn.append(list(responses))
            return parity_reward(responses, truths)

        monkeypatch.setattr(train_rl, "grade_responses", grading)
        train_rl.main(train_rl_flags(task, name, "--max_steps", "2", "--rollout_batch_size", "2", "--group_size", "4", "--sampling_max_tokens", "10",
                                     "--eval_max_tokens", "4", "--eval_num_examples", "1", "--kl_coef", "0", "--no-log_reference_kl", "--learning_rate", "1e-12"))
        runs.append(drawn)
    assert len(runs[0]) == 2 and runs[0][0] != runs[0][1]  # step 2 drew other rollouts of the same prompts
    assert runs[1] == runs[0]  # and a run repeats its draws


def test_a_ratio_loss_scores_the_pre_update_policy_whenever_a_batch_takes_more_than_one_optimizer_step():
    """Guards: the old-policy pass run for --epochs_per_rollout_batch > 1 only. 8 rollouts in optimizer steps of 4 (one
    pass): by the second step the policy has moved, so grpo_clip needs the log-probs scored before the first. One step
    of all 8 does not (its ratio is 1 against its own detached log-probs), nor a REINFORCE loss, --old_policy reference
    (the frozen reference's), or one step off (the sampler's own)."""
    needs = {
        "one step of all 8": (dict(train_batch_size=8), False),
        "two steps of 4": (dict(train_batch_size=4), True),
        "two passes of 8": (dict(train_batch_size=8, epochs_per_rollout_batch=2), True),
        "REINFORCE, two steps": (dict(train_batch_size=4, loss_type="reinforce_with_baseline"), False),
        "the reference, two steps": (dict(train_batch_size=4, old_policy="reference"), False),
        "one step off, two steps": (dict(train_batch_size=4, one_step_off=True), False),
        "cispo, two steps": (dict(train_batch_size=4, loss_type="cispo"), True),
    }
    def needs_pass(changes, total_rollouts=8, world_size=1):
        """train_rl's question: the settings are one rank's share of --train_batch_size, the step count the flags'."""
        settings = update_settings(**changes)
        flags = SimpleNamespace(epochs_per_rollout_batch=settings.epochs_per_rollout_batch, total_rollouts=total_rollouts,
                                train_batch_size=settings.train_batch_size * world_size)
        return policy_update.needs_old_policy_pass(settings, optimizer_steps_per_batch(flags))

    assert {name: needs_pass(changes) for name, (changes, _) in needs.items()} == {name: expected for name, (_, expected) in needs.items()}
    # under torchrun each of 2 ranks holds half of the 16 rollouts and half of --train_batch_size: one step of all
    # 16 is one step of 8 on each rank (the pass ran every step there, comparing a rank's share with the whole batch)
    assert needs_pass(dict(train_batch_size=8), 16, world_size=2) is False
    assert needs_pass(dict(train_batch_size=4), 16, world_size=2) is True


# ------------------------------------------------------------ update_policy against a naive autograd step


def naive_sgd_step(base, batch, per_token_loss) -> torch.Tensor:
    """The weight change of one plain SGD step at lr 1 on the loss written out by hand: a full forward,
    log_softmax + gather, `per_token_loss(log_probs, logits, rows)` (N, T), its mean over each response, mean over rows."""
    model = copy.deepcopy(base)
    logits = model(input_ids=batch["input_ids"]).logits.float()
    log_probs = torch.log_softmax(logits, -1).gather(-1, batch["labels"][..., None]).squeeze(-1)
    mask = batch["response_mask"]
    per_token = torch.where(mask, per_token_loss(log_probs, logits, torch.arange(len(mask))), torch.zeros(()))
    (per_token.sum(-1) / mask.sum(-1)).mean().backward()
    return torch.cat([-p.grad.flatten() for p in model.parameters()])


def update_policy_step(base, batch, settings) -> tuple[torch.Tensor, dict]:
    """The weight change of update_policy with plain SGD at lr 1 (no clipping), and its totals."""
    model = copy.deepcopy(base)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    totals = update_policy(model, optimizer, build_scheduler(optimizer, 0, 1), batch, settings, "cpu")
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before, totals


def test_grpo_clip_one_step_off_takes_its_ratio_against_the_sampler_without_a_tis_weight(tiny_model_and_tokenizer, monkeypatch):
    """Guards: token TIS applied on top of a ratio loss one step off (the `old is None` condition dropped). The sampler
    scored every response token 0.1 nats below the trainer: grpo_clip's ratio e^0.1 (inside the clip range) already
    corrects for it, so no importance weight reaches the loss and the step is the naive -min(r A, clip(r) A) step;
    a TIS weight would scale it by another e^0.1."""
    base, tokenizer = tiny_model_and_tokenizer
    batch = small_batch(tokenizer)
    sampler = trainer_log_probs(base, batch) - 0.1
    batch["sampler_log_probs"] = torch.where(batch["response_mask"], sampler, torch.tensor(float("nan")))
    calls = record_microbatch_steps(monkeypatch)
    settings = update_settings(loss_type="grpo_clip", one_step_off=True, train_batch_size=4, train_mini_batch_size=4, max_grad_norm=1e9)
    moved, _ = update_policy_step(base, batch, settings)
    assert len(calls) == 1 and calls[0]["importance_weights"] is None and calls[0]["old_log_probs"] is not None

    def clipped_ratio_loss(log_probs, logits, rows):
        ratio = torch.exp(log_probs - sampler)
        advantages = batch["advantages"][rows, None]
        return -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)

    expected = naive_sgd_step(base, batch, clipped_ratio_loss)
    assert expected.norm() > 1e-3 and (moved - expected).norm() < 1e-4 * expected.norm()


def test_entropy_bonus_gradient_moves_the_weights_as_the_naive_entropy_term(tiny_model_and_tokenizer):
    """Guards: the entropy computed without a gradient under --entropy_coef (entropy_grad off): with every advantage 0
    the only gradient is the bonus -0.1 x H(softmax(logits)), so the step must equal the naive autograd step of that
    term (a detached entropy would leave the weights where they were)."""
    base, tokenizer = tiny_model_and_tokenizer
    batch = small_batch(tokenizer)
    batch["advantages"] = torch.zeros(4)
    settings = update_settings(loss_type="reinforce_with_baseline", entropy_coef=0.1, train_batch_size=4, train_mini_batch_size=4, max_grad_norm=1e9)
    moved, totals = update_policy_step(base, batch, settings)

    def entropy_bonus(log_probs, logits, rows):
        return 0.1 * (torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)  # -0.1 x entropy

    expected = naive_sgd_step(base, batch, entropy_bonus)
    assert expected.norm() > 1e-3 and (moved - expected).norm() < 1e-4 * expected.norm()
    assert totals["entropy_bonus"] > 0


def test_no_baseline_learns_from_the_raw_rewards_not_the_advantages(tiny_model_and_tokenizer):
    """Guards: no_baseline given the advantages instead of the raw rewards. Rewards [1, 0, 1, 0] with every advantage
    0: the step must equal the naive step of -reward x logp (advantages would give no step at all)."""
    base, tokenizer = tiny_model_and_tokenizer
    batch = small_batch(tokenizer)
    batch["advantages"] = torch.zeros(4)
    settings = update_settings(loss_type="no_baseline", train_batch_size=4, train_mini_batch_size=2, max_grad_norm=1e9)
    moved, _ = update_policy_step(base, batch, settings)
    expected = naive_sgd_step(base, batch, lambda log_probs, logits, rows: -batch["raw_rewards"][rows, None] * log_probs)
    assert expected.norm() > 1e-3 and (moved - expected).norm() < 1e-4 * expected.norm()


def test_unequal_microbatches_weight_each_row_by_its_share_of_the_step(tiny_model_and_tokenizer):
    """Guards: each microbatch's loss divided by the step's number of microbatches (or its rows rounded) instead of
    weighted by its share of the step's rows. 3 rows in microbatches of 2 and 1 (weights 2/3 and 1/3 of their means):
    the step is the naive step of the mean over the 3 rows."""
    base, tokenizer = tiny_model_and_tokenizer
    batch = {key: value[:3] for key, value in small_batch(tokenizer).items()}
    settings = update_settings(loss_type="reinforce_with_baseline", train_batch_size=3, train_mini_batch_size=2, max_grad_norm=1e9)
    moved, totals = update_policy_step(base, batch, settings)
    assert (totals["optimizer_steps"], totals["microbatches"]) == (1, 2)
    expected = naive_sgd_step(base, batch, lambda log_probs, logits, rows: -batch["advantages"][rows, None] * log_probs)
    assert expected.norm() > 1e-3 and (moved - expected).norm() < 1e-4 * expected.norm()


def test_the_totals_sum_each_steps_gradient_norm_and_leave_kl_unmeasured_without_a_reference(tiny_model_and_tokenizer, monkeypatch):
    """Guards: totals["grad_norm"] holding the last optimizer step's norm (run_log divides it by the steps for
    train/grad_norm), and train/kl_ref counted as 0 when there are no reference log-probs (NaN prints "n/a"). Two
    optimizer steps of 2 rows: the sum of the two norms that clipping saw."""
    base, tokenizer = tiny_model_and_tokenizer
    norms, real = [], torch.nn.utils.clip_grad_norm_

    def recording(parameters, max_norm, *args, **kwargs):
        norm = real(parameters, max_norm, *args, **kwargs)
        norms.append(norm.item())
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    settings = update_settings(loss_type="reinforce_with_baseline", train_batch_size=2, train_mini_batch_size=2)
    _, totals = update_policy_step(base, small_batch(tokenizer), settings)
    assert len(norms) == 2 and min(norms) > 0 and totals["grad_norm"] == pytest.approx(sum(norms), rel=1e-6)
    assert math.isnan(totals["kl_ref"])


@pytest.mark.parametrize("chunk_size", [0, 3])  # the naive path and the fused, chunked one
def test_score_with_scores_at_the_temperature_it_is_given(tiny_model_and_tokenizer, chunk_size):
    """Guards: score_with ignoring `temperature` (the reference and old-policy passes would score at 1 what the update
    scores at --sampling_temperature). At 0.5 its log-probs equal log_softmax(logits / 0.5) gathered at the labels."""
    model, tokenizer = tiny_model_and_tokenizer
    batch = small_batch(tokenizer)
    mask = batch["response_mask"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    naive = {t: torch.log_softmax(logits / t, -1).gather(-1, batch["labels"][..., None]).squeeze(-1)[mask] for t in (0.5, 1.0)}
    scored = policy_update.score_with(model, batch, 2, "cpu", chunk_size=chunk_size, temperature=0.5)[mask]
    assert torch.allclose(scored, naive[0.5], atol=1e-5)
    assert (naive[0.5] - naive[1.0]).abs().max() > 0.1


def test_a_new_peak_learning_rate_keeps_the_schedules_factor():
    """Guards: set_peak_learning_rate writing the new peak itself into the optimizer (the resumed warm-up jumps).
    Warm-up over 4 steps at peak 1e-3, 2 steps taken: the factor is (2 + 1) / 4 = 0.75, so a new peak 2e-3 gives
    1.5e-3 now, then 2e-3 once the warm-up ends (factor 1 from step 3)."""
    from alignment.optim import set_peak_learning_rate

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = build_scheduler(optimizer, 4, 10)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(7.5e-4)
    set_peak_learning_rate(optimizer, scheduler, 2e-3)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1.5e-3) and scheduler.get_last_lr() == pytest.approx([1.5e-3])
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)
