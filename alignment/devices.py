"""Which device holds which role, and the seed's layer-partitioned policy.

Four roles (seed): the vLLM rollout sampler, the frozen reference model, the
evaluation engine, and the trainable policy, whose decoder layers are spread over
the GPUs the other roles leave free (`partition_model_across_devices`). The whole
table is built in `resolve_role_devices` and printed at start-up; every tensor
move between devices is an explicit `.to(...)` in train_rl or a hook below.
"""

import math

import torch

from alignment.errors import UserError


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _canonical(text: str) -> str:
    """One spelling per device, so that roles compare equal: " cuda:07" is cuda:7."""
    text = text.strip()
    return f"cuda:{int(text[5:])}" if text.startswith("cuda:") and text[5:].isdigit() else text


def _check_device(text: str, flag: str, num_gpus: int) -> str:
    """The device a flag names, in its one spelling; a UserError naming the flag if it is none or does not exist."""
    device = _canonical(text)
    if device == "cpu":
        return device
    if device.startswith("cuda:") and device[5:].isdigit():
        if int(device[5:]) >= num_gpus:
            raise UserError(f"{flag} {text.strip()} does not exist: this machine has {num_gpus} GPU(s); pass a device that exists or --layout auto")
        return device
    raise UserError(f"{flag} {text.strip()!r} is not a device: use cuda:N or cpu")


def auto_layout(num_gpus: int) -> dict[str, object]:
    """Sensible placement for the GPUs this machine has.

    0 GPUs: everything on the CPU. 1 GPU: all roles share it (vLLM gets a small
    memory fraction). 2-3 GPUs: sampler and eval engine on the last GPU, reference
    next to the policy. 4 or more: the seed's rule, sampler on the last GPU,
    reference and eval on the two before it, the policy's layers on the rest (with
    8 GPUs this is exactly the seed's defaults).
    """
    if num_gpus == 0:
        return {"sample": "cpu", "reference": "cpu", "eval": "cpu", "policy": ["cpu"]}
    last = num_gpus - 1
    if num_gpus == 1:
        return {"sample": "cuda:0", "reference": "cuda:0", "eval": "cuda:0", "policy": ["cuda:0"]}
    if num_gpus < 4:
        return {"sample": f"cuda:{last}", "reference": f"cuda:{last - 1}", "eval": f"cuda:{last}", "policy": [f"cuda:{i}" for i in range(last)]}
    return {
        "sample": f"cuda:{last}",
        "reference": f"cuda:{last - 1}",
        "eval": f"cuda:{last - 2}",
        "policy": [f"cuda:{i}" for i in range(last - 2)],
    }


