"""A train_rl run's rollout sampler: one engine whatever the mode, and which policy weights it holds.

The modes (`start_sampler` picks one from the flags):
- vLLM in this process (the seed's sampler), on --sample_device;
- the HF backend: the policy itself when it syncs every step in one process (a sync is
  then free), otherwise a copy of its own;
- --rollout_staleness N: the engine in its own process (sampler_process.py), fed up to N
  batches ahead of the policy while the policy trains on the current one.

Versions count the rollout steps that changed the policy's weights. The sampler starts at
the version it was loaded with and follows the policy: in step (`catch_up`, before a
rollout, when it lags by --rollout_sync_every versions; 0 = never, the seed's frozen
sampler), or one step off (`after_update`: the weights queue behind the batches already
sent, so each batch is sampled by the weights sent before it).
"""

import torch

from alignment.devices import resolve_dtype
from alignment.rollout import HfEngine, VllmEngine, load_hf_model
from alignment.sampler_process import RolloutsAhead, SamplerProcess


def group_prompts(prompts, ground_truths, group_size):
    """Each prompt (and its answer) repeated group_size times (seed)."""
    return [p for p in prompts for _ in range(group_size)], [gt for gt in ground_truths for _ in range(group_size)]


def rollout_seed(seed: int, step: int, rank: int = 0) -> int:
    """The sampling seed of a rollout step (the HF backend and a resumed run draw the same rollouts)."""
    return seed * 100003 + step * 1009 + rank


class Sampler:
    def __init__(self, engine, start_weights, sync_every: int, version: int, ahead: RolloutsAhead | None = None):
        self.engine, self.start_weights, self.sync_every, self.version, self.ahead = engine, start_weights, sync_every, version, ahead

    def catch_up(self, policy_version: int, weights) -> None:
        """In step: copy the policy's weights in (`weights()` gives them) when it lags by --rollout_sync_every."""
        if not self.ahead and self.sync_every and policy_version - self.version >= self.sync_every:
            self.engine.load_weights(weights())
            self.version = policy_version

    def after_update(self, policy_version: int, weights) -> None:
        """One step off: queue the new weights behind the batches already sent."""
        if self.ahead:
            self.engine.load_weights(weights())
            self.version = policy_version

    def sample(self, step: int, prompts, ground_truths, group_size: int, sampling, seed: int, later_batches=()):
        """(grouped prompts, grouped truths, generations, weights version that sampled them).

        One step off, this step's batch was (usually) sent ahead while the previous one
        trained; `later_batches` ([(step, prompts)]) go out now, to generate while this one trains.
        """
        grouped_prompts, grouped_truths = group_prompts(prompts, ground_truths, group_size)
        if self.ahead:
            generations, version = self.ahead.take(step, grouped_prompts, sampling, seed, self.version)
            for later_step, later_prompts, later_seed in later_batches:
                self.ahead.send(later_step, [p for p in later_prompts for _ in range(group_size)], sampling, later_seed, self.version)
            return grouped_prompts, grouped_truths, generations, version
        torch.manual_seed(seed)  # the HF backend samples from torch's RNG: same step, same rollouts
        return grouped_prompts, grouped_truths, self.engine.generate(grouped_prompts, sampling), self.version

    def process_seconds(self) -> dict:
        """The sampler process's own seconds for its last generation and weight load (empty in one process)."""
        if not self.ahead:
            return {}
        return {"sampler_generate": self.engine.seconds.get("generate", float("nan")), "sampler_load": self.engine.seconds.get("load", float("nan"))}

    def close(self) -> None:
        self.engine.close()


def start_sampler(args, sample_device: str, start_weights, version: int, policy, tokenizer, ranks, shares_gpu: bool, compute_dtype, say=print) -> Sampler:
    """The run's sampler, loaded with `start_weights` (weights version `version`).

    Called while the policy still sits on the CPU: vLLM sizes its cache from the GPU memory
    free at its start. `policy` is the HF backend's engine when it samples with the policy
    itself; the HF backend computes in the policy's `compute_dtype`, vLLM in --dtype's
    choice for the sampler's device.
    """
    dtype = resolve_dtype(args.dtype, sample_device)
    if args.rollout_staleness:
        engine = SamplerProcess(args.rollout_backend, start_weights, sample_device, dtype, args.seed, args, shares_gpu=shares_gpu)
        say(f"{args.rollout_backend} sampler in its own process on {sample_device}, up to {args.rollout_staleness} batch(es) ahead of the policy")
        return Sampler(engine, start_weights, args.rollout_sync_every, version, RolloutsAhead(engine))
    if args.rollout_backend == "vllm":
        engine = VllmEngine(start_weights, sample_device, dtype=str(dtype).removeprefix("torch."), seed=args.seed + ranks.rank,
                            gpu_memory_utilization=args.vllm_gpu_memory_utilization, kv_cache_gb=args.vllm_kv_cache_gb,
                            enforce_eager=args.vllm_enforce_eager, shares_gpu=shares_gpu)
        say(f"vLLM sampler on {sample_device} started in {engine.start_seconds:.1f}s")
        return Sampler(engine, start_weights, args.rollout_sync_every, version)
    # hf: the policy itself when it syncs every step in one process; otherwise a copy (a sharded
    # policy cannot generate: ranks would run different numbers of forwards)
    own_copy = args.rollout_sync_every != 1 or ranks.world_size > 1
    model = load_hf_model(start_weights, sample_device, compute_dtype) if own_copy else policy
    return Sampler(HfEngine(model, tokenizer, batch_size=args.hf_batch_size, compute_dtype=compute_dtype), start_weights, args.rollout_sync_every, version)
