"""GRPO-style RL on GSM8K, starting from the SFT checkpoint.

    python -m alignment.train_rl                                  # seed: 8 GPUs, roles on cuda:7/6/5
    python -m alignment.train_rl --layout auto --loss_type grpo_clip --group_size 8
    python -m alignment.train_rl --layout auto --rollout_backend hf   # no vLLM needed
    torchrun --nproc_per_node 8 -m alignment.train_rl --policy_parallel fsdp   # data parallel, FSDP2
    tensorboard --logdir runs

If --checkpoint_path already holds weights, the script only evaluates that
checkpoint; otherwise it trains from the SFT checkpoint (--sft_checkpoint_path,
default: train_sft's --checkpoint_path). Four roles, one device each (seed): a
vLLM rollout sampler, a frozen reference model, an evaluation engine, and the
trainable policy with its layers spread over the remaining GPUs
(`partition_model_across_devices`). Each step: sample group_size responses per
prompt, grade them with r1_zero_reward_fn, normalise rewards within each group,
compute per-token log-probs of the responses, take a policy-gradient step.

Where the algorithm departs from the seed, each one flag away from the seed's behaviour:
- rollouts follow the policy: weights are copied into the sampler every
  --rollout_sync_every steps (0 = the seed's sampler frozen at the start);
- grpo_clip's old policy is the policy that sampled the batch (--old_policy
  rollout, PPO); --old_policy reference compares against the frozen reference
  model as the seed did (policy_update.old_policy_log_probs lists the cases);
- the update trains on the token ids the sampler produced (--rollout_tokens text
  re-tokenises prompt + response text as the seed did, which can change tokens);
- log-probs score the next token (labels shifted by one) and are computed with a
  fused, chunked lm_head + log-softmax (--logprob_chunk_size 0 = naive);
- on GPUs the policy keeps fp32 master weights (parameters, gradients, AdamW
  state) and computes in bf16 under autocast, as TRL and verl do; the seed's pure
  bf16 rounds most RL-sized updates away (--no-fp32_master_weights);
- every scoring pass (policy, old policy, reference) divides the logits by the
  sampling temperature, so the loss scores the distribution that was sampled
  (--scoring_temperature 1 = the seed);
- --rollout_staleness N (default 0) samples up to N batches ahead of the policy in
  a process of its own, with truncated importance sampling (--tis_cap);
- evaluation syncs the sampler and evaluates there (--eval_engine sampler);
  --eval_engine fresh, or a sampler not synced every step, saves to
  --tmp_checkpoint_path and starts a new vLLM engine on --eval_device, as the seed did;
- additions, off by default unless said: --kl_coef (k3 KL to the reference; mean KL
  is logged either way), --length_normalization constant (Dr. GRPO) / token_mean (DAPO),
  --cliprange_high (DAPO), --epochs_per_rollout_batch / --train_batch_size,
  --no-use_std_normalization (Dr. GRPO), batches whose groups all tie are skipped, their
  steps still counted by the learning-rate schedule (--no-skip_zero_signal runs them, as the seed did);
- objective variants, all off by default (grpo.py has each formula and its source):
  --loss_type gspo / cispo, --dynamic_sampling and --overlong mask|penalty (DAPO),
  --entropy_coef, --kl_estimator k1|k2 and --kl_in reward, --mismatch_correction
  (one step off), --eval_samples / --eval_pass_k (pass@k beside greedy accuracy).
Speed (--torch_compile, --microbatch_tokens, --pack_sequences, FSDP2) and the
engineering around a run (owned and locked outputs, --resume, signals) are in the
README; the update itself in policy_update.py, the loss math in grpo.py, the sampler
in sampler.py, the logs in run_log.py.
"""

import math
import os
import random
import time
import uuid
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

from alignment import distributed
from alignment.args import (build_sft_parser, check_checkpoint, check_checkpoint_flags, check_checkpoint_inputs, check_resume_flags, has_weights, model_context_length, parse_rl_args, read_model_config,
                            optimizer_steps_per_batch, resolve_speed_flags, run_record)
from alignment.checkpoint import (OutputLock, check_distinct_outputs, check_output_path, check_saved_model, check_start_kept, check_writable, claim_log_folder, folder_fingerprint, forget_run_from,
                                  has_training_state, load_training_state, read_manifest, real_output_path, recover_checkpoint, record_run_from, remove_output, same_path,
                                  save_model_atomically, save_training_state, start_over, state_step)
from alignment.data import Gsm8kDataset, check_held_out, data_fingerprint, split_path
from alignment.devices import format_role_table, one_device_roles, resolve_dtype, resolve_role_devices
from alignment.distributed import check_fsdp_sizes, rank_slice, reduce_reward_meta, reduce_totals, save_policy
from alignment.drgrpo_grader import grade_responses, r1_zero_reward_fn
from alignment.errors import RunStopped, UserError, run_cli
from alignment.evaluate import add_pass_at_k, check_eval_only_folder, eval_only_setup, evaluate_checkpoint, evaluate_in_subprocess, evaluate_math, file_error, summarize_samples, write_json, write_jsonl
from alignment.flops import policy_peak_flops
from alignment.grpo import LOSSES, advantages_from_scores, normalize_group_rewards, overlong_reward, sequence_kl
from alignment.interrupts import StopOnSignal, resume_command
from alignment.optim import build_optimizer, build_scheduler, set_peak_learning_rate, skip_schedule_steps
from alignment.policy_update import UpdateSettings, empty_totals, load_reference, needs_old_policy_pass, prepare_policy, score_with, sequence_lengths, update_policy
from alignment.precision import describe as describe_precision
from alignment.precision import master_dtype
from alignment.rollout import HfEngine, SamplingSettings, check_model_folder, check_same_tokenizer, checkpoint_tensors, load_hf_model, load_tokenizer
from alignment.run_log import STEP_TIMINGS, RunLog, step_scalars, timed
from alignment.sampler import batches_ahead, rollout_batch, sample_and_grade, start_sampler, truncated_responses
from alignment.sampler_process import SamplerProcessError
from alignment.sft_helpers import tokenize_rollout_ids, tokenize_rollouts


