"""GSM8K with a real pretrained model, end to end, beside TRL: the recipe and its measurement.

    python bench/bench_gsm8k.py --model models/qwen15 --gpus 0,1     # two GPUs: ours on the first, TRL on the second
    python bench/bench_gsm8k.py --model models/qwen15 --gpus 0       # one GPU: the same stages one after another
    python bench/bench_gsm8k.py --model models/qwen15 --gpus 0 --no-trl
    python bench/bench_gsm8k.py --model models/smol --device cpu --tiny   # smoke run of this script on a CPU
    python bench/bench_gsm8k.py --model models/qwen15 --gpus 0 --no-trl --rl_minutes 4 \
        --variant "seed_penalty=--repetition_penalty 1.1" --variant "grpo_mean=--length_normalization mean --use_std_normalization"

Every stage is the project's own command line, so this file is also the recipe a
user follows by hand (the README's "GSM8K with a pretrained model" lists the same
commands):

1. `alignment.evaluate` the start model on the whole test split (greedy, r1_zero prompt);
2. `alignment.train_sft` on the train split (the seed's stage), then evaluate it the same way;
3. RL starts from the start model itself, and step 2 is skipped (on the 1.5B, over 14.5 training
   minutes on two seeds, RL from the base model ended at 0.688 / 0.722 against RL from SFT's
   0.682 / 0.655, though SFT scores higher at step 0: RESULTS runs 19-21); with
   `--no-rl_from_base`, step 2 runs and RL starts from whichever of the two scored higher
   (ties: SFT, the seed's order);
4. `alignment.train_rl` from there, evaluating on the whole test split every
   --evaluate_freq steps on its synced sampler;
5. TRL's `GRPOTrainer` from the same start with the same settings (bench_trl.py
   --workload gsm8k: same prompts, reward function, group size, prompts per step,
   response cap, temperature, learning rate and schedule, Adam betas, no KL, fp32
   master weights with bf16 autocast, vLLM colocated), its checkpoints evaluated by
   `alignment.evaluate` like ours (one call for all of them: one engine).

With two GPUs, TRL and the base-model evaluation run on the second GPU while ours
runs on the first, each alone on its GPU (the host is shared). Writes
<out>/summary.json, <out>/gsm8k_curves.png and one log per stage.

`--variant NAME=FLAGS` (repeatable) adds RL runs from the same start, one after another
on our GPU, each the recipe's train_rl command with FLAGS appended (argparse keeps a
flag's last value, so FLAGS override the recipe's); `--rl_minutes` ends each RL run at
the step whose training time reaches that many minutes (train_rl's --max_train_minutes:
the run still saves and makes its final evaluation), so a sweep fits a time budget; TRL
gets the same limit (bench_trl.py's --max_train_minutes), and its last round is evaluated too. Every RL run evaluates its start checkpoint as step 0 (`--evaluate_at_start`).
Each run's flags go through train_rl's own checks before any stage runs. In the summary a variant keeps its
name (with `--no-recipe` none stands for the recipe); a run that `--rl_deadline_minutes` stopped is listed in
`stopped_at_deadline` (its curve ends where it was cut, without the final save and evaluation), and a run the
deadline would meet before it starts is not started.
Every evaluation is greedy at the recipe's repetition penalty (train_rl's --eval_repetition_penalty), so a variant
that samples its rollouts with another `--repetition_penalty` is evaluated as the others are.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_trl import earlier_run
from common import REPO_ROOT

from alignment.args import _non_negative_int as non_negative_int
from alignment.args import _positive_int as positive_int
from alignment.checkpoint import read_manifest, same_path, start_model_name
from alignment.plot import read_jsonl, training_minutes

# The RL settings both trainers get (why each, and the runs behind them: bench/RESULTS.md "GSM8K, a real model").
RL = {
    "prompts_per_step": 32,
    "group_size": 8,
    "train_batch_size": 128,  # completions per optimizer step: two steps per rollout batch, the second one clipped
    "max_tokens": 1024,  # the seed's; the start model answers in ~100
    "min_tokens": 4,
    "temperature": 1.0,
    "top_p": 1.0,
    "repetition_penalty": 1.0,  # the seed's 1.1 makes every update score tokens the policy did not sample
    "learning_rate": 2e-6,
    "lr_schedule": "cosine",  # to 10% over the run's planned steps: the last iterate lands within 2 points of the best (runs 22-23; constant: 20-21)
    "adam_betas": (0.9, 0.95),
    "cliprange": 0.2,
    "cliprange_high": 0.28,  # DAPO's clip-higher
    "length_normalization": "constant",  # Dr. GRPO: each response's summed loss / max_tokens, no length bias
    "std_normalization": False,  # Dr. GRPO: advantages are reward - group mean
}
TINY_RL = {**RL, "prompts_per_step": 2, "group_size": 4, "train_batch_size": 4, "max_tokens": 24, "learning_rate": 1e-5}


def evaluation_flags_set(flags: list[str]) -> list[str]:
    """The train_rl options among `flags` that change how its evaluations are made (every `--eval_*` but the device),
    read by train_rl's own parser, so `--eval_top_p=0.5` and abbreviations such as `--eval_rep 1.1` count too: a run
    given one evaluates its step 0 otherwise than alignment.evaluate evaluates SFT in the recipe."""
    from alignment.args import build_rl_parser, given_flags

    try:
        given = given_flags(build_rl_parser(), flags)
    except SystemExit:  # argparse's own message (an unknown flag or abbreviation, a bad value) is on stderr above
        raise SystemExit(f"train_rl cannot read the variant flags {' '.join(flags)!r}: fix them (see python -m alignment.train_rl --help)") from None
    return [f"--{dest}" for dest in given if dest.startswith("eval_") and dest != "eval_device"]


def sft_evaluated_by(recipe: bool, variants: list[tuple[str, list[str]]]) -> str | None:
    """The run of this call whose step-0 evaluation stands for SFT's under --no-sft_eval: the recipe's own, else the
    first variant whose flags leave the evaluation as the recipe's; None when every run changes it."""
    if recipe:
        return "rl"
    return next((name for name, flags in variants if not evaluation_flags_set(flags)), None)


