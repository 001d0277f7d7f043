"""How fast is the r1_zero grader? Per-call latency, hostile worst case, batch throughput.

    python bench/bench_grader.py                 # full run, about a minute on 2 CPUs
    python bench/bench_grader.py --quick         # a few seconds
    python bench/bench_grader.py --out runs/bench/grader.json --data_dir data/gsm8k

Sections:
- gsm8k_gold / gsm8k_off_by_one: per-call ms on the SFT gold completions (and the same
  with the answer off by one), the path every GSM8K rollout takes;
- math_style: per-call ms on harder MATH-style pairs (fractions, surds, tuples,
  intervals, percentages...), with the parse cache cleared before every call, so each
  call pays for sympy as a fresh answer would;
- hostile: the slowest single call over power towers, deep nesting, 1 MB strings...;
- batch: seconds to grade 2,048 rollouts serially and with worker processes (the first
  worker call includes starting the pool).
"""

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from alignment import drgrpo_grader
from alignment.drgrpo_grader import grade_responses, r1_zero_reward_fn

REPO_ROOT = Path(__file__).resolve().parents[1]

SPLITS = ("train", "test")  # alignment.data's; it imports torch, which spawned workers need not

# (model answer, ground truth): correct and wrong pairs of the kinds MATH answers take.
MATH_STYLE_PAIRS = [
    ("\\frac{1}{2}", "0.5"), ("\\dfrac{3}{4}", "0.75"), ("1/3", "\\frac{1}{3}"), ("0.333333", "\\frac{1}{3}"),
    ("\\sqrt{2}", "\\sqrt2"), ("1.414", "\\sqrt{2}"), ("2\\sqrt{3}", "\\sqrt{12}"), ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}"),
    ("x=3", "3"), ("y = -2", "-2"), ("50\\%", "50"), ("12.5\\%", "0.125"), ("30^\\circ", "30"), ("45^{\\circ}", "45"),
    ("\\text{(A)}", "A"), ("(B)", "A"), ("(1, 2)", "(1,2)"), ("(2,1)", "(1,2)"), ("[1,2)", "[1, 2)"), ("[1,2]", "[1,2)"),
    ("(-\\infty, 3]", "(-\\infty,3]"), ("\\{1,2,3\\}", "\\{3,2,1\\}"), ("\\pi", "\\pi"), ("3.14", "\\pi"),
    ("\\frac{\\pi}{2}", "\\frac12\\pi"), ("(x+1)^2", "x^2+2x+1"), ("2x+1", "(x+1)^2"), ("10^{3}", "1000"),
    ("\\frac{5}{2}", "2.5"), ("-\\frac{7}{3}", "-\\frac{14}{6}"), ("\\left( 3, -4 \\right)", "(3,-4)"), ("\\$18.50", "18.5"),
    ("2^{10}", "1024"), ("\\sqrt[3]{27}", "3"), ("\\frac{1+\\sqrt{5}}{2}", "\\frac{\\sqrt{5}+1}{2}"), ("e^{i\\pi}", "-1"),
]

HOSTILE_ANSWERS = {
    "power-tower": "10^{10^{10^{10}}}",
    "nine-tower": "9^{9^{9^9}}",
    "python-power": "9**9**9**9",
    "bracketed-power": "(10^{99})^{99}",
    "huge-exponent": "10^{10000000}",
    "factorial": "100000!",
    "deep-parens": "(" * 5000 + "1" + ")" * 5000,
    "deep-frac": "\\frac{" * 2000 + "1",
    "open-braces": "{" * 100_000,
    "many-boxes": "\\boxed{" * 5000,
    "megabyte-text": "x" * 1_000_000,
    "megabyte-digits": "1" * 1_000_000,
    "nul-bytes": "1\x008\x00",
    "nested-sqrt": "\\sqrt{" * 200 + "2" + "}" * 200,
    "long-polynomial": "+".join(f"x^{{{k}}}" for k in range(60)),
    "factorial-power": "(748!+i)^{717+e}",
    "slow-expand": "\\frac{(x+i)^{152\\cdot 3}}{7!}",  # passes the size guard; only the time limit stops it
}


def respond(answer: str) -> str:
    return f" some reasoning </think> <answer> {answer} </answer>"


def find_gsm8k_dir(explicit: str | None) -> Path | None:
    for candidate in (explicit, os.environ.get("GSM8K_DIR"), REPO_ROOT / "data" / "gsm8k"):
        if candidate and all((Path(candidate) / f"{split}.jsonl").is_file() for split in SPLITS):
            return Path(candidate)
    return None


def latency_ms(pairs, clear_cache: bool = False) -> dict:
    """Median / p99 / max milliseconds of single `r1_zero_reward_fn` calls over `pairs`."""
    times = []
    for response, truth in pairs:
        if clear_cache:
            drgrpo_grader._parse_whole.cache_clear()
        start = time.perf_counter()
        r1_zero_reward_fn(response, truth)
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return {
        "calls": len(times),
        "median_ms": round(statistics.median(times), 4),
        "p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 4),
        "max_ms": round(times[-1], 4),
    }


