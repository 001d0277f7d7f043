"""Rollout engines: vLLM (seed) and Hugging Face `generate`, with one interface.

Both honour the same sampling settings: temperature (0 = greedy), top_p,
min_tokens, max_tokens, repetition penalty, and `stop=["</answer>"]` with the stop
string kept in the text (vLLM's `include_stop_str_in_output=True`). Both can take
new weights from the policy (`load_weights`), which is how rollouts follow the
policy instead of staying at the start checkpoint as in the seed.

vLLM is imported lazily inside `VllmEngine`, so everything else runs where vLLM is
not installed.
"""

import gc
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from alignment.errors import UserError
from alignment.precision import autocast

STOP_STRINGS = ("</answer>",)


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    min_tokens: int = 0
    max_tokens: int = 1024
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = STOP_STRINGS
    # also return each sampled token's log-prob under the distribution it was drawn
    # from (after repetition penalty, temperature and top_p), to measure how far the
    # sampler is from the trainer's scoring. Not free: vLLM's front end turns each returned
    # log-prob into Python objects (its text decoded) between decode steps, and W1 on an
    # H200 ran at 19k tokens/s with every request asking, 30k with 1 in 16, 39k with none
    # (bench/bench_sampler_logprobs.py), so train_rl asks on some steps only
    # (--sampler_logprobs_every) unless the engine core runs in its own process.
    log_probs: bool = False

    @property
    def returns_log_probs(self) -> bool:
        return self.log_probs and self.temperature > 0

    @classmethod
    def from_args(cls, args, prefix: str) -> "SamplingSettings":
        """Read `--{prefix}temperature` etc. (prefix `sampling_`, `eval_` or '')."""
        return cls(
            temperature=getattr(args, f"{prefix}temperature"),
            top_p=getattr(args, f"{prefix}top_p"),
            min_tokens=getattr(args, f"{prefix}min_tokens"),
            max_tokens=getattr(args, f"{prefix}max_tokens"),
            repetition_penalty=repetition_penalty_of(args, prefix),
        )


def repetition_penalty_of(args, prefix: str) -> float:
    """`--{prefix}repetition_penalty` where the command has one set (train_rl's --eval_repetition_penalty),
    else `--repetition_penalty`: the seed's one penalty for rollouts and evaluations."""
    own = getattr(args, f"{prefix}repetition_penalty", None)
    return args.repetition_penalty if own is None else own


@dataclass
class Generation:
    text: str
    num_tokens: int
    token_ids: list[int]
    log_probs: list[float] | None = None  # the sampler's, one per token id, when asked


def truncate_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """Cut after the first stop string, keeping it (vLLM's include_stop_str_in_output)."""
    cut = len(text)
    for marker in stop:
        index = text.find(marker)
        if index != -1:
            cut = min(cut, index + len(marker))
    return text[:cut]


