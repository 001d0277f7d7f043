"""`python -m alignment.plot`: a run folder's steps.jsonl and evals.jsonl become one PNG."""

import json
import re
import shutil
from pathlib import Path

import pytest

from alignment.errors import UserError
from alignment.plot import comparison_path, main, read_jsonl


def test_plot_draws_a_run_and_skips_a_torn_line(tmp_path):
    import matplotlib.image

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "train/reward": 0.1 * s, "train/format_reward": 1.0, "train/response_length": 10 + s, "train/kl_ref": None,
             "train/clip_fraction": 0.0, "train/sampler_logprob_abs_diff": 0.01, "perf/step_seconds": 2.0, "perf/rollout_seconds": 1.0,
             "perf/update_seconds": 0.9} for s in range(1, 6)]
    (run / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "train/rew')
    (run / "evals.jsonl").write_text(json.dumps({"step": 5, "avg_all_rewards": 0.5, "format_reward": 1.0}) + "\n")
    assert [r["step"] for r in read_jsonl(run / "steps.jsonl")] == [1, 2, 3, 4, 5]  # the torn line is skipped
    out = main([str(run)])
    assert out == run / "curves.png"
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (520, 960)  # 12 x 6.5 inches at 80 dpi
    assert image[..., :3].std() > 0.05  # curves and text, not a blank canvas


def test_plot_of_a_folder_without_steps_is_one_line(tmp_path):
    with pytest.raises(UserError, match="has no steps; pass the folder of a train_rl run"):
        main([str(tmp_path)])


def test_plot_of_several_runs_draws_them_side_by_side_against_training_minutes(tmp_path):
    import matplotlib.image

    from alignment.plot import training_minutes

    # 3 s a step; the evaluation at step 2 took 2 of its 5 s: the training clock leaves it out
    rows = [{"step": 1, "perf/step_seconds": 3.0, "perf/eval_seconds": 0.0}, {"step": 2, "perf/step_seconds": 5.0, "perf/eval_seconds": 2.0},
            {"step": 3, "perf/step_seconds": 3.0, "perf/eval_seconds": None}]
    assert training_minutes(rows) == {0: 0.0, 1: 3.0 / 60, 2: 6.0 / 60, 3: 9.0 / 60}
    runs = []
    for parent, reward in (("a", 0.2), ("b", 0.6)):  # the same run name in two log folders: labelled by both
        run = tmp_path / parent / "rl"
        run.mkdir(parents=True)
        (run / "steps.jsonl").write_text("".join(json.dumps({**row, "train/reward": reward, "train/response_length": 40.0}) + "\n" for row in rows))
        (run / "evals.jsonl").write_text("".join(json.dumps({"step": s, "avg_all_rewards": reward + 0.1 * s}) + "\n" for s in (0, 3)))
        runs.append(str(run))
    out = main(runs)
    assert out == tmp_path / "a" / "compare_a_rl_vs_b_rl.png"  # named for its runs: another comparison does not replace it
    # the same run name in other folders (bench outputs' runs/rl): another file, where a/rl vs c/rl replaced a/rl vs b/rl
    (tmp_path / "c").mkdir()
    shutil.copytree(tmp_path / "b" / "rl", tmp_path / "c" / "rl")
    assert comparison_path([runs[0], str(tmp_path / "c" / "rl")]) == tmp_path / "a" / "compare_a_rl_vs_c_rl.png"
    # long run names that differ only past the cut: apart too
    long = [str(tmp_path / "a" / ("sweep_" * 25 + tail)) for tail in ("lr_1e-6", "lr_2e-6")]
    paths = [comparison_path([runs[0], other]) for other in long]
    assert paths[0] != paths[1] and all(len(path.name) == len("compare_.png") + 120 for path in paths)
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (640, 960) and image[..., :3].std() > 0.05  # 12 x 8 inches at 80 dpi
    with pytest.raises(UserError, match="has no steps"):
        main([runs[0], str(tmp_path)])


def test_runs_come_from_folders_and_from_a_benchmarks_results_file(tmp_path, monkeypatch):
    import matplotlib.image

    monkeypatch.chdir(tmp_path)

    from alignment.plot import load_runs

    def steps(reward):
        return [{"step": s, "train/reward": reward, "perf/step_seconds": 2.0} for s in (1, 2)]

    results = tmp_path / "results" / "bench.json"
    results.parent.mkdir()
    results.write_text(json.dumps({"date": "d", "runs": {"seed42": {"steps": steps(0.3), "evals": [{"step": 2, "avg_all_rewards": 0.5}]},
                                                         "seed1": {"steps": steps(0.4), "evals": [{"step": 2, "avg_all_rewards": 0.6}]}}}))
    folder = tmp_path / "runs" / "seed1"  # a run folder named like one of the file's runs
    folder.mkdir(parents=True)
    (folder / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in steps(0.9)))
    runs = load_runs([results, folder])
    assert [label for label, *_ in runs] == ["seed42", "bench/seed1", "runs/seed1"]  # equal names made longer
    assert [row["train/reward"] for row in runs[1][1]] == [0.4, 0.4] and runs[1][2] == [{"step": 2, "avg_all_rewards": 0.6}]
    assert runs[2][1] == steps(0.9) and runs[2][2] == []
    assert [(label, evals) for label, _, evals in load_runs([f"{results}:seed1"])] == [("seed1", [{"step": 2, "avg_all_rewards": 0.6}])]
    out = main([str(results), f"{results}:seed1"])  # results files alone: into runs/, not among the tracked results
    assert out == Path("runs") / "compare_bench_vs_bench_seed1.png" and matplotlib.image.imread(out)[..., :3].std() > 0.05
    assert main([str(folder), str(results)]) == tmp_path / "runs" / "compare_seed1_vs_bench.png"
    assert not list(results.parent.glob("*.png"))
    with pytest.raises(UserError, match=r"bench.json has no run 'seed7'; its runs: seed42, seed1"):
        main([f"{results}:seed7"])
    (tmp_path / "summary.json").write_text(json.dumps({"accuracy": 0.5}))
    with pytest.raises(UserError, match="summary.json holds no runs with steps"):
        main([str(tmp_path / "summary.json")])
    (tmp_path / "torn.json").write_text('{"runs": {"a"')
    with pytest.raises(UserError, match="torn.json is not a results file that can be read"):
        main([str(tmp_path / "torn.json")])
    # results files of one name in other folders: labelled and named by the folders that tell them apart (both were
    # "summary_results/ours", and a vs c replaced a vs b's figure)
    for where, reward in (("a", 0.1), ("b", 0.2), ("c", 0.3)):
        (tmp_path / where).mkdir()
        (tmp_path / where / "summary_results.json").write_text(json.dumps({"runs": {"ours": {"steps": steps(reward), "evals": []}}}))
    pair = [str(tmp_path / "a" / "summary_results.json"), str(tmp_path / "b" / "summary_results.json")]
    assert [label for label, *_ in load_runs(pair)] == ["a/summary_results/ours", "b/summary_results/ours"]
    assert main(pair) == Path("runs") / "compare_a_summary_results_vs_b_summary_results.png"
    assert main([pair[0], str(tmp_path / "c" / "summary_results.json")]) == Path("runs") / "compare_a_summary_results_vs_c_summary_results.png"
    # a steps.jsonl row that is not an object is skipped as a torn line is
    (folder / "steps.jsonl").write_text("[1, 2]\n" + "".join(json.dumps(row) + "\n" for row in steps(0.9)))
    assert load_runs([folder])[0][1] == steps(0.9)


