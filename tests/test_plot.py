"""`python -m alignment.plot`: a run folder's steps.jsonl and evals.jsonl become one PNG."""

import json

import pytest

from alignment.errors import UserError
from alignment.plot import main, read_jsonl


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
    assert out == tmp_path / "a" / "compare.png"
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (640, 960) and image[..., :3].std() > 0.05  # 12 x 8 inches at 80 dpi
    with pytest.raises(UserError, match="has no steps"):
        main([runs[0], str(tmp_path)])
