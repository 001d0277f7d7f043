"""Does training learn at RL learning rates? The demo's task on a GPU, one SFT, several RL runs.

    python bench/bench_learning.py                       # one H200: 5 RL runs side by side on one GPU (~3 minutes)
    python bench/bench_learning.py --device cpu --steps 2 --variants lr1e-5_fp32_master   # smoke

The demo's synthetic task and tiny model (alignment/toy/demo.py), one SFT checkpoint,
then `python -m alignment.train_rl` with the demo's RL flags, changing only the
learning rate and the precision, all runs at once on the same GPU (the model is
tiny; each run's vLLM engine takes a small slice of the memory). Held-out accuracy
(200 problems, greedy) at steps 10 / 20 / 30 / 40 is read from each run's log.

The SFT stage runs with --no-fp32_master_weights by default: that reproduces the
SFT checkpoint the issue's "before" table started from (pure bf16, as every GPU
run did before fp32 master weights; its lr of 1e-3 survives bf16 rounding).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from common import REPO_ROOT

from alignment.toy.demo import CONFIG

MARKER = "bench_learning.json"  # in --out: the folder is this benchmark's (older calls' folders hold sft.json)

# name -> the flags that differ from the demo's RL flags
VARIANTS = {
    "lr1e-5_fp32_master": ["--learning_rate", "1e-5"],
    "lr1e-5_pure_bf16": ["--learning_rate", "1e-5", "--no-fp32_master_weights"],
    "lr2e-6_fp32_master": ["--learning_rate", "2e-6"],
    "lr2e-6_pure_bf16": ["--learning_rate", "2e-6", "--no-fp32_master_weights"],
    "lr1e-5_all_fp32": ["--learning_rate", "1e-5", "--dtype", "float32"],
    # the demo's own RL flags (lr 5e-5), fp32 master weights, on the plain path (eager, padded rows);
    # then the same with the fast update path (learning_h200_fast_path.json)
    "demo": ["--no-torch_compile"],
    "demo_fast": ["--pack_sequences", "--microbatch_tokens", "8192", "--torch_compile"],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (all runs share cuda:0) or cpu")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sft_flags", default="--no-fp32_master_weights", help="extra train_sft flags")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench" / "learning"))
    args = parser.parse_args()

    from alignment.toy.synthetic_task import tokenizer_corpus, write_synthetic_gsm8k
    from alignment.toy.tiny_model import build_tiny_checkpoint, r1_zero_whole_tokens

    out = Path(args.out)
    names = args.variants.split(",")
    if unknown := [name for name in names if name not in VARIANTS]:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    # a variant's folders from an earlier call: train_rl would only evaluate its checkpoint, and this call's row replace that run's
    if found := [str(path) for name in names for path in (out / name, out / "runs" / name) if path.exists()]:
        raise SystemExit(f"--out {out}: {', '.join(found[:3])} already there (an earlier call's runs); pass a new --out, or move them away")
    made = json.loads((out / "sft.json").read_text()) if (out / "sft.json").is_file() else None
    if (out / "sft" / "config.json").is_file() and made != {**(made or {}), "seed": args.seed, "sft_flags": args.sft_flags}:
        raise SystemExit(f"--out {out}: its SFT checkpoint was made with {made and {k: made[k] for k in ('seed', 'sft_flags')} or 'settings it does not record'}, "
                         f"this call asks for --seed {args.seed} --sft_flags {args.sft_flags!r} (its data and base model too): pass a new --out")
    # its data and base model are written afresh into <out>/data and <out>/base: never over a folder of the user's
    if out.is_dir() and (held := sorted(path.name for path in out.iterdir())) and not any((out / name).is_file() for name in (MARKER, "sft.json")):
        raise SystemExit(f"--out {out} holds files this benchmark did not write ({', '.join(held[:3])}{' ...' if len(held) > 3 else ''}); "
                         "its synthetic data and tiny base model would replace any there: pass a new or empty --out (nothing was changed)")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(json.dumps({"written_by": "bench/bench_learning.py"}) + "\n")
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    started = time.perf_counter()
    data = write_synthetic_gsm8k(out / "data", seed=args.seed, **CONFIG["task"])
    base = build_tiny_checkpoint(out / "base", texts=tokenizer_corpus(data), seed=args.seed, whole_tokens=r1_zero_whole_tokens(), **CONFIG["model"])
    common = ["--data_dir", str(data), "--seed", str(args.seed)]
    sft = out / "sft"
    if not (sft / "config.json").is_file():
        command = [sys.executable, "-m", "alignment.train_sft", "--model", str(base), "--checkpoint_path", str(sft), "--log_dir", str(out / "runs"),
                   "--run_name", "sft", *CONFIG["sft"], *common, *args.sft_flags.split()]
        with open(out / "sft.log", "w") as log:
            subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        made = {"seed": args.seed, "sft_flags": args.sft_flags, "sft_seconds": time.perf_counter() - started}
        (out / "sft.json").write_text(json.dumps(made) + "\n")
    sft_seconds = made["sft_seconds"]  # a reused checkpoint's own time, not the time it took to find it
    sft_accuracy = re.findall(r"eval step \d+: accuracy ([\d.]+)", (out / "sft.log").read_text())
    print(f"SFT checkpoint {sft} ({sft_seconds:.0f}s); SFT-time greedy accuracy {sft_accuracy[-1] if sft_accuracy else '?'}", flush=True)

    per_engine = f"{0.5 / len(names):.3f}"
    processes = {}
    for name in names:
        command = [
            sys.executable, "-m", "alignment.train_rl", "--sft_checkpoint_path", str(sft), "--checkpoint_path", str(out / name / "rl"),
            "--log_dir", str(out / "runs"), "--run_name", name, "--layout", "auto", "--rollout_backend", "vllm",
            "--vllm_enforce_eager", "--vllm_gpu_memory_utilization", per_engine, "--vllm_kv_cache_gb", "0.5",
            *CONFIG["rl"], *common, "--max_steps", str(args.steps), *VARIANTS[name],
        ]
        log = open(out / f"{name}.log", "w")
        processes[name] = (subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log, time.perf_counter())
        # one engine start at a time: vLLM sizes its KV cache from the GPU memory it sees
        # during start-up, and engines profiling at once counted each other's memory (five at
        # once on an H200: two failed with "No available memory for the cache blocks")
        deadline = time.time() + 600
        while processes[name][0].poll() is None and "started in" not in (out / f"{name}.log").read_text() and time.time() < deadline:
            time.sleep(2)
    rows = []
    for name, (process, log, begun) in processes.items():
        code = process.wait()
        log.close()
        text = (out / f"{name}.log").read_text()
        accuracy = {int(step): float(value) for step, value in re.findall(r"eval step (\d+): accuracy ([\d.]+)", text)}
        rows.append({"variant": name, "flags": " ".join(VARIANTS[name]), "steps": args.steps, "exit": code, "minutes": (time.perf_counter() - begun) / 60, "accuracy_by_step": accuracy})
        print(f"{name:<22} exit {code}  " + " / ".join(f"{accuracy[s]:.3f}" if s in accuracy else "-" for s in sorted(accuracy)), flush=True)
    earlier = json.loads((out / "learning.json").read_text())["rows"] if (out / "learning.json").is_file() else []
    rows = [row for row in earlier if row["variant"] not in names] + rows  # an earlier call's variants stay (they ran from this SFT)
    summary = {"sft_seconds": sft_seconds, "sft_flags": args.sft_flags, "rl_flags": CONFIG["rl"], "steps": args.steps, "rows": rows,
               "minutes_total": (time.perf_counter() - started) / 60}
    (out / "learning.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