def shape_rewards(args, batch, change, ranks, name: str) -> dict:
    """Add `change` (N,) to the rollouts' rewards, normalise each group again: DAPO's overlong penalty
    and --kl_in reward's KL enter before the group mean and std, as verl does. Returns {name: mean}."""
    batch["raw_rewards"] = batch["raw_rewards"] + change
    batch["advantages"], _ = normalize_group_rewards(batch["raw_rewards"], args.group_size, args.advantage_eps, args.use_std_normalization)
    return {name: ranks.mean(change.mean().item())}


def handle_overlong(args, batch, generations, eos_token_id, ranks) -> dict:
    """--overlong (DAPO): truncated responses leave the loss (mask) or the length penalty enters every reward."""
    if args.overlong == "none":
        return {}
    truncated = truncated_responses(generations, args.sampling_max_tokens, eos_token_id)
    if args.overlong == "mask":
        batch["in_loss"] = ~truncated
    logged = {"train/truncated_fraction": ranks.mean(truncated.float().mean().item())}
    if args.overlong == "penalty":
        lengths = torch.tensor([g.num_tokens for g in generations])
        logged.update(shape_rewards(args, batch, overlong_reward(lengths, args.sampling_max_tokens, args.overlong_buffer), ranks, "train/overlong_reward"))
    return logged


def kl_in_reward(args, batch, model, main_device, scoring: dict, ranks) -> dict:
    """--kl_in reward: each response's summed KL (--kl_estimator) between the pre-update policy and the
    reference, times --kl_coef, leaves its reward before the group normalisation (verl's use_kl_in_reward)."""
    before = batch["old_log_probs"] if "old_log_probs" in batch else score_with(model, batch, args.train_mini_batch_size, main_device, **scoring)
    kl = sequence_kl(before, batch["ref_log_probs"], batch["response_mask"], args.kl_estimator)
    return shape_rewards(args, batch, -args.kl_coef * kl, ranks, "train/kl_reward")


def rollout_tensors(args, tokenizer, grouped_prompts, generations, raw_rewards, advantages) -> dict:
    """Prompt + the sampled ids (or the seed's re-tokenised text), the mask of generated tokens, rewards."""
    if args.rollout_tokens == "ids":
        sampler_log_probs = [g.log_probs for g in generations] if any(g.log_probs is not None for g in generations) else None
        tokens = tokenize_rollout_ids(grouped_prompts, [g.token_ids for g in generations], tokenizer, sampler_log_probs)
    else:
        tokens = tokenize_rollouts(grouped_prompts, [g.text for g in generations], tokenizer)
    return {**tokens, "raw_rewards": raw_rewards, "advantages": advantages, "lengths": sequence_lengths(tokens["response_mask"])}


def evaluates_in_a_fresh_engine(args, world_size: int) -> bool:
    """Whether the periodic evaluations take the seed's path (save to --tmp_checkpoint_path, a new vLLM on
    --eval_device): vLLM rollouts in one process, with --eval_engine fresh or a rollout engine that does not hold
    the policy's weights at every step (--rollout_sync_every other than 1), which the evaluation must not change."""
    return args.rollout_backend != "hf" and world_size == 1 and not (args.eval_engine == "sampler" and args.rollout_sync_every == 1)


def evaluate_policy(args, sampler, model, tokenizer, eval_set, roles, ranks, step: int) -> tuple[dict, bool]:
    """The current policy on the eval split; returns the metrics (with samples) and whether the
    sampler now holds the current weights. Under torchrun the ranks split the examples; with
    the seed's frozen sampler (--rollout_sync_every 0) it gets its start weights back after."""
    sampling = SamplingSettings.from_args(args, "eval_")
    if args.rollout_backend == "hf" and ranks.world_size == 1:
        engine = HfEngine(model, tokenizer, batch_size=args.hf_batch_size, compute_dtype=resolve_dtype(args.dtype, roles["sample"]))
        metrics = evaluate_math(engine, r1_zero_reward_fn, eval_set.prompts, eval_set.ground_truths, sampling)
        return add_pass_at_k(metrics, engine, eval_set.prompts, eval_set.ground_truths, args, "eval_"), False  # --eval_samples
    if not evaluates_in_a_fresh_engine(args, ranks.world_size):
        sampler.engine.load_weights(ranks.full_weights(model))
        prompts, truths = rank_slice(eval_set.prompts, ranks), rank_slice(eval_set.ground_truths, ranks)
        started = time.perf_counter()
        local = evaluate_math(sampler.engine, r1_zero_reward_fn, prompts, truths, sampling) if prompts else {"samples": []}
        metrics = summarize_samples(ranks.gather(local["samples"]), time.perf_counter() - started)
        metrics = add_pass_at_k(metrics, sampler.engine, prompts, truths, args, "eval_", ranks.gather)
        if args.rollout_sync_every == 0:
            sampler.engine.load_weights(checkpoint_tensors(sampler.start_weights))
            return metrics, False
        return metrics, True
    # the seed's path: save the policy, evaluate it with a fresh vLLM engine on the eval device, in
    # a child process (vLLM keeps process-wide state: a second engine, once closed, breaks the sampler), pass@k there too
    save_model_atomically(model, tokenizer, args.tmp_checkpoint_path, "eval_checkpoint")
    output_dir = Path(args.log_dir) / args.run_name / f"eval_step_{step}"
    for name in ("metrics.json", "samples.jsonl"):  # this run's evaluation of the step before a --resume, superseded whatever its flags
        (output_dir / name).unlink(missing_ok=True)
    return evaluate_in_subprocess(args.tmp_checkpoint_path, args, output_dir, roles["eval"]), False