def train_rl_flags(rl: dict) -> list[str]:
    return [
        "--rollout_batch_size", str(rl["prompts_per_step"]), "--group_size", str(rl["group_size"]), "--train_batch_size", str(rl["train_batch_size"]),
        "--sampling_max_tokens", str(rl["max_tokens"]), "--sampling_min_tokens", str(rl["min_tokens"]),
        "--sampling_temperature", str(rl["temperature"]), "--sampling_top_p", str(rl["top_p"]),
        "--repetition_penalty", str(rl["repetition_penalty"]), "--eval_repetition_penalty", str(rl["repetition_penalty"]),
        "--learning_rate", str(rl["learning_rate"]), "--lr_schedule", rl["lr_schedule"],
        "--adam_betas", *map(str, rl["adam_betas"]), "--kl_coef", "0", "--no-log_reference_kl",
        "--cliprange", str(rl["cliprange"]), "--cliprange_high", str(rl["cliprange_high"]), "--length_normalization", rl["length_normalization"],
        "--use_std_normalization" if rl["std_normalization"] else "--no-use_std_normalization",
    ]


def trl_flags(rl: dict) -> list[str]:
    return [
        "--prompts_per_step", str(rl["prompts_per_step"]), "--group_size", str(rl["group_size"]), "--train_batch", str(rl["train_batch_size"]),
        "--max_tokens", str(rl["max_tokens"]), "--min_tokens", str(rl["min_tokens"]), "--temperature", str(rl["temperature"]), "--top_p", str(rl["top_p"]),
        "--repetition_penalty", str(rl["repetition_penalty"]), "--learning_rate", str(rl["learning_rate"]), "--lr_schedule", rl["lr_schedule"],
        "--adam_beta2", str(rl["adam_betas"][1]), "--epsilon", str(rl["cliprange"]), "--epsilon_high", str(rl["cliprange_high"]),
        "--loss_type", {"mean": "grpo", "constant": "dr_grpo"}[rl["length_normalization"]], "--scale_rewards", "group" if rl["std_normalization"] else "none",
    ]


def optimizer_steps_per_rollout(rl: dict) -> int:
    return rl["prompts_per_step"] * rl["group_size"] // rl["train_batch_size"]


