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

Where this departs from the seed, each one flag away from the seed's behaviour:
- rollouts follow the policy: weights are copied into the sampler every
  --rollout_sync_every steps (0 = the seed's sampler frozen at the start);
- grpo_clip's old policy is the policy that sampled the batch (--old_policy
  rollout, PPO); --old_policy reference compares against the frozen reference
  model as the seed did. With one optimizer step per rollout batch the old
  log-probs are the policy's own, detached (ratio 1, no extra forward);
- the update trains on the token ids the sampler produced (--rollout_tokens text
  re-tokenises prompt + response text as the seed did, which can change tokens);
- log-probs score the next token (labels shifted by one) and are computed with a
  fused, chunked lm_head + log-softmax (--logprob_chunk_size 0 = naive);
- on GPUs the policy keeps fp32 master weights (parameters, gradients, AdamW
  state) and computes in bf16 under autocast, as TRL and verl do; the seed's pure
  bf16 rounds most RL-sized updates away (--no-fp32_master_weights);
- every scoring pass (policy, old policy, reference) divides the logits by the
  sampling temperature, so the loss scores the distribution that was sampled
  (--scoring_temperature 1 = the seed); the sampler's own log-probs of its tokens
  are compared with the trainer's on step 1 and every --sampler_logprobs_every
  steps (train/sampler_*);
- --rollout_staleness N (default 0) runs the sampler in its own process, N batches
  ahead of the policy, with truncated importance sampling (sampler_process.py);
- evaluation syncs the sampler and evaluates there (--eval_engine sampler);
  --eval_engine fresh saves to --tmp_checkpoint_path and starts a new vLLM
  engine on --eval_device, as the seed did;
- additions: --kl_coef (k3 KL to the reference; mean KL is logged either way),
  --length_normalization constant (Dr. GRPO), --cliprange_high (DAPO),
  --epochs_per_rollout_batch / --train_batch_size, --layout auto, resumable
  training state (--save_state_every, --resume, which checks the run's flags and
  data), non-finite steps skipped, batches with no learning signal skipped,
  --torch_compile (on by default on a GPU), --microbatch_tokens (microbatches cut by tokens),
  --pack_sequences (padding-free microbatches, packing.py; on by default with a token budget on a GPU),
  and --policy_parallel fsdp (alignment/distributed.py);
- outputs are owned and locked (checkpoint.py: a user's folder at an output path
  is refused, one run per path, checksums verified before use), and SIGINT /
  SIGTERM finish the step, save a state and print the resume command (interrupts.py).
The update itself (microbatches, clipping, optimizer step) is in policy_update.py;
the loss math in grpo.py.
"""

import json
import math
import os
import random
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

from alignment import distributed, packing
from alignment.args import build_sft_parser, check_checkpoint, check_resume_flags, has_weights, model_context_length, parse_rl_args, resolve_speed_flags, run_record
from alignment.checkpoint import (OutputLock, check_output_path, check_saved_model, check_writable, file_sha256, has_training_state,
                                  load_training_state, read_manifest, recover_checkpoint, remove_output, save_model_atomically,
                                  save_training_state, state_step)
from alignment.data import Gsm8kDataset, split_path
from alignment.devices import format_role_table, place_model, resolve_dtype, resolve_role_devices
from alignment.distributed import NullWriter, check_fsdp_sizes, per_rank_args, rank_slice, reduce_reward_meta, reduce_totals, save_policy
from alignment.drgrpo_grader import grade_responses, r1_zero_reward_fn
from alignment.errors import RunStopped, UserError, run_cli
from alignment.evaluate import evaluate_in_subprocess, evaluate_math, format_metrics_table, summarize_samples, write_json, write_jsonl
from alignment.flops import peak_flops
from alignment.fused_logprobs import use_compiled_chunk_math
from alignment.grpo import advantages_from_scores
from alignment.interrupts import StopOnSignal, resume_command
from alignment.optim import build_optimizer, build_scheduler, set_peak_learning_rate
from alignment.policy_update import empty_totals, score_with, sequence_lengths, update_policy
from alignment.precision import describe as describe_precision
from alignment.precision import master_dtype
from alignment.rollout import HfEngine, SamplingSettings, VllmEngine, build_engine, checkpoint_tensors, load_hf_model, load_tokenizer
from alignment.sampler_process import RolloutsAhead, SamplerProcess
from alignment.sft_helpers import tokenize_rollout_ids, tokenize_rollouts


# ------------------------------------------------------------------ the step


def group_prompts(prompts, ground_truths, group_size):
    """Each prompt (and its answer) repeated group_size times (seed)."""
    return [p for p in prompts for _ in range(group_size)], [gt for gt in ground_truths for _ in range(group_size)]


def epoch_batch(dataset, order, index, batch_size):
    """Prompts and answers of batch `index` in an epoch's `order`, as the DataLoader yields them."""
    rows = [dataset[i] for i in order[index * batch_size : (index + 1) * batch_size]]
    return [row[0] for row in rows], [row[2] for row in rows]