def place_roles(args, base_model_checkpoint_path, ranks, say) -> tuple[dict, torch.dtype, torch.dtype]:
    """The role -> device table (printed), the compute dtype and the policy's storage dtype."""
    num_layers = read_model_config(base_model_checkpoint_path, "--sft_checkpoint_path")["num_hidden_layers"]
    if ranks.world_size > 1 or args.policy_parallel == "fsdp":
        check_fsdp_sizes(args, ranks)
        roles = one_device_roles(ranks.device, num_layers)  # every role of this rank on its own device
    else:
        roles = resolve_role_devices(args, num_layers)
    dtype = resolve_dtype(args.dtype, roles["policy_main"])  # compute dtype; the reference and the sampler hold it too
    policy_dtype = master_dtype(dtype, args.fp32_master_weights)
    say("role -> device" + (f" (each of {ranks.world_size} ranks, FSDP2 policy)" if ranks.world_size > 1 else "") + "\n" + format_role_table(roles))
    say(f"precision: {describe_precision(policy_dtype, dtype)}; log-probs scored at temperature {args.scoring_temperature:g}")
    return roles, dtype, policy_dtype


def load_prompts(args, tokenizer, base_model_checkpoint_path) -> tuple[Gsm8kDataset, Gsm8kDataset, int, int]:
    """The train and eval splits, every prompt checked to fit the model's context with its
    responses, the rollout steps per pass over the train split, and the run's step count."""
    dataset = Gsm8kDataset("train", args.data_dir, limit=args.num_train_examples)
    eval_set = Gsm8kDataset(args.eval_split, args.data_dir, limit=args.eval_num_examples)
    if args.eval_split != "train":  # --eval_split train grades the training problems on purpose
        check_held_out(dataset, eval_set)
    context = model_context_length(base_model_checkpoint_path)
    dataset.check_prompt_lengths(tokenizer, context, args.sampling_max_tokens, "--sampling_max_tokens")
    eval_set.check_prompt_lengths(tokenizer, context, args.eval_max_tokens, "--eval_max_tokens")
    if len(dataset) < args.rollout_batch_size:
        raise UserError(f"--rollout_batch_size {args.rollout_batch_size} exceeds the {len(dataset)} training prompts")
    if args.dynamic_sampling and args.dynamic_sampling_prompts > len(dataset):  # a round draws that many distinct prompts
        raise UserError(f"--dynamic_sampling_prompts {args.dynamic_sampling_prompts} exceeds the {len(dataset)} training prompts")
    steps_per_epoch = len(dataset) // args.rollout_batch_size
    planned = steps_per_epoch * args.num_epochs
    if args.max_steps and args.max_steps > planned and os.environ.get("RANK", "0") == "0":
        print(f"note: --max_steps {args.max_steps} is more than --num_epochs {args.num_epochs} x {steps_per_epoch} steps an epoch "
              f"({len(dataset)} prompts / --rollout_batch_size {args.rollout_batch_size}): the run ends at step {planned}; raise --num_epochs to train longer")
    return dataset, eval_set, steps_per_epoch, min(args.max_steps or planned, planned)


def build_models(args, base_model_checkpoint_path, state, policy_version: int, roles, dtype, policy_dtype, tokenizer, ranks, say):
    """(policy, sampler, reference model or None, speed switches) for this run, on their devices.

    The policy loads on the CPU first and the sampler starts before it moves to its GPUs:
    vLLM sizes its cache from the memory free at its start (the seed starts it first too).
    """
    start_weights = state["policy_path"] if state else base_model_checkpoint_path
    model = load_hf_model(start_weights, "cpu", policy_dtype)
    speed, speed_line = resolve_speed_flags(args, roles["policy_main"], ranks.world_size, model.config)
    say("speed: " + speed_line)
    shares_gpu = roles["sample"] in {*roles["policy_layers"], roles["policy_main"], roles["reference"]}
    frozen = args.rollout_sync_every == 0  # the seed's frozen sampler samples from the start checkpoint, resumed or not
    sampler = start_sampler(args, roles["sample"], base_model_checkpoint_path if frozen else start_weights, 0 if frozen else policy_version,
                            model, tokenizer, ranks, shares_gpu, dtype, say)
    prepare_policy(model, speed, args.gradient_checkpointing, roles["policy_main"], roles["policy_layers"], ranks, dtype)
    reference_model = None
    if args.kl_coef > 0 or args.old_policy == "reference" or args.log_reference_kl:
        reference_model = load_reference(base_model_checkpoint_path, roles["reference"], dtype, speed["torch_compile"])
    return model, sampler, reference_model, speed


