"""Role placement and the seed's layer partition (fake GPU counts; a real split where GPUs exist)."""

import copy
from types import SimpleNamespace

import pytest
import torch

from alignment.devices import auto_layout, format_role_table, partition_model_across_devices, place_model, resolve_dtype, resolve_role_devices
from alignment.errors import UserError


def seed_args(**overrides):
    values = {"layout": "explicit", "sample_device": "cuda:7", "reference_model_device": "cuda:6", "eval_device": "cuda:5", "policy_devices": None}
    values.update(overrides)
    return SimpleNamespace(**values)


@pytest.mark.parametrize("roles, num_layers, num_gpus, layers", [
    # the seed's 8 GPUs: 0-4 are left; ceil(28 / 5) = 6 layers each, the last GPU gets the remaining 4
    ({}, 28, 8, ["cuda:0"] * 6 + ["cuda:1"] * 6 + ["cuda:2"] * 6 + ["cuda:3"] * 6 + ["cuda:4"] * 4),
    ({"sample_device": "cuda:4", "reference_model_device": "cuda:3", "eval_device": "cuda:2"}, 7, 5, ["cuda:0"] * 4 + ["cuda:1"] * 3),
    ({"sample_device": "cuda:1", "reference_model_device": "cuda:1", "eval_device": "cuda:1"}, 4, 2, ["cuda:0"] * 4),  # shared roles
], ids=["eight_gpus_is_the_seeds", "five_gpus_leave_two_for_the_policy", "two_gpus_with_shared_roles"])
def test_partition_across_the_gpus_left(roles, num_layers, num_gpus, layers):
    assert partition_model_across_devices(seed_args(**roles), num_layers=num_layers, num_gpus=num_gpus) == ("cuda:0", layers)


def test_partition_with_no_gpu_left_is_a_clear_error():
    args = seed_args(sample_device="cuda:0", reference_model_device="cuda:0", eval_device="cuda:0")
    with pytest.raises(UserError, match="no GPU left for the policy"):
        partition_model_across_devices(args, num_layers=4, num_gpus=1)


