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

Also here: which prompts a step samples (`rollout_batch`, `batches_ahead`, and with
--dynamic_sampling `extra_prompts` and `fill_informative_groups`), and which responses
ran into --sampling_max_tokens (`truncated_responses`, for --overlong).
"""

import torch

from alignment.devices import resolve_dtype
from alignment.distributed import SingleProcess, rank_slice
from alignment.rollout import STOP_STRINGS, HfEngine, VllmEngine, load_hf_model
from alignment.run_log import timed
from alignment.sampler_process import RolloutsAhead, SamplerProcess


def group_prompts(prompts, ground_truths, group_size):
    """Each prompt (and its answer) repeated group_size times (seed)."""
    return [p for p in prompts for _ in range(group_size)], [gt for gt in ground_truths for _ in range(group_size)]


def rollout_seed(seed: int, step: int, rank: int = 0, round_index: int = 0) -> int:
    """The sampling seed of a rollout step (the HF backend and a resumed run draw the same rollouts);
    `round_index` numbers --dynamic_sampling's extra rounds (0: the step's own batch)."""
    return seed * 100003 + step * 1009 + rank + round_index * 10_000_019


def rollout_batch(dataset, step: int, steps_per_epoch: int, batch_size: int, seed: int) -> tuple[list[str], list[str]]:
    """The prompts and answers of rollout step `step` (from 1), as the seed's DataLoader
    yields them: epoch (step - 1) // steps_per_epoch, rows shuffled by (seed + epoch).
    The step alone fixes the data position, for a resumed run and for batches sent ahead."""
    epoch, index = divmod(step - 1, steps_per_epoch)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    rows = order[index * batch_size : (index + 1) * batch_size]
    return [dataset.prompts[i] for i in rows], [dataset.ground_truths[i] for i in rows]


def batches_ahead(args, dataset, step: int, steps_per_epoch: int, total_steps: int, ranks=SingleProcess()) -> list[tuple[int, list[str], int]]:
    """One step off: [(step, prompts, seed)] of the next --rollout_staleness steps of this epoch,
    to sample while this one trains (a new epoch, or a resumed run, restarts the pipeline).
    Under torchrun each rank's sampler gets this rank's share of each batch, with the seed the
    rank's own step would sample with, as in step."""
    return [(step + k, rank_slice(rollout_batch(dataset, step + k, steps_per_epoch, args.rollout_batch_size, args.seed)[0], ranks),
             rollout_seed(args.seed, step + k, ranks.rank))
            for k in range(1, args.rollout_staleness + 1) if (step - 1) % steps_per_epoch + k < steps_per_epoch and step + k <= total_steps]


def extra_prompts(dataset, step: int, seed: int, own_prompts, start: int, count: int) -> tuple[list[str], list[str]]:
    """--dynamic_sampling's prompts of step `step` beyond its own: items [start, start + count) of one shuffle
    of the train split without the step's own prompts, seeded by (seed, step). Round 0 takes the first
    --dynamic_sampling_prompts minus --rollout_batch_size of them, each extra round the next
    --dynamic_sampling_prompts, so no prompt is sampled twice in a step (on a split too small for the
    rounds, the shuffle starts over). DAPO takes the next batches of its data loader; drawing apart keeps
    every step's own batch where the step alone puts it (resume, epochs)."""
    own = set(own_prompts)
    generator = torch.Generator().manual_seed(rollout_seed(seed, step, round_index=1))
    pool = [i for i in torch.randperm(len(dataset), generator=generator).tolist() if dataset.prompts[i] not in own]
    rows = [pool[(start + k) % len(pool)] for k in range(count)] if pool else []
    return [dataset.prompts[i] for i in rows], [dataset.ground_truths[i] for i in rows]