def partition_model_across_devices(args, num_layers: int, num_gpus: int | None = None) -> tuple[str, list[str]]:
    """The seed's placement of the trainable policy.

    Take every GPU, drop those of the sampler, reference and eval roles; the first
    GPU left is `main_gpu` (embeddings, final norm, lm_head); the decoder layers go
    in order over the policy GPUs, `layers_per_gpu = ceil(num_layers / len(layer_gpus))`
    each. `--policy_devices` overrides the list of policy GPUs.

    Returns:
        (main_device, layer_devices) with layer_devices[i] the device of layer i.
    """
    num_gpus = gpu_count() if num_gpus is None else num_gpus
    if args.policy_devices:
        policy = [_check_device(d, "--policy_devices", num_gpus) for d in args.policy_devices.split(",")]
    elif num_gpus == 0:
        policy = ["cpu"]
    else:
        taken = {_canonical(device) for device in (args.sample_device, args.reference_model_device, args.eval_device)}
        policy = [f"cuda:{i}" for i in range(num_gpus) if f"cuda:{i}" not in taken]
        if not policy:
            raise UserError(
                f"no GPU left for the policy: the {num_gpus} GPU(s) all hold the sampler, reference or eval role; "
                "pass --policy_devices (GPUs may be shared) or --layout auto"
            )
    main_gpu = policy[0]
    layers_per_gpu = math.ceil(num_layers / len(policy))
    layer_devices = [policy[layer // layers_per_gpu] for layer in range(num_layers)]
    return main_gpu, layer_devices


def resolve_role_devices(args, num_layers: int, num_gpus: int | None = None) -> dict[str, object]:
    """The role -> device table: the device flags as given (seed), each in one spelling (cuda:07 is
    cuda:7), or with --layout auto the placement for this machine's GPUs. `args` is left as parsed.

    Raises UserError naming the flag when a device does not exist.
    """
    import argparse

    num_gpus = gpu_count() if num_gpus is None else num_gpus
    if args.layout == "auto":
        layout = auto_layout(num_gpus)
        args = argparse.Namespace(**{**vars(args), "sample_device": layout["sample"], "reference_model_device": layout["reference"],
                                     "eval_device": layout["eval"], "policy_devices": args.policy_devices or ",".join(layout["policy"])})
    roles = (("sample_device", "--sample_device"), ("reference_model_device", "--reference_model_device"), ("eval_device", "--eval_device"))
    args = argparse.Namespace(**{**vars(args), **{name: _check_device(getattr(args, name), flag, num_gpus) for name, flag in roles}})
    main_device, layer_devices = partition_model_across_devices(args, num_layers, num_gpus)
    return {
        "sample": args.sample_device,
        "reference": args.reference_model_device,
        "eval": args.eval_device,
        "policy_main": main_device,
        "policy_layers": layer_devices,
    }


def one_device_roles(device: str, num_layers: int) -> dict[str, object]:
    """Every role on one device: each rank's table under FSDP."""
    return {"sample": device, "reference": device, "eval": device, "policy_main": device, "policy_layers": [device] * num_layers}


def format_role_table(roles: dict[str, object]) -> str:
    layers = roles["policy_layers"]
    spans, start = [], 0
    for index in range(1, len(layers) + 1):
        if index == len(layers) or layers[index] != layers[start]:
            spans.append(f"{layers[start]} (layers {start}-{index - 1})")
            start = index
    rows = [
        ("rollout sampler (vLLM)", roles["sample"]),
        ("reference model", roles["reference"]),
        ("evaluation engine", roles["eval"]),
        ("policy embed/norm/lm_head", roles["policy_main"]),
        ("policy decoder layers", ", ".join(spans)),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {device}" for name, device in rows)


def _move_to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple):
        return tuple(_move_to(item, device) for item in value)
    if isinstance(value, list):
        return [_move_to(item, device) for item in value]
    if isinstance(value, dict):
        return {key: _move_to(item, device) for key, item in value.items()}
    return value


def _inputs_to_device(device):
    def hook(module, args, kwargs):
        return _move_to(args, device), _move_to(kwargs, device)

    return hook


def place_model(model, main_device: str, layer_devices: list[str]) -> None:
    """Move a HF decoder-only model onto the partition, in place.

    Embeddings, rotary tables, final norm and lm_head go to `main_device`; layer i
    to `layer_devices[i]`. A forward pre-hook on each layer and on the final norm
    moves its inputs (hidden states, position embeddings, masks) to its device, so
    the forward and backward run across GPUs one stage after the other.
    """
    decoder = model.model
    if len(decoder.layers) != len(layer_devices):
        raise ValueError(f"{len(layer_devices)} layer devices for {len(decoder.layers)} layers")
    model.to(main_device)
    if len(set(layer_devices)) == 1 and layer_devices[0] == main_device:
        return
    for layer, device in zip(decoder.layers, layer_devices):
        layer.to(device)
        layer.register_forward_pre_hook(_inputs_to_device(device), with_kwargs=True)
    decoder.norm.register_forward_pre_hook(_inputs_to_device(main_device), with_kwargs=True)


def resolve_device(flag_value: str, flag: str = "--device") -> str:
    """`auto` -> cuda:0 when a GPU exists, else cpu; other values are checked (a UserError naming `flag`)."""
    if flag_value == "auto":
        return "cuda:0" if gpu_count() else "cpu"
    return _check_device(flag_value, flag, gpu_count())


def resolve_dtype(flag_value: str, device: str) -> torch.dtype:
    """`auto` -> bfloat16 on a GPU, float32 on the CPU (bf16 matmuls are slow there)."""
    if flag_value == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[flag_value]
