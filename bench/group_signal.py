"""What a larger group would give a run whose groups tie: a model of its prompts' pass rates, fitted to its logs.

    python bench/group_signal.py runs/rl_base                                   # a train_rl run folder
    python bench/group_signal.py bench/results/gsm8k_qwen15_h100_rl_from_base_cosine.json --from_step 60
    python bench/group_signal.py runs/rl_base --sizes 4 8 16 32 --out signal.json

A group of G samples of one prompt carries a gradient only when its rewards differ (0/1 rewards, as the r1_zero
reward gives). train_rl logs three numbers a step that depend on how the batch's pass rates p are spread: the train
reward (the mean of p), the fraction of groups all right (the mean of p^G) and the fraction all equal (all right or
all wrong). Drawing each prompt's p from a Beta(a, b), the first two give a and b (the mean fixes a/(a+b); the
all-right fraction, which falls from the mean to mean^G as the Beta narrows, fixes a+b); the all-wrong fraction,
the mean of (1-p)^G, is left over to check the fit against. The fitted Beta then gives, for any group size, the
fraction of groups that would be mixed, and so how many mixed groups a step buys per 1,000 samples. It is a model of
the logged averages (steps from --from_step on), not a run: it says what another group size would do to the tied
groups if the pass rates stayed as they are. Each run's group size is the one it recorded (a run folder's flags.json, a
results file's settings); --group_size is for runs that record none, and is refused where a run recorded another.
"""

import argparse
import json
import math
import os
import statistics
from pathlib import Path

from alignment.errors import UserError, run_cli
from alignment.plot import is_results_file, load_runs, read_results_file, recorded_flags, split_source

LOGGED = ("train/reward", "train/fraction_groups_all_right", "train/fraction_groups_all_equal")


def beta_moment(a: float, b: float, k: int) -> float:
    """E[p^k] for p ~ Beta(a, b): B(a + k, b) / B(a, b)."""
    log_beta = lambda x, y: math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)  # noqa: E731
    return math.exp(log_beta(a + k, b) - log_beta(a, b))


def fit_beta(mean: float, all_right: float, group_size: int) -> tuple[float, float]:
    """(a, b) of the Beta whose mean is `mean` and whose E[p^group_size] is `all_right`. For a fixed mean that moment
    falls from `mean` (all mass at 0 and 1) to mean^G (all at the mean) as a + b grows: bisection on log(a + b)."""
    if not 0 < mean < 1 or not mean**group_size < all_right < mean:
        raise UserError(f"a reward of {mean:.3f} with {all_right:.3f} of the groups of {group_size} all right fits no spread of pass rates "
                        f"(the fraction lies between mean^G = {mean**group_size:.3f} and the mean for 0/1 rewards); check --group_size")
    low, high = math.log(1e-4), math.log(1e6)
    for _ in range(200):
        middle = (low + high) / 2
        concentration = math.exp(middle)
        if beta_moment(mean * concentration, (1 - mean) * concentration, group_size) > all_right:
            low = middle
        else:
            high = middle
    concentration = math.exp((low + high) / 2)
    return mean * concentration, (1 - mean) * concentration


def group_fractions(a: float, b: float, group_size: int) -> dict:
    """The fractions of groups of `group_size` all right, all wrong and mixed, under Beta(a, b) pass rates."""
    right, wrong = beta_moment(a, b, group_size), beta_moment(b, a, group_size)
    return {"all_right": right, "all_wrong": wrong, "mixed": 1 - right - wrong}


def analyse(steps: list[dict], group_size: int, sizes: list[int], from_step: int, label: str) -> dict:
    """The logged averages from `from_step` on, the fitted Beta, its check and each size's prediction."""
    # a NaN logged by another writer counts as not logged, as train_rl's null does (the averages became NaN, and the error blamed --group_size)
    rows = [row for row in steps if row.get("step", 0) >= from_step
            and all(isinstance(row.get(key), (int, float)) and math.isfinite(row[key]) for key in LOGGED)]
    if not rows:
        raise UserError(f"{label}: no step from --from_step {from_step} on logs {', '.join(LOGGED)} (an older train_rl's log, or a shorter run)")
    reward, all_right, all_equal = (statistics.fmean(row[key] for row in rows) for key in LOGGED)
    try:
        a, b = fit_beta(reward, all_right, group_size)
    except UserError as error:
        raise UserError(f"{label}: {error}") from None
    return {"run": label, "steps": len(rows), "from_step": from_step, "group_size": group_size, "reward": reward, "all_right": all_right,
            "all_wrong": all_equal - all_right, "beta": [a, b], "all_wrong_fitted": group_fractions(a, b, group_size)["all_wrong"],
            "sizes": {size: {**group_fractions(a, b, size), "mixed_per_1000_samples": 1000 * group_fractions(a, b, size)["mixed"] / size}
                      for size in sizes}}


