"""One picture of a run: the curves people look at first, without a TensorBoard server.

    python -m alignment.plot runs/rl                  # writes runs/rl/curves.png
    python -m alignment.plot runs/demo/rl --out curves.png
    python -m alignment.plot runs/rl runs/rl_seed1                   # side by side: runs/compare_rl_vs_rl_seed1.png
    python -m alignment.plot bench/results/gsm8k_qwen15_h200_drgrpo_100steps.json:recipe_100_steps runs/rl

Reads the run folder's steps.jsonl (one line of scalars per step, written by train_rl)
and evals.jsonl (one line per evaluation) and draws, against the step: train reward
and format rate, held-out accuracy, response length, KL to the reference and the clip
fraction, the sampler/trainer log-prob gap, and seconds per step. Given several runs it
draws them side by side instead, one line each: held-out accuracy against the step and
against training minutes (the clock --max_train_minutes reads: evaluations left out),
train reward and response length, each run labelled with the flags it ran with that
another run did not (from the run folders' flags.json). A run can also come from a
benchmark's results file (bench/results/*.json, whose "runs" hold each run's steps and
evals, and its flags.json as "flags" where it was copied in): FILE.json for all of its
runs, FILE.json:NAME for one. Headless (Agg).
"""

import argparse
import hashlib
import json
import os
import re
from pathlib import Path

from alignment.args import PER_RUN_FLAGS
from alignment.errors import UserError, run_cli


IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg")


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a jsonl file; a line cut short by a crash, or one that is not an object, is skipped."""
    rows = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _number(row: dict, key: str) -> float | None:
    """The row's value of `key` if it is a number; anything else (null, a string another writer logged) is not logged."""
    value = row.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    points = [(row["step"], _number(row, key)) for row in rows if _number(row, key) is not None]
    return [step for step, _ in points], [value for _, value in points]


def training_minutes(steps: list[dict]) -> dict[int, float]:
    """Minutes of training after each step (0 before step 1): the steps' seconds without their
    evaluations, the clock train_rl's --max_train_minutes reads."""
    minutes, total = {0: 0.0}, 0.0
    for row in steps:
        total += (_number(row, "perf/step_seconds") or 0.0) - (_number(row, "perf/eval_seconds") or 0.0)
        minutes[row["step"]] = total / 60
    return minutes


def _steps_of(run_dir: Path) -> list[dict]:
    steps = read_jsonl(run_dir / "steps.jsonl")
    if not steps:
        raise UserError(f"{run_dir / 'steps.jsonl'} has no steps; pass the folder of a train_rl run (<log_dir>/<run_name>)")
    return _numbered(steps, run_dir / "steps.jsonl", in_order=True)


def _evals_of(run_dir: Path) -> list[dict]:
    return _numbered(read_jsonl(run_dir / "evals.jsonl"), run_dir / "evals.jsonl")


def _numbered(rows, where, in_order: bool = False) -> list[dict]:
    """`rows` if each is an object with an integer step (in_order: each after the one before, as train_rl's steps.jsonl,
    trimmed on --resume, has them). A row of another kind (evaluate's samples.jsonl as steps.jsonl) was a KeyError
    traceback, or a blank figure; a step logged twice (two runs' logs in one file) drew the curve back on itself
    and counted its seconds twice in the training minutes."""
    previous = None
    for row in rows if isinstance(rows, list) else [rows]:
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise UserError(f"{where}: a row without an integer 'step' ({json.dumps(row)[:80]}); pass a train_rl run folder (<log_dir>/<run_name>) "
                            "or a benchmark's results file")
        if in_order and previous is not None and step <= previous:
            raise UserError(f"{where}: step {step} comes after step {previous} (two runs' logs in one file?); keep one row per step, in order")
        previous = step
    return rows


