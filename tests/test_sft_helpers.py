"""alignment/sft_helpers.py and fused_logprobs.py on a tiny Qwen2 built on the fly."""

import copy
import math

import pytest
import torch

from alignment.fused_logprobs import chunked_linear_log_probs
from alignment.sft_helpers import (
    compute_entropy,
    get_response_log_probs,
    sft_microbatch_train_step,
    tokenize_prompt_and_output,
    tokenize_rollouts,
)

PROMPTS = ["User: What is 2 plus 3?\nAssistant: <think>", "User: What is 10 plus 4?\nAssistant: <think>"]
OUTPUTS = [" 2 + 3 = 5 </think> <answer> 5 </answer>", " 14 </think> <answer> 14 </answer>"]


def test_tokenize_prompt_and_output_layout(tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    batch = tokenize_prompt_and_output(PROMPTS, OUTPUTS, tokenizer)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    output_ids = [tokenizer(o)["input_ids"] for o in OUTPUTS]
    full = [p + o for p, o in zip(prompt_ids, output_ids)]
    width = max(map(len, full)) - 1
    assert batch["input_ids"].shape == batch["labels"].shape == batch["response_mask"].shape == (2, width)
    for row in range(2):
        n = len(full[row])
        padded = full[row] + [tokenizer.pad_token_id] * (width + 1 - n)
        assert batch["input_ids"][row].tolist() == padded[:-1]
        assert batch["labels"][row].tolist() == padded[1:]
        expected_mask = [False] * (len(prompt_ids[row]) - 1) + [True] * len(output_ids[row]) + [False] * (width + 1 - n)
        assert batch["response_mask"][row].tolist() == expected_mask
        # the masked labels are exactly the output tokens
        assert batch["labels"][row][batch["response_mask"][row]].tolist() == output_ids[row]


def test_tokenize_rollouts_masks_response_only(tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    responses = [OUTPUTS[0], OUTPUTS[1] + tokenizer.eos_token]
    batch = tokenize_rollouts(PROMPTS, responses, tokenizer)
    reference = tokenize_prompt_and_output(PROMPTS, OUTPUTS, tokenizer)
    # the prompts end in '>' so joint tokenisation splits at the same place; the
    # eos the second response carries is excluded from the mask
    assert batch["response_mask"].sum(-1).tolist() == reference["response_mask"].sum(-1).tolist()
    for row in range(2):
        assert batch["labels"][row][batch["response_mask"][row]].tolist() == reference["labels"][row][reference["response_mask"][row]].tolist()


def _per_token_loop(model, input_ids, labels):
    """Naive reference: one forward per prefix, score the next token."""
    out = torch.zeros(labels.shape)
    for row in range(input_ids.shape[0]):
        for t in range(input_ids.shape[1]):
            logits = model(input_ids=input_ids[row : row + 1, : t + 1]).logits[0, -1]
            out[row, t] = torch.log_softmax(logits.double(), -1)[labels[row, t]].float()
    return out


@pytest.mark.parametrize("chunk_size", [0, 5])
def test_log_probs_equal_per_token_loop(tiny_model_and_tokenizer, chunk_size):
    model, tokenizer = tiny_model_and_tokenizer
    batch = tokenize_prompt_and_output(PROMPTS, OUTPUTS, tokenizer)
    input_ids, labels = batch["input_ids"][:, :12], batch["labels"][:, :12]
    with torch.no_grad():
        result = get_response_log_probs(model, input_ids, labels, return_token_entropy=True, chunk_size=chunk_size)
        expected = _per_token_loop(model, input_ids, labels)
        logits = model(input_ids=input_ids).logits
    assert torch.allclose(result["log_probs"], expected, atol=1e-5)
    probs = torch.softmax(logits.double(), -1)
    hand_entropy = -(probs * probs.log()).sum(-1)
    assert torch.allclose(result["token_entropy"].double(), hand_entropy, atol=1e-5)


def test_fused_log_probs_gradient_matches_naive(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    batch = tokenize_prompt_and_output(PROMPTS, OUTPUTS, tokenizer)
    weights = torch.randn(batch["labels"].shape, generator=torch.Generator().manual_seed(0))
    grads = []
    for chunk_size in (0, 7):
        clone = copy.deepcopy(model)
        log_probs = get_response_log_probs(clone, batch["input_ids"], batch["labels"], chunk_size=chunk_size)["log_probs"]
        (log_probs * weights).sum().backward()
        grads.append({name: p.grad.clone() for name, p in clone.named_parameters()})
    naive, fused = grads
    assert naive.keys() == fused.keys()
    for name in naive:
        assert torch.allclose(naive[name], fused[name], atol=1e-4, rtol=1e-4), name


def test_fused_log_probs_on_response_positions_only_equal_the_full_pass(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    batch = tokenize_prompt_and_output(PROMPTS, OUTPUTS, tokenizer)
    mask = batch["response_mask"]
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    results, grads = [], []
    for positions in (None, mask):
        clone = copy.deepcopy(model)
        out = get_response_log_probs(clone, batch["input_ids"], batch["labels"], return_token_entropy=True, chunk_size=4, temperature=0.7, positions=positions)
        (out["log_probs"] * weights * mask).sum().backward()  # a loss reads response positions only
        results.append(out)
        grads.append({name: p.grad.clone() for name, p in clone.named_parameters()})
    full, selected = results
    assert 0 < mask.sum() < mask.numel()
    for key in ("log_probs", "token_entropy"):
        assert torch.allclose(selected[key][mask], full[key][mask], atol=1e-5)
        assert torch.equal(selected[key][~mask], torch.zeros(int((~mask).sum())))  # the prompt and padding were not scored
    assert torch.all(full["log_probs"][~mask] < 0)  # the full pass did score them
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4), name


def test_compiled_chunk_math_equals_eager():
    """train_rl --torch_compile fuses the per-chunk softmax math: same values and gradients."""
    from alignment import fused_logprobs

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 16, generator=generator)
    labels = torch.randint(0, 50, (1, 23), generator=generator)
    grad = torch.randn(1, 23, generator=generator)
    results = []
    for compiled in (False, True):
        fused_logprobs.use_compiled_chunk_math(compiled)
        try:
            hidden = torch.randn(1, 23, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
            head = weight.clone().requires_grad_(True)
            with torch.autocast("cpu", torch.bfloat16):  # bf16 matmuls, fp32 softmax math, as on a GPU
                log_probs, entropy = fused_logprobs.chunked_linear_log_probs(hidden, head, labels, chunk_size=8, with_entropy=True)
            (log_probs * grad).sum().backward()
            results.append((log_probs.detach(), entropy, hidden.grad, head.grad))
        finally:
            fused_logprobs.use_compiled_chunk_math(False)
    assert results[1][0].dtype == torch.float32 and results[1][3].dtype == torch.float32
    for eager, compiled in zip(*results):
        assert torch.allclose(eager, compiled, atol=1e-4, rtol=1e-3), (eager - compiled).abs().max()
    assert fused_logprobs._chunk_math["log_probs"] is fused_logprobs._chunk_log_probs  # switched back


def test_chunked_log_probs_gradcheck_float64():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    labels = torch.randint(0, 9, (2, 3), generator=generator)
    assert torch.autograd.gradcheck(lambda h, w: chunked_linear_log_probs(h, w, labels, chunk_size=4)[0], (hidden, weight))
    log_probs, _ = chunked_linear_log_probs(hidden, weight, labels, chunk_size=4)
    naive = torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert torch.allclose(log_probs, naive, atol=1e-12)


def test_compute_entropy_hand_cases():
    uniform = torch.zeros(1, 2, 8)
    assert torch.allclose(compute_entropy(uniform), torch.full((1, 2), math.log(8)))
    peaked = torch.tensor([[[1000.0, 0.0, 0.0]]])
    assert compute_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)
    two_way = torch.tensor([[[0.0, 0.0, -1e4]]])
    assert compute_entropy(two_way).item() == pytest.approx(math.log(2), abs=1e-6)


def test_sft_microbatch_train_step_hand_case():
    log_probs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -4.0]], requires_grad=True)
    mask = torch.tensor([[False, True, True], [True, True, False]])
    loss, meta = sft_microbatch_train_step(log_probs, mask, gradient_accumulation_steps=2, normalize_constant=2.0)
    # per sequence: -(-5)/2 = 2.5 and -(-1)/2 = 0.5; mean 1.5; / 2 accumulation steps
    assert loss.item() == pytest.approx(0.75)
    assert meta["num_response_tokens"].item() == 4
    expected = torch.tensor([[0.0, -0.125, -0.125], [-0.125, -0.125, 0.0]])
    assert torch.allclose(log_probs.grad, expected)