def test_bench_runs_of_one_name_get_their_own_comparison_and_labels(tmp_path):
    """Two bench outputs' runs (gsm8k_A/runs/rl, gsm8k_B/runs/rl): named and labelled by their parent alone, both
    were "runs/rl", so A vs C replaced A vs B's figure and the legend could not tell the lines apart."""
    from alignment.plot import load_runs

    runs = []
    for out in ("gsm8k_A", "gsm8k_B", "gsm8k_C"):
        run = tmp_path / out / "runs" / "rl"
        run.mkdir(parents=True)
        (run / "steps.jsonl").write_text(json.dumps({"step": 1, "perf/step_seconds": 3.0, "train/reward": 0.5}) + "\n")
        runs.append(str(run))
    assert [label for label, *_ in load_runs(runs[:2])] == ["gsm8k_A/runs/rl", "gsm8k_B/runs/rl"]
    first, second = comparison_path(runs[:2]), comparison_path([runs[0], runs[2]])
    assert first == tmp_path / "gsm8k_A" / "runs" / "compare_gsm8k_A_runs_rl_vs_gsm8k_B_runs_rl.png" and second != first
    with pytest.raises(UserError, match=r"^--out notes.txt: name an image file ending in .png, .pdf, .svg, .jpg"):
        main([*runs[:2], "--out", "notes.txt"])


