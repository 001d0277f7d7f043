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
                logits = (hidden[start:stop].to(matmul_dtype) @ matmul_weight.t()).to(compute_dtype)
                normalizer = torch.logsumexp(logits, dim=-1)
                log_normalizers[start:stop] = normalizer
                log_probs[start:stop] = logits.gather(-1, labels[start:stop, None]).squeeze(-1) - normalizer
                if with_entropy:
                    probs = torch.exp(logits - normalizer[:, None])
                    entropy[start:stop] = normalizer - (probs * logits).sum(-1)
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
                logits = (chunk_hidden @ matmul_weight.t()).to(compute_dtype)
                grad_out = grad_log_probs[start:stop, None]
                # d/dlogits of g * log p(label) = g * (onehot - softmax)
                grad_logits = -torch.exp(logits - log_normalizers[start:stop, None]) * grad_out
                grad_logits.scatter_add_(-1, labels[start:stop, None], grad_out)
                grad_logits = grad_logits.to(matmul_weight.dtype)
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