def recorded_group_sizes(source) -> list[int | None]:
    """The --group_size each run of `source` ran with, in load_runs' order: its recorded flags (a run folder's
    flags.json, a results file run's copy of it), else a results file's rl_settings with a run's own `--group_size N`
    in its flags in words; None where nothing records it."""
    path, name = split_source(source)
    recorded = [flags.get("group_size") if flags else None for flags in recorded_flags(source)]  # flags.json's record
    if not is_results_file(path):
        return [size if isinstance(size, int) else None for size in recorded]
    results, runs = read_results_file(path, name)
    default = (results.get("rl_settings") or {}).get("group_size")
    sizes = []
    for size, run in zip(recorded, runs.values()):
        if isinstance(size, int):
            sizes.append(size)
            continue
        words = str(run.get("flags", "")).replace("--group_size=", "--group_size ").split()  # flags in words; argparse takes both spellings
        given = [words[i + 1] for i, word in enumerate(words[:-1]) if word == "--group_size"]
        sizes.append(int(given[-1]) if given and given[-1].isdigit() else default if isinstance(default, int) else None)
    return sizes


def group_sizes(sources, runs: list, given: int | None) -> list[int]:
    """Each run's group size: the recorded one; --group_size (else the recipe's 8) where none is recorded. A --group_size
    that contradicts a record is refused: fitted with the wrong size, the Beta and every prediction are wrong."""
    recorded = [size for source in sources for size in recorded_group_sizes(source)]
    sizes = []
    for (label, _, _), size in zip(runs, recorded):
        if size is not None and given is not None and size != given:
            raise UserError(f"--group_size {given}: run {label} recorded --group_size {size}; leave --group_size out to use each run's own")
        sizes.append(size if size is not None else given if given is not None else 8)
    return sizes


def report(result: dict) -> str:
    lines = [f"{result['run']}: {result['steps']} steps from step {result['from_step']}, groups of {result['group_size']}: reward {result['reward']:.3f}, "
             f"all right {result['all_right']:.3f}, all wrong {result['all_wrong']:.3f} (the fit's {result['all_wrong_fitted']:.3f}); "
             f"pass rates ~ Beta({result['beta'][0]:.2f}, {result['beta'][1]:.2f})",
             "  group size | all right | all wrong | mixed | mixed groups per 1,000 samples"]
    for size, row in result["sizes"].items():
        lines.append(f"  {size:>10} | {row['all_right']:9.3f} | {row['all_wrong']:9.3f} | {row['mixed']:5.3f} | {row['mixed_per_1000_samples']:6.1f}")
    return "\n".join(lines)


def check_out(out: Path, sources) -> None:
    """--out may not be an input or lie inside a run folder (it replaced the run's steps.jsonl), nor replace a file of
    another kind (a results file, the user's notes): only an earlier output of this script is written over."""
    real = out.resolve()
    for source in sources:
        path = split_source(source)[0].resolve()
        if real == path or path in real.parents:
            raise UserError(f"--out {out} is {'inside ' if real != path else ''}the input {source}; write the results elsewhere (e.g. --out signal.json)")
    if real.is_file():
        try:
            earlier = json.loads(real.read_text())
        except (OSError, ValueError):
            earlier = None
        if not (isinstance(earlier, list) and all(isinstance(result, dict) and "beta" in result for result in earlier)):
            raise UserError(f"--out {out} already holds a file that is not this script's results; pass another path, or move it away (nothing was written)")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="train_rl run folders (<log_dir>/<run_name>) or results files (FILE.json, FILE.json:NAME)")
    parser.add_argument("--group_size", type=int, help="the --group_size of runs that record none (default: the recipe's 8); each run's "
                        "flags.json or results file says its own")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32], help="group sizes to predict")
    parser.add_argument("--from_step", type=int, default=1, help="average the steps from this one on (past the first rise: e.g. 60)")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if (args.group_size is not None and args.group_size < 2) or min(args.sizes) < 1:
        parser.error("--group_size must be 2 or more and every --sizes entry 1 or more")
    args.runs = [os.path.expanduser(run) for run in args.runs]  # a quoted `~/...` or `--out=~/x.json` (no shell expands it) names the home folder
    if args.out:
        args.out = args.out.expanduser()
        check_out(args.out, args.runs)
    runs = load_runs(args.runs)
    results = [analyse(steps, size, args.sizes, args.from_step, label) for (label, steps, _), size in zip(runs, group_sizes(args.runs, runs, args.group_size))]
    print("\n\n".join(map(report, results)))
    if args.out:
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
        except OSError as error:
            raise UserError(f"--out {args.out}: cannot write it ({error.strerror or error}); pass a writable file path") from None
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    run_cli(main)
