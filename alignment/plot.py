"""One picture of a run: the curves people look at first, without a TensorBoard server.

    python -m alignment.plot runs/rl                  # writes runs/rl/curves.png
    python -m alignment.plot runs/demo/rl --out curves.png

Reads the run folder's steps.jsonl (one line of scalars per step, written by train_rl)
and evals.jsonl (one line per evaluation) and draws, against the step: train reward
and format rate, held-out accuracy, response length, KL to the reference and the clip
fraction, the sampler/trainer log-prob gap, and seconds per step. Headless (Agg).
"""

import argparse
import json
from pathlib import Path

from alignment.errors import UserError, run_cli


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a jsonl file; a line cut short by a crash is skipped."""
    rows = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
    return [step for step, _ in points], [value for _, value in points]


def plot_run(run_dir, out=None, start_eval: dict | None = None) -> Path:
    """Draw `run_dir`'s curves into `out` (default <run_dir>/curves.png); returns the path.

    `start_eval`: the starting checkpoint's evaluation metrics, drawn at step 0 (the demo
    passes the SFT checkpoint's, so the accuracy curve starts where RL started).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    steps, evals = read_jsonl(run_dir / "steps.jsonl"), read_jsonl(run_dir / "evals.jsonl")
    if start_eval:
        evals = [{**start_eval, "step": 0}, *evals]
    if not steps:
        raise UserError(f"{run_dir / 'steps.jsonl'} has no steps; pass the folder of a train_rl run (<log_dir>/<run_name>)")
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
    out = Path(out) if out else run_dir / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=80)
    plt.close(figure)
    return out


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m alignment.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a train_rl run folder (<log_dir>/<run_name>), holding steps.jsonl")
    parser.add_argument("--out", default=None, help="PNG to write; default <run_dir>/curves.png")
    args = parser.parse_args(argv)
    out = plot_run(args.run_dir, args.out)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    run_cli(main)