def split_source(source) -> tuple[Path, str | None]:
    """FILE.json:NAME -> (FILE.json, NAME); anything else -> (its path, None)."""
    file, separator, name = str(source).partition(".json:")
    return (Path(file + ".json"), name) if separator else (Path(source), None)


def is_results_file(path: Path) -> bool:
    return path.suffix == ".json" and not path.is_dir()


def read_results_file(path: Path, name: str | None) -> tuple[dict, dict]:
    """A benchmark's results file, checked: (the whole file, its runs by name: all of them, or only run `name`)."""
    try:
        results = json.loads(path.read_text())
        runs = results.get("runs")
    except (OSError, ValueError, AttributeError) as error:
        raise UserError(f"{path} is not a results file that can be read ({str(error).splitlines()[0] if str(error) else 'no runs'})") from None
    if not isinstance(runs, dict) or not all(isinstance(run, dict) and run.get("steps") for run in runs.values()):
        raise UserError(f'{path} holds no runs with steps (a results file keeps them as "runs": {{name: {{"steps": [...], "evals": [...]}}}}); pass a train_rl run folder instead')
    if name is not None and name not in runs:
        raise UserError(f"{path} has no run {name!r}; its runs: {', '.join(runs)}")
    return results, {run_name: run for run_name, run in runs.items() if name in (None, run_name)}


def _results_runs(path: Path, name: str | None, file_label: str) -> list[tuple[str, str, list, list]]:
    """(label, longer label, steps, evals) of the runs in a benchmark's results file, or of its run `name`; the longer
    label names the file by `file_label` (results_file_labels)."""
    return [(run_name, f"{file_label}/{run_name}", _numbered(run["steps"], f"{path}:{run_name} steps", in_order=True),
             _numbered(run.get("evals") or [], f"{path}:{run_name} evals")) for run_name, run in read_results_file(path, name)[1].items()]


def results_file_labels(paths: list[Path]) -> dict[str, str]:
    """Each results file's name without .json, or, where two files of one name are given (a/summary.json,
    b/summary.json), as many parent folders as tell them apart."""
    paths = list(dict.fromkeys(map(Path, paths)))
    stems = [path.stem for path in paths]
    longer = distinct_suffixes([path.with_suffix("") for path in paths])
    return {str(path): stem if stems.count(stem) == 1 else suffix for path, stem, suffix in zip(paths, stems, longer)}


def distinct_suffixes(paths: list[Path]) -> list[str]:
    """For each folder, the fewest trailing parts of its path ("a/runs/rl") that no other of `paths` ends with:
    bench outputs' run folders all end in runs/rl, so their parent alone does not tell them apart."""
    parts = [Path(path).resolve().parts for path in paths]
    suffixes = []
    for index, own in enumerate(parts):
        count = 1
        while count < len(own) and any(other[-count:] == own[-count:] for at, other in enumerate(parts) if at != index and other != own):
            count += 1
        suffixes.append("/".join(own[-max(count, 2):]))
    return suffixes


def recorded_flags(source) -> list[dict | None]:
    """The flags each run of `source` recorded, in load_runs' order: a run folder's flags.json (train_rl writes it), a
    results file run's "flags" where it holds that file's {"flags": {...}}; None for a folder without one (an older
    run's) and for a results file's runs that describe their flags in words."""
    path, name = split_source(source)
    if is_results_file(path):
        records = [run.get("flags") for run in read_results_file(path, name)[1].values()]
        return [record["flags"] if isinstance(record, dict) and isinstance(record.get("flags"), dict) else None for record in records]
    try:
        flags = json.loads((path / "flags.json").read_text())["flags"]
    except (OSError, ValueError, KeyError, TypeError):
        return [None]
    return [flags if isinstance(flags, dict) else None]