class Lane:
    """Stages that run one after another on one GPU (or the CPU), each a logged subprocess."""

    def __init__(self, name: str, gpu: str | None, out: Path):
        self.name, self.out = name, out
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        self.env["CUDA_VISIBLE_DEVICES"] = gpu if gpu is not None else ""
        for variable in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            self.env[variable] = str(out / "caches" / name / variable.lower())  # two lanes never share a compile cache

    def run(self, stage: str, command: list[str], deadline: float | None = None) -> float:
        """Run one stage to the end, or to `deadline` (time.time()); returns its minutes.

        Past the deadline the stage gets SIGTERM (train_rl finishes its step and exits, its
        evaluations so far logged; bench_trl finishes its generation round and saves it, to be
        evaluated with the others), then SIGKILL a minute later. Any other failure stops the benchmark."""
        started = time.perf_counter()
        print(f"[{self.name}] {stage}: {' '.join(command)}", flush=True)
        with open(self.out / f"{stage}.log", "a") as log:  # an earlier call's log of this stage stays above this one's
            log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n")
            log.flush()
            process = subprocess.Popen(command, cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            cut = False
            try:
                code = process.wait(timeout=None if deadline is None else max(deadline - time.time(), 1))
            except subprocess.TimeoutExpired:
                print(f"[{self.name}] {stage}: deadline reached, stopping it", flush=True)
                process.terminate()
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                code, cut = process.returncode, True
                (self.out / f"{stage}.deadline").write_text(f"stopped by --rl_deadline_minutes at {time.strftime('%Y-%m-%d %H:%M:%S')}, "
                                                            f"exit {code}\n")  # the summary marks the run as cut
        minutes = (time.perf_counter() - started) / 60
        print(f"[{self.name}] {stage}: {'stopped at the deadline ' if cut else ''}exit {code} after {minutes:.1f} min", flush=True)
        if code and not cut:
            raise SystemExit(f"{stage} failed (exit {code}); see {self.out / f'{stage}.log'}")
        return minutes


def evaluate(lane: Lane, stage: str, model: Path, args) -> float:
    """`alignment.evaluate` on the test split (greedy, r1_zero); returns the accuracy."""
    return evaluate_each(lane, stage, [(stage, model)], args)[0]


def evaluate_each(lane: Lane, log: str, stages_and_models: list[tuple[str, Path]], args) -> list[float]:
    """One `alignment.evaluate` call for several checkpoints (TRL's: one engine, each loaded into it in place),
    each into <out>/<stage>; one log, <out>/<log>.log. Returns the accuracies in order."""
    command = [sys.executable, "-m", "alignment.evaluate", "--model_path", *(str(model) for _, model in stages_and_models),
               "--output_dir", *(str(lane.out / stage) for stage, _ in stages_and_models),
               "--data_dir", str(args.data_dir), "--device", args.device_name, "--max_tokens", str(args.eval_max_tokens),
               "--repetition_penalty", str(args.rl["repetition_penalty"])]  # as train_rl's evaluations (--eval_repetition_penalty)
    if args.eval_num_examples:
        command += ["--num_examples", str(args.eval_num_examples)]
    command += ["--vllm_kv_cache_gb", "1"] if args.device == "cpu" else ["--vllm_enforce_eager"]  # one generate each: no compile to amortise
    lane.run(log, command)
    return [json.loads((lane.out / stage / "metrics.json").read_text())["avg_all_rewards"] for stage, _ in stages_and_models]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="the start model: an HF folder (e.g. a converted Qwen2.5 Instruct)")
    parser.add_argument("--gpus", default="0", help="one GPU id (every stage on it) or two (ours on the first, TRL and the base evaluation on the second)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a few examples, steps and tokens: checks the script, measures nothing")
    parser.add_argument("--trl", action=argparse.BooleanOptionalAction, default=True, help="run TRL beside ours (needs `trl` installed)")
    parser.add_argument("--rl_steps", type=positive_int, default=145,
                        help="our RL steps, the steps the cosine decays over (the recipe's 145: what fits 14.5 training minutes at ~6 s a step on one H100)")
    parser.add_argument("--evaluate_freq", type=non_negative_int, default=20, help="whole-test-split evaluations every N steps (TRL's --trl_save_every: the same steps)")
    parser.add_argument("--trl_steps", type=positive_int, default=None, help="TRL's rollout steps (generation rounds; default --rl_steps)")
    parser.add_argument("--trl_save_every", type=non_negative_int, default=20, help="TRL checkpoints evaluated by alignment.evaluate every N rollout steps (0: only the last, with --rl_minutes)")
    parser.add_argument("--trl_microbatch", type=positive_int, default=8, help="TRL completions per forward/backward (32 ran out of memory on an H200 beside its engine)")
    parser.add_argument("--rl_deadline_minutes", type=float, default=None,
                        help="stop both RL runs this many minutes after the script started (what they logged by then is reported)")
    parser.add_argument("--rl_minutes", type=float, default=None,
                        help="end each of our RL runs at the step whose training time reaches this many minutes (train_rl --max_train_minutes: "
                             "it still saves and evaluates; engine start and evaluations are not counted), and TRL's the same way")
    parser.add_argument("--lr_schedule", choices=["constant", "cosine"], default=RL["lr_schedule"],
                        help=f"both trainers' learning-rate schedule (default: the recipe's, {RL['lr_schedule']}); cosine decays to 10%% of the "
                             "peak over each run's planned steps (--rl_steps, --trl_steps: give both the same number)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="another RL run from the same start: the recipe's train_rl flags plus FLAGS (repeatable; runs after the recipe's own)")
    parser.add_argument("--recipe", action=argparse.BooleanOptionalAction, default=True, help="run the recipe's own RL run (rl) before the variants; --no-recipe without --variant runs TRL alone from the start checkpoint")
    parser.add_argument("--rl_from_base", action=argparse.BooleanOptionalAction, default=True,
                        help="start RL from --model itself, with no SFT stage (RESULTS runs 19-21: the better start on the 1.5B, though SFT scores "
                             "higher at step 0); --no-rl_from_base trains SFT and starts from the higher of the two step-0 accuracies (the seed's SFT start)")
    parser.add_argument("--base_eval", action=argparse.BooleanOptionalAction, default=True,
                        help="evaluate the start model (step 0 of the default start's curves); with --no-rl_from_base, --no-base_eval starts RL from SFT without it (the rule picks SFT whenever it beats the base)")
    parser.add_argument("--sft_eval", action=argparse.BooleanOptionalAction, default=True,
                        help="evaluate SFT on the test split before RL; --no-sft_eval (with --no-base_eval) leaves that to the step-0 evaluation "
                             "of the recipe's run (else of the first variant that changes no evaluation flag), the same greedy pass on its own "
                             "engine, and saves one engine start")
    parser.add_argument("--sft_flags", default="--num_epochs 1 --batch_size 32 --microbatch_size 32 --eval_num_examples 64",
                        help="train_sft flags (its own end-of-training evaluation is HF generate on --eval_num_examples; the recipe's is alignment.evaluate)")
    parser.add_argument("--data_dir", type=Path, default=REPO_ROOT / "data" / "gsm8k")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "gsm8k")
    parser.add_argument("--summarize_only", action="store_true", help="run nothing: rebuild summary.json and the PNG from --out")
    parser.add_argument("--rl_run", default="rl", help="with --summarize_only: our run's name under <out>/runs")
    parser.add_argument("--trl_dir", default="trl", help="with --summarize_only: TRL's folder under <out> (its evaluations are eval_<trl_dir>_<step>)")
    return parser


