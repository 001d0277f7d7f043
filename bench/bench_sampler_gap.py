"""Where the sampler/trainer log-prob gap on identical weights comes from.

    python bench/bench_sampler_gap.py --model models/qwen15 --device cpu --dtype float32
    python bench/bench_sampler_gap.py --model models/qwen15 --device cuda:0 --dtype bfloat16
    python bench/bench_sampler_gap.py --device cpu --tiny          # smoke run on a random tiny model

train_rl logs `train/sampler_logprob_abs_diff` on step 1, when vLLM and the policy hold the
same weights: the mean |sampler - trainer| log-prob of the sampled tokens. One vLLM engine
samples r1_zero prompts at temperature 1 with each --penalties value and returns its
processed log-probs (after the repetition penalty, as train_rl asks for them); the
policy, loaded as train_rl loads it (fp32 weights, --dtype compute under autocast),
scores the same token ids twice:
- `raw`: as train_rl's update does (the model's own distribution);
- `penalised`: with vLLM's repetition penalty applied to its logits first (a token seen in
  the prompt or earlier in the response has its logit divided by the penalty when positive,
  multiplied when negative), i.e. the distribution the sampler drew from.
If `penalised` is near zero where `raw` is not, the penalty is the gap; what `penalised`
keeps is the two engines' numerics (bf16 rounding, kernels). The output layer and the
embeddings vLLM holds are compared with the checkpoint's too (an untied lm_head that one
side replaced by the embeddings would show here).
"""

import argparse

import torch
from common import REPO_ROOT, build_checkpoint, gsm8k_questions, write_result

from alignment.data import format_r1_zero_prompt
from alignment.policy_update import score_with, sequence_lengths
from alignment.rollout import SamplingSettings, VllmEngine, load_hf_model, load_tokenizer
from alignment.sft_helpers import tokenize_rollout_ids


def penalised_log_probs(model, batch, penalty: float, compute_dtype) -> torch.Tensor:
    """(B, T) log-probs of the labels under vLLM's repetition penalty over prompt + earlier response tokens.

    Full-vocabulary logits, one row at a time (the reference path: no chunking)."""
    result = torch.zeros(batch["labels"].shape)
    device = model.get_input_embeddings().weight.device
    for row in range(batch["labels"].shape[0]):
        width = batch["lengths"][row]
        ids = batch["input_ids"][row, :width].to(device)
        with torch.no_grad(), torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            logits = model(input_ids=ids[None]).logits[0].float()
        # position t predicts token t + 1 and has seen tokens 0..t (the prompt and the response so far)
        first = torch.full((logits.shape[-1],), width, dtype=torch.long, device=device)
        first.scatter_reduce_(0, ids, torch.arange(width, device=device), reduce="amin")
        seen = first[None, :] <= torch.arange(width, device=device)[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, batch["labels"][row, :width, None].to(device)).squeeze(-1)
        result[row, :width] = log_probs.cpu()
    return result


def gap(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> dict:
    """Mean |difference|, mean difference and max ratio exp(trainer - sampler) over the response tokens."""
    valid = mask & ~torch.isnan(sampler)
    difference = (trainer - sampler)[valid]
    return {"abs_diff": difference.abs().mean().item(), "mean_diff": difference.mean().item(), "ratio_max": difference.exp().max().item(),
            "tokens": int(valid.sum())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="an HF folder (default: bench/common.py's random model; --tiny: a tiny one)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="vLLM's dtype and the policy's compute dtype (weights stay fp32)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--num_prompts", type=int, default=32)
    parser.add_argument("--max_tokens", type=int, default=256)
    parser.add_argument("--penalties", type=float, nargs="+", default=[1.0, 1.1])
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench"))
    args = parser.parse_args()

    model_path = args.model or build_checkpoint(REPO_ROOT / "runs" / "bench" / ("model_tiny" if args.tiny else "model"), args.tiny)
    compute_dtype = getattr(torch, args.dtype)
    engine = VllmEngine(model_path, args.device, dtype=args.dtype, seed=0, kv_cache_gb=1.0, max_model_len=2048,
                        gpu_memory_utilization=None if args.device == "cpu" else 0.5)
    tokenizer = load_tokenizer(model_path)
    policy = load_hf_model(model_path, args.device, torch.float32)
    rows = [{"row": "setup", "model": str(model_path), "device": args.device, "dtype": args.dtype}]

    held = engine.llm.apply_model(lambda model: {name: tensor.detach().float().cpu() for name, tensor in model.named_parameters()
                                                 if name in ("lm_head.weight", "model.embed_tokens.weight")})[0]
    own = dict(policy.named_parameters())
    for name, tensor in held.items():
        reference = own[name].detach().float().cpu()
        rows.append({"row": f"vllm {name} vs checkpoint", "max_abs_diff": (tensor[: reference.shape[0]] - reference).abs().max().item(),
                     "tied_in_vllm": bool(name == "lm_head.weight" and torch.equal(tensor, held.get("model.embed_tokens.weight", tensor[:0])))})
        write_result(args.out, f"sampler_gap_{args.dtype}", rows)

    prompts = [format_r1_zero_prompt(q) for q in gsm8k_questions()[: args.num_prompts]]
    for penalty in args.penalties:
        sampling = SamplingSettings(temperature=1.0, top_p=1.0, min_tokens=4, max_tokens=args.max_tokens, repetition_penalty=penalty, log_probs=True)
        generations = engine.generate(prompts, sampling)
        batch = tokenize_rollout_ids(prompts, [g.token_ids for g in generations], tokenizer, [g.log_probs for g in generations])
        batch["lengths"] = sequence_lengths(batch["response_mask"])
        raw = score_with(policy, batch, 8, args.device, chunk_size=1024, compute_dtype=compute_dtype)
        mask = batch["response_mask"]
        rows.append({"row": f"penalty {penalty:g}, trainer raw (train_rl's update)", **gap(raw, batch["sampler_log_probs"], mask)})
        write_result(args.out, f"sampler_gap_{args.dtype}", rows)
        penalised = penalised_log_probs(policy, batch, penalty, compute_dtype)
        rows.append({"row": f"penalty {penalty:g}, trainer with the penalty", **gap(penalised, batch["sampler_log_probs"], mask)})
        write_result(args.out, f"sampler_gap_{args.dtype}", rows)
    engine.close()


if __name__ == "__main__":
    main()