class HfEngine:
    """Rollouts with transformers `generate` on a model we already hold.

    With `--rollout_sync_every 1` the engine wraps the policy itself, so a "sync" is
    free; otherwise it wraps its own copy and `load_weights` copies the policy in.
    `compute_dtype` runs generation under autocast (an fp32-master policy samples
    with the bf16 compute the trainer uses). Generation runs eagerly even through
    layers compiled for the update (--torch_compile): each decoding step changes the
    KV cache's state and length, and the compiled layers would recompile for them
    until torch's recompile limit sent them back to eager anyway.
    """

    def __init__(self, model, tokenizer, batch_size: int = 64, compute_dtype: torch.dtype = torch.float32):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.compute_dtype = compute_dtype

    @property
    def device(self):
        return self.model.get_input_embeddings().weight.device  # where the model is now (train_rl places the policy after wrapping it)

    @torch.no_grad()
    def generate(self, prompts: list[str], sampling: SamplingSettings) -> list[Generation]:
        from transformers import StoppingCriteria, StoppingCriteriaList, StopStringCriteria

        class StopAfterMinTokens(StoppingCriteria):
            """vLLM ignores stop strings before min_tokens; HF's criterion does not."""

            def __init__(self, inner, prompt_length):
                self.inner, self.prompt_length = inner, prompt_length

            def __call__(self, input_ids, scores, **kwargs):
                done = self.inner(input_ids, scores, **kwargs)
                if input_ids.shape[1] - self.prompt_length < sampling.min_tokens:
                    return torch.zeros_like(done)
                return done

        was_training = self.model.training
        self.model.eval()
        padding_side = self.tokenizer.padding_side
        self.tokenizer.padding_side = "left"
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        outputs = []
        try:
            for start in range(0, len(prompts), self.batch_size):
                batch = self.tokenizer(prompts[start : start + self.batch_size], return_tensors="pt", padding=True).to(self.device)
                prompt_length = batch["input_ids"].shape[1]
                stop = StopAfterMinTokens(StopStringCriteria(self.tokenizer, list(sampling.stop)), prompt_length)
                sample = sampling.temperature > 0
                recorder = _SampledLogProbs() if sampling.returns_log_probs else None
                processors = []
                if sample:
                    # temperature and top_p as our own processors, after HF's defaults
                    # (repetition penalty, min length), the order HF and vLLM use; the
                    # recorder then sees the distribution each token is drawn from
                    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

                    processors = [TemperatureLogitsWarper(sampling.temperature)] + ([TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1 else [])
                    processors = LogitsProcessorList(processors + ([recorder] if recorder else []))
                with autocast(str(self.device), self.compute_dtype), torch.compiler.set_stance("force_eager"):
                    generated = self.model.generate(
                        **batch,
                        do_sample=sample,
                        temperature=1.0 if sample else None,
                        top_p=1.0 if sample else None,
                        top_k=0 if sample else None,
                        logits_processor=processors or None,
                        min_new_tokens=sampling.min_tokens,
                        max_new_tokens=sampling.max_tokens,
                        repetition_penalty=sampling.repetition_penalty,
                        stopping_criteria=StoppingCriteriaList([stop]),
                        pad_token_id=pad_id,
                        eos_token_id=self.tokenizer.eos_token_id,
                    )[:, prompt_length:]
                log_probs = recorder.finish(generated) if recorder else None
                for index, row in enumerate(generated.tolist()):
                    if pad_id in row:  # finished rows are padded after their last token
                        row = row[: row.index(pad_id)]
                    text = truncate_at_stop(self.tokenizer.decode(row, skip_special_tokens=True), sampling.stop)
                    row_log_probs = log_probs[index, : len(row)].tolist() if log_probs is not None else None
                    outputs.append(Generation(text=text, num_tokens=len(row), token_ids=row, log_probs=row_log_probs))
        finally:
            self.tokenizer.padding_side = padding_side
            self.model.train(was_training)
        return outputs

    def load_weights(self, named_tensors) -> None:
        own = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name in own and own[name].data_ptr() != tensor.data_ptr():
                    own[name].copy_(tensor)

    def close(self) -> None:
        pass


class _SampledLogProbs:
    """A last logits processor that keeps log_softmax of the scores a token is drawn from.

    At each step it sees the previous step's sampled token (the last input id), so it
    holds one (B, V) step at a time; `finish` scores the final token.
    """

    def __init__(self):
        self.previous = None
        self.columns = []

    def __call__(self, input_ids, scores):
        if self.previous is not None:
            self.columns.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, generated):
        """(B, new_tokens) log-probs of the sampled ids, on the CPU."""
        if self.previous is not None and generated.shape[1]:
            self.columns.append(self.previous.gather(-1, generated[:, -1:]).squeeze(-1))
        self.previous = None
        return torch.stack(self.columns, dim=1).cpu() if self.columns else torch.zeros(generated.shape)


def isolate_compile_caches(index: int) -> None:
    """One set of compile caches per GPU index, for this process (one engine per process).

    vLLM 0.26's compile caches (its graph cache and the AOT-compiled model) are not
    keyed by GPU, and inductor's generated code names its device: artifacts compiled
    on one GPU and loaded on another failed with "CUDA driver error: invalid argument"
    (H200 x2). vLLM's cache root, inductor's and triton's each get a per-index folder
    (under torchrun every rank's, GPU 0's included, since the ranks compile at once).
    """
    for variable, default in (("VLLM_CACHE_ROOT", "~/.cache/vllm"), ("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_" + os.environ.get("USER", "user")),
                              ("TRITON_CACHE_DIR", "~/.triton/cache")):
        root = os.environ.get(variable, os.path.expanduser(default))
        if not root.rstrip("/").endswith(f"alignment_cuda{index}"):
            os.environ[variable] = os.path.join(root, f"alignment_cuda{index}")


