"""Build a small Qwen2 model and byte-level BPE tokenizer on the fly.

No hub access is needed: the tokenizer is trained in seconds with `tokenizers`
on the texts it will see, and the model is randomly initialised. Both are saved as
an ordinary Hugging Face checkpoint that transformers and vLLM load like any other.
Tests, the CPU demo and the GPU benchmarks' `--tiny` smoke runs use it.

vLLM's CPU attention needs head_dim 64 (16 failed with "Unsupported CPU attention
configuration"), so every config here keeps hidden_size / num_attention_heads = 64.
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

from alignment.data import R1_ZERO_PROMPT

END_OF_TEXT = "<|endoftext|>"


def train_byte_level_tokenizer(texts, vocab_size: int = 512, whole_tokens=()) -> PreTrainedTokenizerFast:
    """A GPT-2 style byte-level BPE tokenizer; `<|endoftext|>` is eos and pad.

    Any string round-trips (byte-level), so model outputs never hit unknown tokens.
    `whole_tokens` are strings encoded as one token each wherever they occur
    (the demo passes the fixed parts of the r1_zero prompt, so a tiny model spends
    its compute on the question rather than on ~100 tokens of boilerplate; the
    prompt text itself is unchanged).
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if whole_tokens:
        tokenizer.add_tokens([AddedToken(text, normalized=False, special=False) for text in whole_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        clean_up_tokenization_spaces=False,
    )


def tiny_qwen2_config(vocab_size: int, hidden_size: int = 128, num_layers: int = 2, intermediate_size: int = 256, max_position_embeddings: int = 1024, eos_token_id: int = 0) -> Qwen2Config:
    heads, key_value_heads = hidden_size // 64, max(1, hidden_size // 128)
    if hidden_size % 64 or heads % key_value_heads:  # e.g. 96 (no 64-dim heads) or 320 (5 heads over 2 key/value heads)
        raise ValueError(f"hidden_size {hidden_size}: give a multiple of 64 whose head count (hidden_size / 64) is a multiple of "
                         "hidden_size // 128, such as 64, 128, 256 or 384: heads are 64 wide and share key/value heads")
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )


def r1_zero_whole_tokens() -> tuple[str, ...]:
    """The r1_zero format's fixed strings, for `whole_tokens`.

    The prompt's text before and after `{question}`, and the answer's tags as an SFT
    completion writes them (` </think> <answer>`, ` </answer>`): a bare answer is then
    four or five tokens (tag, space, digits, tag) rather than eleven, and a worked one
    loses seven.
    """
    before, after = R1_ZERO_PROMPT.split("{question}")
    return before, after, " </think> <answer>", " </answer>"


def build_tiny_checkpoint(path, texts=None, vocab_size: int = 512, seed: int = 0, whole_tokens=(), **config_overrides) -> Path:
    """Train a tokenizer on `texts`, build a random Qwen2, save both to `path`.

    `texts` defaults to the r1_zero prompt plus a few arithmetic lines, enough for
    tests. Returns the checkpoint path.
    """
    import torch

    path = Path(path)
    if texts is None:
        texts = [R1_ZERO_PROMPT.replace("{question}", f"What is {a} plus {b}?") + f" {a} + {b} = {a + b} </think> <answer> {a + b} </answer>" for a in range(20) for b in range(5)]
    tokenizer = train_byte_level_tokenizer(texts, vocab_size=vocab_size, whole_tokens=whole_tokens)
    config = tiny_qwen2_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # generation_config.json would carry transformers defaults that vLLM also reads;
    # keep the checkpoint neutral so both backends sample exactly as we ask.
    generation_config = path / "generation_config.json"
    if generation_config.exists():
        generation_config.write_text(json.dumps({"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.eos_token_id}))
    return path
