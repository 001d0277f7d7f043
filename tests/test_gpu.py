"""The GPU-only paths, on a CUDA machine with vLLM's CUDA build (skipped elsewhere, so CI's
CPU runs skip them): a compiled engine pinned to its GPU by device_ids, the direct weight
copy into the engine's parameters, and train_rl end to end with bf16 compute on fp32
master weights. Run on a GPU box with `pytest tests/test_gpu.py`."""

import copy
import importlib.util
import sys

import pytest
import torch

from alignment.plot import read_jsonl
from conftest import REPO_ROOT, make_tiny_task, train_rl_flags
from test_rollout import PROMPTS, perturbed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                reason="needs a CUDA GPU and vLLM's CUDA build")


def engine_device() -> str:
    """The last GPU: on a machine of two, the engine must land on cuda:1 through device_ids."""
    return f"cuda:{torch.cuda.device_count() - 1}"


@pytest.fixture(scope="module")
def gpu_engine(tiny_checkpoint):
    from alignment.rollout import VllmEngine

    engine = VllmEngine(tiny_checkpoint, engine_device(), dtype="bfloat16", seed=0, gpu_memory_utilization=0.2)  # compiled (no enforce_eager)
    yield engine
    engine.close()


def sampler_gap(engine, policy) -> float:
    """Mean |sampler log-prob - policy log-prob| over the engine's greedy tokens (bench_rollout's proof)."""
    from bench_rollout import hf_log_probs, mean_abs_difference, vllm_token_log_probs  # bench/ is on pytest's path (pyproject.toml)

    sequences = vllm_token_log_probs(engine, PROMPTS, max_tokens=12)
    return mean_abs_difference(sequences, hf_log_probs(policy, sequences, "cuda:0"))


def test_engine_weights_live_on_the_requested_gpu(gpu_engine):
    devices = gpu_engine.llm.apply_model(lambda model: {str(p.device) for p in model.parameters()})[0]
    assert devices == {engine_device()}


def test_direct_copy_makes_the_engine_score_like_the_policy(gpu_engine, tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    policy = perturbed(model, seed=1).to(device="cuda:0", dtype=torch.bfloat16).eval()
    before = sampler_gap(gpu_engine, policy)
    gpu_engine.load_weights(policy.state_dict().items())  # cuda:0 -> the engine's GPU, parameter by parameter
    assert gpu_engine.last_sync_path == "direct"  # the tiny vocabulary (416) is padded to 448 rows in vLLM: the plan fills the first 416
    after = sampler_gap(gpu_engine, policy)
    assert before > 0.5 and after < 0.1, (before, after)  # bf16 kernels differ a little (W1 model: 3.7 -> 0.058)
    start = copy.deepcopy(model).to(dtype=torch.bfloat16).eval()  # a copy: the session fixture stays fp32 on the CPU
    gpu_engine.load_weights(start.state_dict().items())  # back, from CPU tensors copied to the GPU
    assert sampler_gap(gpu_engine, start.to("cuda:0")) < 0.1


def test_train_rl_on_a_gpu_with_fp32_master_weights(tmp_path):
    """Two steps with the default GPU numerics; a child process, since one engine lives per process."""
    import subprocess

    task = make_tiny_task(tmp_path, num_train=32, num_test=8, seed=1)
    flags = train_rl_flags(task, "gpu", "--rollout_backend", "vllm", "--tmp_checkpoint_path", str(tmp_path / "rl_tmp"), "--train_mini_batch_size", "4",
                           "--sampling_max_tokens", "24", "--eval_max_tokens", "24", "--eval_num_examples", "8", "--max_steps", "2",
                           "--evaluate_freq", "2", "--kl_coef", "0.01", "--vllm_gpu_memory_utilization", "0.2", checkpoint_path=tmp_path / "rl")
    done = subprocess.run([sys.executable, "-m", "alignment.train_rl", *flags], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = read_jsonl(tmp_path / "runs" / "gpu" / "steps.jsonl")
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[0]["train/sampler_logprob_abs_diff"] < 0.1  # step 1 compares the sampler's log-probs with the trainer's
    assert all(s["train/grad_norm"] > 0 for s in steps)
    assert (tmp_path / "rl" / "model.safetensors").is_file()


def test_packed_varlen_attention_on_a_gpu_matches_the_padded_path(tiny_checkpoint):
    """--pack_sequences' FlashAttention varlen kernel (GQA, causal) against padded sdpa, bf16 compute on fp32 weights."""
    from alignment.precision import autocast
    from alignment.rollout import load_hf_model
    from alignment.sft_helpers import get_response_log_probs

    vocabulary = load_hf_model(tiny_checkpoint, "cpu", torch.float32).config.vocab_size
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 31, 17, 64, 9]
    input_ids = torch.randint(0, vocabulary, (len(lengths), max(lengths)), generator=generator)
    labels = torch.randint(0, vocabulary, input_ids.shape, generator=generator)
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    results = []
    for packed in (False, True):
        model = load_hf_model(tiny_checkpoint, "cuda:0", torch.float32)
        with autocast("cuda:0", torch.bfloat16):
            log_probs = get_response_log_probs(model, input_ids.cuda(), labels.cuda(), chunk_size=64, positions=mask,
                                               lengths=lengths if packed else None)["log_probs"]
        (log_probs * mask.cuda()).sum().backward()
        results.append((log_probs.detach().cpu() * mask, torch.cat([p.grad.flatten() for p in model.parameters()]).cpu()))
    (padded, padded_grad), (packed, packed_grad) = results
    assert (packed - padded).abs().max() < 0.05  # bf16 kernels: the two attention paths round differently
    assert torch.nn.functional.cosine_similarity(packed_grad, padded_grad, dim=0) > 0.999