# vLLM fuses some of Hugging Face's projections into one parameter (rows stacked in this order)
_FUSED_SOURCES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def direct_copy_plan(engine_model, source_shapes: dict[str, torch.Size]):
    """[(engine parameter, [source names])], or None if any parameter does not map."""
    plan = []
    embed = dict(engine_model.named_parameters()).get("model.embed_tokens.weight")
    for name, parameter in engine_model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        module_prefix, _, module = prefix.rpartition(".")
        if name == "lm_head.weight" and embed is not None and parameter.data_ptr() == embed.data_ptr():
            continue  # tied to the embeddings, filled with them
        sources = [f"{module_prefix}.{part}.{leaf}" for part in _FUSED_SOURCES[module]] if module in _FUSED_SOURCES else [name]
        if any(s not in source_shapes for s in sources) or any(source_shapes[s][1:] != parameter.shape[1:] for s in sources):
            return None
        rows = sum(source_shapes[s][0] for s in sources)
        # vLLM pads the vocabulary to a multiple of 64 rows (never read: logits are cut to the real vocabulary)
        padded_vocabulary = name.endswith(("embed_tokens.weight", "lm_head.weight")) and rows < parameter.shape[0]
        if rows != parameter.shape[0] and not padded_vocabulary:
            return None
        plan.append((parameter, sources))
    return plan


def copy_by_plan(plan, tensors: dict[str, torch.Tensor]) -> None:
    """Fill each engine parameter in place from its source tensors (stacked as vLLM fuses them)."""
    with torch.no_grad():
        for parameter, sources in plan:
            offset = 0
            for source in sources:
                rows = tensors[source].shape[0]
                parameter.data[offset : offset + rows].copy_(tensors[source], non_blocking=True)
                offset += rows