def test_a_figure_that_cannot_be_written_is_one_line(tmp_path):
    """--out under a regular file, or naming a folder: FileExistsError and IsADirectoryError tracebacks from matplotlib."""
    run = tmp_path / "rl"
    run.mkdir()
    (run / "steps.jsonl").write_text(json.dumps({"step": 1, "perf/step_seconds": 3.0, "train/reward": 0.5}) + "\n")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "folder.png").mkdir()
    for out in (tmp_path / "afile" / "x.png", tmp_path / "folder.png"):
        with pytest.raises(UserError, match=rf"^cannot write the figure to {re.escape(str(out))} \(.*\); pass --out a writable .png path$"):
            main([str(run), "--out", str(out)])
    assert main([str(run), "--out", str(tmp_path / "ok.png")]) == tmp_path / "ok.png"


def captured_figures(monkeypatch) -> list:
    """Figures that plot_run / plot_runs draw, kept open instead of written (their lines can then be read back)."""
    from alignment import plot

    figures = []
    monkeypatch.setattr(plot, "_save", lambda figure, out: figures.append(figure) or out)
    return figures


def curves(axis) -> dict:
    """label -> (x, y) of an axis' lines."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in axis.get_lines()}


def test_a_runs_panels_draw_every_logged_point_of_the_right_series(tmp_path, monkeypatch):
    """Each panel reads its own key from the right file: train curves from steps.jsonl, held-out accuracy from evals.jsonl
    (the start checkpoint's at step 0), every point up to the last, zeros included, a null left out."""
    import matplotlib.pyplot as plt

    from alignment.plot import plot_run

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 1, "train/reward": 0.0, "train/format_reward": 0.5, "train/response_length": 30.0, "train/kl_ref": 0.0, "train/clip_fraction": 0.1},
            {"step": 2, "train/reward": 0.25, "train/format_reward": 1.0, "train/response_length": 20.0, "train/kl_ref": None, "train/clip_fraction": 0.2},
            {"step": 3, "train/reward": 0.5, "train/format_reward": 1.0, "train/response_length": 10.0, "train/kl_ref": 0.02, "train/clip_fraction": 0.3}]
    (run / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run / "evals.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ({"step": 2, "avg_all_rewards": 0.0, "format_reward": 0.5},
                                                                               {"step": 3, "avg_all_rewards": 0.75, "format_reward": 1.0})))
    figures = captured_figures(monkeypatch)
    plot_run(run, start_eval={"avg_all_rewards": 0.125, "format_reward": 0.25})
    axes = figures[0].axes
    assert curves(axes[0]) == {"reward": ([1, 2, 3], [0.0, 0.25, 0.5]), "format rate": ([1, 2, 3], [0.5, 1.0, 1.0])}
    assert curves(axes[1]) == {"accuracy": ([0, 2, 3], [0.125, 0.0, 0.75]), "format rate": ([0, 2, 3], [0.25, 0.5, 1.0])}
    assert curves(axes[2]) == {"mean": ([1, 2, 3], [30.0, 20.0, 10.0])}
    assert curves(axes[3]) == {"KL (k3)": ([1, 3], [0.0, 0.02]), "clipped tokens": ([1, 2, 3], [0.1, 0.2, 0.3])}
    plt.close(figures[0])


def test_side_by_side_runs_draw_accuracy_against_steps_and_training_minutes_and_the_train_curves(tmp_path, monkeypatch):
    """One line per run in each panel: held-out accuracy at the evaluated steps and at the training minutes after them
    (the start's evaluation at minute 0), train reward and response length per step."""
    import matplotlib.pyplot as plt

    from alignment.plot import plot_runs

    runs = []
    for name, reward in (("a", 0.25), ("b", 0.5)):
        run = tmp_path / name
        run.mkdir()
        steps = [{"step": s, "perf/step_seconds": 60.0, "perf/eval_seconds": 30.0 if s == 2 else 0.0, "train/reward": reward * s,
                  "train/response_length": 100.0 - s, "format_reward": 1.0} for s in (1, 2, 3)]
        (run / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in steps))
        (run / "evals.jsonl").write_text("".join(json.dumps({"step": s, "avg_all_rewards": accuracy, "format_reward": 1.0}) + "\n"
                                                 for s, accuracy in ((0, 0.0), (2, reward), (3, 2 * reward))))
        runs.append(str(run))
    figures = captured_figures(monkeypatch)
    plot_runs(runs, tmp_path / "compare.png")
    axes = figures[0].axes  # (0, 0), (0, 1), (1, 0), (1, 1)
    assert curves(axes[0]) == {"a": ([0, 2, 3], [0.0, 0.25, 0.5]), "b": ([0, 2, 3], [0.0, 0.5, 1.0])}
    # 60 s a step, 30 s of step 2 evaluating: 0, 1.5 and 2.5 training minutes at steps 0, 2 and 3
    assert curves(axes[1]) == {"a": ([0.0, 1.5, 2.5], [0.0, 0.25, 0.5]), "b": ([0.0, 1.5, 2.5], [0.0, 0.5, 1.0])}
    assert curves(axes[2]) == {"a": ([1, 2, 3], [0.25, 0.5, 0.75]), "b": ([1, 2, 3], [0.5, 1.0, 1.5])}
    assert curves(axes[3]) == {"a": ([1, 2, 3], [99.0, 98.0, 97.0]), "b": ([1, 2, 3], [99.0, 98.0, 97.0])}
    plt.close(figures[0])


