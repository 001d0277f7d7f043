"""The policy update and the log-prob pass, through train_rl's code (bench/RESULTS.md, sections 4 and 5).

    python bench/bench_update.py                        # GPU: Qwen2.5-Math-1.5B shape, bf16
    python bench/bench_update.py --device cpu --tiny    # CI smoke: seconds on a CPU

The policy update: one optimizer step over a GRPO batch of 256 sequences,
prompts from GSM8K (~150 tokens), response lengths 50..1024 (mean ~300), run by
`update_policy` (fwd + bwd + AdamW). Each row: tokens/s (real tokens,
padding excluded), MFU against the bf16 matmul rate measured in the same call,
peak memory, and the share of computed positions that were padding.
The log-prob pass: `score_with`, forward only, as for the
reference model or the old policy.
"""

import argparse
import copy
from pathlib import Path

from common import REPO_ROOT, build_checkpoint, matmul_ceiling_tflops, synthetic_grpo_batch, timed, write_result

import torch  # noqa: E402

from alignment.flops import update_flops  # noqa: E402
from alignment.fused_logprobs import use_compiled_chunk_math  # noqa: E402
from alignment.optim import build_optimizer, build_scheduler  # noqa: E402
from alignment.policy_update import UpdateSettings, score_with, update_policy  # noqa: E402
from alignment.rollout import load_hf_model, load_tokenizer  # noqa: E402
from alignment.sft_helpers import microbatches  # noqa: E402


def update_args(microbatch: int, chunk_size: int, batch_size: int, packed: bool = False, budget: int = 0) -> UpdateSettings:
    """train_rl's defaults (grpo_clip, one optimizer step per batch) with this variant's microbatches."""
    return UpdateSettings(train_batch_size=batch_size, train_mini_batch_size=microbatch, logprob_chunk_size=chunk_size, pack_sequences=packed,
                          microbatch_tokens=budget)