def pack_tensors(named_tensors) -> bytes:
    """(name, tensor) pairs as bytes another process can open without a copy: CUDA tensors
    travel as IPC handles, CPU tensors through shared memory (torch.multiprocessing's
    reductions). The sender keeps the tensors alive until the receiver has loaded them."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    reductions.init_reductions()  # the tensor reductions, registered with ForkingPickler (idempotent)
    return bytes(ForkingPickler.dumps([(name, tensor) for name, tensor in named_tensors]))


def _count_ranks_eagerly(worker=None) -> None:
    """On a CPU, count each returned log-prob's rank eagerly: vLLM's sampler counts it with a
    torch.compile'd function (vllm.v1.sample.ops.logprobs), whose first call costs every process
    seconds (an inductor build of a C++ kernel, or a cache lookup that hashes torch's sources; the
    demo's first rollout took 3.9 s against 0.6 s for the next) for a comparison and a sum. The
    same integers. Runs where the sampler runs: in this process, or in the engine core's
    (collective_rpc passes the worker)."""
    try:
        from vllm.v1.sample import sampler
    except ImportError:
        return
    if hasattr(sampler, "batched_count_greater_than"):
        sampler.batched_count_greater_than = lambda x, values: (x >= values).sum(-1)


def _load_packed_in_worker(worker, payload: bytes, device: str) -> str:
    """Runs inside vLLM's engine-core process (collective_rpc): open the packed tensors, copy them in."""
    import pickle

    tensors = dict(pickle.loads(payload))
    if device.startswith("cuda"):
        plan = getattr(worker, "_alignment_plan", None)
        if plan is None:
            plan = direct_copy_plan(worker.get_model(), {k: v.shape for k, v in tensors.items()}) or False
            worker._alignment_plan = plan
        if plan:
            copy_by_plan(plan, tensors)
            torch.cuda.synchronize()
            return "direct"
    worker.reload_weights(weights_iterator=iter(tensors.items()))
    return "reload_weights"


class VllmEngine:
    """A vLLM `LLM` on one device, with in-place weight updates.

    In-process by default (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so weights are handed
    over as tensors, never serialised. `load_weights` has two paths:
    - direct copy (GPU): each engine parameter is filled in place from the policy's
      tensors (q/k/v and gate/up stacked as vLLM fuses them), GPU to GPU, no
      temporary state dict; used when every parameter maps with matching shapes;
    - `collective_rpc("reload_weights", weights_iterator=...)`, vLLM's supported
      reload (CPU, or any model the direct map does not cover).
    Either way the prefix cache is dropped afterwards: its KV entries were computed
    with the old weights. The same code runs on vLLM 0.26 and 0.32.

    `engine_process=True` (the sampler process of --rollout_staleness on a GPU) runs
    vLLM's engine core in a process of its own, so the front end's per-token Python
    (text, stop strings, log-prob bookkeeping) overlaps the GPU steps instead of adding
    to them; weights then travel packed (`pack_tensors`: IPC handles, no copy) and the
    same two paths run inside the engine-core process.

    Only one engine may live in a process at a time: closing one tears down vLLM's
    process-wide state, which breaks any other (the seed's temporary eval engine
    therefore runs in a child process; see evaluate.evaluate_in_subprocess).
    """

    def __init__(self, model_path, device: str, dtype: str, seed: int, gpu_memory_utilization: float | None = None, kv_cache_gb: float = 1.0,
                 enforce_eager: bool | None = None, max_model_len: int | None = None, shares_gpu: bool = False, engine_process: bool = False):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine_process else "0"
        self._rpc_folder = self._rpc_base = None
        if engine_process:  # collective_rpc sends our load function to the engine core by pickle
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        try:
            from vllm import LLM
        except ImportError as error:
            raise UserError(f"vLLM is not importable ({error}); install it (see README) or pass --rollout_backend hf / --backend hf") from None
        under_torchrun = torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        if enforce_eager is None:  # eager on a CPU: compiling there costs seconds at start-up and gains nothing measurable
            enforce_eager = device == "cpu"
        kwargs = {"model": str(model_path), "dtype": dtype, "seed": seed, "enforce_eager": enforce_eager, "max_model_len": max_model_len,
                  # returned log-probs are those of the distribution sampled from (after
                  # penalties, temperature, top_p), not the raw model's
                  "logprobs_mode": "processed_logprobs"}
        if under_torchrun:
            # One engine per rank. vLLM would otherwise take the ranks' process group for
            # its own tensor-parallel world; in "external launcher" mode it joins that group
            # as one single-GPU engine per rank, on the rank's LOCAL_RANK device.
            kwargs["distributed_executor_backend"] = "external_launcher"
        if device == "cpu":
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 1024**3)
        else:
            index = int(device.split(":")[1])
            if index and not under_torchrun:
                kwargs["device_ids"] = [index]  # vLLM takes no device=; this pins the engine to one GPU
            if index or under_torchrun:
                isolate_compile_caches(index)
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization or (0.3 if shares_gpu else 0.85)
        previous = torch.cuda.current_device() if torch.cuda.is_available() and not engine_process else None
        started = time.perf_counter()
        if engine_process:
            self._rpc_base = os.environ.get("VLLM_RPC_BASE_PATH")
            self._rpc_folder = _private_rpc_folder(self._rpc_base)
        else:
            # vLLM's engine core runs full garbage collections while it starts (loading weights,
            # profiling memory), then freezes the heap until its shutdown. Frozen now, those
            # passes skip the ~650,000 objects of torch's, transformers' and vLLM's modules: on
            # a CPU they were half of an engine's start.
            gc.collect()
            gc.freeze()
        self.llm = LLM(**kwargs)
        if device == "cpu" and engine_process:
            self.llm.collective_rpc(_count_ranks_eagerly)
        elif device == "cpu":
            _count_ranks_eagerly()
        self.start_seconds = time.perf_counter() - started
        if previous is not None:
            torch.cuda.set_device(previous)  # the engine made its GPU current; the policy code expects its own
        self.device = device
        self.engine_process = engine_process
        self._direct_plan = None
        self.last_sync_path = None

    def _on_device(self):
        """Run engine work with its GPU current (its kernels and graphs assume it)."""
        import contextlib

        return torch.cuda.device(self.device) if self.device.startswith("cuda") and not self.engine_process else contextlib.nullcontext()

    def generate(self, prompts: list[str], sampling: SamplingSettings) -> list[Generation]:
        from vllm import SamplingParams

        params = SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            min_tokens=sampling.min_tokens,
            max_tokens=sampling.max_tokens,
            repetition_penalty=sampling.repetition_penalty,
            stop=list(sampling.stop),
            include_stop_str_in_output=True,
            logprobs=0 if sampling.returns_log_probs else None,  # 0: only the sampled token's
        )
        with self._on_device():
            results = self.llm.generate(prompts, params, use_tqdm=False)
        generations = []
        for result in results:
            output = result.outputs[0]
            ids = list(output.token_ids)
            log_probs = [step[token].logprob for step, token in zip(output.logprobs, ids)] if output.logprobs is not None else None
            generations.append(Generation(text=output.text, num_tokens=len(ids), token_ids=ids, log_probs=log_probs))
        return generations

    def load_packed(self, payload: bytes) -> None:
        """Load weights packed by `pack_tensors` (in another process, which keeps them alive until this returns)."""
        if self.engine_process:
            self.last_sync_path = self.llm.collective_rpc(_load_packed_in_worker, args=(payload, self.device))[0]
            self.llm.reset_prefix_cache()
        else:
            import pickle

            self.load_weights(pickle.loads(payload))

    def load_weights(self, named_tensors) -> None:
        """Copy the policy's weights (checkpoint names) into the engine."""
        if self.engine_process:
            tensors = list(named_tensors)  # alive until the engine core has copied them
            self.load_packed(pack_tensors(tensors))
            return
        with self._on_device():
            if self.device.startswith("cuda"):
                tensors = dict(named_tensors)
                if self._direct_plan is None:
                    engine_model = self.llm.apply_model(lambda model: model)[0]  # in-process: the module itself
                    self._direct_plan = direct_copy_plan(engine_model, {k: v.shape for k, v in tensors.items()}) or False
                if self._direct_plan:
                    copy_by_plan(self._direct_plan, tensors)
                    torch.cuda.synchronize(self.device)
                    self.last_sync_path = "direct"
                else:
                    self._reload(tensors.items())
            else:
                self._reload(named_tensors)
            self.llm.reset_prefix_cache()

    def _reload(self, named_tensors) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.last_sync_path = "reload_weights"

    def close(self) -> None:
        del self.llm  # an in-process engine's shutdown unfreezes the heap
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self._rpc_folder is not None:
            shutil.rmtree(self._rpc_folder, ignore_errors=True)
            if self._rpc_base is None:
                os.environ.pop("VLLM_RPC_BASE_PATH", None)
            else:
                os.environ["VLLM_RPC_BASE_PATH"] = self._rpc_base