def recipe_settings(args) -> dict:
    """The RL settings both trainers get from this call's flags. TRL plans --rl_steps rounds unless --trl_steps says
    otherwise; a cosine pair planned over different steps is refused (the two rates would differ at equal steps)."""
    args.trl_steps = args.trl_steps or args.rl_steps
    rl = {**(TINY_RL if args.tiny else RL), "lr_schedule": args.lr_schedule}
    if rl["lr_schedule"] == "cosine" and args.trl and not args.tiny and args.trl_steps != args.rl_steps and not args.summarize_only:
        raise SystemExit(f"--lr_schedule cosine decays over each run's planned steps: --trl_steps {args.trl_steps} against --rl_steps "
                         f"{args.rl_steps} would give TRL and ours different rates at equal steps: give both the same number, or add --no-trl")
    return rl


def main():
    args = build_parser().parse_args()
    # the stages run in the repo's folder: every path they are given is absolute
    args.out, args.data_dir = args.out.resolve(), args.data_dir.resolve()
    args.model = args.model.resolve() if args.model.exists() else args.model

    rl = args.rl = recipe_settings(args)
    variants = [parse_variant(text) for text in args.variant]
    if not args.recipe and not variants and not args.trl:
        raise SystemExit("--no-recipe --no-trl leaves no RL run: add at least one --variant NAME=FLAGS, or drop --no-trl")
    if args.rl_from_base and not args.base_eval and not args.summarize_only:
        raise SystemExit("--no-base_eval: RL starts from the base model (the default) and the curves from its evaluation: drop --no-base_eval, "
                         "or add --no-rl_from_base to start from SFT")
    if not args.rl_from_base and not args.sft_eval and (args.base_eval or not (args.recipe or variants)):
        raise SystemExit("--no-sft_eval needs --no-base_eval (the start is chosen from both accuracies) and a run of ours (its step 0 is SFT's "
                         "evaluation): add --no-base_eval, or drop --no-sft_eval")
    stands_for_sft = sft_evaluated_by(args.recipe, variants)
    if not args.rl_from_base and not args.sft_eval and not args.summarize_only and stands_for_sft is None:
        raise SystemExit(f"--no-sft_eval: every run of this call changes how it evaluates (an --eval_* flag), so none of their "
                         "step-0 evaluations is SFT's as the recipe makes it: drop --no-recipe, add a variant without those flags, or drop --no-sft_eval")
    if args.summarize_only:  # our run only where it ran
        earlier = summary_runs(args.out, False, [])[1]
        before = json.loads((args.out / "summary.json").read_text()) if (args.out / "summary.json").is_file() else {}
        ours_run = args.rl_run if (args.out / "runs" / args.rl_run / "steps.jsonl").is_file() else None
        # the model, GPUs and RL settings the runs had: this call's --model may be a placeholder, or the folder renamed since
        write_summary(args.out, before.get("model", args.model), before.get("gpus", args.gpus), before.get("rl_settings", rl), ours_run, args.trl_dir,
                      [name for name in earlier if name != ours_run])
        return
    # before SFT and our runs, not after them; an earlier run's evaluations (eval_trl_<step>) would be summarised as the new one's
    if args.trl and (found := earlier_run(args.out / "trl") + sorted(path.name for path in args.out.glob("eval_trl_*"))):
        raise SystemExit(f"--out {args.out} already holds a TRL run ({', '.join(found[:3])}); its checkpoints and evaluations would mix "
                         "with a new one's: pass a new --out, move trl and eval_trl_* away, or add --no-trl")
    for name in (["rl"] if args.recipe else []) + [name for name, _ in variants]:
        # train_rl would only evaluate the checkpoint there (the seed's rule) and the summary report the earlier run's curves
        if found := [str(path) for path in (args.out / name, args.out / "runs" / name) if path.exists()]:
            raise SystemExit(f"--out {args.out}: our run {name} has run there already ({', '.join(found)}); the summary would report that run: "
                             "pass a new --out, move those folders away, or name the variant otherwise")
    if not args.base_eval or args.rl_from_base:  # the start is known now, before any work
        check_same_start(args.out, "base" if args.rl_from_base else "sft", args.rl_from_base)
    if not args.rl_from_base and (args.out / "sft" / "config.json").is_file():
        made_from = (read_manifest(args.out / "sft") or {}).get("start_model")
        if made_from != start_model_name(args.model):
            raise SystemExit(f"--out {args.out}: {args.out / 'sft'} was trained from {made_from or 'a model its manifest does not name'}, not --model "
                             f"{args.model}; RL would start from it: pass a new --out, or remove {args.out / 'sft'} (and eval_sft) to train SFT again")
        print(f"reusing the SFT checkpoint in {args.out / 'sft'}, trained from --model (remove it to train SFT again)", flush=True)
    args.eval_num_examples = 8 if args.tiny else None  # None: the whole test split (1,319)
    args.eval_max_tokens = 32 if args.tiny else 1024
    args.device_name = "cpu" if args.device == "cpu" else "cuda:0"  # each lane sees its own GPU as cuda:0
    check_run_flags(args, [("rl", [])] * args.recipe + variants)
    if args.trl and not trl_installed():
        raise SystemExit("--trl: the trl package is not installed here (bench_trl.py needs trl==1.16.0): install it, or add --no-trl")
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + 60 * args.rl_deadline_minutes if args.rl_deadline_minutes else None
    gpus = [g.strip() for g in args.gpus.split(",")] if args.device == "cuda" else [None]
    ours = Lane("ours", gpus[0], args.out)
    peer = Lane("peer", gpus[1], args.out) if len(gpus) > 1 else ours
    common = ["--data_dir", str(args.data_dir)]
    sft = args.out / "sft"

    # 1-2. the start model and the SFT stage, on the two lanes at once when there are two
    def sft_stage():
        if not (sft / "config.json").is_file():
            tiny = ["--num_train_examples", "16", "--max_steps", "2", "--batch_size", "8", "--microbatch_size", "8", "--eval_num_examples", "2", "--eval_max_tokens", "8"]
            ours.run("sft", [sys.executable, "-m", "alignment.train_sft", "--model", str(args.model), "--checkpoint_path", str(sft),
                             "--log_dir", str(args.out / "runs"), *common, *(tiny if args.tiny else args.sft_flags.split())])
        return evaluate(ours, "eval_sft", sft, args) if args.sft_eval else None

    with ThreadPoolExecutor(2) as pool:
        base = pool.submit(evaluate, peer, "eval_base", args.model, args) if args.base_eval else None
        tuned = pool.submit(sft_stage) if peer is not ours and not args.rl_from_base else None
        base, tuned = (base.result() if base else None), (tuned.result() if tuned else None if args.rl_from_base else sft_stage())
    if args.rl_from_base:
        start = args.model
    else:
        start = sft if base is None or tuned >= base else args.model  # ties: SFT, the seed's order
    check_same_start(args.out, "sft" if start == sft else "base", args.rl_from_base)
    started = {"rl_start": "sft" if start == sft else "base", "path": str(start)}
    if tuned is None and not args.rl_from_base:  # --no-sft_eval: whose step 0 is SFT's evaluation (an earlier call's, when that run is still there)
        earlier = json.loads((args.out / "rl_start.json").read_text()).get("sft_evaluated_by") if (args.out / "rl_start.json").is_file() else None
        started["sft_evaluated_by"] = earlier if earlier and (args.out / "runs" / earlier / "evals.jsonl").is_file() else stands_for_sft
    (args.out / "rl_start.json").write_text(json.dumps(started) + "\n")
    sft_said = "not trained (RL from the base model; --no-rl_from_base trains it)" if args.rl_from_base else "at our step 0" if tuned is None else f"{tuned:.3f}"
    print(f"base {'not evaluated' if base is None else f'{base:.3f}'}, SFT {sft_said}: "
          f"RL starts from {start}", flush=True)

    # 3-4. ours (the recipe, then each variant, one after another) and TRL from the same start
    def one_rl(name: str, extra: list[str]):
        if deadline is not None and time.time() >= deadline:  # it would be stopped within its engine start
            print(f"[ours] {name}: not started, --rl_deadline_minutes {args.rl_deadline_minutes:g} has passed", flush=True)
            return
        ours.run(name, rl_command(args, start, name) + extra, deadline)

    def our_rl():
        for name, extra in ([("rl", [])] if args.recipe else []) + variants:
            one_rl(name, extra)

    def trl_rl():
        peer.run("trl", trl_command(args, start), deadline)
        if checkpoints := trl_checkpoints(args.out / "trl", rl):
            evaluate_each(peer, "eval_trl", [(f"eval_trl_{step}", checkpoint) for step, checkpoint in checkpoints], args)

    with ThreadPoolExecutor(2) as pool:
        ours_done = pool.submit(our_rl)
        trl_done = pool.submit(trl_rl) if args.trl and peer is not ours else None
        ours_done.result()
        if args.trl:
            try:
                trl_done.result() if trl_done else trl_rl()
            except SystemExit as failure:  # ours is still summarised
                print(f"TRL: {failure}", flush=True)
    ours_run, variant_runs = summary_runs(args.out, args.recipe, [name for name, _ in variants])
    write_summary(args.out, args.model, args.gpus, rl, ours_run, variant_runs=variant_runs)


