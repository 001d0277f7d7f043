"""Token log-probs through the output layer without a (B, T, V) fp32 tensor.

The naive path, `log_softmax(model(x).logits.float()).gather(labels)`, builds fp32
logits and log-probs of shape (B, T, V): 8 x 1024 x 151,936 x 4 bytes = 5 GB each
for Qwen2.5-Math-1.5B, plus their gradients. Here the lm_head matmul, the
log-sum-exp and the gather run chunk by chunk over the flattened tokens; backward
recomputes each chunk's logits instead of keeping them, so peak memory is one
chunk's (chunk, V) logits. The extra lm_head matmul in backward costs a few percent
of a step and buys a larger microbatch.

    log p(label) = logit[label] - logsumexp(logits)
    d log p / d logits = onehot(label) - softmax(logits)

Precision: the matmuls run in `matmul_dtype` (bf16 under autocast, whatever the
master weights are stored in), the softmax math in at least fp32, and the weight
gradient is accumulated in fp32 and returned in the weight's own dtype, so fp32
master weights get an fp32 gradient. Autocast is switched off inside: backward
runs outside any autocast context, and both passes must use the same dtypes.
"""

import torch


def _chunk_log_probs(logits, labels, with_entropy: bool):
    """(n, V) logits in the matmul dtype -> log p(label), log-normaliser, entropy (or None).

    The softmax math runs in at least fp32 (bf16 logits lose the small log-probs).
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    normalizer = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(-1, labels[:, None]).squeeze(-1) - normalizer
    entropy = normalizer - (torch.exp(logits - normalizer[:, None]) * logits).sum(-1) if with_entropy else None
    return log_probs, normalizer, entropy


def _chunk_grad_logits(logits, normalizer, labels, grad_out):
    """d/dlogits of sum(grad_out * log p(label)) = grad_out * (onehot - softmax), in the logits' dtype."""
    grad = -torch.exp(logits.to(normalizer.dtype) - normalizer[:, None]) * grad_out[:, None]
    return grad.scatter_add(-1, labels[:, None], grad_out[:, None]).to(logits.dtype)


_chunk_math = {"log_probs": _chunk_log_probs, "grad_logits": _chunk_grad_logits}


def use_compiled_chunk_math(enabled: bool = True) -> None:
    """Run the per-chunk softmax math through torch.compile (train_rl --torch_compile).

    Eagerly, each chunk's (n, V) logits pass through memory ~6 times (cast, max, exp,
    sum, gather; in backward cast, exp, multiply, scatter, cast): on an H200 these
    element-wise passes took a third of the policy update. Compiled, they fuse into
    one or two kernels per chunk. Same math; tests compare the two.
    """
    if enabled:
        _chunk_math.update(log_probs=torch.compile(_chunk_log_probs, dynamic=True), grad_logits=torch.compile(_chunk_grad_logits, dynamic=True))
    else:
        _chunk_math.update(log_probs=_chunk_log_probs, grad_logits=_chunk_grad_logits)


class _ChunkedLinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, with_entropy, matmul_dtype):
        # hidden (N, H), weight (V, H), labels (N,) -> log_probs (N,) fp32, entropy (N,) fp32
        n_tokens = hidden.shape[0]
        # softmax math in at least fp32 (bf16 logits lose the small log-probs)
        compute_dtype = torch.promote_types(matmul_dtype, torch.float32)
        matmul_weight = weight.to(matmul_dtype)  # one cast per call, not per chunk
        log_probs = torch.empty(n_tokens, dtype=compute_dtype, device=hidden.device)
        log_normalizers = torch.empty_like(log_probs)
        entropy = torch.empty_like(log_probs) if with_entropy else None
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for start in range(0, n_tokens, chunk_size):
                stop = min(start + chunk_size, n_tokens)
                logits = hidden[start:stop].to(matmul_dtype) @ matmul_weight.t()
                chunk_log_probs, normalizer, chunk_entropy = _chunk_math["log_probs"](logits, labels[start:stop], with_entropy)
                log_probs[start:stop], log_normalizers[start:stop] = chunk_log_probs, normalizer
                if with_entropy:
                    entropy[start:stop] = chunk_entropy
        ctx.save_for_backward(hidden, matmul_weight, labels, log_normalizers)
        ctx.chunk_size = chunk_size
        ctx.weight_dtype = weight.dtype
        if with_entropy:
            ctx.mark_non_differentiable(entropy)
            return log_probs, entropy
        return log_probs, torch.zeros(0, device=hidden.device)

    @staticmethod
    def backward(ctx, grad_log_probs, _grad_entropy):
        hidden, matmul_weight, labels, log_normalizers = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        compute_dtype = log_normalizers.dtype
        grad_weight = torch.zeros(matmul_weight.shape, dtype=compute_dtype, device=matmul_weight.device) if ctx.needs_input_grad[1] else None
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                stop = min(start + ctx.chunk_size, hidden.shape[0])
                chunk_hidden = hidden[start:stop].to(matmul_weight.dtype)
                logits = chunk_hidden @ matmul_weight.t()
                grad_logits = _chunk_math["grad_logits"](logits, log_normalizers[start:stop], labels[start:stop], grad_log_probs[start:stop].to(compute_dtype))
                if grad_hidden is not None:
                    grad_hidden[start:stop] = grad_logits @ matmul_weight
                if grad_weight is not None:
                    grad_weight += (grad_logits.t() @ chunk_hidden).to(compute_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    matmul_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden @ weight.T)[labels], chunked, with a memory-light backward.

    Args:
        hidden: (B, T, H) final hidden states (after the model's last norm).
        weight: (V, H) output-embedding matrix (lm_head.weight; may be tied).
        labels: (B, T) token ids to score.
        chunk_size: tokens per chunk; peak extra memory is chunk_size x V floats.
        with_entropy: also return the per-token entropy (no gradient flows through it).
        matmul_dtype: dtype of the two matmuls; default: the autocast dtype when
            autocast is on for hidden's device, else weight's dtype.
    Returns:
        log_probs (B, T) and entropy (B, T) or None, in float32 (float64 for float64 inputs).
    """
    if matmul_dtype is None:
        device_type = hidden.device.type
        matmul_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    batch, seq_len, hidden_size = hidden.shape
    log_probs, entropy = _ChunkedLinearLogProbs.apply(
        hidden.reshape(-1, hidden_size), weight, labels.reshape(-1), int(chunk_size), with_entropy, matmul_dtype
    )
    log_probs = log_probs.view(batch, seq_len)
    return log_probs, entropy.view(batch, seq_len) if with_entropy else None