def math_style_rollouts(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """Distinct MATH-style (response, truth) pairs, so worker caches cannot hide the parse cost."""
    rng = random.Random(seed)
    rollouts = []
    for _ in range(count):
        a, b = rng.randint(1, 99), rng.randint(2, 99)
        template = rng.randrange(6)
        if template == 0:
            answer, truth = f"\\frac{{{a}}}{{{b}}}", f"{a / b:.12g}" if rng.random() < 0.5 else f"{a}/{b}"
        elif template == 1:
            answer, truth = f"{a}\\sqrt{{{b}}}", f"\\sqrt{{{a * a * b}}}"
        elif template == 2:
            answer, truth = f"({a}, {b})", f"({a},{b + rng.randint(0, 1)})"
        elif template == 3:
            answer, truth = f"x = {a}", str(a + rng.randint(0, 1))
        elif template == 4:
            answer, truth = f"{a}\\%", f"{a / 100}"
        else:
            answer, truth = f"[{a}, {a + b})", f"[{a},{a + b})"
        rollouts.append((respond(answer), truth))
    return rollouts


def batch_seconds(responses, truths, num_workers: int) -> float:
    start = time.perf_counter()
    grade_responses(responses, truths, num_workers=num_workers)
    return round(time.perf_counter() - start, 4)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Benchmark alignment/drgrpo_grader.py")
    parser.add_argument("--out", default="runs/bench/grader.json", help="where the JSON results go (a folder: its grader.json)")
    parser.add_argument("--data_dir", default=None, help="GSM8K folder (default: $GSM8K_DIR, then data/gsm8k)")
    parser.add_argument("--quick", action="store_true", help="small samples: a few seconds instead of a minute")
    parser.add_argument("--batch_size", type=int, default=2048, help="rollouts per batch in the throughput test")
    parser.add_argument("--num_workers", type=int, default=None, help="worker processes for the batch test (default: CPUs, at most 8)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.is_dir():  # a folder, as the other benchmarks' --out (runs/bench): the results go into it
        out = out / "grader.json"
    if out.parent.exists() and not out.parent.is_dir():
        raise SystemExit(f"--out {args.out}: {out.parent} is a file, not a folder; pass a .json path or a folder")
    batch_size = 256 if args.quick else args.batch_size
    num_workers = args.num_workers or min(drgrpo_grader._available_cpus(), 8)
    results = {"quick": args.quick, "cpus": drgrpo_grader._available_cpus(), "num_workers": num_workers}
    # Workers only help when CPUs are free: record how busy the machine was.
    results["load_average_1min_before"] = round(os.getloadavg()[0], 2)

    r1_zero_reward_fn(respond("\\frac{1}{2}"), "0.5")  # one-off imports and parser warm-up, not charged below

    data_dir = find_gsm8k_dir(args.data_dir)
    gold = []
    if data_dir is None:
        print("gsm8k: no data found (set GSM8K_DIR or run `python -m alignment.data download`); skipped")
    else:
        from alignment.data import Gsm8kDataset

        for split in SPLITS:
            dataset = Gsm8kDataset(split, data_dir)
            gold += zip(dataset.completions, dataset.ground_truths)
        gold = gold[:1000] if args.quick else gold
        off_by_one = [(c.rpartition("<answer>")[0] + f"<answer> {int(t) + 1} </answer>", t) for c, t in gold]
        results["gsm8k_gold"] = latency_ms(gold)
        results["gsm8k_off_by_one"] = latency_ms(off_by_one)

    repeats = 1 if args.quick else 5
    results["math_style"] = latency_ms([(respond(a), t) for a, t in MATH_STYLE_PAIRS] * repeats, clear_cache=True)

    worst = {}
    for name, answer in HOSTILE_ANSWERS.items():
        for response, truth in ((respond(answer), "18"), (respond("18"), answer)):
            start = time.perf_counter()
            r1_zero_reward_fn(response, truth)
            worst[name] = max(worst.get(name, 0.0), (time.perf_counter() - start) * 1000)
    slowest = max(worst, key=worst.get)
    results["hostile"] = {"worst_ms": round(worst[slowest], 2), "worst_input": slowest, "per_input_ms": {k: round(v, 2) for k, v in worst.items()}}

    batches = {}
    if gold:
        batches["gsm8k"] = [(gold * (batch_size // len(gold) + 1))[:batch_size]]
    batches["math_style"] = [math_style_rollouts(batch_size, seed) for seed in range(3)]
    results["batch"] = {"size": batch_size}
    for name, samples in batches.items():
        drgrpo_grader._parse_whole.cache_clear()
        serial = batch_seconds(*zip(*samples[0]), num_workers=1)
        first = batch_seconds(*zip(*samples[-1]), num_workers=num_workers)  # starts the pool if needed
        warm = batch_seconds(*zip(*samples[1 if len(samples) > 1 else 0]), num_workers=num_workers)
        results["batch"][name] = {
            "serial_s": serial,
            "workers_first_call_s": first,
            "workers_warm_s": warm,
            "serial_rollouts_per_s": round(batch_size / serial),
            "workers_warm_rollouts_per_s": round(batch_size / warm),
        }

    for key in ("gsm8k_gold", "gsm8k_off_by_one", "math_style"):
        if key in results:
            r = results[key]
            print(f"{key:17s} {r['calls']:6d} calls  median {r['median_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  max {r['max_ms']:.3f} ms")
    print(f"hostile           worst {results['hostile']['worst_ms']:.1f} ms ({slowest})")
    for name in batches:
        r = results["batch"][name]
        print(
            f"batch {name:11s} {batch_size} rollouts  serial {r['serial_s']:.3f} s  "
            f"{num_workers} workers {r['workers_warm_s']:.3f} s (first call {r['workers_first_call_s']:.3f} s)"
        )
    results["load_average_1min_after"] = round(os.getloadavg()[0], 2)
    print(f"load average (1 min) before {results['load_average_1min_before']}, after {results['load_average_1min_after']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
