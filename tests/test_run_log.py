"""run_log: the scalars a researcher reads in TensorBoard and steps.jsonl are the step's sums over the right counts,
and what a run writes per step and per evaluation (planted bugs that every training test let through, 2026-12-07)."""

import json
import math
from types import SimpleNamespace

from alignment.run_log import RunLog, step_scalars
from conftest import RecordingWriter as Writer


REWARDS = {"reward_mean": 0.5, "format_reward_mean": 1.0, "answer_reward_mean": 0.5, "reward_std": 0.5,
           "fraction_groups_all_equal": 0.25, "fraction_groups_all_right": 0.125}


def scalars_of(epochs=2, rollouts=16, train_batch=4):
    # two epochs over 16 rollouts in optimizer batches of 4: 8 optimizer steps, each of 2 microbatches
    args = SimpleNamespace(epochs_per_rollout_batch=epochs, total_rollouts=rollouts, train_batch_size=train_batch, rollout_staleness=0)
    totals = {"microbatches": 16, "optimizer_steps": 8, "loss": 4.0, "grad_norm": 12.0, "entropy": 8.0, "clip_fraction": 1.6, "kl_ref": 3.2,
              "sampler_tokens": 100, "sampler_abs_diff": 5.0, "sampler_ratio": 101.0, "sampler_ratio_max": 1.3, "tis_capped": 0,
              "tokens": 3000, "flops": 0}
    timings = {"rollout": 2.0, "reward": 0.1, "logprobs": 0.5, "update": 1.5, "sync": 0.01, "step": 6.0}
    progress = {"skipped_steps": 0, "zero_signal_batches": 0}
    return step_scalars(args, progress, REWARDS, totals, timings, generated_tokens=800, learning_rate=1e-6, peak_flops=None, sampled_tokens=1000)


def test_each_scalar_is_its_sum_over_the_count_it_is_a_mean_of():
    scalars = scalars_of()
    assert scalars["train/loss"] == 4.0 / 8  # one loss per optimizer step: epochs x rollouts // train batch
    assert scalars["train/grad_norm"] == 12.0 / 8  # one norm per optimizer step
    assert math.isclose(scalars["train/entropy"], 8.0 / 16) and math.isclose(scalars["train/kl_ref"], 3.2 / 16)  # per microbatch
    assert math.isclose(scalars["train/clip_fraction"], 1.6 / 16)
    assert scalars["train/sampler_logprob_abs_diff"] == 0.05 and scalars["train/sampler_importance_ratio"] == 1.01  # per sampled token
    assert scalars["train/response_length"] == 800 / 16  # the batch's tokens over its responses
    assert scalars["perf/train_tokens_per_s"] == 3000 / 1.5  # the update's seconds, not the whole step's
    assert scalars["perf/rollout_tokens_per_s"] == 1000 / 2.0 and scalars["perf/step_seconds"] == 6.0
    assert math.isnan(scalars["train/tis_capped_fraction"]) and math.isnan(scalars["perf/mfu"])  # not measured: n/a
    assert scalars_of(epochs=1)["train/loss"] == 4.0 / 4


def test_a_step_is_written_everywhere_and_printed_every_log_every_steps_and_at_the_last(tmp_path, capsys):
    writer = Writer()
    log = RunLog(tmp_path, writer, resumed_step=0, log_every=10)
    scalars = scalars_of()
    for step in (1, 2, 3):
        log.step(step, 3, scalars, skipped_steps=0)
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in printed] == ["3/3"]  # neither step 1 nor 2 is a multiple of 10; the last always prints
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3] and rows[0]["train/tis_capped_fraction"] is None and rows[0]["train/loss"] == 0.5
    assert ("train/loss", 0.5, 2) in writer.scalars and not any(key == "train/tis_capped_fraction" for key, _, _ in writer.scalars)


