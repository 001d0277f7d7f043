"""Supervised fine-tuning on GSM8K r1_zero completions; produces RL's base policy.

    python -m alignment.train_sft --model Qwen/Qwen2.5-Math-1.5B --checkpoint_path checkpoints/sft

Loss: negative log-likelihood of the completion tokens only (prompt masked), summed
per sequence and divided by `--normalize_constant` (CS336 convention), averaged
over the batch, accumulated over microbatches (--microbatch_size rows, or as many
length-sorted rows as fit --microbatch_tokens padded tokens: the same gradient, less
padding when lengths differ). AdamW, clip 1.0, warm-up then
cosine. fp32 master weights with bf16 compute on GPU (--no-fp32_master_weights:
pure bf16, where AdamW at lr 2e-5 keeps only about a quarter of its updates),
fp32 on CPU. The checkpoint is an ordinary Hugging Face
folder written atomically; `train_rl` starts from it.

TensorBoard (runs/<run_name>/): train/loss, train/nll_per_token, train/lr,
train/grad_norm, train/tokens_per_s, eval/*. A rerun under the same --run_name replaces
the earlier run's curves there, as it replaces the checkpoint (the earlier event files stay).
"""

import random
import time
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from alignment.args import check_checkpoint, parse_sft_args
from alignment.checkpoint import (OutputLock, check_distinct_outputs, check_output_path, check_saved_model, check_sft_log_folder, check_start_kept, check_writable,
                                  claim_log_folder, read_manifest, real_output_path, record_sft_log_folder, recover_checkpoint, save_model_atomically, start_model_name, unfinished_runs_from)
from alignment.data import Gsm8kDataset, check_held_out, split_path
from alignment.devices import resolve_device, resolve_dtype
from alignment.drgrpo_grader import r1_zero_reward_fn
from alignment.errors import RunStopped, UserError, run_cli
from alignment.interrupts import StopOnSignal
from alignment.evaluate import evaluate_math
from alignment.optim import build_optimizer, build_scheduler
from alignment.precision import autocast, master_dtype
from alignment.precision import describe as describe_precision
from alignment.rollout import HfEngine, SamplingSettings, check_model_folder, load_hf_model, load_tokenizer
from alignment.sft_helpers import get_response_log_probs, microbatches, sft_microbatch_train_step, tokenize_prompt_and_output


def evaluate_sft(model, tokenizer, args, writer, step, dataset) -> dict:
    engine = HfEngine(model, tokenizer, batch_size=64, compute_dtype=resolve_dtype(args.dtype, resolve_device(args.device)))
    sampling = SamplingSettings(temperature=0.0, max_tokens=args.eval_max_tokens, repetition_penalty=1.0)
    metrics = evaluate_math(engine, r1_zero_reward_fn, dataset.prompts, dataset.ground_truths, sampling)
    for key in ("avg_all_rewards", "format_reward", "answer_reward", "mean_response_tokens"):
        writer.add_scalar(f"eval/{key}", metrics[key], step)
    print(f"eval step {step}: accuracy {metrics['avg_all_rewards']:.3f} format {metrics['format_reward']:.3f} ({metrics['num_examples']} examples)")
    return metrics


def open_log(run_dir: Path) -> SummaryWriter:
    """TensorBoard writer for this run. SFT replaces its checkpoint, so a rerun replaces the
    earlier run's curves too: its events are hidden from step 0 on (purge_step), not mixed
    with this run's; their files stay on disk. A rerun that ends before it saves its checkpoint
    gives them back (set_aside_unsaved_curves). (Another checkpoint's curves are refused before:
    check_sft_log_folder.)"""
    earlier = sorted(run_dir.glob("events.out.tfevents.*"))
    if earlier:
        print(f"{run_dir}: TensorBoard shows this run's curves in place of the earlier SFT run's ({len(earlier)} event file(s), kept on disk)")
    return SummaryWriter(str(run_dir), purge_step=0 if earlier else None)