def differing_flags(flag_sets: list[dict | None]) -> list[str]:
    """For each run, the flags it recorded that another run recorded otherwise, as a command line would give them
    ("--learning_rate 1e-05 --seed 1"): what a side-by-side figure compares. Empty where no other run recorded flags."""
    known = [flags for flags in flag_sets if flags is not None]
    keys = sorted({key for flags in known for key in flags} - set(PER_RUN_FLAGS))
    differ = [key for key in keys if len({json.dumps(flags.get(key), sort_keys=True) for flags in known}) > 1]

    def given(key, value):
        if isinstance(value, bool):
            return f"--{key}" if value else f"--no-{key}"
        return f"--{key} {' '.join(map(str, value)) if isinstance(value, list) else value}"

    return ["" if flags is None else " ".join(given(key, flags.get(key)) for key in differ) for flags in flag_sets]


def load_runs(sources) -> list[tuple[str, list, list]]:
    """(label, steps, evals) for every run the sources name: train_rl run folders, results files
    (FILE.json: all its runs; FILE.json:NAME: one). Labels are run names, made longer (as many
    parent folders as tell them apart, or the file) where two would be the same."""
    runs = []
    folders = [path for path, _ in map(split_source, sources) if not is_results_file(path)]
    longer = dict(zip(map(str, folders), distinct_suffixes(folders)))
    files = results_file_labels([path for path, _ in map(split_source, sources) if is_results_file(path)])
    for source in sources:
        path, name = split_source(source)
        if is_results_file(path):
            runs += _results_runs(path, name, files[str(path)])
        else:
            runs.append((path.name, longer[str(path)], _steps_of(path), _evals_of(path)))
    names = [label for label, *_ in runs]
    return [(label if names.count(label) == 1 else longer, steps, evals) for label, longer, steps, evals in runs]


def plot_runs(sources, out) -> Path:
    """Draw several runs side by side into `out`, one line per run (sources as `load_runs` takes them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load_runs(sources)
    differ = differing_flags([flags for source in sources for flags in recorded_flags(source)])
    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    for (label, steps, evals), flags in zip(runs, differ):
        label = f"{label}: {flags}" if flags else label  # what the runs compare, where their folders recorded it
        minutes = training_minutes(steps)
        x, accuracy = _series(evals, "avg_all_rewards")
        line = axes[0, 0].plot(x, accuracy, marker="o", markersize=3, label=label)[0]
        axes[0, 1].plot([minutes.get(step, float("nan")) for step in x], accuracy, marker="o", markersize=3, color=line.get_color(), label=label)
        for axis, key in ((axes[1, 0], "train/reward"), (axes[1, 1], "train/response_length")):
            axis.plot(*_series(steps, key), color=line.get_color(), linewidth=1, label=label)
    for axis, title, xlabel in ((axes[0, 0], "held-out accuracy (greedy)", "step"),
                                (axes[0, 1], "held-out accuracy (greedy)", "training minutes (evaluations left out)"),
                                (axes[1, 0], "reward (train rollouts)", "step"), (axes[1, 1], "response length (train, tokens)", "step")):
        axis.set_title(title, fontsize=10)
        axis.set_xlabel(xlabel, fontsize=8)
        axis.tick_params(labelsize=8)
        axis.grid(alpha=0.3)
    axes[0, 1].legend(fontsize=7)
    figure.tight_layout()
    return _save(figure, Path(out))


def plot_run(run_dir, out=None, start_eval: dict | None = None) -> Path:
    """Draw `run_dir`'s curves into `out` (default <run_dir>/curves.png); returns the path.

    `start_eval`: the starting checkpoint's evaluation metrics, drawn at step 0 (the demo
    passes the SFT checkpoint's, so the accuracy curve starts where RL started).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    steps, evals = _steps_of(run_dir), _evals_of(run_dir)
    if start_eval:
        evals = [{**start_eval, "step": 0}, *evals]
    panels = [
        ("reward (train rollouts)", [("train/reward", "reward"), ("train/format_reward", "format rate")]),
        ("held-out accuracy (greedy)", [("avg_all_rewards", "accuracy"), ("format_reward", "format rate")]),
        ("response length (tokens)", [("train/response_length", "mean")]),
        ("KL to reference / clip fraction", [("train/kl_ref", "KL (k3)"), ("train/clip_fraction", "clipped tokens")]),
        ("sampler vs trainer", [("train/sampler_logprob_abs_diff", "mean |log-prob gap|")]),
        ("seconds per step", [("perf/step_seconds", "step"), ("perf/rollout_seconds", "rollout"), ("perf/update_seconds", "update")]),
    ]
    figure, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    for axis, (title, curves) in zip(axes.flat, panels):
        rows = evals if title.startswith("held-out") else steps
        for key, label in curves:
            x, y = _series(rows, key)
            if x:
                axis.plot(x, y, marker="o" if len(x) < 20 else None, markersize=3, label=label)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("step", fontsize=8)
        axis.tick_params(labelsize=8)
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend(fontsize=7)
        else:
            axis.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axis.transAxes, color="gray")
    figure.suptitle(str(run_dir), fontsize=10)
    figure.tight_layout()
    return _save(figure, Path(out) if out else run_dir / "curves.png")


