"""The policy-gradient update on one rollout batch, and the fixed log-prob passes.

`update_policy` runs the microbatches of each optimizer step through
`grpo_microbatch_train_step` (alignment/grpo.py), clips, and steps; `score_with` gives
the frozen reference's (or the pre-update policy's) per-token log-probs;
`old_policy_log_probs` says which log-probs a ratio loss (grpo_clip, gspo, cispo)
compares against. The
settings come in one frozen `UpdateSettings`, built once from the flags. Used by
train_rl and by the benchmarks, which time exactly this code.
"""

from dataclasses import dataclass, fields

import torch

from alignment import distributed, packing
from alignment.devices import place_model
from alignment.errors import UserError
from alignment.flops import update_flops
from alignment.fused_logprobs import use_compiled_chunk_math
from alignment.grpo import LOSSES, grpo_microbatch_train_step, mismatch_weights
from alignment.optim import skip_schedule_steps
from alignment.precision import autocast
from alignment.rollout import load_hf_model
from alignment.sft_helpers import chunks, get_response_log_probs, microbatches


def prepare_policy(model, speed: dict, gradient_checkpointing: bool, main_device, layer_devices, ranks, compute_dtype) -> None:
    """Make the policy (loaded on the CPU) trainable where it trains, in place.

    `speed` says whether to compile (each decoder layer, and the output layer's softmax math)
    and to pack microbatches (resolve_speed_flags); then FSDP2 shards it over the ranks, or
    the seed's layer partition places it (`layer_devices`, one per decoder layer).
    """
    if speed["pack_sequences"]:
        packing.require_support(main_device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    use_compiled_chunk_math(speed["torch_compile"])  # process-wide: set for this run whichever way, never left over from another
    if speed["torch_compile"]:
        compile_layers(model)
    if ranks.world_size > 1:
        model.to(main_device)
        distributed.shard_policy(model, compute_dtype=compute_dtype)
    else:
        place_model(model, main_device, layer_devices)  # the seed's partition_model_across_devices
    model.config.use_cache = False
    model.train()


def load_reference(path, device, dtype, torch_compile: bool):
    """The frozen reference model (forward only, no gradients), compiled like the policy."""
    reference = load_hf_model(path, device, dtype).eval().requires_grad_(False)
    if torch_compile:
        compile_layers(reference)
    return reference


def compile_layers(model) -> None:
    for layer in model.model.layers:  # one graph for all layers; dynamic: widths vary per microbatch
        layer.compile(dynamic=True)


@dataclass(frozen=True)
class UpdateSettings:
    """What `update_policy` needs from the flags (train_rl's --help says what each does)."""

    loss_type: str = "grpo_clip"
    old_policy: str = "rollout"
    epochs_per_rollout_batch: int = 1
    train_batch_size: int = 8  # sequences per optimizer step (this rank's share under FSDP)
    train_mini_batch_size: int = 8  # rows per microbatch, when not cut by tokens
    microbatch_tokens: int = 0
    pack_sequences: bool = False
    logprob_chunk_size: int = 1024
    scoring_temperature: float = 1.0
    cliprange: float = 0.2
    cliprange_high: float = 0.2
    length_normalization: str = "mean"
    length_normalization_constant: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in: str = "loss"  # "reward": train_rl took the KL from the rewards, the loss has none
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    one_step_off: bool = False  # --rollout_staleness > 0: rollouts from an older policy, corrected with the sampler's log-probs
    tis_cap: float = 2.0
    mismatch_correction: str = "tis"
    seed: int = 0

    @classmethod
    def from_args(cls, args, world_size: int = 1, pack_sequences: bool | None = None) -> "UpdateSettings":
        """The flags' values; under FSDP each of `world_size` ranks takes an equal share of an
        optimizer step's sequences (each rank averages over its own; FSDP averages the ranks).
        `pack_sequences`: the value resolved for this device when the flag was left at auto."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values["one_step_off"] = bool(getattr(args, "rollout_staleness", 0))
        values["pack_sequences"] = bool(values.get("pack_sequences") if pack_sequences is None else pack_sequences)
        values["train_batch_size"] = args.train_batch_size // world_size
        return cls(**values)

    def scoring_options(self, compute_dtype) -> dict:
        """`score_with`'s keyword arguments: the reference and old-policy passes score as the update does."""
        return {"chunk_size": self.logprob_chunk_size, "temperature": self.scoring_temperature, "compute_dtype": compute_dtype,
                "pack": self.pack_sequences, "token_budget": self.microbatch_tokens}


def old_policy_log_probs(settings: UpdateSettings, log_probs, ref_log_probs=None, sampler_log_probs=None, stored_old_log_probs=None):
    """The log-probs the ratio of grpo_clip, gspo and cispo compares the policy against (None for the other losses).

    - `--old_policy reference` (the seed): the frozen start checkpoint's, `ref_log_probs`;
    - one step off (--rollout_staleness): the sampler's own, the policy that sampled the batch;
    - more than one optimizer step on a batch: `stored_old_log_probs`, the pre-update policy's,
      scored once before the first step (train_rl's `score_with` pass);
    - one optimizer step on fresh rollouts (the default): the policy's own, detached, since
      the policy that sampled the batch is this one (ratio 1, no extra forward).
    """
    if not LOSSES[settings.loss_type].ratio:
        return None
    if settings.old_policy == "reference":
        return ref_log_probs
    if sampler_log_probs is not None:
        return sampler_log_probs
    if stored_old_log_probs is not None:
        return stored_old_log_probs
    return log_probs.detach()


def needs_old_policy_pass(settings: UpdateSettings, optimizer_steps: int) -> bool:
    """Whether a ratio loss (grpo_clip, gspo, cispo) needs the pre-update policy scored before the
    update: more than one optimizer step on the batch (`optimizer_steps`, args.optimizer_steps_per_batch: the same on
    every rank, where `settings` holds one rank's share of the batch), the ratio against the sampling policy, in sync."""
    return LOSSES[settings.loss_type].ratio and settings.old_policy == "rollout" and optimizer_steps > 1 and not settings.one_step_off


@torch.no_grad()
def score_with(model, batch, rows_per_chunk, main_device, chunk_size, temperature=1.0, compute_dtype=torch.float32, pack=False, token_budget=0):
    """(N, T) log-probs of every rollout under `model`, no grad, kept on the CPU.

    Used for the frozen reference model (on its own device: only the (B, T)
    result moves, never logits) and for the pre-update policy. `temperature`
    divides the logits (the sampler's temperature, as in the update); the forward
    runs under autocast to `compute_dtype`, like the training forward. `pack`: each
    chunk's rows run as one padding-free sequence (--pack_sequences); `token_budget`:
    chunks cut by computed tokens instead of `rows_per_chunk` (--microbatch_tokens).
    """
    device = model.get_input_embeddings().weight.device
    result = torch.zeros(batch["labels"].shape, dtype=torch.float32)
    by_length = sorted(range(result.shape[0]), key=lambda row: batch["lengths"][row])  # less padding per chunk
    # no_grad, not inference_mode: under FSDP2 the policy's unshard buffers would become
    # inference tensors, and the next training forward fails writing into them
    with autocast(str(device), compute_dtype):
        for rows in microbatches(by_length, batch["lengths"], rows_per_chunk, token_budget, pack):
            width = max(batch["lengths"][row] for row in rows)
            log_probs = get_response_log_probs(model, batch["input_ids"][rows, :width].to(device), batch["labels"][rows, :width].to(device),
                                               chunk_size=chunk_size, temperature=temperature, positions=batch["response_mask"][rows, :width],
                                               lengths=[batch["lengths"][row] for row in rows] if pack else None)["log_probs"]
            result[rows, :width] = log_probs.float().cpu()
    return result


def update_policy(model, optimizer, scheduler, batch, settings: UpdateSettings, main_device, compute_dtype=torch.float32, sort_by_length=True,
                  ranks=distributed.SingleProcess(), step=0):
    """All optimizer steps for one rollout batch; returns summed metrics.

    `batch` holds (N, T) input_ids / labels / response_mask / ref_log_probs and
    (N,) raw_rewards and advantages for the N rollouts, plus old_log_probs when
    a ratio loss needs them from a separate pass, and with --overlong mask (N,)
    `in_loss` (False: the row's loss is masked out). Microbatches of
    `train_mini_batch_size` rows are accumulated into optimizer steps of
    `train_batch_size`, for `epochs_per_rollout_batch` passes. Rows are
    length-sorted within each optimizer step so microbatches carry little padding
    (equal-size microbatches: the summed gradient does not depend on the order;
    the benchmarks pass sort_by_length=False to measure what it saves; with
    `pack_sequences` each microbatch's rows run as one padding-free sequence, same
    rows and loss, no padding computed at all; with `microbatch_tokens` the
    microbatches are cut by computed tokens instead of rows). Each microbatch's mean
    loss is weighted by its share of the step's rows, so the loss is the mean over
    the step. With more than one pass the rows are shuffled per pass, seeded by
    (seed, `step`).

    Forward passes run under autocast to `compute_dtype` (bf16 compute on fp32
    master weights); the loss and backward run outside it. Log-probs are scored
    at `scoring_temperature`. When `batch` holds the sampler's own
    `sampler_log_probs`, the rows of the first optimizer step (scored before any
    update, so by the weights that sampled them when the sampler is in sync) also
    give the sampler/trainer mismatch: summed |trainer - sampler| log-prob and
    importance ratio exp(trainer - sampler), their max, and the token count.
    `flops` counts the model FLOPs the update needed (alignment/flops.py), for MFU.
    """
    n_rollouts = batch["input_ids"].shape[0]
    lengths = batch["lengths"]
    totals = empty_totals()
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)  # a new order for every rollout batch
    # rollouts from an older policy (one step off): corrected with the sampler's log-probs
    behaviour = "sampler_log_probs" in batch and settings.one_step_off
    # per-microbatch metrics stay on the device and are read once at the end: a read
    # (.item()) would stall the host until the GPU drains, every microbatch
    keys = ("loss", "entropy", "clip_fraction", "kl_ref") + (("mismatch_masked",) if behaviour and settings.mismatch_correction != "tis" else ()) + (
        ("entropy_bonus",) if settings.entropy_coef else ())
    sums = {key: torch.zeros((), device=main_device) for key in keys}
    sums["mismatch"] = None  # the sampler/trainer gap: device-side sums, read once at the end
    for epoch in range(settings.epochs_per_rollout_batch):
        order = torch.randperm(n_rollouts, generator=generator).tolist() if settings.epochs_per_rollout_batch > 1 else list(range(n_rollouts))
        for step_rows in chunks(order, settings.train_batch_size):
            if sort_by_length:
                step_rows = sorted(step_rows, key=lambda row: lengths[row])
            finite = torch.ones((), dtype=torch.bool, device=main_device)
            step_microbatches = microbatches(step_rows, lengths, settings.train_mini_batch_size, settings.microbatch_tokens, settings.pack_sequences)
            first_step = epoch == 0 and totals["optimizer_steps"] + totals["skipped_steps"] == 0
            constant = normalize_constant(settings, batch, step_rows, ranks)
            for index, rows in enumerate(step_microbatches):
                if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: reduce gradients once per step
                    model.set_requires_gradient_sync(index == len(step_microbatches) - 1)
                finite &= _train_microbatch(model, batch, rows, len(step_rows), settings, main_device, compute_dtype, behaviour, first_step, sums, totals,
                                            constant)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
            if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
                grad_norm = grad_norm.full_tensor()
            # every rank must agree, or the shards would step apart
            if ranks.all_true(bool(finite & torch.isfinite(grad_norm))):  # the one host read per optimizer step
                optimizer.step()
                check_weights_finite(model, optimizer, ranks, step)
                scheduler.step()
                totals["grad_norm"] += grad_norm.item()
                totals["optimizer_steps"] += 1
                totals["skipped_since_last_step"] = 0
            else:
                totals["skipped_steps"] += 1  # never write NaN/inf into the weights
                totals["skipped_since_last_step"] += 1  # --max_skipped_steps counts them in a row, across batches too
                skip_schedule_steps(scheduler, 1)  # the rate stays on its plan
            optimizer.zero_grad(set_to_none=True)
    mismatch = sums.pop("mismatch")
    totals.update({key: totals.get(key, 0.0) + value.item() for key, value in sums.items()})
    if "entropy_bonus" in totals:  # reduce_totals averages the default keys only
        totals["entropy_bonus"] = ranks.mean(totals["entropy_bonus"])
    if mismatch is not None:
        totals.update(zip(("sampler_abs_diff", "sampler_ratio", "sampler_ratio_max", "sampler_tokens", "tis_capped"), (value.item() for value in mismatch)))
    return totals