def sample_rollouts(engine, prompts, ground_truths, group_size, sampling, seed):
    """Repeat each prompt group_size times (seed) and sample one response each."""
    grouped_prompts, grouped_ground_truths = group_prompts(prompts, ground_truths, group_size)
    torch.manual_seed(seed)  # the HF backend samples from torch's RNG: same step, same rollouts
    generations = engine.generate(grouped_prompts, sampling)
    return grouped_prompts, grouped_ground_truths, generations


# --------------------------------------------------------------- evaluation


def evaluate_policy(args, engine, model, tokenizer, eval_set, writer, step, ranks, sampler_start=None) -> tuple[dict, bool]:
    """Evaluate the current policy on the eval split.

    Returns the metrics (with samples) and whether the rollout engine now holds
    the current weights (so the next step need not sync them again). Under torchrun
    the sampler evaluates; with --rollout_sync_every 0 (the seed's frozen sampler) it
    is given its start weights (`sampler_start`, a checkpoint folder) back afterwards.
    """
    sampling = SamplingSettings.from_args(args, "eval_")
    synced = False
    if args.rollout_backend == "hf" and ranks.world_size == 1:
        engine = HfEngine(model, tokenizer, batch_size=args.hf_batch_size, compute_dtype=resolve_dtype(args.dtype, args.sample_device))
        metrics = evaluate_math(engine, r1_zero_reward_fn, eval_set.prompts, eval_set.ground_truths, sampling)
    elif (args.eval_engine == "sampler" and args.rollout_sync_every == 1) or ranks.world_size > 1:
        engine.load_weights(ranks.full_weights(model))  # the sampler now holds the current policy
        synced = True
        # under torchrun each rank evaluates its share (every example exactly once); the
        # samples are gathered on every rank
        prompts, truths = rank_slice(eval_set.prompts, ranks), rank_slice(eval_set.ground_truths, ranks)
        started = time.perf_counter()
        local = evaluate_math(engine, r1_zero_reward_fn, prompts, truths, sampling) if prompts else {"samples": []}
        metrics = summarize_samples(ranks.gather(local["samples"]), time.perf_counter() - started)
        if args.rollout_sync_every == 0:
            engine.load_weights(checkpoint_tensors(sampler_start))  # the seed's sampler stays at its start
            synced = False
    else:
        # the seed's path: save the policy, evaluate it with a temporary vLLM engine on
        # the eval device. A child process, because vLLM keeps process-wide state:
        # a second in-process engine, once closed, breaks the sampler.
        save_model_atomically(model, tokenizer, args.tmp_checkpoint_path)
        metrics = evaluate_in_subprocess(args.tmp_checkpoint_path, args, Path(args.log_dir) / args.run_name / f"eval_step_{step}")
    for key in ("avg_all_rewards", "format_reward", "answer_reward", "mean_response_tokens"):
        writer.add_scalar(f"eval/{key}", metrics[key], step)
    shown = metrics["samples"][: args.num_logged_rollouts]
    if shown:
        writer.add_text("eval/samples", "\n\n---\n\n".join(
            f"**reward {s['reward']:.0f}** (truth {s['ground_truth']})\n\n```\n{s['response']}\n```" for s in shown), step)
    if ranks.is_main:
        print(f"eval step {step}: accuracy {metrics['avg_all_rewards']:.3f} format {metrics['format_reward']:.3f} "
              f"response tokens {metrics['mean_response_tokens']:.0f} ({metrics['num_examples']} examples, {metrics['seconds']:.1f}s)")
        evals_log = Path(args.log_dir) / args.run_name / "evals.jsonl"  # for `python -m alignment.plot`
        evals_log.parent.mkdir(parents=True, exist_ok=True)
        with open(evals_log, "a") as handle:
            handle.write(json.dumps({"step": step, **{k: v for k, v in metrics.items() if k != "samples"}}) + "\n")
    return metrics, synced


# ---------------------------------------------------------------- the loop


