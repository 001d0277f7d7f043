"""bench/group_signal.py: the pass-rate model fitted to a run's tied-group logs, checked on groups sampled from a known spread."""

import importlib.util
import json
import random

import pytest

from alignment.errors import UserError
from conftest import REPO_ROOT

spec = importlib.util.spec_from_file_location("group_signal", REPO_ROOT / "bench" / "group_signal.py")
group_signal = importlib.util.module_from_spec(spec)
spec.loader.exec_module(group_signal)


def sampled_steps(a: float, b: float, group_size: int, steps: int, prompts: int, seed: int = 0) -> list[dict]:
    """steps.jsonl rows as train_rl logs them, for prompts whose pass rates are drawn from Beta(a, b) and whose
    groups are sampled as 0/1 rewards."""
    rng, rows = random.Random(seed), []
    for step in range(1, steps + 1):
        groups = [[float(rng.random() < p) for _ in range(group_size)] for p in (rng.betavariate(a, b) for _ in range(prompts))]
        right = sum(all(group) for group in groups) / prompts
        rows.append({"step": step, "train/reward": sum(map(sum, groups)) / (prompts * group_size), "train/fraction_groups_all_right": right,
                     "train/fraction_groups_all_equal": right + sum(not any(group) for group in groups) / prompts})
    return rows


def mixed_fraction(a: float, b: float, group_size: int, prompts: int, seed: int) -> float:
    """The fraction of sampled groups whose rewards differ, counted."""
    rows = sampled_steps(a, b, group_size, 1, prompts, seed)
    return 1 - rows[0]["train/fraction_groups_all_equal"]


def test_the_fit_recovers_a_known_spread_and_predicts_other_group_sizes():
    """Pass rates from Beta(0.7, 0.2) (the shape the 1.5B's base-start runs fit), groups of 8: the fit finds the spread
    from the reward and the all-right fraction, matches the all-wrong fraction it did not use, and predicts the mixed
    fraction of groups of 4 and 16 as they come out when sampled."""
    rows = sampled_steps(0.7, 0.2, 8, steps=200, prompts=100, seed=1)
    result = group_signal.analyse(rows, group_size=8, sizes=[4, 8, 16], from_step=1, label="sampled")
    assert result["steps"] == 200
    assert result["beta"] == [pytest.approx(0.7, rel=0.1), pytest.approx(0.2, rel=0.1)]
    assert result["all_wrong_fitted"] == pytest.approx(result["all_wrong"], abs=0.005)
    for size in (4, 16):
        assert result["sizes"][size]["mixed"] == pytest.approx(mixed_fraction(0.7, 0.2, size, prompts=20000, seed=size), abs=0.015)
    # a spread with more mass in the middle gives more mixed groups of 8: the model tells the two apart
    flatter = group_signal.analyse(sampled_steps(2.0, 0.6, 8, steps=100, prompts=100, seed=2), 8, [8], 1, "flatter")
    assert flatter["beta"] == [pytest.approx(2.0, rel=0.15), pytest.approx(0.6, rel=0.15)]
    assert flatter["sizes"][8]["mixed"] > result["sizes"][8]["mixed"] + 0.2
    assert result["sizes"][8]["mixed_per_1000_samples"] == pytest.approx(1000 * result["sizes"][8]["mixed"] / 8)


def test_the_cli_reads_a_run_folder_from_a_step_on_and_refuses_logs_no_spread_fits(tmp_path, capsys):
    run = tmp_path / "runs" / "rl"
    run.mkdir(parents=True)
    early = sampled_steps(0.05, 0.95, 8, 9, 50)  # before the format is learned: nearly every group all wrong
    later = [{**row, "step": row["step"] + 9} for row in sampled_steps(0.7, 0.2, 8, 100, 100, seed=3)]
    (run / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in early + later))
    results = group_signal.main([str(run), "--from_step", "10", "--sizes", "8", "16", "--out", str(tmp_path / "signal.json")])
    out = capsys.readouterr().out
    assert out.startswith("rl: 100 steps from step 10, groups of 8: reward 0.7")  # the early steps (every group tied) left out
    assert json.loads((tmp_path / "signal.json").read_text())[0]["beta"] == pytest.approx(results[0]["beta"])
    assert results[0]["beta"] == [pytest.approx(0.7, rel=0.15), pytest.approx(0.2, rel=0.15)]
    assert group_signal.main([str(run)])[0]["reward"] < results[0]["reward"] - 0.05  # from step 1 the early steps count
    with pytest.raises(UserError, match=r"^rl: a reward of 0.7\d\d with 0.5\d\d of the groups of 2 all right fits no spread of pass rates .*check --group_size"):
        group_signal.main([str(run), "--from_step", "10", "--group_size", "2"])  # the runs' group size mistyped: more groups of 2 would be all right
    with pytest.raises(UserError, match=r"^rl: no step from --from_step 500 on logs train/reward"):
        group_signal.main([str(run), "--from_step", "500"])