def test_side_by_side_runs_are_labelled_with_the_flags_that_differ_between_them(tmp_path, monkeypatch):
    """Two runs that differ in one flag were labelled by their folder names alone: the figure did not say what it compared.
    Each run's own places (--run_name, --checkpoint_path) are not a difference; a run without flags.json gets no flags."""
    import matplotlib.pyplot as plt

    from alignment.plot import plot_runs

    base = {"learning_rate": 2e-06, "seed": 42, "adam_betas": [0.9, 0.95], "dynamic_sampling": False, "max_train_minutes": None}
    changes = {"a": {}, "b": {"learning_rate": 1e-05, "adam_betas": [0.9, 0.99], "dynamic_sampling": True}, "c": {"seed": 1}, "old": None}
    runs = []
    for name, change in changes.items():
        run = tmp_path / name
        run.mkdir()
        (run / "steps.jsonl").write_text(json.dumps({"step": 1, "perf/step_seconds": 6.0, "train/reward": 0.5, "train/response_length": 9.0}) + "\n")
        (run / "evals.jsonl").write_text(json.dumps({"step": 1, "avg_all_rewards": 0.5}) + "\n")
        if change is not None:
            flags = {**base, **change, "run_name": name, "checkpoint_path": f"checkpoints/{name}"}
            (run / "flags.json").write_text(json.dumps({"flags": flags, "derived_flags": []}))
        runs.append(str(run))
    figures = captured_figures(monkeypatch)
    plot_runs(runs, tmp_path / "compare.png")
    assert list(curves(figures[0].axes[0])) == [
        "a: --adam_betas 0.9 0.95 --no-dynamic_sampling --learning_rate 2e-06 --seed 42",
        "b: --adam_betas 0.9 0.99 --dynamic_sampling --learning_rate 1e-05 --seed 42",
        "c: --adam_betas 0.9 0.95 --no-dynamic_sampling --learning_rate 2e-06 --seed 1", "old"]
    plt.close(figures[0])
    plot_runs(runs[:1] + runs[3:], tmp_path / "compare.png")  # one run with flags: nothing to compare them with
    assert list(curves(figures[1].axes[0])) == ["a", "old"]
    plt.close(figures[1])
    results = tmp_path / "bench.json"  # a results file whose run carries its folder's flags.json, beside a run folder
    results.write_text(json.dumps({"runs": {"r": {"flags": {"flags": {**base, "seed": 7}}, "steps": [{"step": 1, "perf/step_seconds": 6.0}],
                                                  "evals": []}, "words": {"flags": "the recipe's", "steps": [{"step": 1}], "evals": []}}}))
    plot_runs([runs[0], str(results)], tmp_path / "compare.png")
    assert list(curves(figures[2].axes[2])) == ["a: --seed 42", "r: --seed 7", "words"]
    plt.close(figures[2])