def train(args, base_model_checkpoint_path, stop: StopOnSignal | None = None) -> dict:
    ranks = distributed.setup(args)  # one process (seed), or a torchrun launch with FSDP2
    say = print if ranks.is_main else (lambda *_, **__: None)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    num_layers = json.loads((Path(base_model_checkpoint_path) / "config.json").read_text())["num_hidden_layers"]
    if ranks.world_size > 1 or args.policy_parallel == "fsdp":
        check_fsdp_sizes(args, ranks)
        device = ranks.device  # every role of this rank on its own device
        roles = {"sample": device, "reference": device, "eval": device, "policy_main": device, "policy_layers": [device] * num_layers}
        args.sample_device = args.reference_model_device = args.eval_device = device
    else:
        roles = resolve_role_devices(args, num_layers)
    main_device = roles["policy_main"]
    dtype = resolve_dtype(args.dtype, main_device)  # compute dtype; the reference and the sampler hold it too
    policy_dtype = master_dtype(dtype, args.fp32_master_weights)
    say("role -> device" + (f" (each of {ranks.world_size} ranks, FSDP2 policy)" if ranks.world_size > 1 else "") + "\n" + format_role_table(roles))
    say(f"precision: {describe_precision(policy_dtype, dtype)}; log-probs scored at temperature {args.scoring_temperature:g}")

    state = load_training_state(args.state_dir) if args.resume else None  # checked against its manifest
    if args.resume and state is None:
        say(f"--resume: no training state in {args.state_dir}; starting from the SFT checkpoint")

    # init order (seed): writer, sampler, tokenizer, policy, reference, data, optimizer; the
    # data and tokenizer are read first here, so that a bad row fails before any model loads
    tokenizer = load_tokenizer(args.model or base_model_checkpoint_path)
    dataset = Gsm8kDataset("train", args.data_dir, limit=args.num_train_examples)
    eval_set = Gsm8kDataset(args.eval_split, args.data_dir, limit=args.eval_num_examples)
    context = model_context_length(base_model_checkpoint_path)
    dataset.check_prompt_lengths(tokenizer, context, args.sampling_max_tokens, "--sampling_max_tokens")
    eval_set.check_prompt_lengths(tokenizer, context, args.eval_max_tokens, "--eval_max_tokens")
    writer = SummaryWriter(f"{args.log_dir}/{args.run_name}", purge_step=state["step"] + 1 if state else None) if ranks.is_main else NullWriter()
    if ranks.is_main:  # one JSON line of scalars per step, and one per evaluation
        for name in ("steps.jsonl", "evals.jsonl"):
            _trim_jsonl(Path(args.log_dir) / args.run_name / name, state["step"] if state else 0, say)
    start_weights = state["policy_path"] if state else base_model_checkpoint_path
    # the seed's frozen sampler (--rollout_sync_every 0) samples from the start checkpoint, resumed or not
    sampler_start = base_model_checkpoint_path if args.rollout_sync_every == 0 else start_weights
    policy_gpus = set(roles["policy_layers"]) | {main_device, args.reference_model_device}
    ahead = None  # with --rollout_staleness: batches sent to the sampler process before their step
    if args.rollout_staleness:
        if ranks.world_size > 1:
            raise UserError(f"--rollout_staleness {args.rollout_staleness} runs one sampler process beside one trainer; under torchrun use --rollout_staleness 0")
        engine = SamplerProcess(args.rollout_backend, sampler_start, args.sample_device, resolve_dtype(args.dtype, args.sample_device), args.seed,
                                args, shares_gpu=args.sample_device in policy_gpus)
        ahead = RolloutsAhead(engine)
        say(f"{args.rollout_backend} sampler in its own process on {args.sample_device}, up to {args.rollout_staleness} batch(es) ahead of the policy")
    elif args.rollout_backend == "vllm":
        engine = VllmEngine(sampler_start, args.sample_device, dtype=str(resolve_dtype(args.dtype, args.sample_device)).removeprefix("torch."), seed=args.seed + ranks.rank,
                            gpu_memory_utilization=args.vllm_gpu_memory_utilization, kv_cache_gb=args.vllm_kv_cache_gb,
                            enforce_eager=args.vllm_enforce_eager, shares_gpu=args.sample_device in policy_gpus)
        say(f"vLLM sampler on {args.sample_device} started in {engine.start_seconds:.1f}s")
    model = load_hf_model(start_weights, "cpu", policy_dtype)
    say("speed: " + resolve_speed_flags(args, main_device, ranks.world_size, model.config))
    if args.pack_sequences:
        packing.require_support(main_device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.torch_compile:
        for layer in model.model.layers:  # one graph for all layers; dynamic: widths vary per microbatch
            layer.compile(dynamic=True)
        use_compiled_chunk_math()  # the output layer's softmax math, fused
    if ranks.world_size > 1:
        model.to(main_device)
        distributed.shard_policy(model, compute_dtype=dtype)
    else:
        place_model(model, main_device, roles["policy_layers"])  # the seed's layer partition
    model.config.use_cache = False
    model.train()
    # perf/mfu's denominator: every GPU the policy trains on (FSDP ranks, or the layer partition's GPUs)
    policy_gpu_count = ranks.world_size if ranks.world_size > 1 else len({str(d) for d in roles["policy_layers"]} | {str(main_device)})
    peak = peak_flops(main_device, args.peak_tflops)
    total_peak = peak * policy_gpu_count if peak else None
    reference_model = None
    if args.kl_coef > 0 or args.old_policy == "reference" or args.log_reference_kl:
        reference_model = load_hf_model(base_model_checkpoint_path, args.reference_model_device, dtype).eval().requires_grad_(False)
        if args.torch_compile:  # its forward-only scoring pass, fused like the policy's
            for layer in reference_model.model.layers:
                layer.compile(dynamic=True)
    if args.rollout_backend == "hf" and not ahead:
        # sync every step in one process: sample with the policy itself; otherwise a copy
        # (a sharded policy cannot generate: ranks would run different numbers of forwards)
        own_copy = args.rollout_sync_every != 1 or ranks.world_size > 1
        sampler_model = load_hf_model(sampler_start, args.sample_device, dtype) if own_copy else model
        engine = HfEngine(sampler_model, tokenizer, batch_size=args.hf_batch_size, compute_dtype=dtype)

    if len(dataset) < args.rollout_batch_size:
        raise UserError(f"--rollout_batch_size {args.rollout_batch_size} exceeds the {len(dataset)} training prompts")
    steps_per_epoch = len(dataset) // args.rollout_batch_size
    total_steps = min(args.max_steps or steps_per_epoch * args.num_epochs, steps_per_epoch * args.num_epochs)
    optimizer = build_optimizer(model, args.learning_rate, args.weight_decay, args.adam_betas)
    optimizer_steps_total = total_steps * args.epochs_per_rollout_batch * (args.total_rollouts // args.train_batch_size)
    scheduler = build_scheduler(optimizer, args.warmup_steps, optimizer_steps_total)

    # the loop's state, saved as is (counters.json) and restored as is: step counts rollout
    # batches, batch_in_epoch fixes the data position, policy_version counts the rollout
    # steps that changed the weights (the sampler syncs when it lags behind it)
    progress = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "skipped_steps": 0, "zero_signal_batches": 0, "policy_version": 0, "world_size": ranks.world_size}
    if state:
        distributed.load_optimizer_state(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_peak_learning_rate(optimizer, scheduler, args.learning_rate)  # a changed --learning_rate takes effect
        progress.update({key: state[key] for key in progress if key != "world_size"})
        say(f"resumed from {args.state_dir} at step {progress['step']} (epoch {progress['epoch']}, batch {progress['batch_in_epoch']})")
    # the sampler starts from the resumed weights (the seed's frozen sampler: from the start checkpoint)
    sampler_version, skipped_in_a_row = (0 if args.rollout_sync_every == 0 else progress["policy_version"]), 0

    rollout_sampling = SamplingSettings.from_args(args, "sampling_")
    single_step_per_batch = args.epochs_per_rollout_batch == 1 and args.train_batch_size == args.total_rollouts
    rank_args = per_rank_args(args, ranks)  # this rank's share of the batch sizes
    eval_metrics = {}
    run = run_record(args, file_sha256(split_path(args.data_dir, "train")))
    stop = stop or StopOnSignal()  # main() installs it: SIGINT / SIGTERM finish the step, save, exit
    while progress["step"] < total_steps:
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed + progress["epoch"])).tolist()
        loader = DataLoader(dataset, batch_size=args.rollout_batch_size, sampler=order[progress["batch_in_epoch"] * args.rollout_batch_size :], drop_last=True)
        for prompts, _sft_completions, ground_truths in loader:  # completions are unused in RL (seed)
            progress["step"] += 1
            progress["batch_in_epoch"] += 1
            step = progress["step"]
            timings = {}
            step_started = time.perf_counter()
            # under torchrun each rank takes whole prompts, so every group stays on one rank
            prompts, ground_truths = rank_slice(list(prompts), ranks), rank_slice(list(ground_truths), ranks)

            # 1. rollouts follow the policy: copy weights in when the sampler lags
            started = time.perf_counter()
            if args.rollout_sync_every and progress["policy_version"] - sampler_version >= args.rollout_sync_every:
                engine.load_weights(ranks.full_weights(model))
                sampler_version = progress["policy_version"]
            timings["sync"] = time.perf_counter() - started

            # 2. sample group_size responses per prompt
            # on some steps the sampler also returns its log-probs of the sampled ids, to log how far it is from the trainer
            started = time.perf_counter()
            # (every step with --rollout_staleness: the importance weights need them)
            measure_gap = args.rollout_tokens == "ids" and args.sampler_logprobs_every > 0 and (step - 1) % args.sampler_logprobs_every == 0
            step_sampling = replace(rollout_sampling, log_probs=measure_gap or ahead is not None)
            seed = args.seed * 100003 + step * 1009 + ranks.rank
            if ahead:
                # generated while the previous batch trained (or now, at the start of an epoch);
                # then the next batches of this epoch go out, to generate while this one trains
                grouped_prompts, grouped_truths = group_prompts(prompts, ground_truths, args.group_size)
                generations, sampled_version = ahead.take(step, grouped_prompts, step_sampling, seed, sampler_version)
                for later in range(1, args.rollout_staleness + 1):
                    index = progress["batch_in_epoch"] - 1 + later  # that step's batch in this epoch's order
                    if index < steps_per_epoch and step + later <= total_steps:
                        later_prompts, _ = group_prompts(*epoch_batch(dataset, order, index, args.rollout_batch_size), args.group_size)
                        ahead.send(step + later, later_prompts, step_sampling, args.seed * 100003 + (step + later) * 1009, sampler_version)
            else:
                grouped_prompts, grouped_truths, generations = sample_rollouts(engine, prompts, ground_truths, args.group_size, step_sampling, seed)
                sampled_version = sampler_version
            if ahead:  # the engine process's own times: the generation that overlapped training, the last weight load
                timings["sampler_generate"], timings["sampler_load"] = engine.seconds.get("generate", math.nan), engine.seconds.get("load", math.nan)
            staleness = progress["policy_version"] - sampled_version  # updates between the sampler's weights and the policy's
            responses = [g.text for g in generations]
            timings["rollout"] = time.perf_counter() - started
            generated_tokens = ranks.sum(sum(g.num_tokens for g in generations))

            # 3. rewards, then advantages normalised within each prompt's group
            started = time.perf_counter()
            scores = grade_responses(responses, grouped_truths)
            advantages, raw_rewards, reward_meta = advantages_from_scores(scores, args.group_size, args.advantage_eps, args.use_std_normalization)
            reward_meta = reduce_reward_meta(reward_meta, raw_rewards, ranks)
            timings["reward"] = time.perf_counter() - started

            # 4. token sequences: prompt + the sampled ids (or the seed's re-tokenised
            #    full text); the mask keeps generated tokens only
            if args.rollout_tokens == "ids":
                sampler_log_probs = [g.log_probs for g in generations] if any(g.log_probs is not None for g in generations) else None
                tokens = tokenize_rollout_ids(grouped_prompts, [g.token_ids for g in generations], tokenizer, sampler_log_probs)
            else:
                tokens = tokenize_rollouts(grouped_prompts, responses, tokenizer)
            batch = {**tokens, "raw_rewards": raw_rewards, "advantages": advantages}
            batch["lengths"] = sequence_lengths(batch["response_mask"])

            # 5. log-probs that stay fixed during the update: the frozen reference
            #    (on its own device, inference mode), and the pre-update policy when
            #    grpo_clip takes more than one optimizer step on this batch
            # A batch whose every group has equal rewards has zero advantage everywhere:
            # its gradient is exactly zero (without KL), so skip the work, and keep Adam's
            # momentum from moving the weights on no evidence.
            signal = raw_rewards if args.loss_type == "no_baseline" else advantages
            has_signal = ranks.any_true(args.kl_coef > 0 or not args.skip_zero_signal or bool(signal.abs().max() > 0))
            started = time.perf_counter()
            scoring = {"chunk_size": args.logprob_chunk_size, "temperature": args.scoring_temperature, "compute_dtype": dtype, "pack": args.pack_sequences,
                       "token_budget": args.microbatch_tokens}
            if has_signal and reference_model is not None:
                batch["ref_log_probs"] = score_with(reference_model, batch, args.train_mini_batch_size, main_device, **scoring)
            if has_signal and args.loss_type == "grpo_clip" and args.old_policy == "rollout" and not single_step_per_batch and not ahead:  # (ahead: the sampler's are the old)
                batch["old_log_probs"] = score_with(model, batch, args.train_mini_batch_size, main_device, **scoring)
            timings["logprobs"] = time.perf_counter() - started

            # 6. policy-gradient update: log-probs, loss, backward, clip, step
            started = time.perf_counter()
            if has_signal:
                totals = reduce_totals(update_policy(model, optimizer, scheduler, batch, rank_args, main_device, compute_dtype=dtype, ranks=ranks, step=step), ranks)
            else:
                totals = empty_totals()
                progress["zero_signal_batches"] += 1
                say(f"step {step}: every group has equal rewards, no learning signal; update skipped", flush=True)
            timings["update"] = time.perf_counter() - started
            totals["staleness"] = staleness
            if totals["optimizer_steps"]:
                progress["policy_version"] += 1
                if ahead:  # queued behind the batches sent ahead: they keep the weights they were sent with
                    started = time.perf_counter()
                    engine.load_weights(ranks.full_weights(model))
                    sampler_version = progress["policy_version"]
                    timings["sync"] += time.perf_counter() - started
            progress["skipped_steps"] += totals["skipped_steps"]
            skipped_in_a_row = skipped_in_a_row + 1 if totals["skipped_steps"] and not totals["optimizer_steps"] else 0
            if skipped_in_a_row >= args.max_skipped_steps:
                raise UserError(
                    f"{skipped_in_a_row} optimizer steps in a row had a non-finite loss or gradient (step {step}); "
                    f"stopped with the last good weights untouched ({args.checkpoint_path} / {args.state_dir}); lower --learning_rate or check the data"
                )

            # 7. periodic evaluation
            timings["eval"] = 0.0
            if args.evaluate_freq and step % args.evaluate_freq == 0:
                started = time.perf_counter()
                eval_metrics, synced = evaluate_policy(args, engine, model, tokenizer, eval_set, writer, step, ranks, sampler_start)
                if synced:
                    sampler_version = progress["policy_version"]
                timings["eval"] = time.perf_counter() - started

            timings["step"] = time.perf_counter() - step_started
            if ranks.is_main:
                _log_step(writer, args, progress, total_steps, reward_meta, totals, timings, generated_tokens, scheduler.get_last_lr()[0], total_peak)

            stopping = ranks.any_true(stop.received is not None)
            if args.save_state_every and (step % args.save_state_every == 0 or stopping):
                model_state, optimizer_state = ranks.full_state_dict_on_main(model), ranks.optimizer_state_on_main(model, optimizer)
                if ranks.is_main:
                    save_training_state(args.state_dir, model, tokenizer, model_state, optimizer_state, scheduler, progress, run)
                    print(f"saved training state at step {step} to {args.state_dir}", flush=True)
                ranks.barrier()
            if stopping:
                writer.close()
                saved = (f"the training state of step {step} is in {args.state_dir}; continue with:\n  {resume_command(None)}"
                         if args.save_state_every else "no training state was saved (--save_state_every 0), so a rerun starts over")
                raise RunStopped(f"stopped by {stop.name} after step {step}: {saved}", stop.exit_code)
            if step >= total_steps:
                break
        if progress["batch_in_epoch"] == steps_per_epoch:
            # a full pass over the data: save the policy (seed), start the next epoch
            save_policy(ranks, model, tokenizer, args.checkpoint_path)
            say(f"epoch {progress['epoch']} done: saved policy to {args.checkpoint_path}")
            progress["epoch"] += 1
            progress["batch_in_epoch"] = 0

    step = progress["step"]
    if not (args.evaluate_freq and step % args.evaluate_freq == 0):
        eval_metrics, _ = evaluate_policy(args, engine, model, tokenizer, eval_set, writer, step, ranks, sampler_start)
    if progress["batch_in_epoch"]:  # stopped mid-epoch (--max_steps): save what we have
        save_policy(ranks, model, tokenizer, args.checkpoint_path)
        say(f"saved RL checkpoint to {args.checkpoint_path}")
    if ranks.is_main:
        run_dir = Path(args.log_dir) / args.run_name
        write_jsonl(run_dir / "final_eval_samples.jsonl", eval_metrics.get("samples", []))
        write_json(run_dir / "final_eval_metrics.json", {**{k: v for k, v in eval_metrics.items() if k != "samples"}, "step": step, "skipped_steps": progress["skipped_steps"]})
        remove_output(args.state_dir)  # finished: the final checkpoint is the result
    eval_metrics.pop("samples", None)
    writer.close()
    engine.close()
    ranks.close()
    return eval_metrics


