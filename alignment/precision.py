"""Mixed precision for the trainable policy: fp32 master weights, bf16 compute.

`--dtype` is the compute dtype (auto = bf16 on a GPU, fp32 on the CPU). With
`--fp32_master_weights` (the default) the policy's parameters, their gradients and
AdamW's state stay in fp32 and forward/backward run under `torch.autocast` in the
compute dtype, as TRL, verl and OpenRLHF train. Why it matters: AdamW's step on a
bf16 weight of magnitude ~0.02 is rounded away unless it exceeds half a bf16 ulp
(~6e-5), so at lr 1e-6 about 98% of the elements never move (measured: torch AdamW
on a bf16 weight of std 0.02 changed 1.96% of its elements per step; with fp32 master
weights, 100%).

`--no-fp32_master_weights` keeps the seed's behaviour: parameters, gradients and
optimizer state all in the compute dtype (half the memory, no autocast).

The frozen reference model and the rollout engine hold compute-dtype copies; a
weight sync casts fp32 -> bf16 on the way in.
"""

import contextlib

import torch


def master_dtype(compute_dtype: torch.dtype, fp32_master_weights: bool) -> torch.dtype:
    """The dtype the trainable policy's parameters (and so AdamW's state) are stored in."""
    return torch.float32 if fp32_master_weights else compute_dtype


def autocast(device: str, compute_dtype: torch.dtype):
    """`torch.autocast` to `compute_dtype` on `device`'s type when it is below fp32, else a no-op.

    Under the seed's layer partition one context covers every GPU (autocast is per
    device type). Parameters already in the compute dtype pass through unchanged,
    so this is harmless for pure-bf16 models and for the frozen reference.
    """
    if compute_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=compute_dtype)


def describe(master: torch.dtype, compute: torch.dtype) -> str:
    """One line for the start-up log."""
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if master == compute:
        return f"policy weights, gradients, AdamW state and compute all {name[compute]}"
    return f"policy master weights, gradients and AdamW state {name[master]}; forward/backward under autocast {name[compute]}"