def cut_decay_note(args, rate: float, planned_steps: int) -> str:
    """What a time box that ends a cosine run early leaves of its decay: the rate is still above the floor the schedule
    reaches at its planned last step, so the last iterate trained at a higher rate than the run planned."""
    if args.lr_schedule != "cosine":
        return ""
    return (f", before its cosine decay ends: the rate is {rate:.2g}, {rate / args.learning_rate:.0%} of --learning_rate, where the "
            f"schedule planned 10% at step {planned_steps} (plan fewer --max_steps for the decay to end inside the box)")


def optimizer_and_schedule(args, model, total_steps: int, state: dict | None, say):
    """AdamW and its schedule over every optimizer step of the run; restored from a training state."""
    optimizer = build_optimizer(model, args.learning_rate, args.weight_decay, args.adam_betas)
    scheduler = build_scheduler(optimizer, args.warmup_steps, total_steps * optimizer_steps_per_batch(args), args.lr_schedule, say)
    if state:
        distributed.load_optimizer_state(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_peak_learning_rate(optimizer, scheduler, args.learning_rate)  # a changed --learning_rate takes effect
        say(f"resumed from {args.state_dir} at step {state['step']}")
        # another --learning_rate, --max_steps, --warmup_steps or --lr_schedule plans the rate anew, as if the run had started with it
        was, now = state["scheduler"].get("_last_lr", [None])[0], scheduler.get_last_lr()[0]
        if was is not None and not math.isclose(was, now, rel_tol=1e-6):
            say(f"resume: the learning rate is now {now:.3g}, where the run left it at {was:.3g}: the changed flags plan it anew "
                f"over the {total_steps} steps, as if the run had started with them")
    return optimizer, scheduler


def save_state(args, ranks, model, tokenizer, optimizer, scheduler, counters: dict, run: dict) -> None:
    """A training state for --resume (full weights and optimizer state, gathered on rank 0 under FSDP)."""
    model_state, optimizer_state = ranks.full_state_dict_on_main(model), ranks.optimizer_state_on_main(model, optimizer)
    if ranks.is_main:
        save_training_state(args.state_dir, model, tokenizer, model_state, optimizer_state, scheduler, counters, run)
        print(f"saved training state at step {counters['step']} to {args.state_dir}", flush=True)
    ranks.barrier()


def _drop_training_state(args, base_model_checkpoint_path, run_id: str) -> None:
    """The run's result is kept: its training state goes, and with it the note that keeps train_sft off its start."""
    remove_output(args.state_dir, "training_state", run_id=run_id)
    forget_run_from(base_model_checkpoint_path, run_id)


def train(args, base_model_checkpoint_path, run: dict, stop: StopOnSignal) -> dict:
    """The RL run (main() checked its paths and flags, and holds the locks and the signal handler `stop`)."""
    ranks = distributed.setup(args)  # one process (seed), or a torchrun launch with FSDP2
    say = print if ranks.is_main else (lambda *_, **__: None)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    roles, dtype, policy_dtype = place_roles(args, base_model_checkpoint_path, ranks, say)
    main_device = roles["policy_main"]
    run_dir = Path(args.log_dir) / args.run_name
    state = load_training_state(args.state_dir, run_dir) if args.resume else None  # checked against its manifest
    # data and tokenizer first (the seed builds them after the models): a bad row fails before any model loads
    tokenizer = load_tokenizer(args.model or base_model_checkpoint_path, "--model" if args.model else "--sft_checkpoint_path")
    if args.model:
        check_same_tokenizer(tokenizer, args.model, base_model_checkpoint_path, "--model")
    dataset, eval_set, steps_per_epoch, total_steps = load_prompts(args, tokenizer, base_model_checkpoint_path)
    log = RunLog(run_dir, SummaryWriter(str(run_dir), purge_step=state["step"] + 1 if state else None) if ranks.is_main else None,
                 state["step"] if state else 0, args.log_every, say)
    log.flags(run, state["step"] if state else 0)

    # the loop's counters, saved and restored as they are; versions count the steps that changed the weights
    progress = {"step": 0, "skipped_steps": 0, "zero_signal_batches": 0, "policy_version": 0, "world_size": ranks.world_size}
    missing = [key for key in progress if state and key != "world_size" and key not in state]
    if missing:
        raise UserError(f"the training state in {args.state_dir} has no {', '.join(missing)} in its counters.json (an older version wrote it); "
                        f"start a new run with another --checkpoint_path and --run_name, or {start_over(run_dir, args.state_dir)} to start over")
    progress.update({key: state[key] for key in progress if state and key != "world_size"})
    # non-finite optimizer steps skipped since the last one taken (--max_skipped_steps); 0 in an older version's state
    progress["skipped_in_a_row"] = state.get("skipped_in_a_row", 0) if state else 0
    model, sampler, reference_model, speed = build_models(args, base_model_checkpoint_path, state, progress["policy_version"], roles, dtype, policy_dtype,
                                                          tokenizer, ranks, say)
    optimizer, scheduler = optimizer_and_schedule(args, model, total_steps, state, say)
    settings = UpdateSettings.from_args(args, ranks.world_size, speed["pack_sequences"])
    scoring = settings.scoring_options(dtype)
    total_peak = policy_peak_flops(roles, ranks.world_size, args.peak_tflops)
    rollout_sampling = SamplingSettings.from_args(args, "sampling_")
    weights = lambda: ranks.full_weights(model)  # noqa: E731 - the policy's weights, gathered under FSDP
    trained_seconds, stopping = 0.0, False
    if args.evaluate_at_start and not state:  # step 0: the start checkpoint, evaluated as every later step is
        log.evaluation(0, evaluate_policy(args, sampler, model, tokenizer, eval_set, roles, ranks, 0)[0], args.num_logged_rollouts)

    saved_to = args.checkpoint_path  # where the last save went (save_policy diverts one that --checkpoint_path no longer takes)
    saved_step = None  # the step this process last saved the policy at
    for step in range(progress["step"] + 1, total_steps + 1):
        progress["step"], step_started, timings = step, time.perf_counter(), dict.fromkeys(STEP_TIMINGS, 0.0)
        prompts, truths = (rank_slice(items, ranks) for items in rollout_batch(dataset, step, steps_per_epoch, args.rollout_batch_size, args.seed))  # whole prompts per rank

        # 1-2. rollouts follow the policy; sample group_size responses per prompt (one step off: the batch came
        # ahead, and the next ones go out now) and grade them (--dynamic_sampling refills groups that tie). The sampler's
        # own log-probs of its tokens come back on some steps (every step one step off: the importance weights need them)
        with timed(timings, "sync"):
            sampler.catch_up(progress["policy_version"], weights)
        measure_gap = args.rollout_tokens == "ids" and args.sampler_logprobs_every > 0 and (step - 1) % args.sampler_logprobs_every == 0
        grouped_prompts, grouped_truths, generations, scores, sampled_version, extras = sample_and_grade(
            args, sampler, dataset, step, prompts, truths, replace(rollout_sampling, log_probs=measure_gap or bool(args.rollout_staleness)),
            batches_ahead(args, dataset, step, steps_per_epoch, total_steps, ranks), ranks, timings, grade_responses)
        timings.update(sampler.process_seconds())
        generated_tokens = ranks.sum(sum(g.num_tokens for g in generations))  # the batch's; the engine's (refill rounds too) below

        # 3. advantages normalised within each prompt's group (--overlong: DAPO's truncation mask or length penalty)
        with timed(timings, "reward"):
            advantages, raw_rewards, reward_meta = advantages_from_scores(scores, args.group_size, args.advantage_eps, args.use_std_normalization)
            reward_meta = reduce_reward_meta(reward_meta, raw_rewards, ranks)
        batch = rollout_tensors(args, tokenizer, grouped_prompts, generations, raw_rewards, advantages)
        extras.update(handle_overlong(args, batch, generations, tokenizer.eos_token_id, ranks))

        # 4. log-probs fixed during the update: the frozen reference, and the pre-update policy when a
        # ratio loss takes several optimizer steps. A batch whose groups all tie has zero advantage:
        # its gradient is zero (without KL or an entropy bonus), so skip the work and keep Adam's momentum still.
        signal = batch[LOSSES[args.loss_type].signal]  # raw_rewards or advantages, as the loss was registered
        # the KL penalty and the entropy bonus have a gradient of their own
        has_signal = ranks.any_true(args.kl_coef > 0 or args.entropy_coef != 0 or not args.skip_zero_signal or bool(signal.abs().max() > 0))
        with timed(timings, "logprobs"):
            if has_signal and reference_model is not None:
                batch["ref_log_probs"] = score_with(reference_model, batch, args.train_mini_batch_size, main_device, **scoring)
            if has_signal and needs_old_policy_pass(settings, optimizer_steps_per_batch(args)):
                batch["old_log_probs"] = score_with(model, batch, args.train_mini_batch_size, main_device, **scoring)
            if args.kl_in == "reward":
                extras.update(kl_in_reward(args, batch, model, main_device, scoring, ranks))

        # 5. the policy-gradient update: log-probs, loss, backward, clip, step
        with timed(timings, "update"):
            totals = reduce_totals(update_policy(model, optimizer, scheduler, batch, settings, main_device, dtype, ranks=ranks, step=step), ranks) if has_signal else empty_totals()
        totals["staleness"] = progress["policy_version"] - sampled_version  # updates between the sampler's weights and the policy's
        if not has_signal:
            skip_schedule_steps(scheduler, optimizer_steps_per_batch(args))  # the steps this batch would have taken
            progress["zero_signal_batches"] += 1
            say(f"step {step}: every group has equal rewards, no learning signal; update skipped", flush=True)
        if totals["optimizer_steps"]:
            progress["policy_version"] += 1
            with timed(timings, "sync"):
                sampler.after_update(progress["policy_version"], weights)  # one step off: queued behind the batches sent ahead
        progress["skipped_steps"] += totals["skipped_steps"]
        # optimizer steps in a row, over batches too (a batch that ran none, its groups tied, neither adds nor ends a run of them)
        progress["skipped_in_a_row"] = totals["skipped_since_last_step"] + (0 if totals["optimizer_steps"] else progress["skipped_in_a_row"])
        if progress["skipped_in_a_row"] >= args.max_skipped_steps:
            raise UserError(f"{progress['skipped_in_a_row']} optimizer steps in a row had a non-finite loss or gradient (step {step}); stopped with the "
                            f"last good weights untouched ({args.checkpoint_path} / {args.state_dir}); lower --learning_rate or check the data")

        # --max_train_minutes: this step is the last once the launch has trained that long; it then saves and
        # evaluates as the last step does (the periodic evaluation below would only evaluate the same weights)
        trained_seconds += time.perf_counter() - step_started
        if args.max_train_minutes and step < total_steps and ranks.any_true(trained_seconds >= 60 * args.max_train_minutes):
            planned, total_steps = total_steps, step
            say(f"--max_train_minutes {args.max_train_minutes:g}: {ranks.max(trained_seconds) / 60:.1f} minutes of training after step {step}; the run ends here"
                + cut_decay_note(args, scheduler.get_last_lr()[0], planned))

        # 6. periodic evaluation (the last step's runs once its weights are saved, below), then the step's log line
        if args.evaluate_freq and step % args.evaluate_freq == 0 and step < total_steps:
            with timed(timings, "eval"):
                eval_metrics, synced = evaluate_policy(args, sampler, model, tokenizer, eval_set, roles, ranks, step)
            if synced:
                sampler.version = progress["policy_version"]
            log.evaluation(step, eval_metrics, args.num_logged_rollouts)
        timings["step"] = time.perf_counter() - step_started
        log.step(step, total_steps, {**step_scalars(args, progress, reward_meta, totals, timings, generated_tokens, scheduler.get_last_lr()[0], total_peak,
                                                  extras.get("train/dynamic_sampling_sampled_tokens", generated_tokens)),
                                     **extras}, progress["skipped_steps"])

        # 7. save: the policy after each pass over the data (seed), a training state every
        # --save_state_every steps and when a signal asks to stop
        if step % steps_per_epoch == 0:
            saved_to, saved_step = save_policy(ranks, model, tokenizer, args.checkpoint_path, step, total_steps, run), step
            say(f"epoch {step // steps_per_epoch - 1} done: saved policy to {saved_to}")
        stopping = ranks.any_true(stop.received is not None)
        if stopping and step == total_steps:  # trained to its end: saved below as any finished run, only the final evaluation is skipped
            break
        if args.save_state_every and (step % args.save_state_every == 0 or stopping):
            save_state(args, ranks, model, tokenizer, optimizer, scheduler, {**progress, "epoch": (step - 1) // steps_per_epoch}, run)
        if stopping:  # every rank agreed, so every rank leaves together
            log.close()
            ranks.close()
            raise RunStopped(f"stopped by {stop.name} after step {step}: {resume_hint(args)}", stop.exit_code)
        if step == total_steps:
            break

    # the final weights are saved before the final evaluation: a run that has trained keeps them whatever
    # happens during the evaluation (minutes on GSM8K; a scheduler's SIGKILL after its grace period)
    # unless step 7 saved them at the run's last step: stopped mid-epoch (--max_steps), or resumed from a state of
    # the last step, whose loop ran no step (the checkpoint may be gone, or --checkpoint_path another folder now)
    if saved_step != total_steps:
        saved_to = save_policy(ranks, model, tokenizer, args.checkpoint_path, total_steps, total_steps, run)
        say(f"saved RL checkpoint to {saved_to}")
    if stopping:  # a signal in the last step: the run's result is kept, its state no longer needed
        if ranks.is_main:
            _drop_training_state(args, base_model_checkpoint_path, run["run_id"])
        log.close()
        ranks.close()
        raise RunStopped(f"stopped by {stop.name} in the last step ({total_steps}): the trained policy is saved to {saved_to}; "
                         f"its final evaluation did not run: rerun the same command to evaluate it", stop.exit_code)
    eval_metrics, _ = evaluate_policy(args, sampler, model, tokenizer, eval_set, roles, ranks, total_steps)
    log.evaluation(total_steps, eval_metrics, args.num_logged_rollouts)
    if ranks.is_main:
        write_jsonl(run_dir / "final_eval_samples.jsonl", eval_metrics.get("samples", []))
        write_json(run_dir / "final_eval_metrics.json", {**drop_samples(eval_metrics), "step": total_steps, "skipped_steps": progress["skipped_steps"]})
        _drop_training_state(args, base_model_checkpoint_path, run["run_id"])  # finished: the final checkpoint is the result
    for closing in (log, sampler, ranks):
        closing.close()
    if Path(saved_to) != Path(args.checkpoint_path):  # trained and evaluated, but not where it was asked for
        raise RunStopped(f"the trained policy (step {total_steps}) is saved to {saved_to}, not to --checkpoint_path {args.checkpoint_path}, "
                         f"which changed during the run (see the warning above); its final evaluation is in {run_dir}", 1)
    return drop_samples(eval_metrics)


def resume_hint(args) -> str:
    """What a stopped run leaves to continue from: its last training state and the command, or what a rerun does."""
    if has_training_state(args.state_dir):
        return f"the training state of step {state_step(args.state_dir)} is in {args.state_dir}; continue with:\n  {resume_command(None)}"
    run_dir = Path(args.log_dir) / args.run_name
    if has_weights(args.checkpoint_path):  # an epoch's checkpoint: the seed's rule would evaluate it, not train on
        return (f"no training state was saved (--save_state_every 0); {args.checkpoint_path} holds the policy of an earlier epoch, "
                f"which a rerun only evaluates: {start_over(run_dir, args.checkpoint_path)} to start over")
    return (f"no training state was saved (--save_state_every 0), so a rerun starts over: under another --run_name "
            f"({run_dir} keeps this run's logs), or after removing {run_dir}")


def check_not_a_copy_of_the_runs_state(state_dir, saved_run: dict) -> None:
    """A resume writes its states into --state_dir and removes it when the run ends: a copy of the run's state (a
    snapshot kept to branch from) would be replaced, then removed, while the state it was copied from stays as the
    same run's. A state moved to --state_dir resumes as any other."""
    recorded = (saved_run.get("flags") or {}).get("state_dir")
    if not recorded or same_path(recorded, state_dir) or not has_training_state(recorded):
        return
    if ((read_manifest(recorded) or {}).get("run") or {}).get("run_id") == saved_run.get("run_id"):
        raise UserError(f"--state_dir {state_dir} is a copy of this run's training state in {recorded} (step {state_step(recorded)} there): "
                        f"a resume writes its states into --state_dir and removes it when the run ends, so the copy would be gone; "
                        f"resume from {recorded}, or move that state away first to continue from the copy (nothing was changed)")


def input_fingerprints(args, start, recorded: dict | None = None) -> tuple[str | None, str | None]:
    """The start checkpoint's and train.jsonl's fingerprints as they are now (None for one that is not there);
    `recorded`, the run record they are checked against (folder_fingerprint reads its start's as an older version wrote it)."""
    start_sha256 = folder_fingerprint(start, (recorded or {}).get("start_checkpoint_sha256")) if has_weights(start) else None
    return start_sha256, split_fingerprint(args.data_dir, "train")


def split_fingerprint(data_dir, split: str) -> str | None:
    """A GSM8K split file's SHA-256 as it is now (None when it is not there)."""
    return data_fingerprint(data_dir, split) if split_path(data_dir, split).is_file() else None


def drop_samples(metrics: dict) -> dict:
    return {key: value for key, value in metrics.items() if key != "samples"}


def main(argv=None) -> dict:
    args = parse_rl_args(argv)
    distributed.check_launch(args)
    for flag in ("checkpoint_path", "state_dir", "tmp_checkpoint_path"):  # the folders a save swaps in by renaming
        setattr(args, flag, real_output_path(getattr(args, flag), f"--{flag}"))
    sft_args = build_sft_parser().parse_args([])  # the seed parses both; RL starts where SFT saved
    base_model_checkpoint_path = args.sft_checkpoint_path or sft_args.checkpoint_path
    run_dir = Path(args.log_dir) / args.run_name
    outputs = [(args.checkpoint_path, "--checkpoint_path", "rl_checkpoint"), (args.state_dir, "--state_dir", "training_state")]
    if evaluates_in_a_fresh_engine(args, int(os.environ.get("WORLD_SIZE", "1"))):  # checked and locked with the others before any work
        outputs.append((args.tmp_checkpoint_path, "--tmp_checkpoint_path", "eval_checkpoint"))
    # one folder, one role (symlinks followed), before anything is read or written
    locks = [(path, flag) for path, flag, _ in outputs] + [(run_dir, "--log_dir/--run_name")]
    check_distinct_outputs(locks)
    for path, flag in locks:  # nor the start: a save there would replace it, files inside it would change it
        check_start_kept(base_model_checkpoint_path, "--sft_checkpoint_path", path, flag)
    writes = os.environ.get("RANK", "0") == "0"  # under torchrun rank 0 alone writes
    # what an interrupted write left is recovered only under the paths' locks, so that no run
    # still writing there (on this host or another) loses its temp folder
    with OutputLock([(path, flag) for path, flag in locks if Path(path).absolute().parent.is_dir()] if writes else []):
        if writes:
            for path, _, _ in outputs:
                recover_checkpoint(path)
        return _start(args, base_model_checkpoint_path, run_dir, outputs, locks, writes)


def _start(args, base_model_checkpoint_path, run_dir, outputs, locks, writes) -> dict:
    """main() with the outputs recovered: evaluate an existing RL checkpoint (the seed's rule), or check everything and train."""
    if has_training_state(args.state_dir) and not args.resume:
        # never discard an unfinished run without a word: hours of GPU time may be in it
        then = (f"remove {args.state_dir} to evaluate {args.checkpoint_path}" if has_weights(args.checkpoint_path)
                else f"{start_over(run_dir, args.state_dir)} to start over from the SFT checkpoint")
        raise UserError(f"{args.state_dir} holds the training state of an unfinished run (step {state_step(args.state_dir)}); "
                        f"pass --resume to continue it, or {then}")
    if has_weights(args.checkpoint_path) and not has_training_state(args.state_dir):
        # the seed's rule: an existing RL checkpoint is evaluated, never retrained (a finished
        # run removes its training state, so only an interrupted one trains past a checkpoint)
        check_checkpoint(args.checkpoint_path, "--checkpoint_path", f"{start_over(run_dir, args.checkpoint_path)} to train again")
        saved = read_manifest(args.checkpoint_path) or {}
        if saved.get("kind", "rl_checkpoint") != "rl_checkpoint":  # its evaluation would be reported as this RL run's result
            raise UserError(f"--checkpoint_path {args.checkpoint_path} holds a {saved['kind']} this tool wrote, not an RL run's checkpoint; "
                            f"pass an RL run's --checkpoint_path, or evaluate it with `python -m alignment.evaluate --model_path "
                            f"{args.checkpoint_path}` (nothing was changed)")
        check_checkpoint_flags(saved, args)  # this command's training flags are that run's
        check_checkpoint_inputs(saved, args, *input_fingerprints(args, base_model_checkpoint_path, saved.get("run")))  # and so are its start and data
        check_saved_model(args.checkpoint_path, f"the checkpoint cannot be evaluated; {start_over(run_dir, args.checkpoint_path)} to train again")
        check_model_folder(args.checkpoint_path, "--checkpoint_path")
        check_writable(run_dir, "--log_dir")
        if not writes:  # under torchrun rank 0 evaluates it alone: every rank would run the whole split and write the same files
            print(f"rank {os.environ['RANK']}: rank 0 evaluates {args.checkpoint_path}")
            return {}
        setup = eval_only_setup(args)
        with OutputLock([(run_dir, "--log_dir/--run_name")]):
            check_eval_only_folder(run_dir, args.checkpoint_path, setup)  # another run's logs, or another evaluation, stay as they are
            claim_log_folder(run_dir, "--log_dir/--run_name")
            try:
                return evaluate_checkpoint(args, setup)
            except OSError as error:
                raise file_error(error, f"the evaluation of {args.checkpoint_path}") from None
    check_checkpoint(base_model_checkpoint_path, "--sft_checkpoint_path", "run `python -m alignment.train_sft` first or pass --sft_checkpoint_path")
    if not Path(base_model_checkpoint_path).is_dir():
        raise UserError(f"--sft_checkpoint_path {base_model_checkpoint_path} must be a local folder (train_rl reads its config and loads it into vLLM)")
    check_saved_model(base_model_checkpoint_path, f"RL cannot start from it; restore it or run train_sft again (--sft_checkpoint_path {base_model_checkpoint_path})")
    check_model_folder(base_model_checkpoint_path, "--sft_checkpoint_path")
    context = model_context_length(base_model_checkpoint_path)
    for flag in ("sampling_max_tokens", "eval_max_tokens"):
        if context and getattr(args, flag) >= context:
            raise UserError(f"--{flag} {getattr(args, flag)} leaves no room for the prompt in the model's {context}-token context; lower it")
    # every output is ours (of its kind, with no file added) or new, and writable, before anything loads (checkpoint.py)
    for path, flag, kind in outputs:
        check_output_path(path, flag, kind)
    check_writable(run_dir, "--log_dir")
    # recorded with the run: a resumed run must load the same start and data again, and a rerun that only
    # evaluates the checkpoint must name what it was trained from
    resumed = read_manifest(args.state_dir).get("run", {}) if args.resume and has_training_state(args.state_dir) else None
    start_sha256, train_data_sha256 = input_fingerprints(args, base_model_checkpoint_path, resumed)
    eval_data_sha256 = split_fingerprint(args.data_dir, args.eval_split)
    run_id = uuid.uuid4().hex
    if args.resume and not has_training_state(args.state_dir):
        print(f"--resume: no training state in {args.state_dir}; starting from the SFT checkpoint")
    if resumed is not None:
        saved = resumed
        check_not_a_copy_of_the_runs_state(args.state_dir, saved)
        # --checkpoint_path may change on resume, but never onto another run's result: the save would replace it
        held = ((read_manifest(args.checkpoint_path) or {}).get("run") or {}).get("run_id") if has_weights(args.checkpoint_path) else None
        if held and held != saved.get("run_id"):
            raise UserError(f"--resume --checkpoint_path {args.checkpoint_path} holds the checkpoint of another run ({held[:8]}), which this run's "
                            f"saves would replace; pass this run's own --checkpoint_path {saved.get('flags', {}).get('checkpoint_path', '')}".rstrip())
        for line in check_resume_flags(saved, args, train_data_sha256, start_sha256, eval_data_sha256):
            print(f"resume: {line}")
        saved_step = state_step(args.state_dir)
        if args.max_steps and args.max_steps < saved_step:
            raise UserError(f"--resume --max_steps {args.max_steps}: the training state in {args.state_dir} is at step {saved_step} already; "
                            f"pass --max_steps {saved_step} or more (or leave it out) to continue the run")
        run_id = saved.get("run_id") or run_id  # the state stays this run's: it removes it when it finishes
    run = run_record(args, train_data_sha256, run_id, start_sha256, eval_data_sha256)  # the flags as given, before devices are resolved
    with OutputLock(locks if writes else []), StopOnSignal() as stop:
        if writes:
            claim_log_folder(run_dir, "--log_dir/--run_name", run["run_id"], resuming=args.resume and has_training_state(args.state_dir))
            record_run_from(base_model_checkpoint_path, run["run_id"], args.state_dir)  # train_sft keeps this start while the run is unfinished
        try:
            return train(args, base_model_checkpoint_path, run, stop)
        except SamplerProcessError as error:
            raise RunStopped(f"the sampler process stopped ({str(error).splitlines()[0]}); {resume_hint(args)}",
                             stop.exit_code if stop.received else 1) from None
        except OSError as error:  # a full disk or a lost mount under the logs, the checkpoint or the state: what was saved stays
            where = error.filename or "one of the run's files (its logs, checkpoint or training state)"
            raise RunStopped(f"the run stopped on a file error: {error.strerror or error} ({where}); {resume_hint(args)}", 1) from None


if __name__ == "__main__":
    run_cli(main)