def normalize_constant(settings: UpdateSettings, batch, step_rows, ranks) -> float:
    """What each response's summed token loss is divided by (`grpo_microbatch_train_step`).

    constant: --length_normalization_constant; token_mean (DAPO): the optimizer step's
    response tokens in the loss over its sequences, averaged over the FSDP ranks (each
    holds an equal share of the step), so that the step's loss is its summed token
    loss over its token count. Unused by mean."""
    if settings.length_normalization != "token_mean":
        return settings.length_normalization_constant
    return max(ranks.mean(float(_loss_mask(batch, step_rows, batch["response_mask"][step_rows]).sum())), 1.0) / len(step_rows)


def _loss_mask(batch, rows, mask):
    """`mask` (the rows' response tokens) less the rows --overlong mask keeps out of the loss
    (DAPO: a truncated response carries no loss; entropy and the mismatch stay measured on it)."""
    return mask & batch["in_loss"][rows, None].to(mask.device) if "in_loss" in batch else mask


def check_weights_finite(model, optimizer, ranks, step: int) -> None:
    """After an optimizer step: every weight is finite, or the run stops here, before anything saves them.

    A finite gradient can still make a weight non-finite (an absurd --learning_rate or --weight_decay):
    saved into a training state, such weights would poison every --resume. One fused norm per
    parameter list and one host read (~2 ms for 1.5B on an H200)."""
    parameters = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # FSDP2: this rank's shards
    norms = torch._foreach_norm([p.detach() for p in parameters if p.numel()])
    finite = bool(torch.isfinite(torch.stack([n.float() for n in norms])).all()) if norms else True
    if not ranks.all_true(finite):
        group = optimizer.param_groups[0]
        raise UserError(f"the optimizer step of rollout step {step} made the policy's weights non-finite (--learning_rate {group['lr']:g}, "
                        f"--weight_decay {group.get('weight_decay', 0):g}); stopped before saving them, so the last saved training state "
                        "and checkpoint are as they were; lower --learning_rate / --weight_decay and start again or --resume")