def _private_rpc_folder(base: str | None) -> str | None:
    """A new folder for the ZMQ socket files of an engine whose core runs in a process of its own,
    set as VLLM_RPC_BASE_PATH; None (vLLM's default place) where the sockets' paths would not fit.

    vLLM names those sockets (front end, engine core, worker: 7 an engine) by files in the temp
    folder and leaves them there after a clean shutdown; these go with the folder at close.
    """
    import zmq

    folder = tempfile.mkdtemp(prefix="vllm-rpc-", dir=base)
    if len(f"{folder}/{uuid.uuid4()}") > zmq.IPC_PATH_MAX_LEN:  # a socket's path: the folder, then a UUID
        os.rmdir(folder)
        return None
    os.environ["VLLM_RPC_BASE_PATH"] = folder
    return folder


def checkpoint_tensors(folder):
    """(name, tensor) pairs of a Hugging Face checkpoint folder's safetensors files, on the CPU.

    A tied output layer, which save_pretrained leaves out, comes too, as `lm_head.weight` (the
    embeddings), the way a policy's state_dict lists it: vLLM's reload on a CPU processes only
    the layers it is handed, and without it kept the previous weights' output layer."""
    from pathlib import Path

    from safetensors.torch import load_file

    index = Path(folder) / "model.safetensors.index.json"  # a sharded checkpoint's own list of its files
    files = sorted({Path(folder) / name for name in json.loads(index.read_text())["weight_map"].values()}) if index.is_file() else sorted(Path(folder).glob("*.safetensors"))
    tensors = {}
    for file in files:
        tensors.update(load_file(str(file)))
    config = json.loads((Path(folder) / "config.json").read_text())
    if config.get("tie_word_embeddings") and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    yield from tensors.items()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them: a fast, SentencePiece or BPE vocabulary


