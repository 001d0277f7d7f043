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