@pytest.mark.parametrize(
    "num_gpus, sample, reference, evaluation, policy",
    [
        (0, "cpu", "cpu", "cpu", ["cpu"]),
        (1, "cuda:0", "cuda:0", "cuda:0", ["cuda:0"]),
        (2, "cuda:1", "cuda:0", "cuda:1", ["cuda:0"]),
        (3, "cuda:2", "cuda:1", "cuda:2", ["cuda:0", "cuda:1"]),  # still the 2-3 rule: three GPUs cannot give four roles their own
        (4, "cuda:3", "cuda:2", "cuda:1", ["cuda:0"]),
        (8, "cuda:7", "cuda:6", "cuda:5", ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:4"]),
    ],
)
def test_auto_layout(num_gpus, sample, reference, evaluation, policy):
    assert auto_layout(num_gpus) == {"sample": sample, "reference": reference, "eval": evaluation, "policy": policy}
    args = seed_args(layout="auto")
    roles = resolve_role_devices(args, num_layers=len(policy) * 2, num_gpus=num_gpus)
    assert (roles["sample"], roles["reference"], roles["eval"], roles["policy_main"]) == (sample, reference, evaluation, policy[0])
    assert (args.sample_device, args.eval_device, args.policy_devices) == ("cuda:7", "cuda:5", None)  # the flags stay as given
    assert sorted(set(roles["policy_layers"])) == sorted(policy)


def test_explicit_devices_must_exist():
    with pytest.raises(UserError, match=r"--sample_device cuda:7 does not exist: this machine has 2 GPU\(s\)"):
        resolve_role_devices(seed_args(), num_layers=4, num_gpus=2)
    with pytest.raises(UserError, match="--eval_device 'gpu1' is not a device"):
        resolve_role_devices(seed_args(sample_device="cpu", reference_model_device="cpu", eval_device="gpu1"), num_layers=4, num_gpus=0)
    with pytest.raises(UserError, match="--policy_devices cuda:3 does not exist"):
        resolve_role_devices(seed_args(layout="auto", policy_devices="cuda:0,cuda:3"), num_layers=4, num_gpus=2)


def test_a_device_index_equal_to_the_gpu_count_does_not_exist():
    """GPUs are numbered from 0: on 2 GPUs cuda:1 is the last one and cuda:2 is refused at start-up, not when a tensor moves there."""
    roles = resolve_role_devices(seed_args(sample_device="cuda:1", reference_model_device="cuda:1", eval_device="cuda:1"), num_layers=2, num_gpus=2)
    assert (roles["sample"], roles["policy_main"], roles["policy_layers"]) == ("cuda:1", "cuda:0", ["cuda:0", "cuda:0"])
    with pytest.raises(UserError, match=r"^--sample_device cuda:2 does not exist: this machine has 2 GPU\(s\)"):
        resolve_role_devices(seed_args(sample_device="cuda:2", reference_model_device="cuda:1", eval_device="cuda:1"), num_layers=2, num_gpus=2)
    with pytest.raises(UserError, match=r"^--policy_devices cuda:2 does not exist"):
        partition_model_across_devices(seed_args(policy_devices="cuda:0,cuda:2"), num_layers=2, num_gpus=2)


def test_a_role_device_spelled_another_way_is_still_kept_from_the_policy():
    """`--sample_device cuda:07` (or with a space) is cuda:7: the policy's layers must not be spread onto the sampler's
    GPU because the flag's text differs from the name the partition builds."""
    seed = resolve_role_devices(seed_args(), num_layers=28, num_gpus=8)
    for spelling in ("cuda:07", " cuda:7", "cuda:7 "):
        roles = resolve_role_devices(seed_args(sample_device=spelling), num_layers=28, num_gpus=8)
        assert roles == seed
        assert "cuda:7" not in roles["policy_layers"]
    assert partition_model_across_devices(seed_args(eval_device="cuda:005"), num_layers=28, num_gpus=8) == (seed["policy_main"], seed["policy_layers"])


def test_policy_devices_may_be_written_with_spaces_after_the_commas():
    """`--policy_devices "cuda:0, cuda:1"` (as people type lists) names the same two GPUs as "cuda:0,cuda:1"."""
    expected = ("cuda:0", ["cuda:0", "cuda:0", "cuda:1", "cuda:1"])
    assert partition_model_across_devices(seed_args(policy_devices="cuda:0, cuda:1"), num_layers=4, num_gpus=2) == expected
    assert partition_model_across_devices(seed_args(policy_devices=" cuda:0 ,cuda:1 "), num_layers=4, num_gpus=2) == expected


def test_auto_dtype_is_bf16_on_every_gpu_and_fp32_on_the_cpu():
    """--dtype auto: bf16 on any GPU (a policy on cuda:1 under --layout explicit too), fp32 on the CPU; an explicit dtype is kept."""
    assert [resolve_dtype("auto", device) for device in ("cuda:0", "cuda:1", "cuda:7", "cpu")] == [torch.bfloat16] * 3 + [torch.float32]
    assert (resolve_dtype("float32", "cuda:1"), resolve_dtype("bfloat16", "cpu")) == (torch.float32, torch.bfloat16)


def test_role_table_names_every_role():
    roles = resolve_role_devices(seed_args(), num_layers=28, num_gpus=8)
    table = format_role_table(roles)
    assert "rollout sampler (vLLM)     cuda:7" in table
    assert "cuda:0 (layers 0-5), cuda:1 (layers 6-11)" in table and "cuda:4 (layers 24-27)" in table


def test_place_model_forward_matches_unplaced(tiny_model_and_tokenizer):
    """On CPU both 'devices' are the CPU; with two GPUs the layers really split."""
    model, _ = tiny_model_and_tokenizer
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cpu", "cpu"]
    placed = copy.deepcopy(model)
    place_model(placed, devices[0], devices)
    assert placed.model.layers[1].mlp.up_proj.weight.device.type == torch.device(devices[1]).type
    input_ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
        actual = placed(input_ids=input_ids.to(devices[0])).logits.cpu().float()
    assert torch.allclose(actual, expected, atol=1e-4)
    loss = placed(input_ids=input_ids.to(devices[0])).logits.float().logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None for p in placed.parameters())