def _trim_jsonl(log: Path, last_step: int, say) -> None:
    """Keep a per-step log's lines up to `last_step` (they are not run again); a fresh run starts empty.

    A line cut short by a crash (no valid JSON) is dropped with a note, not an error.
    """
    if not last_step:
        log.unlink(missing_ok=True)
        return
    if not log.exists():
        return
    kept, torn = [], 0
    for line in log.read_text(errors="replace").splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            torn += 1
    if torn:
        say(f"note: dropped {torn} unreadable line(s) of {log} (a crash cut them short)")
    log.write_text("".join(line + "\n" for line in kept))


def _log_step(writer, args, progress, total_steps, reward_meta, totals, timings, generated_tokens, learning_rate, total_peak=None):
    """One step's scalars: TensorBoard, a line of steps.jsonl, and every --log_every steps the console."""
    step = progress["step"]
    nan = float("nan")  # what an update did not measure is n/a (not written to TensorBoard)
    microbatches = totals["microbatches"] or nan
    optimizer_steps = totals["optimizer_steps"] or nan
    loss_steps = args.epochs_per_rollout_batch * (args.total_rollouts // args.train_batch_size) if totals["microbatches"] else nan
    scalars = {
        "train/reward": reward_meta["reward_mean"],
        "train/format_reward": reward_meta["format_reward_mean"],
        "train/answer_reward": reward_meta["answer_reward_mean"],
        "train/reward_std": reward_meta["reward_std"],
        "train/fraction_groups_all_equal": reward_meta["fraction_groups_all_equal"],
        "train/loss": totals["loss"] / loss_steps,
        "train/grad_norm": totals["grad_norm"] / optimizer_steps,
        "train/entropy": totals["entropy"] / microbatches,
        "train/clip_fraction": totals["clip_fraction"] / microbatches,
        "train/kl_ref": totals["kl_ref"] / microbatches,
        # how far the sampler's log-probs of its own tokens are from the trainer's (0 and 1
        # when on-policy; repetition penalty, top_p, a lagging sampler or bf16 kernels move them)
        "train/sampler_logprob_abs_diff": totals["sampler_abs_diff"] / (totals["sampler_tokens"] or nan),
        "train/sampler_importance_ratio": totals["sampler_ratio"] / (totals["sampler_tokens"] or nan),
        "train/sampler_importance_ratio_max": totals["sampler_ratio_max"] if totals["sampler_tokens"] else nan,
        # with --rollout_staleness: updates between the weights that sampled the batch and the policy,
        # and the share of tokens whose importance weight was capped at --tis_cap
        "train/staleness": totals.get("staleness", 0),
        "train/tis_capped_fraction": totals["tis_capped"] / totals["sampler_tokens"] if args.rollout_staleness and totals["sampler_tokens"] else nan,
        "train/response_length": generated_tokens / args.total_rollouts,
        "train/lr": learning_rate,
        "train/skipped_steps": progress["skipped_steps"],
        "train/zero_signal_batches": progress["zero_signal_batches"],
        "perf/rollout_tokens_per_s": generated_tokens / max(timings["rollout"], 1e-9),
        "perf/train_tokens_per_s": totals["tokens"] / max(timings["update"], 1e-9),
        "perf/step_seconds": timings["step"],
        # the update's model FLOPs over the policy GPUs' bf16 peak (n/a on a CPU unless --peak_tflops)
        "perf/mfu": totals["flops"] / max(timings["update"], 1e-9) / total_peak if total_peak and totals["flops"] else nan,
        # this process's high-water mark over its GPUs (an in-process vLLM's KV cache included)
        "perf/peak_memory_gib": max((torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())), default=nan) / 2**30,
    }
    for key in ("rollout", "reward", "logprobs", "update", "sync", "eval"):
        scalars[f"perf/{key}_seconds"] = timings[key]
    for key in ("sampler_generate", "sampler_load"):  # with --rollout_staleness (sampler_process.py)
        scalars[f"perf/{key}_seconds"] = timings.get(key, nan)
    for key, value in scalars.items():
        if not math.isnan(value):
            writer.add_scalar(key, value, step)
    with open(Path(args.log_dir) / args.run_name / "steps.jsonl", "a") as handle:
        handle.write(json.dumps({"step": step, **{k: (None if math.isnan(v) else v) for k, v in scalars.items()}}) + "\n")
    if step % args.log_every == 0 or step == total_steps:
        gap, mfu = scalars["train/sampler_logprob_abs_diff"], scalars["perf/mfu"]
        parts = [
            f"step {step}/{total_steps}", f"reward {scalars['train/reward']:.3f}", f"format {scalars['train/format_reward']:.3f}",
            f"answer {scalars['train/answer_reward']:.3f}", f"loss {scalars['train/loss']:+.4f}", f"kl {scalars['train/kl_ref']:.4f}",
            f"clip {scalars['train/clip_fraction']:.3f}",
            "" if math.isnan(gap) else f"sampler_gap {gap:.4f}",  # measured on some steps (--sampler_logprobs_every)
            f"resp_tokens {scalars['train/response_length']:.0f}", f"rollout_tok/s {scalars['perf/rollout_tokens_per_s']:.0f}",
            f"train_tok/s {scalars['perf/train_tokens_per_s']:.0f}",
            "" if math.isnan(mfu) else f"mfu {mfu:.1%}",  # needs a known GPU or --peak_tflops
            f"{timings['step']:.1f}s",
            f"skipped {progress['skipped_steps']}" if progress["skipped_steps"] else "",
        ]
        print(" ".join(part for part in parts if part), flush=True)