def cut(lengths: list[int], microbatch: int, sort: bool, budget: int, packed: bool) -> tuple[int, int]:
    """(microbatches, positions computed) of one update over rows of `lengths`, cut as update_policy cuts them."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__) if sort else list(range(len(lengths)))
    groups = microbatches(order, lengths, microbatch, budget, packed)
    return len(groups), sum(sum(lengths[row] for row in rows) if packed else len(rows) * max(lengths[row] for row in rows) for rows in groups)


def profile_update(step, device: str, path: Path) -> None:
    """One update under torch.profiler: self time by op, device kernels first, as a text table."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        step()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
    sort_key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_key, row_limit=60, max_name_column_width=90)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table)
    print(f"profile of one update: {path}\n" + "\n".join(table.splitlines()[:30]), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tiny", action="store_true", help="2-layer model, short sequences: a CPU smoke run")
    parser.add_argument("--checkpoint", default=None, help="model folder (built on first use); default runs/bench/model[_tiny]")
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shape", choices=["mix", "w1"], default="mix",
                        help="mix: responses of 50..1024 tokens (the realistic mix); w1: every response 256 tokens (W1's update, bench_step.py)")
    parser.add_argument("--variants", default=None, help="comma-separated subset of variant names")
    parser.add_argument("--logprob_variants", default=None, help="comma-separated subset of the log-prob pass variants")
    parser.add_argument("--pure_bf16", action="store_true", help="bf16 weights and AdamW state (train_rl --no-fp32_master_weights); default fp32 master weights, bf16 compute")
    parser.add_argument("--profile", default=None, metavar="VARIANT",
                        help="after timing, run one more update of this variant under torch.profiler and write the kernel time by op to update_profile.txt")
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench"))
    args = parser.parse_args()

    device = args.device
    checkpoint = build_checkpoint(args.checkpoint or REPO_ROOT / "runs" / "bench" / ("model_tiny" if args.tiny else "model"), args.tiny)
    tokenizer = load_tokenizer(checkpoint)
    compute_dtype = torch.float32 if device == "cpu" else torch.bfloat16
    base = load_hf_model(checkpoint, device, compute_dtype if args.pure_bf16 else torch.float32)
    config = base.config
    batch = synthetic_grpo_batch(tokenizer, args.batch_size, seed=0, tiny=args.tiny, response_length=256 if args.shape == "w1" and not args.tiny else None)
    lengths = batch["lengths"]
    real_tokens = sum(lengths)
    needed_flops = update_flops(config, lengths, batch["response_mask"].sum(-1).tolist())  # MFU's numerator (alignment/flops.py)
    ceiling = matmul_ceiling_tflops(device)
    print(f"device {device} | bf16 matmul ceiling {ceiling:.0f} TFLOP/s | {args.batch_size} sequences, {real_tokens} tokens, "
          f"mean length {real_tokens / len(lengths):.0f} (mean prompt {sum(batch['prompt_lengths']) / len(lengths):.0f})", flush=True)

    # name: (microbatch, fused chunk size (0 = naive), length-sorted, gradient checkpointing, torch.compile, packed rows, token budget)
    variants = {
        "naive_unsorted_mb8": (8, 0, False, False, False, False, 0),
        "fused_unsorted_mb8": (8, 1024, False, False, False, False, 0),
        "fused_sorted_mb8": (8, 1024, True, False, False, False, 0),
        "fused_sorted_mb16": (16, 1024, True, False, False, False, 0),
        "fused_sorted_mb32": (32, 1024, True, False, False, False, 0),
        "fused_sorted_mb64_ckpt": (64, 1024, True, True, False, False, 0),
        "fused_sorted_mb16_compile": (16, 1024, True, False, True, False, 0),
        "fused_sorted_mb32_compile": (32, 1024, True, False, True, False, 0),
        "fused_sorted_tok32k_compile": (32, 1024, True, False, True, False, 32768),  # --microbatch_tokens: rows x width <= 32k
        "packed_mb16": (16, 1024, True, False, False, True, 0),  # --pack_sequences: no padding computed
        "packed_mb32_compile": (32, 1024, True, False, True, True, 0),
        "packed_mb64_compile": (64, 1024, True, False, True, True, 0),
        "packed_tok24k_compile": (32, 1024, True, False, True, True, 24576),  # --pack_sequences --microbatch_tokens 24576
        "packed_tok32k_compile": (32, 1024, True, False, True, True, 32768),
        "packed_tok40k_compile": (32, 1024, True, False, True, True, 40960),
    }
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
    rows = []
    result_name = "update" + ("_w1" if args.shape == "w1" else "") + ("_pure_bf16" if args.pure_bf16 else "") + ("_tiny" if args.tiny else "")
    for name, (microbatch, chunk, sort, checkpointing, compiled, packed, budget) in variants.items():
        model = optimizer = None  # free the previous variant's copy before making the next
        model = copy.deepcopy(base)
        model.train()
        model.config.use_cache = False
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if compiled:  # as train_rl --torch_compile does
            for layer in model.model.layers:
                layer.compile(dynamic=True)
        use_compiled_chunk_math(compiled)
        optimizer = build_optimizer(model, 1e-6, 0.0)
        scheduler = build_scheduler(optimizer, 0, 100)
        step_args = update_args(microbatch, chunk, args.batch_size, packed, budget)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            seconds, times = timed(lambda: update_policy(model, optimizer, scheduler, batch, step_args, device, compute_dtype=compute_dtype, sort_by_length=sort), device,
                                   repeats=args.repeats, warmup=2 if compiled else 1)
        except torch.OutOfMemoryError:
            rows.append({"workload": "update", "variant": name, "error": "out of memory"})
            continue
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.startswith("cuda") else float("nan")
        count, computed = cut(lengths, microbatch, sort, budget, packed)
        rows.append({
            "workload": "update", "variant": name, "master_weights": "bf16" if args.pure_bf16 else "fp32", "microbatch": microbatch if not budget else f"{budget} tokens",
            "microbatches": count, "seconds": seconds,
            "tokens_per_s": real_tokens / seconds, "mfu": needed_flops / seconds / 1e12 / ceiling,
            "peak_gib": peak, "padding_share": 1 - real_tokens / computed, "times": times,
        })
        write_result(args.out, result_name, rows)
        if name == args.profile:
            profile_update(lambda: update_policy(model, optimizer, scheduler, batch, step_args, device, compute_dtype=compute_dtype, sort_by_length=sort),
                           device, Path(args.out) / f"{result_name}_profile_{name}.txt")

    use_compiled_chunk_math(False)
    base.eval()  # the frozen reference's scoring pass: bf16 weights, as train_rl holds it
    base.to(compute_dtype)
    compiled_base = None
    # name: (rows per chunk, fused chunk size (0 = naive), packed rows, torch.compile, token budget)
    logprob_variants = {"logprob_naive_mb16": (16, 0, False, False, 0), "logprob_fused_mb32": (32, 1024, False, False, 0),
                        "logprob_fused_mb64": (64, 1024, False, False, 0), "logprob_packed_mb64": (64, 1024, True, False, 0),
                        "logprob_fused_mb64_compile": (64, 1024, False, True, 0), "logprob_packed_mb64_compile": (64, 1024, True, True, 0),
                        "logprob_packed_tok32k_compile": (64, 1024, True, True, 32768), "logprob_packed_tok64k_compile": (64, 1024, True, True, 65536)}
    if args.logprob_variants:
        logprob_variants = {k: v for k, v in logprob_variants.items() if k in args.logprob_variants.split(",")}
    for name, (microbatch, chunk, packed, compiled, budget) in logprob_variants.items():
        if compiled and compiled_base is None:  # as train_rl --torch_compile holds the reference
            compiled_base = copy.deepcopy(base)
            for layer in compiled_base.model.layers:
                layer.compile(dynamic=True)
        scorer = compiled_base if compiled else base
        use_compiled_chunk_math(compiled)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            seconds, times = timed(lambda: score_with(scorer, batch, microbatch, device, chunk, compute_dtype=compute_dtype, pack=packed, token_budget=budget), device,
                                   repeats=args.repeats, warmup=2 if compiled else 1)
        except torch.OutOfMemoryError:
            rows.append({"workload": "logprob", "variant": name, "error": "out of memory"})
            continue
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.startswith("cuda") else float("nan")
        forward_flops = needed_flops / 3  # forward is a third of fwd+bwd
        rows.append({
            "workload": "logprob", "variant": name, "microbatch": microbatch if not budget else f"{budget} tokens", "seconds": seconds,
            "tokens_per_s": real_tokens / seconds, "mfu": forward_flops / seconds / 1e12 / ceiling, "peak_gib": peak, "times": times,
        })
        write_result(args.out, result_name, rows)


if __name__ == "__main__":
    main()