def _train_microbatch(model, batch, rows, step_size, settings: UpdateSettings, main_device, compute_dtype, behaviour, first_step, sums, totals,
                      constant):
    """Forward, loss and backward of one microbatch of `rows` (out of `step_size` in its optimizer step).

    `constant`: the step's `normalize_constant` (--length_normalization constant / token_mean).
    Adds its metrics to `sums` (device tensors) and `totals`; returns whether its loss was finite.
    `behaviour`: one step off, the sampler's log-probs correct the loss (--mismatch_correction).
    """
    lengths = batch["lengths"]
    width = max(lengths[row] for row in rows)
    cpu_mask = batch["response_mask"][rows, :width]
    input_ids, labels = (batch[key][rows, :width].to(main_device) for key in ("input_ids", "labels"))
    mask = cpu_mask.to(main_device)
    ref = batch["ref_log_probs"][rows, :width].to(main_device) if "ref_log_probs" in batch else None
    with autocast(main_device, compute_dtype):  # --entropy_coef: the bonus needs an entropy with a gradient (the full-vocabulary path)
        out = get_response_log_probs(model, input_ids, labels, return_token_entropy=True, chunk_size=settings.logprob_chunk_size,
                                     temperature=settings.scoring_temperature, positions=cpu_mask,
                                     lengths=[lengths[row] for row in rows] if settings.pack_sequences else None, entropy_grad=bool(settings.entropy_coef))
    log_probs = out["log_probs"]
    sampler = batch["sampler_log_probs"][rows, :width].to(log_probs.device) if "sampler_log_probs" in batch else None
    if sampler is not None and first_step:
        sums["mismatch"] = _add_mismatch(sums["mismatch"], log_probs.detach(), sampler, mask, settings.tis_cap if behaviour else float("inf"))
    sampled = torch.where(mask.bool(), sampler, log_probs.detach()) if behaviour else None  # finite off the response
    stored_old = batch["old_log_probs"][rows, :width].to(main_device) if "old_log_probs" in batch else None
    old = old_policy_log_probs(settings, log_probs, ref, sampled, stored_old)
    loss_mask = _loss_mask(batch, rows, mask)
    token_count = mask.sum().clamp(min=1)
    if sampled is None or settings.mismatch_correction == "tis":
        # truncated importance sampling for the other losses: weight min(pi / pi_sampler, cap) per token (no gradient)
        importance = torch.exp(log_probs.detach() - sampled).clamp(max=settings.tis_cap) if sampled is not None and old is None else None
    else:  # masks (and for the REINFORCE losses weights) from the sampler/trainer ratio; a ratio loss has it in its ratio
        importance = mismatch_weights(log_probs.detach(), sampled, mask, settings.mismatch_correction, settings.tis_cap, reweight=old is None)
        sums["mismatch_masked"] += ((importance == 0) & mask.bool()).sum() / token_count
    entropy = out["token_entropy"]
    loss, meta = grpo_microbatch_train_step(
        log_probs, loss_mask, step_size / len(rows), settings.loss_type,
        raw_rewards=batch["raw_rewards"][rows, None].to(main_device),
        advantages=batch["advantages"][rows, None].to(main_device),
        old_log_probs=old, cliprange=settings.cliprange, cliprange_high=settings.cliprange_high,
        length_normalization=settings.length_normalization, normalize_constant=constant,
        kl_coef=settings.kl_coef if settings.kl_in == "loss" else 0.0, ref_log_probs=ref, importance_weights=importance,
        kl_estimator=settings.kl_estimator, entropy_coef=settings.entropy_coef, token_entropy=entropy if settings.entropy_coef else None,
    )
    sums["loss"] += loss.detach()
    sums["entropy"] += ((entropy.detach() if settings.entropy_coef else entropy) * mask).sum() / token_count
    sums["clip_fraction"] += meta["clip_fraction"] if "clip_fraction" in meta else 0.0
    sums["kl_ref"] += meta["kl"] if "kl" in meta else float("nan")
    if settings.entropy_coef:
        sums["entropy_bonus"] += meta["entropy_bonus"]
    totals["tokens"] += sum(lengths[row] for row in rows)
    totals["flops"] += update_flops(model.config, [lengths[row] for row in rows], cpu_mask.sum(-1).tolist())
    totals["microbatches"] += 1
    return torch.isfinite(loss)