# ----------------------------------------------------------------- entry


def evaluate_only(args) -> dict:
    """The seed's rule: an existing RL checkpoint is evaluated, never retrained."""
    print(f"{args.checkpoint_path} already holds weights: evaluating it (no training)")
    device = args.eval_device if args.layout == "explicit" else resolve_role_devices(args, 1)["eval"]
    dtype = resolve_dtype(args.dtype, device)
    engine = build_engine(args.rollout_backend, args.checkpoint_path, device, dtype, args.seed, args)
    eval_set = Gsm8kDataset(args.eval_split, args.data_dir, limit=args.eval_num_examples)
    torch.manual_seed(args.seed)
    metrics = evaluate_math(engine, r1_zero_reward_fn, eval_set.prompts, eval_set.ground_truths, SamplingSettings.from_args(args, "eval_"))
    engine.close()
    run_dir = Path(args.log_dir) / args.run_name
    write_jsonl(run_dir / "eval_only_samples.jsonl", metrics.pop("samples"))
    write_json(run_dir / "eval_only_metrics.json", {**metrics, "checkpoint_path": str(args.checkpoint_path)})
    writer = SummaryWriter(str(run_dir))
    for key in ("avg_all_rewards", "format_reward", "answer_reward", "mean_response_tokens"):
        writer.add_scalar(f"eval_only/{key}", metrics[key], 0)
    writer.close()
    print(format_metrics_table(metrics, f"{args.checkpoint_path} on {args.eval_split}"))
    return metrics