def set_aside_unsaved_curves(run_dir: Path, earlier: set[Path]) -> None:
    """A rerun that stopped or failed before saving left the earlier run's checkpoint in place, and its event
    file's purge still hid that checkpoint's curves: its files move into a subfolder of their own (a run of
    their own in TensorBoard), and the earlier curves show again."""
    unsaved = sorted(set(run_dir.glob("events.out.tfevents.*")) - earlier)
    if not unsaved:
        return
    aside = run_dir / f"unsaved_rerun_{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(exist_ok=True)
    for path in unsaved:
        path.rename(aside / path.name)
    print(f"{run_dir}: this SFT run saved no checkpoint, so TensorBoard shows the earlier run's curves again; this run's are in {aside}")


def train(args, stop: StopOnSignal) -> dict:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)  # compute dtype
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    dataset = Gsm8kDataset("train", args.data_dir, limit=args.num_train_examples)
    # read now: a bad row fails before the model loads, not after training (--eval_num_examples 0: no SFT-time evaluation)
    eval_set = Gsm8kDataset("test", args.data_dir, limit=args.eval_num_examples) if args.eval_num_examples else None
    if split_path(args.data_dir, "test").is_file():  # the whole test split: the SFT checkpoint is graded on it later
        check_held_out(dataset, Gsm8kDataset("test", args.data_dir))
    writer = open_log(Path(args.log_dir) / args.run_name)
    tokenizer = load_tokenizer(args.model, "--model")
    model = load_hf_model(args.model, device, master_dtype(dtype, args.fp32_master_weights))
    print(f"precision: {describe_precision(master_dtype(dtype, args.fp32_master_weights), dtype)}")
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()

    lengths = [len(ids) for ids in tokenizer([p + c for p, c in zip(dataset.prompts, dataset.completions)])["input_ids"]]
    examples = [i for i, n in enumerate(lengths) if n <= args.max_seq_len]
    if len(examples) < len(dataset):
        print(f"dropped {len(dataset) - len(examples)} examples longer than --max_seq_len {args.max_seq_len}")
    if len(examples) < args.batch_size:
        raise UserError(f"--batch_size {args.batch_size} exceeds the {len(examples)} usable training examples")
    steps_per_epoch = len(examples) // args.batch_size
    total_steps = min(args.max_steps or steps_per_epoch * args.num_epochs, steps_per_epoch * args.num_epochs)

    optimizer = build_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = build_scheduler(optimizer, args.warmup_steps, total_steps, args.lr_schedule)
    order_rng = random.Random(args.seed)
    stop = stop or StopOnSignal()
    step, metrics = 0, {}
    progress = tqdm(total=total_steps, desc="sft", unit="step", dynamic_ncols=True)
    for epoch in range(args.num_epochs):
        order = examples[:]
        order_rng.shuffle(order)
        for batch_start in range(0, steps_per_epoch * args.batch_size, args.batch_size):
            if step >= total_steps:
                break
            started = time.perf_counter()
            # sort the step's examples by length so microbatches carry little padding; each
            # microbatch's mean is weighted by its share of the step, so the gradient is the sum
            # over the step's examples / batch_size however they are cut (rows or --microbatch_tokens)
            batch = sorted(order[batch_start : batch_start + args.batch_size], key=lambda i: lengths[i])
            loss_total, nll_total, token_total = 0.0, 0.0, 0
            for indices in microbatches(batch, lengths, args.microbatch_size, args.microbatch_tokens):
                tokens = tokenize_prompt_and_output([dataset.prompts[i] for i in indices], [dataset.completions[i] for i in indices], tokenizer)
                input_ids, labels, mask = (tokens[k].to(device) for k in ("input_ids", "labels", "response_mask"))
                positions = tokens["response_mask"]  # the prompt is not scored (on the CPU: no device sync)
                with autocast(device, dtype):
                    log_probs = get_response_log_probs(model, input_ids, labels, chunk_size=args.logprob_chunk_size, positions=positions)["log_probs"]
                loss, meta = sft_microbatch_train_step(log_probs, mask, args.batch_size / len(indices), args.normalize_constant)
                loss_total += loss.item()
                nll_total += -(log_probs.detach() * mask).sum().item()
                token_total += int(meta["num_response_tokens"])
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            seconds = time.perf_counter() - started
            scalars = {
                "train/loss": loss_total,
                "train/nll_per_token": nll_total / max(token_total, 1),
                "train/lr": scheduler.get_last_lr()[0],
                "train/grad_norm": grad_norm,
                "train/tokens_per_s": token_total / seconds,
            }
            for key, value in scalars.items():
                writer.add_scalar(key, value, step)
            progress.update(1)
            if step % args.log_every == 0 or step == total_steps:
                tqdm.write(
                    f"step {step}/{total_steps} epoch {epoch} loss {loss_total:.4f} nll/token {scalars['train/nll_per_token']:.4f} "
                    f"lr {scalars['train/lr']:.2e} grad_norm {grad_norm:.3f} tokens/s {scalars['train/tokens_per_s']:.0f}"
                )
            if args.eval_every and step % args.eval_every == 0 and step < total_steps:
                evaluate_sft(model, tokenizer, args, writer, step, eval_set)
            if stop.received is not None and step < total_steps:
                writer.close()
                raise RunStopped(f"stopped by {stop.name} after SFT step {step}: SFT keeps no resumable state and nothing was written to "
                                 f"{args.checkpoint_path}; rerun the same command to train again", stop.exit_code)
    progress.close()
    # saved before the final evaluation: a trained model is kept whatever happens during it
    save_model_atomically(model, tokenizer, args.checkpoint_path, "sft_checkpoint", record={"start_model": start_model_name(args.model)})
    print(f"saved SFT checkpoint to {args.checkpoint_path}")
    if stop.received is not None:
        writer.close()
        raise RunStopped(f"stopped by {stop.name} in the last SFT step ({step}): the trained model is saved to {args.checkpoint_path}; "
                         f"its final evaluation did not run (python -m alignment.evaluate --model_path {args.checkpoint_path})", stop.exit_code)
    metrics = evaluate_sft(model, tokenizer, args, writer, step, eval_set) if eval_set is not None else {}
    writer.close()
    if eval_set is None:
        print(f"not evaluated (--eval_num_examples 0): python -m alignment.evaluate --model_path {args.checkpoint_path}")
    metrics.pop("samples", None)
    return metrics