def _add_mismatch(sums, trainer, sampler, mask, cap=float("inf")):
    """Running (sum |trainer - sampler|, sum ratio, max ratio, tokens, tokens with ratio > cap) over response tokens."""
    mask = mask.bool() & ~torch.isnan(sampler)  # rows the sampler did not score are NaN
    difference = (trainer - sampler)[mask]
    ratio = torch.exp(difference)
    step = (difference.abs().sum(), ratio.sum(), ratio.max() if ratio.numel() else ratio.new_zeros(()), mask.sum().to(ratio.dtype), (ratio > cap).sum().to(ratio.dtype))
    if sums is None:
        return step
    return (sums[0] + step[0], sums[1] + step[1], torch.maximum(sums[2], step[2]), sums[3] + step[3], sums[4] + step[4])


def empty_totals() -> dict:
    return {"loss": 0.0, "entropy": 0.0, "clip_fraction": 0.0, "kl_ref": 0.0, "grad_norm": 0.0, "tokens": 0, "flops": 0.0, "optimizer_steps": 0, "skipped_steps": 0, "skipped_since_last_step": 0, "microbatches": 0,
            "sampler_abs_diff": 0.0, "sampler_ratio": 0.0, "sampler_ratio_max": 0.0, "sampler_tokens": 0.0, "tis_capped": 0.0}


def sequence_lengths(mask) -> list[int]:
    """Length of each right-padded row up to its last response token (for trimming)."""
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
    return (last + 1).clamp(min=1).tolist()