def summary_runs(out: Path, recipe: bool, variants: list[str]) -> tuple[str | None, list[str]]:
    """(our run, the variants) for the summary: this call's runs and those an earlier call left in
    `out` (a variant added later with --no-recipe), the recipe's "rl" as ours whenever it ran there, so that no
    call's summary drops the other's runs or reports a variant as the recipe. Our run None: no recipe run (the variants
    and TRL, under their own names), as --summarize_only finds the folder too."""
    earlier = sorted(path.name for path in (out / "runs").glob("*") if path.name != "sft" and (path / "steps.jsonl").is_file())
    ours = "rl" if recipe or "rl" in earlier else None
    return ours, [name for name in dict.fromkeys([*variants, *earlier]) if name != ours]


def check_same_start(out: Path, start: str, rl_from_base: bool = False) -> None:
    """Refuse a call whose RL would start from another checkpoint than the runs already in `out`: rl_start.json
    holds one start for the whole summary, and overwriting it would draw those runs from the wrong step 0."""
    recorded = json.loads((out / "rl_start.json").read_text()).get("rl_start") if (out / "rl_start.json").is_file() else None
    runs = sorted(path.name for path in (out / "runs").glob("*") if path.name != "sft" and (path / "steps.jsonl").is_file())
    runs += ["trl"] if earlier_run(out / "trl") else []
    if recorded not in (None, start) and runs:
        advice = "drop --no-rl_from_base" if start == "sft" else "add --no-rl_from_base" if rl_from_base else "add --no-base_eval"
        raise SystemExit(f"--out {out}: its RL runs ({', '.join(runs[:3])}) started from {recorded}, this call's would start from {start} "
                         f"(one summary holds one start): pass a new --out, or {advice}")