def test_a_value_that_is_not_a_number_counts_as_not_logged(tmp_path, monkeypatch):
    """A string (or a boolean) that another writer logged under a scalar's key broke a side-by-side plot with a TypeError
    from the training-minutes sum; it is a point not logged, as a null is, in the curves and in the minutes."""
    import matplotlib.pyplot as plt

    from alignment.plot import plot_run, plot_runs

    run = tmp_path / "other"
    run.mkdir()
    steps = [{"step": 1, "perf/step_seconds": 60.0, "train/reward": 0.5}, {"step": 2, "perf/step_seconds": "n/a", "train/reward": True},
             {"step": 3, "perf/step_seconds": 120.0, "train/reward": 0.75}]
    (run / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in steps))
    (run / "evals.jsonl").write_text("".join(json.dumps({"step": s, "avg_all_rewards": a}) + "\n" for s, a in ((2, "0.5"), (3, 0.6))))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "steps.jsonl").write_text(json.dumps({"step": 1, "perf/step_seconds": 60.0, "train/reward": 0.5}) + "\n")
    figures = captured_figures(monkeypatch)
    plot_runs([str(run), str(plain)], tmp_path / "compare.png")
    axes = figures[0].axes
    assert curves(axes[0])["other"] == ([3], [0.6]) and curves(axes[1])["other"] == ([3.0], [0.6])  # minutes 1 + 0 + 2
    assert curves(axes[2])["other"] == ([1, 3], [0.5, 0.75])
    plot_run(run)
    plt.close(figures[0])
    plt.close(figures[1])


def test_a_torn_line_inside_a_log_is_skipped_and_the_lines_after_it_are_read(tmp_path):
    """A line cut short is skipped, not the end of the file: the steps logged after it still count."""
    log = tmp_path / "steps.jsonl"
    log.write_text('{"step": 1}\n{"step": 2, "train/rew\n{"step": 3}\n')
    assert read_jsonl(log) == [{"step": 1}, {"step": 3}]


def test_a_log_of_another_kind_or_with_a_step_logged_twice_is_one_line(tmp_path):
    """A file of another kind as a run's log (evaluate's samples.jsonl as steps.jsonl, an evals row without its step, a
    results file whose rows are lists) was a KeyError or AttributeError traceback, or a blank figure written without a
    word; a step logged twice (two runs' logs in one file) drew the curve back on itself and counted its seconds twice."""
    run = tmp_path / "rl"
    run.mkdir()
    steps = [{"step": s, "perf/step_seconds": 60.0, "train/reward": 0.5} for s in (1, 2, 3)]

    def write(steps_rows, evals_rows=()):
        (run / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in steps_rows))
        (run / "evals.jsonl").write_text("".join(json.dumps(row) + "\n" for row in evals_rows))

    other = tmp_path / "other"
    other.mkdir()
    (other / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in steps))
    cases = [
        ([{"prompt": "p", "response": "r", "reward": 1.0}], [], r"rl/steps.jsonl: a row without an integer 'step' \({\"prompt\": \"p\""),
        ([*steps[:2], {"step": "3", "train/reward": 0.5}], [], r"rl/steps.jsonl: a row without an integer 'step'"),
        (steps, [{"avg_all_rewards": 0.5}], r"rl/evals.jsonl: a row without an integer 'step'"),
        ([*steps, *steps[1:]], [], r"rl/steps.jsonl: step 2 comes after step 3 \(two runs' logs in one file\?\); keep one row per step, in order"),
    ]
    for steps_rows, evals_rows, message in cases:
        write(steps_rows, evals_rows)
        for sources in ([str(run)], [str(run), str(other)]):  # one run's figure, and side by side
            with pytest.raises(UserError, match=message):
                main([*sources, "--out", str(tmp_path / "figure.png")])
    assert not (tmp_path / "figure.png").exists()
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"runs": {"a": {"steps": [[1, 0.5]], "evals": []}}}))
    with pytest.raises(UserError, match=r"results.json:a steps: a row without an integer 'step' \(\[1, 0.5\]\)"):
        main([str(results), "--out", str(tmp_path / "figure.png")])
    write(steps, [{"step": 0, "avg_all_rewards": 0.25}, {"step": 3, "avg_all_rewards": 0.5}])
    assert main([str(run)]) == run / "curves.png"


def test_a_tilde_in_out_names_the_home_folder(tmp_path, monkeypatch):
    """`--out=~/curves.png` (no shell expands it) wrote into a folder named `~` in the working folder."""
    home, work = tmp_path / "home", tmp_path / "work"
    (home / "rl").mkdir(parents=True)
    work.mkdir()
    (home / "rl" / "steps.jsonl").write_text(json.dumps({"step": 1, "perf/step_seconds": 3.0, "train/reward": 0.5}) + "\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert main(["~/rl", "--out=~/figures/rl.png"]) == home / "figures" / "rl.png"
    assert (home / "figures" / "rl.png").is_file() and not list(work.iterdir())
