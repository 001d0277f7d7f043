"""One place for an objective: the loss registry in grpo.py, what args.py reads from it, and the aggregation modes.

A loss is one `@register_loss` function in alignment/grpo.py; `--loss_type` and its checks come from the
registration (read from the file's text, so `--help` imports no torch), and the update calls it through the
registry. The aggregation of token losses is one choice, `--length_normalization` mean / constant / token_mean.
"""

import copy
import dataclasses
import itertools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from alignment import args as cli
from alignment import grpo
from alignment.errors import UserError
from alignment.optim import build_scheduler
from alignment.policy_update import UpdateSettings, update_policy
from alignment.sft_helpers import get_response_log_probs
from alignment.toy.synthetic_task import write_synthetic_gsm8k
from test_update_knobs import small_batch


def test_args_reads_the_registrations_grpo_holds_without_importing_torch():
    """args.py's view of the registry (parsed from grpo.py's text) is exactly grpo.LOSSES, and building the
    parser and its --help imports no torch."""
    assert cli.LOSSES == {name: {"description": loss.description, "ratio": loss.ratio, "signal": loss.signal, "aggregations": loss.aggregations}
                          for name, loss in grpo.LOSSES.items()}
    assert list(cli.LOSSES) == ["no_baseline", "reinforce_with_baseline", "grpo_clip", "gspo", "cispo"]
    assert cli.RATIO_LOSSES == ("grpo_clip", "gspo", "cispo") and cli.AGGREGATIONS == grpo.AGGREGATIONS == ("mean", "constant", "token_mean")
    assert cli.LOSSES["gspo"]["aggregations"] == ("mean",) and cli.LOSSES["no_baseline"]["signal"] == "raw_rewards"
    code = ("import sys; from alignment.args import build_rl_parser; text = ' '.join(build_rl_parser().format_help().split()); "
            "assert 'torch' not in sys.modules, 'torch imported'; assert 'cispo: -sg(clip(ratio))' in text and 'token_mean' in text")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_loss_flags_follow_the_registrations(tmp_path):
    """--loss_type takes the registered names; a loss registered for some aggregations refuses the others in one line."""
    base = ["--data_dir", str(write_synthetic_gsm8k(tmp_path, num_train=16, num_test=4))]
    assert cli.parse_rl_args(base + ["--length_normalization", "token_mean", "--loss_type", "cispo"]).length_normalization == "token_mean"
    with pytest.raises(UserError, match="--loss_type gspo is defined for --length_normalization mean only, not token_mean"):
        cli.validate_rl_args(cli.parse_rl_args(base + ["--loss_type", "gspo", "--length_normalization", "token_mean"]))
    with pytest.raises(SystemExit):
        cli.parse_rl_args(base + ["--loss_type", "ppo"])


def weight_change(model, batch, settings, rows_per_microbatch):
    """The weight change of one update_policy step under plain SGD at lr 1 (= minus the gradient; no clipping)."""
    model = copy.deepcopy(model)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    settings = dataclasses.replace(settings, train_mini_batch_size=rows_per_microbatch)
    update_policy(model, optimizer, build_scheduler(optimizer, 0, 1), batch, settings, "cpu")
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


def reference_gradient(model, batch, per_token_weight):
    """-d/dtheta of sum over response tokens of (A_i * logp_it * weight_it), computed on the whole batch at once."""
    model = copy.deepcopy(model)
    log_probs = get_response_log_probs(model, batch["input_ids"], batch["labels"])["log_probs"]
    mask = batch["response_mask"].float()
    (-(batch["advantages"][:, None] * log_probs * mask * per_token_weight).sum()).backward()
    return -torch.cat([p.grad.flatten() for p in model.parameters()])


def test_token_mean_is_the_steps_summed_token_loss_over_its_tokens_however_it_is_cut(tiny_model_and_tokenizer):
    """--length_normalization token_mean (DAPO): one optimizer step's gradient is that of the summed token loss over
    the step's response tokens, with microbatches of 1 row or all 4; the per-sequence mean (the default) differs on
    responses of unequal length."""
    model, tokenizer = tiny_model_and_tokenizer
    batch = small_batch(tokenizer)
    mask = batch["response_mask"].float()
    assert len(set(mask.sum(-1).tolist())) > 1  # unequal lengths: the modes differ
    settings = UpdateSettings(loss_type="reinforce_with_baseline", train_batch_size=4, length_normalization="token_mean", logprob_chunk_size=0, max_grad_norm=1e9)
    expected = reference_gradient(model, batch, torch.full_like(mask, 1.0 / mask.sum().item()))
    for rows in (1, 2, 4):
        assert torch.allclose(weight_change(model, batch, settings, rows), expected, rtol=1e-4, atol=1e-7)
    mean = dataclasses.replace(settings, length_normalization="mean")
    per_sequence = reference_gradient(model, batch, 1.0 / mask.sum(-1, keepdim=True) / 4)
    assert torch.allclose(weight_change(model, batch, mean, 2), per_sequence, rtol=1e-4, atol=1e-7)
    assert (per_sequence - expected).norm() > 0.05 * expected.norm()


def test_a_loss_registered_in_grpo_trains_through_the_update_with_no_other_change(tiny_model_and_tokenizer):
    """A new loss is one decorated function: registered here at run time, update_policy trains with it by name
    (-2 * A * logp gives twice reinforce_with_baseline's step under SGD)."""
    model, tokenizer = tiny_model_and_tokenizer
    batch = small_batch(tokenizer)

    @grpo.register_loss("double_reinforce", "-2 * advantage * logp (a test's)")
    def double_reinforce(inputs: grpo.LossInputs):
        return -2.0 * inputs.signal * inputs.policy_log_probs, {}

    try:
        with pytest.raises(ValueError, match="registered twice"):
            grpo.register_loss("double_reinforce", "again")(double_reinforce)
        settings = UpdateSettings(loss_type="double_reinforce", train_batch_size=4, logprob_chunk_size=0, max_grad_norm=1e9)
        doubled = weight_change(model, batch, settings, 4)
        single = weight_change(model, batch, dataclasses.replace(settings, loss_type="reinforce_with_baseline"), 4)
        assert single.norm() > 0 and torch.allclose(doubled, 2 * single, rtol=1e-4, atol=1e-6)  # (new - old weights rounds to 1e-7)
    finally:
        del grpo.LOSSES["double_reinforce"]



def test_the_readmes_example_objective_trains_as_written(tiny_model_and_tokenizer):
    """README "How to add an objective": its snippet, run as written, registers a ratio loss the update trains with;
    on fresh rollouts (ratio 1, nothing capped) its step is reinforce_with_baseline's."""
    model, tokenizer = tiny_model_and_tokenizer
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(readme) if line.startswith('    @register_loss("capped_ratio"'))
    snippet = textwrap.dedent("\n".join(itertools.takewhile(lambda line: line.startswith("    "), readme[start:])))
    exec(snippet, dict(vars(grpo)))
    try:
        assert grpo.LOSSES["capped_ratio"].ratio
        settings = UpdateSettings(loss_type="capped_ratio", train_batch_size=4, logprob_chunk_size=0, max_grad_norm=1e9)
        capped = weight_change(model, small_batch(tokenizer), settings, 4)
        plain = weight_change(model, small_batch(tokenizer), dataclasses.replace(settings, loss_type="reinforce_with_baseline"), 4)
        assert plain.norm() > 0 and torch.allclose(capped, plain, rtol=1e-4, atol=1e-6)
    finally:
        del grpo.LOSSES["capped_ratio"]