def test_an_evaluation_shows_the_samples_asked_for_and_keeps_them_out_of_evals_jsonl(tmp_path, capsys):
    writer = Writer()
    log = RunLog(tmp_path, writer, resumed_step=0, log_every=1)
    samples = [{"reward": 1.0, "ground_truth": str(i), "response": f"answer {i}"} for i in range(3)]
    metrics = {"avg_all_rewards": 0.5, "format_reward": 1.0, "answer_reward": 0.5, "mean_response_tokens": 12.0, "num_examples": 3,
               "seconds": 0.1, "samples": samples}
    log.evaluation(4, metrics, shown_samples=2)
    (key, text, step), = writer.texts
    assert (key, step) == ("eval/samples", 4) and text.count("**reward") == 2 and "answer 1" in text and "answer 2" not in text
    (row,) = [json.loads(line) for line in (tmp_path / "evals.jsonl").read_text().splitlines()]
    assert row == {"step": 4, **{k: v for k, v in metrics.items() if k != "samples"}}
    assert "eval step 4: accuracy 0.500" in capsys.readouterr().out


def test_a_resumed_run_keeps_both_logs_up_to_its_step_and_a_new_run_starts_them_empty(tmp_path):
    for name in ("steps.jsonl", "evals.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps({"step": step}) + "\n" for step in (0, 2, 4)))
    RunLog(tmp_path, Writer(), resumed_step=2, log_every=1)
    for name in ("steps.jsonl", "evals.jsonl"):  # steps 3-4 run again: their old lines would be read twice
        assert [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()] == [0, 2], name
    RunLog(tmp_path, Writer(), resumed_step=0, log_every=1)
    assert not (tmp_path / "steps.jsonl").exists() and not (tmp_path / "evals.jsonl").exists()
    RunLog(tmp_path / "absent", None, resumed_step=3, log_every=1)  # another rank's: writes and trims nothing


def hparams_data(summary):
    """The HParams plugin's record in a summary (its Experiment, or its SessionStartInfo), decoded."""
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    (value,) = summary.value
    assert value.metadata.plugin_data.plugin_name == "hparams"
    return HParamsPluginData.FromString(value.metadata.plugin_data.content)


def test_the_run_flags_go_to_flags_json_and_tensorboard_at_the_step_the_run_starts_from(tmp_path):
    """Runs compared in TensorBoard said nothing of their flags, and group_signal had to be told each run's group size."""
    writer = Writer()
    run = {"flags": {"group_size": 4, "learning_rate": 2e-06, "run_name": "g4", "length_normalization_constant": 1024, "adam_betas": [0.9, 0.95],
                     "dynamic_sampling": True},
           "derived_flags": ["length_normalization_constant"], "run_id": "abc"}
    RunLog(tmp_path, writer, resumed_step=0, log_every=1).flags(run, 0)
    assert json.loads((tmp_path / "flags.json").read_text()) == {"flags": run["flags"], "derived_flags": ["length_normalization_constant"]}
    (key, text, step), = writer.texts
    assert (key, step) == ("run/flags", 0) and "| group_size | 4 |" in text and '| run_name | "g4" |' in text
    assert "| length_normalization_constant | 1024 (derived) |" in text and "| learning_rate | 2e-06 |" in text
    # TensorBoard's HParams table: the flags as the run started, without its own places, and the metrics it reads
    experiment, started = (hparams_data(summary) for summary, _ in writer.summaries)
    assert [metric.name.tag for metric in experiment.experiment.metric_infos] == ["eval/avg_all_rewards", "eval/format_reward", "train/reward",
                                                                                  "train/response_length"]
    table = {key: value.string_value or value.number_value for key, value in started.session_start_info.hparams.items()}
    assert table == {"group_size": 4, "learning_rate": 2e-06, "length_normalization_constant": 1024, "adam_betas": "0.9 0.95", "dynamic_sampling": "True"}
    resumed = {**run, "flags": {**run["flags"], "learning_rate": 1e-06}}
    RunLog(tmp_path, writer, resumed_step=7, log_every=1).flags(resumed, 7)  # a resume's flags, at its step
    assert writer.texts[1][2] == 7 and json.loads((tmp_path / "flags.json").read_text())["flags"]["learning_rate"] == 1e-06
    assert len(writer.summaries) == 2  # the table keeps the first start's row (the plugin reads the first)
    RunLog(tmp_path / "absent", None, resumed_step=0, log_every=1).flags(run, 0)  # another rank's: writes nothing
    assert not (tmp_path / "absent").exists()


def test_the_places_left_out_of_run_comparisons_are_train_rl_flags():
    """A misspelt name in PER_RUN_FLAGS would leave that path in every HParams row and plot label as a difference."""
    from alignment.args import PER_RUN_FLAGS, build_rl_parser

    assert set(PER_RUN_FLAGS) <= {action.dest for action in build_rl_parser()._actions}