def test_sampler_log_probs_align_with_labels_and_skip_unscored_rows(tiny_model_and_tokenizer):
    from alignment.sft_helpers import tokenize_rollout_ids

    _, tokenizer = tiny_model_and_tokenizer
    responses = [[5, 6, 7], [8, 9]]
    batch = tokenize_rollout_ids(PROMPTS, responses, tokenizer, [[-0.5, -1.5, -2.5], None])
    grid, mask = batch["sampler_log_probs"], batch["response_mask"]
    assert grid[0][mask[0]].tolist() == [-0.5, -1.5, -2.5]  # each value sits on its token's label
    assert batch["labels"][0][mask[0]].tolist() == responses[0]
    assert torch.isnan(grid[0][~mask[0]]).all() and torch.isnan(grid[1]).all()  # no value: NaN, never a fake 0


def test_pad_eos_and_bos_leave_the_response_mask_when_they_are_three_tokens():
    """An Instruct tokenizer pads with another token than its EOS (Qwen2.5: <|endoftext|> against <|im_end|>):
    a sampled EOS is masked out of the loss as the pad is, and so is a BOS, whichever of them a response holds."""
    from types import SimpleNamespace

    from alignment.sft_helpers import tokenize_rollout_ids

    class Tokenizer(SimpleNamespace):
        def __call__(self, texts):
            return {"input_ids": [[11, 12, 13][: len(text)] for text in texts]}

    tokenizer = Tokenizer(pad_token_id=0, eos_token_id=2, bos_token_id=1)
    batch = tokenize_rollout_ids(["abc", "ab"], [[5, 6, 2], [7, 1, 8, 2]], tokenizer)
    assert batch["labels"].tolist() == [[12, 13, 5, 6, 2], [12, 7, 1, 8, 2]]
    assert batch["response_mask"].tolist() == [[False, False, True, True, False], [False, True, False, True, False]]
