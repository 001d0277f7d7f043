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