def main(argv=None) -> dict:
    args = parse_rl_args(argv)
    sft_args = build_sft_parser().parse_args([])  # the seed parses both; RL starts where SFT saved
    base_model_checkpoint_path = args.sft_checkpoint_path or sft_args.checkpoint_path
    run_dir = Path(args.log_dir) / args.run_name
    for path in (args.checkpoint_path, args.state_dir):
        recover_checkpoint(path)
    writes = os.environ.get("RANK", "0") == "0"  # under torchrun rank 0 alone writes
    if has_training_state(args.state_dir) and not args.resume:
        # never discard an unfinished run without a word: hours of GPU time may be in it
        then = f"evaluate {args.checkpoint_path}" if has_weights(args.checkpoint_path) else "start over from the SFT checkpoint"
        raise UserError(f"{args.state_dir} holds the training state of an unfinished run (step {state_step(args.state_dir)}); "
                        f"pass --resume to continue it, or remove {args.state_dir} to {then}")
    if has_weights(args.checkpoint_path) and not has_training_state(args.state_dir):
        # the seed's rule: an existing RL checkpoint is evaluated, never retrained (a finished
        # run removes its training state, so only an interrupted one trains past a checkpoint)
        check_checkpoint(args.checkpoint_path, "--checkpoint_path", "remove it to train again")
        check_saved_model(args.checkpoint_path, f"the checkpoint cannot be evaluated; remove {args.checkpoint_path} to train again")
        check_writable(run_dir, "--log_dir")
        with OutputLock([(run_dir, "--log_dir/--run_name")] if writes else []):
            return evaluate_only(args)
    check_checkpoint(base_model_checkpoint_path, "--sft_checkpoint_path", "run `python -m alignment.train_sft` first or pass --sft_checkpoint_path")
    if not Path(base_model_checkpoint_path).is_dir():
        raise UserError(f"--sft_checkpoint_path {base_model_checkpoint_path} must be a local folder (train_rl reads its config and loads it into vLLM)")
    context = model_context_length(base_model_checkpoint_path)
    for flag in ("sampling_max_tokens", "eval_max_tokens"):
        if context and getattr(args, flag) >= context:
            raise UserError(f"--{flag} {getattr(args, flag)} leaves no room for the prompt in the model's {context}-token context; lower it")
    # every output is ours (or new) and writable, before anything loads (checkpoint.py)
    outputs = [(args.checkpoint_path, "--checkpoint_path"), (args.state_dir, "--state_dir")]
    if args.eval_engine == "fresh":
        outputs.append((args.tmp_checkpoint_path, "--tmp_checkpoint_path"))
    for path, flag in outputs:
        check_output_path(path, flag)
    check_writable(run_dir, "--log_dir")
    if args.resume and has_training_state(args.state_dir):
        changed = check_resume_flags(read_manifest(args.state_dir).get("run", {}), args, file_sha256(split_path(args.data_dir, "train")))
        for line in changed:
            print(f"resume: {line} takes effect")
    with OutputLock([*outputs, (run_dir, "--log_dir/--run_name")] if writes else []), StopOnSignal() as stop:
        return train(args, base_model_checkpoint_path, stop)


if __name__ == "__main__":
    run_cli(main)