def main(argv=None) -> dict:
    args = parse_sft_args(argv)
    args.checkpoint_path = real_output_path(args.checkpoint_path, "--checkpoint_path")  # a save swaps the folder in by renaming
    check_checkpoint(args.model, "--model", "pass a local checkpoint folder or a hub id such as Qwen/Qwen2.5-Math-1.5B")
    run_dir = f"{args.log_dir}/{args.run_name}"
    check_distinct_outputs([(args.checkpoint_path, "--checkpoint_path"), (run_dir, "--log_dir/--run_name")])
    check_start_kept(args.model, "--model", args.checkpoint_path, "--checkpoint_path")
    check_saved_model(args.model, "SFT cannot start from it; restore it or pass another --model")
    check_model_folder(args.model, "--model")
    check_writable(Path(args.checkpoint_path).parent, "--checkpoint_path", args.checkpoint_path)
    check_writable(run_dir, "--log_dir")
    with OutputLock([(args.checkpoint_path, "--checkpoint_path"), (run_dir, "--log_dir/--run_name")]), StopOnSignal() as stop:
        recover_checkpoint(args.checkpoint_path)  # under the lock: no other run is writing there
        check_output_path(args.checkpoint_path, "--checkpoint_path", "sft_checkpoint")  # ours (an SFT checkpoint), empty or new; writable
        unfinished = unfinished_runs_from(args.checkpoint_path)
        if unfinished:  # an RL run that resumes needs the start it trained from
            state_dir, step = unfinished[0]
            raise UserError(f"--checkpoint_path {args.checkpoint_path} is the start of an unfinished RL run (its training state {state_dir}, step {step}), "
                            f"which cannot resume from another start checkpoint: finish it first (train_rl --resume), remove {state_dir}, "
                            f"or pass another --checkpoint_path")
        check_sft_log_folder(run_dir, args.checkpoint_path)  # the curves a rerun hides are the replaced checkpoint's only
        claim_log_folder(run_dir, "--log_dir/--run_name")
        record_sft_log_folder(run_dir, args.checkpoint_path)
        earlier, saved = set(Path(run_dir).glob("events.out.tfevents.*")), read_manifest(args.checkpoint_path)
        try:
            return train(args, stop)
        except BaseException:
            if earlier and read_manifest(args.checkpoint_path) == saved:  # the earlier checkpoint stays: so do its curves
                set_aside_unsaved_curves(Path(run_dir), earlier)
            raise


if __name__ == "__main__":
    run_cli(main)