def test_out_never_replaces_an_input_or_a_file_of_another_kind(tmp_path, capsys):
    """`--out runs/rl/steps.jsonl` replaced the run's log with the results; a results file given as both input and --out,
    or a file of the user's, was replaced the same way; --out naming a folder or a missing folder was a traceback."""
    run = tmp_path / "runs" / "rl"
    run.mkdir(parents=True)
    log = "".join(json.dumps(row) + "\n" for row in sampled_steps(0.7, 0.2, 8, 20, 50, seed=4))
    (run / "steps.jsonl").write_text(log)
    results = tmp_path / "bench.json"
    results.write_text(json.dumps({"runs": {"a": {"steps": sampled_steps(0.7, 0.2, 8, 20, 50, seed=5), "evals": []}}}))
    saved = results.read_text()
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}\n')
    for out, message in ((run / "steps.jsonl", r"is inside the input .*rl; write the results elsewhere"),
                         (run, r"is the input .*rl; write the results elsewhere"),
                         (results, r"is the input .*bench.json:a; write the results elsewhere"),
                         (notes, r"already holds a file that is not this script's results; pass another path, or move it away")):
        with pytest.raises(UserError, match=rf"^--out {out} {message}"):
            group_signal.main([str(run), f"{results}:a", "--out", str(out)])
    assert (run / "steps.jsonl").read_text() == log and results.read_text() == saved and notes.read_text() == '{"mine": 1}\n'
    (tmp_path / "afolder").mkdir()
    with pytest.raises(UserError, match=r"^--out .*afolder: cannot write it \(Is a directory\); pass a writable file path$"):
        group_signal.main([str(run), "--out", str(tmp_path / "afolder")])
    out = tmp_path / "new" / "signal.json"  # a folder that is not there yet is made, and the script's own results are replaced
    for _ in range(2):
        assert group_signal.main([str(run), "--out", str(out)])[0]["steps"] == 20
    assert json.loads(out.read_text())[0]["run"] == "rl"


def test_a_nan_in_the_log_counts_as_not_logged(tmp_path):
    """A NaN (from another writer; train_rl writes null) made the averages NaN, and the error blamed --group_size."""
    rows = sampled_steps(0.7, 0.2, 8, 30, 50, seed=6)
    with_nan = [{**row, "train/reward": float("nan")} if row["step"] == 3 else row for row in rows]
    result = group_signal.analyse(with_nan, 8, [8], 1, "nan")
    assert result["steps"] == 29 and result["reward"] == pytest.approx(group_signal.analyse(rows[:2] + rows[3:], 8, [8], 1, "x")["reward"])


def test_each_run_is_fitted_with_the_group_size_it_recorded(tmp_path, capsys):
    """The fit used --group_size (default 8) for every run: a run of groups of 4 was fitted as groups of 8 unless the user
    remembered to say so, and one command could not read runs of two group sizes."""
    g4 = tmp_path / "runs" / "g4"
    g4.mkdir(parents=True)
    rows4 = sampled_steps(0.7, 0.2, 4, 40, 100, seed=7)
    (g4 / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows4))
    (g4 / "flags.json").write_text(json.dumps({"flags": {"group_size": 4}, "derived_flags": []}))
    results = tmp_path / "bench.json"  # a results file: its settings' group size, a variant's own --group_size in its flags
    results.write_text(json.dumps({"rl_settings": {"group_size": 8}, "runs": {
        "rl": {"flags": "the recipe's train_rl flags", "steps": sampled_steps(0.7, 0.2, 8, 40, 100, seed=8), "evals": []},
        "g16": {"flags": "the recipe's train_rl flags, --group_size 16 --rollout_batch_size 16", "steps": sampled_steps(0.7, 0.2, 16, 40, 100, seed=9),
                "evals": []}}}))
    found = group_signal.main([str(g4), str(results)])
    assert [(result["run"], result["group_size"]) for result in found] == [("g4", 4), ("rl", 8), ("g16", 16)]
    for result in found:  # each fitted with its own size recovers the spread all three were sampled from
        assert result["beta"] == [pytest.approx(0.7, rel=0.2), pytest.approx(0.2, rel=0.2)], result["run"]
    assert group_signal.main([f"{results}:g16", "--group_size", "16"])[0]["group_size"] == 16
    data = json.loads(results.read_text())
    data["runs"]["g16"]["flags"] = "the recipe's train_rl flags, --group_size=16"  # a variant written with argparse's `=`
    results.write_text(json.dumps(data))
    assert group_signal.main([f"{results}:g16"])[0]["group_size"] == 16
    data["runs"]["g16"]["flags"] = {"flags": {"group_size": 16, "seed": 1}, "derived_flags": []}  # a run folder's flags.json, copied in
    data["runs"]["g16"]["steps"] = sampled_steps(0.7, 0.2, 16, 40, 100, seed=9)
    results.write_text(json.dumps(data))
    assert group_signal.main([f"{results}:g16"])[0]["group_size"] == 16
    with pytest.raises(UserError, match=r"^--group_size 8: run g4 recorded --group_size 4; leave --group_size out"):
        group_signal.main([str(g4), "--group_size", "8"])
    (g4 / "flags.json").unlink()  # an older run's folder records nothing: --group_size, else the recipe's 8
    assert group_signal.main([str(g4), "--group_size", "4"])[0]["beta"] == pytest.approx(found[0]["beta"])
    assert group_signal.main([str(g4)])[0]["group_size"] == 8