def _save(figure, out: Path) -> Path:
    """Write the figure to `out`; a place it cannot go (under a file, a folder of that name, no permission) is one line."""
    import matplotlib.pyplot as plt

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, dpi=80)
    except OSError as error:
        raise UserError(f"cannot write the figure to {out} ({error.strerror or error}); pass --out a writable .png path") from None
    finally:
        plt.close(figure)
    return out


def comparison_path(sources) -> Path:
    """Where a comparison goes without --out: compare_<a>_vs_<b>.png, named for its runs so that another
    comparison does not replace it, beside the first run folder (runs/ when all are results files, which
    sit among tracked files). Run folders of one name (bench outputs' runs/rl) are named with as many parent
    folders as tell them apart, and a name cut to length ends in a hash of the whole, as load_runs labels them apart."""
    split = [split_source(source) for source in sources]
    folders = [path for path, _ in split if not is_results_file(path)]
    short = [path.name for path in folders]
    longer = dict(zip(map(str, folders), distinct_suffixes(folders)))
    files = results_file_labels([path for path, _ in split if is_results_file(path)])
    names = []
    for path, name in split:
        if is_results_file(path):
            names.append(files[str(path)].replace("/", "_") + (f"_{name}" if name else ""))
        else:
            names.append(path.name if short.count(path.name) == 1 else longer[str(path)].replace("/", "_"))
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", "_vs_".join(names))
    if len(stem) > 120:
        stem = f"{stem[:111]}_{hashlib.sha256(stem.encode()).hexdigest()[:8]}"
    return (folders[0].parent if folders else Path("runs")) / f"compare_{stem}.png"


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m alignment.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", nargs="+", help="a train_rl run folder (<log_dir>/<run_name>), holding steps.jsonl; several: side by side; "
                                                   "also a results file, FILE.json (all its runs) or FILE.json:NAME")
    parser.add_argument("--out", default=None, help="PNG to write; default <run_dir>/curves.png, for several runs compare_<run>_vs_<run>.png beside the first run's folder (runs/ for results files alone)")
    args = parser.parse_args(argv)
    # `--out=~/x.png` (no shell expands it) names the home folder: it made a folder named `~` in the working folder
    args.run_dir, args.out = [os.path.expanduser(source) for source in args.run_dir], args.out and os.path.expanduser(args.out)
    if args.out and Path(args.out).suffix.lower() not in IMAGE_SUFFIXES:
        raise UserError(f"--out {args.out}: name an image file ending in {', '.join(IMAGE_SUFFIXES)} (the figure's format follows the name)")
    first = split_source(args.run_dir[0])[0]
    if len(args.run_dir) == 1 and not is_results_file(first):
        out = plot_run(first, args.out)
    else:
        out = plot_runs(args.run_dir, args.out or comparison_path(args.run_dir))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    run_cli(main)
