"""Tokenisation, per-token log-probs, entropy and the SFT loss step.

Shared by SFT and RL. `tokenize_prompt_and_output`, `compute_entropy`,
`get_response_log_probs` and `sft_microbatch_train_step` follow the CS336
assignment-5 names and shapes; `microbatches` cuts a step's rows by count or by
tokens. Every (B, T) tensor is aligned with `labels`: position t scores token t+1
of the full sequence.
"""

import torch

from alignment.fused_logprobs import chunked_linear_log_probs
from alignment.grpo import masked_normalize


def _pad_and_shift(sequences: list[list[int]], response_starts: list[int], response_ends: list[int], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad, then split into inputs/labels shifted by one; mask response labels."""
    max_len = max(len(ids) for ids in sequences)
    full = torch.full((len(sequences), max_len), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), max_len), dtype=torch.bool)
    for row, ids in enumerate(sequences):
        full[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[row, response_starts[row] : response_ends[row]] = True
    return {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": mask[:, 1:]}


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def tokenize_prompt_and_output(prompt_strs: list[str], output_strs: list[str], tokenizer) -> dict[str, torch.Tensor]:
    """Tokenise prompt and output separately, concatenate, right-pad, shift by one.

    Returns:
        input_ids (B, L-1): all but the last token of each padded sequence;
        labels (B, L-1): input shifted left by one;
        response_mask (B, L-1): True exactly where `labels` is an output token.
        L is the longest prompt+output length in the batch.
    """
    prompt_ids = tokenizer(list(prompt_strs))["input_ids"]
    output_ids = tokenizer(list(output_strs), add_special_tokens=False)["input_ids"]
    sequences = [p + o for p, o in zip(prompt_ids, output_ids, strict=True)]
    starts = [len(p) for p in prompt_ids]
    ends = [len(s) for s in sequences]
    return _pad_and_shift(sequences, starts, ends, _pad_id(tokenizer))


def tokenize_rollouts(prompt_strs: list[str], response_strs: list[str], tokenizer) -> dict[str, torch.Tensor]:
    """The seed's RL tokenisation: prompts alone (for their length) and full texts.

    The response mask runs from the prompt's token count (its attention-mask sum)
    to the end of the full text, minus pad, eos and bos positions, so the loss
    covers only tokens the policy generated. Returns the same keys and shapes as
    `tokenize_prompt_and_output`, shifted by one so log-probs score the next token.
    """
    prompt_lengths = [sum(mask) for mask in tokenizer(list(prompt_strs))["attention_mask"]]
    full_ids = tokenizer([p + r for p, r in zip(prompt_strs, response_strs, strict=True)])["input_ids"]
    batch = _pad_and_shift(full_ids, prompt_lengths, [len(ids) for ids in full_ids], _pad_id(tokenizer))
    return _mask_out_special_tokens(batch, tokenizer)


def tokenize_rollout_ids(prompt_strs: list[str], response_token_ids: list[list[int]], tokenizer, response_log_probs: list[list[float]] | None = None) -> dict[str, torch.Tensor]:
    """Prompt tokens followed by the exact token ids the sampler produced.

    Unlike `tokenize_rollouts`, no text round trip: the log-probs are those of the
    tokens that were sampled, even where decoding and re-encoding a response would
    give other tokens (partial UTF-8 bytes, merges across the prompt boundary).
    Same keys, shapes and masking (pad, eos and bos positions excluded).
    With `response_log_probs` (the sampler's, one per response token, or None for
    a row it did not score) the batch also holds "sampler_log_probs" (B, T),
    aligned with `labels`, NaN where there is no sampler value.
    """
    prompt_ids = tokenizer(list(prompt_strs))["input_ids"]
    sequences = [p + list(r) for p, r in zip(prompt_ids, response_token_ids, strict=True)]
    batch = _pad_and_shift(sequences, [len(p) for p in prompt_ids], [len(ids) for ids in sequences], _pad_id(tokenizer))
    if response_log_probs is not None:
        grid = torch.full(batch["labels"].shape, float("nan"), dtype=torch.float32)
        for row, (prompt, values) in enumerate(zip(prompt_ids, response_log_probs, strict=True)):
            if values is None:
                continue
            # labels[t] is token t + 1, so response token j sits at len(prompt) - 1 + j
            grid[row, len(prompt) - 1 : len(prompt) - 1 + len(values)] = torch.tensor(values, dtype=torch.float32)
        batch["sampler_log_probs"] = grid
    return _mask_out_special_tokens(batch, tokenizer)


def _mask_out_special_tokens(batch, tokenizer):
    special = {token for token in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) if token is not None}
    for token in special:
        batch["response_mask"] &= batch["labels"] != token
    return batch


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, via logsumexp. (B, T, V) -> (B, T)."""
    logits = logits.float()
    log_normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = torch.exp(logits - log_normalizer)
    return log_normalizer.squeeze(-1) - (probs * logits).sum(-1)


def _supports_fused_head(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        # the fused path calls the decoder body and reads lm_head's weight directly,
        # bypassing the root's unshard/reduce hooks: sharded models take the naive path
        return False
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    return (
        isinstance(head, torch.nn.Linear)
        and head.bias is None
        and hasattr(model, "model")
        and not getattr(config, "final_logit_softcapping", None)
        and getattr(config, "logit_scale", None) in (None, 1.0)
    )


def get_response_log_probs(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
    *,
    chunk_size: int = 0,
    temperature: float = 1.0,
    positions: torch.Tensor | None = None,
    lengths: list[int] | None = None,
    entropy_grad: bool = False,
) -> dict[str, torch.Tensor]:
    """Per-token log p(labels | prefix) from a causal LM, at a sampling temperature.

    Args:
        input_ids, labels: (B, T), right-padded (no attention mask is needed:
            causal attention never lets a real token see the padding after it).
        chunk_size: 0 = naive full-vocab `log_softmax` + `gather` (the reference
            path); > 0 = fused, chunked lm_head + log-softmax (same numbers, no
            (B, T, V) fp32 tensor), used where the model exposes a plain lm_head.
        temperature: the logits are divided by it before the softmax, so the
            log-probs (and entropy) are those of the distribution a sampler at this
            temperature draws from; 1.0 scores the raw model.
        positions: optional (B, T) bool mask of the positions the caller reads
            (the response mask). The fused path then runs the output layer on those
            positions only and returns 0 elsewhere: prompt and padding positions
            are ~40% of a GRPO batch, and the output layer with its softmax is the costliest
            part of a step per position. Pass it on the CPU (no device sync). The naive path scores all.
        lengths: optional real-token count of each row (positions past it are
            padding). The fused path then packs the rows into one padding-free
            sequence (alignment/packing.py, --pack_sequences); same results.
        entropy_grad: the entropy keeps its gradient (--entropy_coef): the naive path,
            whatever `chunk_size` (the fused one computes entropy without a gradient).
    Returns:
        {"log_probs": (B, T)} in fp32, plus "token_entropy": (B, T) if asked.
    """
    if chunk_size and not entropy_grad and _supports_fused_head(model):
        weight = model.get_output_embeddings().weight
        batch, width = input_ids.shape
        labels = labels.to(weight.device).reshape(-1)
        if lengths is not None:  # hidden states of the real tokens only; `index` maps them to the grid
            from alignment.packing import packed_forward

            hidden, flat = packed_forward(model.model, model.config, input_ids, lengths)
            hidden = hidden.to(weight.device)
            if positions is not None:
                keep = positions.cpu().reshape(-1).index_select(0, flat).nonzero().squeeze(1)
                hidden, flat = hidden.index_select(0, keep.to(weight.device, non_blocking=True)), flat.index_select(0, keep)
            index = flat.to(weight.device, non_blocking=True)
            labels = labels.index_select(0, index)
        else:
            hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state  # no KV cache: one pass, and no cache writes in compiled layers
            hidden = hidden.to(weight.device).reshape(batch * width, -1)
            index = None
            if positions is not None:
                index = positions.reshape(-1).nonzero().squeeze(1).to(weight.device, non_blocking=True)
                hidden, labels = hidden.index_select(0, index), labels.index_select(0, index)
        if temperature != 1.0:
            hidden = hidden / temperature  # (h / T) @ W.T = logits / T
        log_probs, entropy = chunked_linear_log_probs(hidden[None], weight, labels[None], chunk_size, return_token_entropy)

        def to_grid(values):  # (1, N) -> (B, T), zeros off the scored positions
            values = values[0]
            if index is not None:
                values = values.new_zeros(batch * width).index_copy(0, index, values)
            return values.view(batch, width)

        result = {"log_probs": to_grid(log_probs)}
        if return_token_entropy:
            result["token_entropy"] = to_grid(entropy)
        return result
    logits = model(input_ids=input_ids).logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, labels.to(logits.device).unsqueeze(-1)).squeeze(-1)
    result = {"log_probs": log_probs}
    if return_token_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            result["token_entropy"] = compute_entropy(logits)
    return result


def sft_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    normalize_constant: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the response tokens, scaled, then `backward()`.

    loss = -masked_normalize(log_probs, mask, dim=-1, normalize_constant).mean()
           / gradient_accumulation_steps
    Returns the scaled loss and metadata with the number of response tokens.
    """
    per_sequence = -masked_normalize(policy_log_probs, response_mask, dim=-1, normalize_constant=normalize_constant)
    loss = per_sequence.mean() / gradient_accumulation_steps
    loss.backward()
    return loss.detach(), {"num_response_tokens": response_mask.sum().detach()}


def microbatches(rows: list[int], lengths: list[int], size: int, token_budget: int = 0, packed: bool = False) -> list[list[int]]:
    """`rows` cut, in order, into microbatches of `size` rows, or with `token_budget` into runs
    of as many consecutive rows as fit the budget in computed tokens: the real tokens when
    the rows are packed, rows x the longest row when padded. A row longer than the budget runs
    alone. On length-sorted rows this holds the work per microbatch near the budget, where a
    row count gives the short rows small microbatches and the long ones the memory peak."""
    if not token_budget:
        return chunks(rows, size)
    groups, current, tokens, longest = [], [], 0, 0
    for row in rows:
        n = lengths[row]
        cost = tokens + n if packed else (len(current) + 1) * max(longest, n)
        if current and cost > token_budget:
            groups.append(current)
            current, tokens, longest = [], 0, 0
        current.append(row)
        tokens, longest = tokens + n, max(longest, n)
    if current:
        groups.append(current)
    return groups


def chunks(items, size):
    """`items` in runs of `size`, the last one shorter."""
    return [items[start : start + size] for start in range(0, len(items), size)]