def fill_informative_groups(sample_round, group_size: int, wanted_groups: int, max_extra_rounds: int, ranks):
    """DAPO's dynamic sampling (Yu et al. 2025, "DAPO", section 3.2, "over-sample and filter out").

    A group whose rewards all tie has zero advantage and no gradient: such groups are dropped
    and the batch refilled with the groups of extra rounds of prompts until it holds
    `wanted_groups` groups whose rewards differ, or `max_extra_rounds` extra rounds ran.
    Still short then, tied groups fill it (they train on nothing but KL), so the batch keeps
    its size. Every rank runs as many rounds (under torchrun the samplers step together).

    `sample_round(round_index)` -> (grouped prompts, grouped truths, generations, scores,
    weights version), round 0 being the step's own prompts. Returns the same five for the
    kept groups and {extra rounds, fraction of sampled groups that were informative, mean
    reward of every sampled response, tokens generated over every round (summed over ranks):
    the engine's work, which the kept responses understate}.
    """
    kept, tied, sampled_groups, round_index, sampled_rewards, sampled_tokens = [], [], 0, 0, [], 0
    while True:
        *columns, version = sample_round(round_index)
        sampled_rewards += [score["reward"] for score in columns[3]]
        sampled_tokens += sum(generation.num_tokens for generation in columns[2])
        for start in range(0, len(columns[0]), group_size):
            group = tuple(column[start : start + group_size] for column in columns)
            (kept if len({score["reward"] for score in group[3]}) > 1 else tied).append(group)
        sampled_groups += len(columns[0]) // group_size
        if round_index >= max_extra_rounds or not ranks.any_true(len(kept) < wanted_groups):
            break
        round_index += 1
    groups = (kept + tied)[:wanted_groups]
    flat = [[item for group in groups for item in group[column]] for column in range(4)]
    # train/reward is the kept groups' mean; the mean over every sampled response compares with a run without refill
    return (*flat, version, {"train/dynamic_sampling_rounds": round_index,
                             "train/dynamic_sampling_informative_fraction": ranks.mean(len(kept) / max(sampled_groups, 1)),
                             "train/dynamic_sampling_sampled_reward": ranks.mean(sum(sampled_rewards) / max(len(sampled_rewards), 1)),
                             "train/dynamic_sampling_sampled_tokens": ranks.sum(sampled_tokens)})


def sample_and_grade(args, sampler, dataset, step: int, prompts, truths, sampling, later, ranks, timings: dict, grade):
    """train_rl's steps 1-3a: the step's rollouts, graded by `grade` (grade_responses): (grouped prompts,
    grouped truths, generations, scores, weights version, scalars to log). --dynamic_sampling (DAPO)
    replaces the groups whose rewards all tie with groups of extra prompts (`fill_informative_groups`),
    --dynamic_sampling_prompts per round: the step's own groups come first, so they are kept first."""
    step_prompts = ranks.gather(prompts) if args.dynamic_sampling else prompts  # the whole step's batch, which extra prompts leave out

    def sample_round(round_index):
        # round 0: the step's own prompts, then (--dynamic_sampling_prompts above --rollout_batch_size) extra
        # ones drawn apart, in the same engine call; an extra round: --dynamic_sampling_prompts drawn apart
        round_prompts, round_truths = (prompts, truths) if round_index == 0 else ([], [])
        first = args.dynamic_sampling_prompts - args.rollout_batch_size  # round 0's extra prompts
        start, count = (0, first) if round_index == 0 else (first + (round_index - 1) * args.dynamic_sampling_prompts, args.dynamic_sampling_prompts)
        if args.dynamic_sampling and count:
            extra, extra_truths = (rank_slice(items, ranks) for items in extra_prompts(dataset, step, args.seed, step_prompts, start, count))
            round_prompts, round_truths = round_prompts + extra, round_truths + extra_truths
        with timed(timings, "rollout"):
            grouped_prompts, grouped_truths, generations, version = sampler.sample(
                step, round_prompts, round_truths, args.group_size, sampling, rollout_seed(args.seed, step, ranks.rank, round_index), () if round_index else later)
        with timed(timings, "reward"):
            return grouped_prompts, grouped_truths, generations, grade([g.text for g in generations], grouped_truths), version

    if not args.dynamic_sampling:
        return (*sample_round(0), {})
    return fill_informative_groups(sample_round, args.group_size, len(prompts), args.max_sampling_rounds, ranks)


def truncated_responses(generations, max_tokens: int, eos_token_id: int | None, stop=STOP_STRINGS) -> torch.Tensor:
    """(N,) bool: the responses that ran into `max_tokens` without ending, for --overlong.

    Truncated: `max_tokens` tokens generated, no stop string ("</answer>") in the text, and
    the last token not EOS. (A response that ends exactly at the limit is not truncated; the
    HF engine drops a final EOS that is also the pad token, so such a response is shorter.)
    """
    return torch.tensor([g.num_tokens >= max_tokens and not any(marker in g.text for marker in stop)
                         and not (g.token_ids and g.token_ids[-1] == eos_token_id) for g in generations], dtype=torch.bool)


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
        trained; `later_batches` ([(step, prompts, seed)], `batches_ahead`) go out now, to generate while this one trains.
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
