"""Padding-free microbatches (--pack_sequences): a microbatch's rows joined into one sequence.

A length-sorted microbatch of right-padded rows still computes its padding: 13.5% of the
positions of the realistic mix at 32 rows per microbatch (bench/RESULTS.md). Packed, the
real tokens of every row are laid end to end in a single row, position ids restart at 0
for each sequence, and attention runs through a variable-length kernel that keeps every
sequence to itself (`torch.nn.attention.varlen`, FlashAttention; on a CPU one causal
attention call per sequence). Only the forward's layout changes: the log-probs go back to
the (rows, width) grid, so the loss, its per-sequence normalisation and the gradients are
those of the padded path (tests/test_packing.py compares them).

The attention function is registered with transformers under `ATTENTION` and switched on
only for the packed forward (`packed_forward`), so every other forward (generation with
padding masks, evaluation) keeps the model's own implementation.
"""

import contextlib
import functools
import importlib.util
import inspect
import itertools

import torch

ATTENTION = "alignment_packed"
HAS_VARLEN_KERNEL = importlib.util.find_spec("torch.nn.attention.varlen") is not None  # torch 2.11 and 2.13 have it


@functools.cache
def _compile_disabled_varlen_causal():
    """`_varlen_causal` outside --torch_compile's per-layer graphs (real ints for the kernel, no recompiles
    per length); built at first use, since torch.compiler imports torch._dynamo (0.6 s per process)."""
    return torch.compiler.disable(_varlen_causal)


def _varlen_causal(query, key, value, cu_seq_lens, longest: int, scale):
    """(N, H, D) queries of packed sequences -> (N, H, D), each sequence attending causally to itself.

    FlashAttention's varlen kernel on a GPU in bf16/fp16; otherwise (a CPU, or fp32 on a GPU) one
    causal attention call per sequence."""
    if query.is_cuda and value.dtype in (torch.bfloat16, torch.float16):
        from torch.nn.attention.varlen import varlen_attn

        query, key = query.to(value.dtype), key.to(value.dtype)  # a no-op from packed_attention, which casts them
        # grouped-query attention: torch 2.13's kernel asks for the flag; 2.11's takes the shapes as they are (measured on an H200)
        gqa = {"enable_gqa": key.shape[1] != query.shape[1]} if _kernel_takes_gqa_flag() else {}
        return varlen_attn(query, key, value, cu_seq_lens, cu_seq_lens, longest, longest, scale=scale, window_size=(-1, 0), **gqa)
    bounds = cu_seq_lens.tolist()
    parts = []
    for start, stop in itertools.pairwise(bounds):
        q, k, v = (t[start:stop].transpose(0, 1) for t in (query, key, value))  # (H, n, D)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[0] != q.shape[0])
        parts.append(out.transpose(0, 1))
    return torch.cat(parts)


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs):
    """transformers' attention-function signature: (1, H, N, D) in, (1, N, H, D) out."""
    if sliding_window is not None and sliding_window < kwargs["max_length_q"]:
        raise NotImplementedError("--pack_sequences supports full causal attention only (this model uses a sliding window)")
    query, key, value = (t[0].transpose(0, 1) for t in (query, key, value))
    if query.is_cuda and value.dtype in (torch.bfloat16, torch.float16):
        # under autocast the values come from a bf16 matmul, while the rotary embedding's fp32
        # cos/sin promote queries and keys to fp32 (sdpa casts them itself; FlashAttention does
        # not). Cast here, inside --torch_compile's layer graph, where the cast and the (N, H, D)
        # layout the kernel reads can fuse into the rotary embedding's kernel (measured: 0.5-0.8%
        # faster than the cast in the kernel's eager wrapper, within noise; bench/RESULTS.md)
        query, key = (t.to(value.dtype).contiguous() for t in (query, key))
    boundaries = kwargs["cu_seq_lens_q"].to(query.device, non_blocking=True)  # layers may sit on other GPUs (--policy_devices)
    return _compile_disabled_varlen_causal()(query, key, value, boundaries, kwargs["max_length_q"], scaling)[None], None


def require_support(device: str) -> None:
    """A clear error at start-up, not deep in the first update, where the GPU kernel is missing."""
    from alignment.errors import UserError

    if device.startswith("cuda") and not HAS_VARLEN_KERNEL:
        raise UserError(f"--pack_sequences needs torch.nn.attention.varlen, which torch {torch.__version__} lacks: install the pinned torch (requirements.txt) or drop the flag")


@functools.cache
def _kernel_takes_gqa_flag() -> bool:
    if not HAS_VARLEN_KERNEL:
        return False
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, packed_attention)


_register()


def layout(lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For right-padded rows of `width` with `lengths` real tokens: the real tokens' flat indices
    into the (rows * width) grid, their position ids, and the int32 sequence boundaries (S + 1,)."""
    flat = torch.cat([torch.arange(n) + row * width for row, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    boundaries = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return flat, positions, boundaries


@contextlib.contextmanager
def _attention_implementation(config, name: str):
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def packed_forward(decoder, config, input_ids: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `decoder` (the model body, e.g. `model.model`) over the rows of `input_ids` (B, T) packed.

    Returns the (N, H) last hidden states of the N = sum(lengths) real tokens, in row order,
    and their flat indices into the (B * T) grid (on the CPU).
    """
    device = input_ids.device
    flat, positions, boundaries = layout(lengths, input_ids.shape[1])
    packed_ids = input_ids.reshape(-1).index_select(0, flat.to(device, non_blocking=True))[None]
    boundaries = boundaries.to(device, non_blocking=True)
    longest = max(lengths)
    with _attention_implementation(config, ATTENTION):
        hidden = decoder(input_ids=packed_ids, position_ids=positions.to(device, non_blocking=True)[None], use_cache=False, cu_seq_lens_q=boundaries,
                         cu_seq_lens_k=boundaries, max_length_q=longest, max_length_k=longest).last_hidden_state
    return hidden[0], flat
