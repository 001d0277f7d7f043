"""What returning the sampled tokens' log-probs costs a vLLM batch, and where the time goes.

    python bench/bench_sampler_logprobs.py --device cuda:0
    python bench/bench_sampler_logprobs.py --device cpu --tiny --num_prompts 8 --new_tokens 16   # smoke

One compiled engine, W1's batch (256 r1_zero prompts x 256 new tokens, min = max,
temperature 1, top_p 1). Rows (median of 2 after a warm-up), each its output tokens/s:
- none:        no request asks for log-probs (train_rl's default step);
- all:         every request asks for the sampled token's log-prob (logprobs=0, as
               train_rl asks on --sampler_logprobs_every steps and every --rollout_staleness step);
- one_in_16:   only every 16th request asks;
- none_raw / all_raw: the same without detokenisation and stop strings (token ids
               only), which takes the frontend's per-token text work out.
Then a cProfile of one "all" and one "none" batch (the engine runs in this process,
so the profile holds the engine's Python too): the top functions by own time, in
<out>/sampler_logprobs_profile.txt.
"""

import argparse
import cProfile
import io
import os
import pstats

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from common import REPO_ROOT, build_checkpoint, gsm8k_questions, timed, write_result  # noqa: E402

from alignment.data import format_r1_zero_prompt  # noqa: E402
from alignment.rollout import STOP_STRINGS, VllmEngine  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--num_prompts", type=int, default=256)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench"))
    args = parser.parse_args()

    from vllm import SamplingParams

    checkpoint = build_checkpoint(REPO_ROOT / "runs" / "bench" / ("model_tiny" if args.tiny else "model"), args.tiny)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    engine = VllmEngine(checkpoint, args.device, dtype=dtype, seed=0, kv_cache_gb=1.0, max_model_len=2048,
                        gpu_memory_utilization=None if args.device == "cpu" else 0.85)
    prompts = [format_r1_zero_prompt(q) for q in gsm8k_questions()[: args.num_prompts]]

    def params(log_probs: bool, text: bool) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_p=1.0, min_tokens=args.new_tokens, max_tokens=args.new_tokens,
                              stop=list(STOP_STRINGS) if text else None, include_stop_str_in_output=text, detokenize=text,
                              logprobs=0 if log_probs else None)

    variants = {
        "none": [params(False, True)] * len(prompts),
        "all": [params(True, True)] * len(prompts),
        "one_in_16": [params(i % 16 == 0, True) for i in range(len(prompts))],
        "none_raw": [params(False, False)] * len(prompts),
        "all_raw": [params(True, False)] * len(prompts),
    }

    def generate(name):
        with engine._on_device():
            return engine.llm.generate(prompts, variants[name], use_tqdm=False)

    rows = [{"row": "engine_start", "seconds": engine.start_seconds, "device": args.device}]
    tokens = len(prompts) * args.new_tokens
    for name in variants:
        seconds, times = timed(lambda: generate(name), args.device, repeats=2, warmup=1)
        rows.append({"row": name, "seconds": seconds, "output_tokens_per_s": tokens / seconds, "times": times})
        print(rows[-1], flush=True)
        write_result(args.out, "sampler_logprobs", rows)

    report = io.StringIO()
    for name in ("all", "none"):
        profile = cProfile.Profile()
        profile.enable()
        generate(name)
        profile.disable()
        stats = pstats.Stats(profile, stream=report)
        # vLLM's per-token log-prob bookkeeping: how often it ran (the top 30 below may not show it on a loaded CPU)
        bookkeeping = sum(calls for (_, _, function), (_, calls, *_) in stats.stats.items() if function == "_update_sample_logprobs")
        report.write(f"=== {name}: _update_sample_logprobs calls {bookkeeping}; top 30 by own time\n")
        stats.sort_stats("tottime").print_stats(30)
    with open(os.path.join(args.out, "sampler_logprobs_profile.txt"), "w") as handle:
        handle.write(report.getvalue())
    engine.close()


if __name__ == "__main__":
    main()