def check_model_folder(path, flag: str) -> None:
    """Before any engine loads a local model folder: its config names an architecture transformers knows, its
    tokenizer loads, and its safetensors files hold every parameter, each of the shape its config.json implies
    (a shard missing or cut short: from_pretrained fails late, an in-place load would keep the previous values).

    Each problem is one line naming the flag, the folder and what to do (vLLM and transformers would fail deep
    inside, or only after a whole run). A hub id is left to transformers."""
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        return
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"{flag} {path} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); save the tokenizer beside the weights "
                        "(`tokenizer.save_pretrained`) or copy its files there")
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as error:
        raise UserError(f"{flag} {path}: its config.json does not load ({str(error).splitlines()[0][:200]}); restore it, or install a "
                        "transformers that knows its model_type") from None
    try:
        AutoTokenizer.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - a damaged tokenizer file fails with JSON, Rust or OS errors
        raise UserError(f"{flag} {path}: its tokenizer does not load ({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}); "
                        "restore the tokenizer files") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    from alignment.checkpoint import safetensors_shapes

    present = set()
    for file in sorted(path.glob("*.safetensors")):
        for name, shape in safetensors_shapes(file).items():
            if name in expected and expected[name] != shape:
                raise UserError(f"{flag} {path}: {file.name} holds {name} of shape {list(shape)}, but its config.json makes it {list(expected[name])}; "
                                "the weights and config.json come from different models: restore the matching config.json")
            present.add(name)
    missing = sorted({name for name, _ in model.named_parameters()} - present)  # a tied output layer is listed once, as the embeddings
    if present and missing:
        raise UserError(f"{flag} {path}: its safetensors files hold no {missing[0]}{f' (nor {len(missing) - 1} more weights)' if len(missing) > 1 else ''}; "
                        "a shard is missing or incomplete: restore the checkpoint")


def load_hf_model(model_path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    except OSError as error:
        raise UserError(f"cannot load a model from {model_path}: {str(error).splitlines()[0]}") from None
    return model.to(device)


def load_tokenizer(model_path, flag: str | None = None):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as error:  # ValueError: a folder with no tokenizer files in it
        named = f"{flag} {model_path}" if flag else str(model_path)
        raise UserError(f"cannot load a tokenizer from {named}: {str(error).splitlines()[0]}; pass a folder or hub id that holds one") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_same_tokenizer(tokenizer, source, checkpoint, flag: str) -> None:
    """Refuse a tokenizer (from `flag` `source`) whose vocabulary or special tokens differ from those saved
    with `checkpoint`: the engine reads the checkpoint's own, so prompts would be encoded one way and read
    another, and the result would be saved beside weights it does not fit. Nothing saved there: no check."""
    if not any((Path(checkpoint) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return
    saved = load_tokenizer(checkpoint)
    if saved.get_vocab() != tokenizer.get_vocab() or saved.all_special_tokens != tokenizer.all_special_tokens:
        raise UserError(f"{flag} {source}: its tokenizer ({len(tokenizer)} tokens) differs from the one saved with {checkpoint} "
                        f"({len(saved)} tokens); leave {flag} out to use the checkpoint's own, or pass the model it was trained from")


def build_engine(backend: str, model_path, device: str, dtype: torch.dtype, seed: int, args, tokenizer=None, shares_gpu: bool = False,
                 engine_process: bool = False):
    """A rollout/eval engine for `model_path` on `device` (`backend` vllm or hf; `engine_process`: see VllmEngine)."""
    if backend == "vllm":
        return VllmEngine(
            model_path, device, dtype=str(dtype).removeprefix("torch."), seed=seed,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization, kv_cache_gb=args.vllm_kv_cache_gb,
            enforce_eager=args.vllm_enforce_eager, shares_gpu=shares_gpu, engine_process=engine_process,
        )
    tokenizer = tokenizer or load_tokenizer(model_path)
    return HfEngine(load_hf_model(model_path, device, dtype), tokenizer, batch_size=args.hf_batch_size)
