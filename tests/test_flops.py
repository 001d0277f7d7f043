"""alignment/flops.py: the update's model FLOPs and the MFU denominator."""

import pytest
from transformers import Qwen2Config

from alignment.flops import peak_flops, training_flops_per_token, update_flops

# hidden 8, 2 query heads of 4, 1 key/value head, MLP 16, 2 layers, vocab 10
CONFIG = Qwen2Config(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def test_training_flops_per_token_by_hand():
    per_layer = 8 * 8 * 2 + 8 * 4 * 2 + 3 * 8 * 16  # q and o, k and v, gate/up/down = 576
    attention = 6 * 2 * 8 * 5  # 6 L d T at T = 5
    assert training_flops_per_token(CONFIG, 5) == 6 * (2 * per_layer + 10 * 8) + attention == 7872
    assert training_flops_per_token(CONFIG, 5, with_head=False) == 6 * 2 * per_layer + attention == 7392


def test_update_flops_counts_the_head_on_response_tokens_only():
    # two sequences: 5 tokens (2 of them response), 3 tokens (1 response)
    decoder = 5 * (6912 + 6 * 2 * 8 * 5) + 3 * (6912 + 6 * 2 * 8 * 3)
    head = 6 * 10 * 8
    assert update_flops(CONFIG, [5, 3], [2, 1]) == decoder + 3 * head
    assert update_flops(CONFIG, [5, 3], [0, 0]) == decoder


def test_peak_flops():
    assert peak_flops("cuda:0", 100) == pytest.approx(1e14)  # --peak_tflops wins
    assert peak_flops("cuda:0", 0) is None  # 0: do not log MFU
    assert peak_flops("cpu") is None  # no datasheet figure for a CPU


def test_attention_flops_follow_the_query_width_when_head_dim_is_set():
    """Configs with an explicit head_dim (Qwen3-style) have query width heads x head_dim, not hidden:
    the attention term and the q/o projections must follow it."""
    from types import SimpleNamespace

    # hidden 8, 4 query heads of 4 (query width 16), 2 key/value heads (width 8), MLP 16, 1 layer, vocab 10
    config = SimpleNamespace(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=4, vocab_size=10)
    per_layer = 8 * 16 * 2 + 8 * 8 * 2 + 3 * 8 * 16  # q and o 256, k and v 128, gate/up/down 384 = 768
    attention = 6 * 1 * 16 * 5  # 6 L (heads x head_dim) T at T = 5 = 480, not 6 L hidden T = 240
    assert training_flops_per_token(config, 5, with_head=False) == 6 * per_layer + attention == 5088
    assert training_flops_per_token(config, 5) == 6 * (per_layer + 10 * 8) + attention == 5568


def test_datasheet_peak_found_in_the_gpu_name(monkeypatch):
    """CUDA names start with the vendor ("NVIDIA H100 80GB HBM3"): the model is looked up inside the name, in any case;
    the H100's PCIe and NVL cards have their own, lower peaks than the SXM part."""
    import torch

    names = {"cuda:0": "NVIDIA H100 80GB HBM3", "cuda:1": "NVIDIA A100-SXM4-40GB", "cuda:2": "nvidia h200", "cuda:3": "NVIDIA GeForce RTX 4090",
             "cuda:4": "NVIDIA H100 PCIe", "cuda:5": "NVIDIA H100 NVL"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: names[str(device)])
    assert peak_flops("cuda:0") == 989e12
    assert peak_flops("cuda:1") == 312e12
    assert peak_flops("cuda:2") == 989e12
    assert peak_flops("cuda:3") is None  # no datasheet figure: no MFU rather than a wrong one
    assert peak_flops("cuda:0", 500) == 500e12
    assert (peak_flops("cuda:4"), peak_flops("cuda:5")) == (756e12, 835e12)


def test_policy_peak_counts_every_gpu_the_policy_trains_on():
    """perf/mfu's denominator: every FSDP rank's GPU, or each distinct GPU of the one-process layer partition."""
    from alignment.flops import policy_peak_flops

    split = {"policy_main": "cuda:0", "policy_layers": ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]}
    assert policy_peak_flops(split, 1, 100) == pytest.approx(2 * 100e12)  # one process, layers on 2 GPUs
    one = {"policy_main": "cuda:0", "policy_layers": ["cuda:0"] * 4}
    assert policy_peak_flops(one, 1, 100) == pytest.approx(100e12)
    assert policy_peak_flops(one, 4, 100) == pytest.approx(4 * 100e12)  # 4 FSDP ranks, one GPU each
    assert policy_peak_flops(split, 1, 0) is None