def trl_command(args, start: Path) -> list[str]:
    """bench_trl.py's command line from `start`, with the recipe's settings and our run's time box."""
    steps, save_every = (2, 1) if args.tiny else (args.trl_steps, args.trl_save_every)
    command = [sys.executable, str(REPO_ROOT / "bench" / "bench_trl.py"), "--workload", "gsm8k", "--model", str(start), "--data_dir", str(args.data_dir),
               "--out", str(args.out / "trl"), "--steps", str(steps), "--save_every", str(save_every), "--microbatch", str(args.trl_microbatch),
               "--device", args.device, *trl_flags(args.rl)]
    if args.rl_minutes:  # bench_trl ends after the round that reaches it and saves that round's checkpoint
        command += ["--max_train_minutes", str(args.rl_minutes)]
    return command + (["--tiny"] if args.tiny else [])


def trl_checkpoints(trl_out: Path, rl: dict) -> list[tuple[int, Path]]:
    """TRL's saved checkpoints as (rollout step, folder), in step order: every --trl_save_every
    rounds and, time-boxed, the last round's (TRL names them by optimizer step; a save cut short
    by the deadline has no trainer_state.json, which the Trainer writes after the weights, and is left out)."""
    found = []
    for folder in trl_out.glob("checkpoint-*"):
        optimizer_step = folder.name.rpartition("-")[2]
        if optimizer_step.isdigit() and (folder / "trainer_state.json").is_file():
            found.append((int(optimizer_step) // optimizer_steps_per_rollout(rl), folder))
    return sorted(found)


def rl_command(args, start: Path, name: str) -> list[str]:
    """The recipe's train_rl command line for run `name` from `start` (a --variant appends its flags)."""
    command = [sys.executable, "-m", "alignment.train_rl", "--sft_checkpoint_path", str(start), "--checkpoint_path", str(args.out / name),
               "--log_dir", str(args.out / "runs"), "--run_name", name, "--layout", "auto", "--data_dir", str(args.data_dir), *train_rl_flags(args.rl),
               "--max_steps", str(2 if args.tiny else args.rl_steps), "--evaluate_freq", str(1 if args.tiny else args.evaluate_freq),
               "--eval_max_tokens", str(args.eval_max_tokens), "--evaluate_at_start"]
    if args.rl_minutes:  # train_rl ends the run itself, with its save and final evaluation
        command += ["--max_train_minutes", str(args.rl_minutes)]
    if args.tiny:
        command += ["--eval_num_examples", str(args.eval_num_examples), "--vllm_kv_cache_gb", "1", "--train_mini_batch_size", "4"]
    elif args.device == "cuda":
        command += ["--microbatch_tokens", "16384"]  # packed microbatches beside the colocated engine
    return command


def trl_installed() -> bool:
    return importlib.util.find_spec("trl") is not None


def check_run_flags(args, runs: list[tuple[str, list[str]]]) -> None:
    """Each run's train_rl command line through train_rl's own parser and checks, before any stage: a variant train_rl
    refuses (a batch its group size does not divide, flags that do not combine) stops the call in one line, not
    after the evaluations and the runs before it."""
    import contextlib
    import io

    from alignment.args import parse_rl_args
    from alignment.errors import UserError

    for name, extra in runs:
        argv, said = rl_command(args, args.model, name)[3:] + extra, io.StringIO()  # without `python -m alignment.train_rl`
        try:
            with contextlib.redirect_stderr(said):
                parse_rl_args(argv)
        except UserError as error:
            raise SystemExit(f"--variant {name}: train_rl refuses its flags: {error}") from None
        except SystemExit:  # argparse: an unknown flag or a bad value, its message the last line it wrote
            raise SystemExit(f"--variant {name}: train_rl refuses its flags: {said.getvalue().strip().splitlines()[-1]}") from None


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`NAME=FLAGS` -> (NAME, FLAGS split as a shell would)."""
    import shlex

    name, sep, flags = text.partition("=")
    # a run's checkpoint is <out>/NAME and its log <out>/NAME.log: never one of the benchmark's own folders or logs
    taken = name in ("rl", "sft", "trl", "runs", "caches", "eval_base", "eval_sft") or name.startswith("eval_trl")
    if not sep or not name.replace("-", "").replace("_", "").replace(".", "").isalnum() or taken:
        raise SystemExit(f"--variant {text!r}: expected NAME=FLAGS with NAME of letters, digits, '-', '_', '.' "
                         "(not rl, sft, trl, runs, caches, eval_base, eval_sft or eval_trl...: the benchmark's own folders)")
    try:
        return name, shlex.split(flags)
    except ValueError as error:  # an unclosed quote
        raise SystemExit(f"--variant {text!r}: its flags do not split as a shell would ({error}); close the quote") from None


def write_summary(out: Path, model, gpus: str, rl: dict, rl_run: str | None = "rl", trl_dir: str = "trl", variant_runs=()) -> dict:
    """summary.json, gsm8k_curves.png and a printed table, from what the stages wrote in `out`
    (`rl_run` None: no run of ours, TRL's alone)."""
    summary = {"model": str(model), "gpus": gpus, "rl_settings": {k: list(v) if isinstance(v, tuple) else v for k, v in rl.items()}}
    started = json.loads((out / "rl_start.json").read_text()) if (out / "rl_start.json").is_file() else {}  # what the run started from
    base_model = started["path"] if started.get("rl_start") == "base" and started.get("path") else model
    for stage, evaluated in (("eval_base", base_model), ("eval_sft", out / "sft")):
        if (out / stage / "metrics.json").is_file():  # --no-base_eval skips the first
            metrics = json.loads((out / stage / "metrics.json").read_text())
            if "model_path" in metrics and not same_path(metrics["model_path"], evaluated) and not moved_with(out, stage, metrics["model_path"]):
                print(f"{out / stage} evaluated {metrics['model_path']}, not {evaluated}: left out of the summary", flush=True)
                continue
            summary[stage] = {key: metrics[key] for key in ("avg_all_rewards", "format_reward", "mean_response_tokens", "num_examples")}
    if "eval_sft" not in summary and (step_zero := _step_zero(out, started)):  # --no-sft_eval
        summary["eval_sft"] = step_zero
    if "eval_sft" not in summary and started.get("rl_start") != "base":  # what every curve starts from (from SFT)
        raise SystemExit(f"--out {out} holds no evaluation of its SFT checkpoint (eval_sft/metrics.json): not a bench_gsm8k folder, or one "
                         f"whose SFT was not evaluated; pass the --out a run wrote (nothing was changed)")
    base = summary.get("eval_base", {}).get("avg_all_rewards", float("-inf"))
    summary["rl_start"] = started.get("rl_start") or ("sft" if summary["eval_sft"]["avg_all_rewards"] >= base else "base")
    if summary["rl_start"] == "base" and "eval_base" not in summary:  # the curves start from it
        raise SystemExit(f"--out {out}: its RL started from the base model {base_model}, and it holds no evaluation of that model "
                         "(eval_base/metrics.json): pass the --out a run wrote (nothing was changed)")
    if rl_run is not None:
        summary.update(read_ours(out / "runs" / rl_run))
    # runs the deadline stopped: their curves end where they were cut, without the final save and evaluation
    summary["stopped_at_deadline"] = sorted(path.stem for path in out.glob("*.deadline"))
    summary["variants"] = {name: read_ours(out / "runs" / name) for name in variant_runs if name != rl_run and (out / "runs" / name / "steps.jsonl").is_file()}
    summary["eval_trl"] = {int(path.name.rpartition("_")[2]): json.loads((path / "metrics.json").read_text())
                           for path in out.glob(f"eval_{trl_dir}_*") if (path / "metrics.json").is_file()}
    if (out / trl_dir / "steps.jsonl").is_file():
        summary.update(read_trl(out / trl_dir))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    draw(summary, out / "gsm8k_curves.png")
    print_table(summary)
    return summary


def _step_zero(out: Path, started: dict) -> dict | None:
    """SFT's evaluation as the run `started` (rl_start.json) names (`sft_evaluated_by`: one that evaluates as the recipe
    does) logged it at step 0, when RL started from SFT: --no-sft_eval's stand-in for eval_sft."""
    if started.get("rl_start") != "sft" or not started.get("sft_evaluated_by"):
        return None
    run = started["sft_evaluated_by"]
    for row in read_jsonl(out / "runs" / run / "evals.jsonl"):
        if row["step"] == 0:
            keys = ("avg_all_rewards", "format_reward", "mean_response_tokens", "num_examples")
            return {**{key: row[key] for key in keys}, "evaluated_by": f"runs/{run} step 0"}
    return None


def moved_with(out: Path, stage: str, recorded) -> bool:
    """Whether eval_sft's recorded model is this --out's own sft, from before the folder was moved or renamed
    (metrics.json records the absolute path, which no longer exists)."""
    return stage == "eval_sft" and Path(recorded).name == "sft" and not Path(recorded).exists()


def read_ours(run_dir: Path) -> dict:
    """Our run's evaluations and per-step seconds, from train_rl's logs."""
    steps, evals = read_jsonl(run_dir / "steps.jsonl"), read_jsonl(run_dir / "evals.jsonl")
    later = steps[1:] or steps  # step 1 pays the compile
    breakdown = {key: _median([row.get(f"perf/{key}_seconds") for row in later]) for key in ("step", "rollout", "reward", "logprobs", "update", "sync", "eval")}
    # training time to each step, without the evaluations (TRL's run has none inside it); step 0: --evaluate_at_start
    minutes = training_minutes(steps)
    total = max(minutes.items())[1]  # an evaluation after the last logged step: the whole run's
    return {"ours_evals": [{"step": e["step"], "accuracy": e["avg_all_rewards"], "format": e["format_reward"],
                            "train_minutes": minutes.get(e["step"], total)} for e in evals],
            "ours_median_seconds": breakdown, "ours_peak_memory_gib": max((row.get("perf/peak_memory_gib") or 0) for row in steps) if steps else None,
            "ours_train_reward": [(row["step"], row["train/reward"]) for row in steps]}


def read_trl(out: Path) -> dict:
    """TRL's per-step seconds, rewards and timings (bench_trl.py --workload gsm8k writes them)."""
    rows = []  # one row per rollout step: TRL logs each optimizer step, several per generation round
    for row in read_jsonl(out / "steps.jsonl"):
        step = row.get("rollout_step", row["step"])
        if rows and rows[-1]["step"] == step:
            last = rows[-1]
            timers = {name: last["timers"].get(name, 0.0) + row["timers"].get(name, 0.0) for name in {*last["timers"], *row["timers"]}}
            rows[-1] = {**row, "step": step, "step_seconds": last["step_seconds"] + row["step_seconds"], "timers": timers,
                        "reward": last.get("reward") if last.get("reward") is not None else row.get("reward")}
        else:
            rows.append({**row, "step": step})
    later = rows[1:] or rows
    timers = sorted({name for row in later for name in row.get("timers", {})})
    return {"trl_median_seconds": {"step": _median([r["step_seconds"] for r in later]), **{name: _median([r["timers"].get(name) for r in later]) for name in timers}},
            "trl_train_minutes": {r["step"]: r["elapsed_seconds"] / 60 for r in rows},
            "trl_peak_memory_gib": max((r.get("peak_memory_gib") or 0) for r in rows) if rows else None,
            "trl_train_reward": [(r["step"], r.get("reward")) for r in rows]}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def draw(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = summary["eval_sft" if summary["rl_start"] == "sft" else "eval_base"]["avg_all_rewards"]
    ours = [(0, 0.0, start)] + [(e["step"], e["train_minutes"], e["accuracy"]) for e in summary.get("ours_evals", []) if e["step"] > 0]
    trl = [(0, 0.0, start)] + [(int(step), summary.get("trl_train_minutes", {}).get(int(step), float("nan")), e["avg_all_rewards"])
                               for step, e in sorted(summary.get("eval_trl", {}).items(), key=lambda item: int(item[0]))]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    variants = {name: [(0, 0.0, start)] + [(e["step"], e["train_minutes"], e["accuracy"]) for e in run["ours_evals"] if e["step"] > 0]
                for name, run in summary.get("variants", {}).items()}
    for axis, index, label in ((axes[0], 0, "RL step"), (axes[1], 1, "training minutes (evaluations excluded)")):
        if summary.get("ours_evals"):  # the recipe's run
            axis.plot([p[index] for p in ours], [p[2] for p in ours], marker="o", markersize=3, label="alignment train_rl")
        for name, points in variants.items():
            axis.plot([p[index] for p in points], [p[2] for p in points], marker=".", markersize=3, label=f"train_rl {name}")
        if len(trl) > 1:
            axis.plot([p[index] for p in trl], [p[2] for p in trl], marker="s", markersize=4, label="TRL GRPOTrainer")
        axis.set_xlabel(label, fontsize=8)
        axis.set_ylabel("GSM8K test accuracy (greedy, 1,319)", fontsize=8)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    rewards = [(summary.get("ours_train_reward", []), "alignment train_rl"), (summary.get("trl_train_reward", []), "TRL GRPOTrainer"),
               *((run.get("ours_train_reward", []), f"train_rl {name}") for name, run in summary.get("variants", {}).items())]
    for rows, label in rewards:
        points = [(s, r) for s, r in rows if r is not None]
        if points:
            axes[2].plot([s for s, _ in points], [r for _, r in points], label=label, alpha=0.8)
    axes[2].set_xlabel("RL step", fontsize=8)
    axes[2].set_ylabel("train reward (sampled rollouts)", fontsize=8)
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=7)
    figure.suptitle(f"GRPO on GSM8K from {Path(summary['model']).name} ({summary['rl_start']} start)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def print_table(summary: dict) -> None:
    base = summary.get("eval_base", {}).get("avg_all_rewards")
    sft = summary.get("eval_sft", {}).get("avg_all_rewards")
    print(f"base {'not evaluated' if base is None else f'{base:.3f}'} | SFT {'not evaluated' if sft is None else f'{sft:.3f}'} | RL start: {summary['rl_start']}")
    for name, run in [("ours", summary), *summary.get("variants", {}).items()]:
        for e in run.get("ours_evals", []):
            print(f"{name} step {e['step']:>4}: accuracy {e['accuracy']:.3f} after {e['train_minutes']:.1f} training minutes")
    for step, e in sorted(summary.get("eval_trl", {}).items(), key=lambda item: int(item[0])):
        print(f"TRL  step {int(step):>4}: accuracy {e['avg_all_rewards']:.3f} after {summary.get('trl_train_minutes', {}).get(int(step), float('nan')):.1f} training minutes")
    for name, run in [("ours", summary), *summary.get("variants", {}).items()]:
        if run.get("ours_median_seconds"):  # under --no-recipe only the variants have one
            print(f"median seconds per step, {name}: {run['ours_median_seconds']}")
    if summary.get("trl_median_seconds"):
        print(f"median seconds per rollout step, TRL: {summary['trl_median_seconds']}")


if __name__ == "__main__":
    main()
