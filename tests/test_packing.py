"""--pack_sequences: a microbatch's rows as one padding-free sequence give the padded path's
log-probs, entropy, loss and gradients (CPU: one causal attention per sequence).
--microbatch_tokens: microbatches cut by computed tokens take the row-count path's step."""

import pytest
import torch

from alignment.optim import build_scheduler
from alignment.packing import layout
from alignment.policy_update import score_with, update_policy
from alignment.rollout import load_hf_model, load_tokenizer
from alignment.sft_helpers import get_response_log_probs, microbatches
from conftest import make_tiny_task, steps_log, train_rl_flags, update_settings
from test_precision import grpo_batch


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_tiny_task(tmp_path_factory.mktemp("packing"), num_train=32, num_test=8, seed=2)


@pytest.fixture(scope="module")
def batch(task):
    return grpo_batch(load_tokenizer(task.sft))


def test_layout_indexes_the_real_tokens_and_restarts_positions():
    flat, positions, boundaries = layout([3, 1, 2], width=4)
    assert flat.tolist() == [0, 1, 2, 4, 8, 9]
    assert positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert boundaries.tolist() == [0, 3, 4, 6] and boundaries.dtype == torch.int32


@pytest.mark.parametrize("with_positions", [True, False])
def test_packed_log_probs_entropy_and_gradients_equal_the_padded_path(task, batch, with_positions):
    rows = slice(0, 7)  # rows of different lengths, right-padded to the longest
    lengths = batch["lengths"][rows]
    width = max(lengths)
    input_ids, labels, mask = (batch[key][rows, :width] for key in ("input_ids", "labels", "response_mask"))
    assert min(lengths) < width  # the padded path computes padding here; the packed one does not
    results = {}
    for packed in (False, True):
        model = load_hf_model(task.sft, "cpu", torch.float32)
        out = get_response_log_probs(model, input_ids, labels, return_token_entropy=True, chunk_size=5, temperature=0.7,
                                     positions=mask if with_positions else None, lengths=lengths if packed else None)
        (out["log_probs"] * mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        results[packed] = (out["log_probs"] * mask, out["token_entropy"] * mask, grads)
    for padded, packed in zip(results[False], results[True]):
        assert torch.allclose(packed, padded, atol=1e-5, rtol=1e-4)
    assert results[True][2].abs().sum() > 0
    assert model.config._attn_implementation == "sdpa"  # packing switched it only for its own forward


def test_microbatches_cut_by_rows_or_by_computed_tokens():
    lengths = [2, 3, 3, 5, 9]
    rows = list(range(5))
    assert microbatches(rows, lengths, 2) == [[0, 1], [2, 3], [4]]
    # packed: real tokens 2 + 3 + 3 = 8 fit 8; the 9-token row exceeds the budget and runs alone
    assert microbatches(rows, lengths, 2, token_budget=8, packed=True) == [[0, 1, 2], [3], [4]]
    # padded: rows x the longest row; a third row of 3 would cost 9
    assert microbatches(rows, lengths, 2, token_budget=8) == [[0, 1], [2], [3], [4]]
    assert microbatches(rows, lengths, 2, token_budget=100) == [rows]
    assert microbatches([4, 0, 1], lengths, 2, token_budget=12) == [[4], [0, 1]]  # unsorted: the running longest row counts


def one_update(task, batch, pack: bool, compiled: bool = False, token_budget: int = 0):
    model = load_hf_model(task.sft, "cpu", torch.float32).train()
    if compiled:
        for layer in model.model.layers:
            layer.compile(dynamic=True)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the step is minus the (clipped) gradient: compares gradients
    args = update_settings(logprob_chunk_size=5, train_mini_batch_size=4, pack_sequences=pack, microbatch_tokens=token_budget)  # 4 microbatches of different widths
    totals = update_policy(model, optimizer, build_scheduler(optimizer, 0, 1), batch, args, "cpu")
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    return totals, delta


def test_packed_update_takes_the_padded_update_step(task, batch):
    padded, padded_delta = one_update(task, batch, pack=False)
    packed, packed_delta = one_update(task, batch, pack=True)
    assert packed["optimizer_steps"] == padded["optimizer_steps"] == 1
    for key in ("loss", "entropy", "grad_norm", "clip_fraction"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    assert packed["tokens"] == padded["tokens"] and packed["flops"] == padded["flops"]
    assert padded_delta.abs().sum() > 0
    assert torch.allclose(packed_delta, padded_delta, atol=1e-6, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.after_compiles  # its layer graphs are among those the end-to-end --torch_compile run below compiles
def test_packed_update_under_compiled_layers_equals_eager(task, batch):
    """--torch_compile's per-layer graphs (dynamic shapes) around the packed attention."""
    eager, eager_delta = one_update(task, batch, pack=True)
    compiled, compiled_delta = one_update(task, batch, pack=True, compiled=True)
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-4, abs=1e-6)
    assert torch.allclose(compiled_delta, eager_delta, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("pack", [False, True])
def test_token_budget_microbatches_take_the_row_count_step(task, batch, pack):
    """Microbatches of unequal row counts, each weighted by its share of the step's rows:
    the loss is still the mean over all 16 sequences, so the step is the same."""
    budget = 100
    order = sorted(range(16), key=lambda row: batch["lengths"][row])
    cut = microbatches(order, batch["lengths"], 4, budget, pack)
    assert len({len(rows) for rows in cut}) > 1 and len(cut) != 4  # unequal, and not the row-count cut
    rows_, rows_delta = one_update(task, batch, pack=pack)
    tokens, tokens_delta = one_update(task, batch, pack=pack, token_budget=budget)
    assert tokens["microbatches"] == len(cut) and rows_["microbatches"] == 4
    for key in ("loss", "grad_norm", "clip_fraction"):
        assert tokens[key] == pytest.approx(rows_[key], rel=1e-4, abs=1e-6), key
    assert rows_delta.abs().sum() > 0
    assert torch.allclose(tokens_delta, rows_delta, atol=1e-6, rtol=1e-4)


def test_packed_scoring_equals_padded_scoring(task, batch):
    model = load_hf_model(task.sft, "cpu", torch.float32)
    padded = score_with(model, batch, 5, "cpu", chunk_size=5, temperature=0.7)
    packed = score_with(model, batch, 5, "cpu", chunk_size=5, temperature=0.7, pack=True)
    assert torch.allclose(packed, padded, atol=1e-5)
    for pack in (False, True):  # chunks cut by computed tokens
        assert torch.allclose(score_with(model, batch, 5, "cpu", chunk_size=5, temperature=0.7, pack=pack, token_budget=64), padded, atol=1e-5)
    assert (padded * batch["response_mask"]).abs().sum() > 0


@pytest.mark.slow
def test_train_rl_with_packing_scores_and_steps_like_the_padded_run(task):
    """End to end: the policy update and the reference model's scoring pass (KL) both packed.
    Step 1 sees the same rollouts in both runs, so its metrics agree; every step finishes."""
    from alignment import train_rl

    def run(name, *extra):
        train_rl.main(train_rl_flags(task, name, "--learning_rate", "1e-4", "--max_steps", "2", *extra))
        return steps_log(task, name)

    padded, packed = run("padded"), run("packed", "--pack_sequences")
    # the fast path in full: packed microbatches cut by tokens, compiled policy and reference layers
    fast = run("fast", "--pack_sequences", "--microbatch_tokens", "300", "--torch_compile")
    assert [s["step"] for s in packed] == [1, 2] == [s["step"] for s in fast]
    # the random model earns no reward and step 1's policy is the reference, so loss and KL are 0;
    # entropy and the sampler gap are real numbers computed from the packed log-probs
    for key in ("train/loss", "train/kl_ref", "train/entropy", "train/sampler_logprob_abs_diff", "train/reward"):
        assert packed[0][key] == pytest.approx(padded[0][key], rel=1e-4, abs=1e-7), key
        assert fast[0][key] == pytest.approx(padded[0][key], rel=1e-4, abs=1e-6), key
    assert packed[0]["train/entropy"] > 1.0 and packed[0]["train/sampler_logprob_abs_diff"] > 0
