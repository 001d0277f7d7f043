"""Model FLOPs of a policy update and the GPU's peak: the MFU train_rl logs as perf/mfu.

MFU = the FLOPs the update needs / seconds / the accelerator's dense bf16 peak, as
nanoGPT prints it. Needed FLOPs (PaLM appendix B): 6 x the matmul parameters per token
(decoder layers; the lm_head only where the loss reads logits, i.e. response tokens)
+ 6 x layers x query width (heads x head_dim, in most configs the hidden size) x
context for causal attention. Recomputation (gradient checkpointing, the fused
log-prob's second lm_head pass) is work the hardware does, not model FLOPs, so it
lowers MFU.
"""

import torch

# dense bf16 tensor-core peaks from the vendors' datasheets, FLOP/s, looked up in this order inside the GPU's name:
# the H100's PCIe and NVL cards before the SXM part, whose 989 would make their MFU read low
DATASHEET_BF16_PEAK = {"H100 PCIE": 756e12, "H100 NVL": 835e12, "H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12,
                       "GH200": 989e12}


def training_flops_per_token(config, context: float, with_head: bool = True) -> float:
    """Forward + backward FLOPs of one token of a `context`-token sequence (see the module
    doc; 6 L d T is causal attention's 12 L d T halved by the mask)."""
    hidden, layers, inter = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_width, kv_width = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = hidden * q_width * 2 + hidden * kv_width * 2 + 3 * hidden * inter  # q, o, k, v, gate/up/down
    matmul_params = layers * per_layer + (config.vocab_size * hidden if with_head else 0)
    return 6 * matmul_params + 6 * layers * q_width * context


def update_flops(config, lengths: list[int], response_tokens: list[int]) -> float:
    """FLOPs one pass of the update needs over these sequences (token count and
    response-token count per row): the decoder on every token, the lm_head on the
    response tokens (the fused path computes no other logits)."""
    head = training_flops_per_token(config, 0) - training_flops_per_token(config, 0, with_head=False)
    return sum(n * training_flops_per_token(config, n, with_head=False) + r * head for n, r in zip(lengths, response_tokens))


def peak_flops(device: str, override_tflops: float | None = None) -> float | None:
    """The MFU denominator: `override_tflops` if given (0 = none), else the datasheet
    bf16 peak of a known GPU by name; None on a CPU or an unknown GPU."""
    if override_tflops is not None:
        return override_tflops * 1e12 if override_tflops > 0 else None
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((peak for key, peak in DATASHEET_BF16_PEAK.items() if key in name.upper()), None)


def policy_peak_flops(roles: dict, world_size: int, override_tflops: float | None = None) -> float | None:
    """perf/mfu's denominator: the peak of every GPU the policy trains on (the FSDP ranks, or
    the GPUs of the seed's layer partition); None where no peak is known."""
    peak = peak_flops(roles["policy_main"], override_tflops)
    gpus = world_size if world_size > 1 else len({str(d) for d in roles["policy_layers"]} | {str(roles["policy_main"])})
    return peak * gpus if peak else None
