"""Data-parallel training under torchrun with FSDP2 (`--policy_parallel fsdp`).

    torchrun --nproc_per_node 8 -m alignment.train_rl --policy_parallel fsdp ...
    torchrun --nnodes 2 --node_rank R --nproc_per_node 8 --rdzv_backend c10d \\
        --rdzv_endpoint HOST:29500 --rdzv_id run1 -m alignment.train_rl --policy_parallel fsdp ...

Each rank holds a shard of the policy (`fully_shard` per decoder layer, then the
root), a full frozen reference model, and its own rollout engine on its own device
(vLLM with a small memory fraction, or an HF copy). The prompts of each rollout
batch are split across ranks whole groups at a time, so group normalisation stays
local; gradients are averaged by FSDP, which equals the global mean because every
rank holds the same number of sequences. Only rank 0 writes TensorBoard, logs and
checkpoints (full Hugging Face folders, gathered from the shards).

Why the reference is replicated, not sharded: it is frozen and forward-only, so a
replica costs one model's memory per GPU (3 GB in bf16 for 1.5B) and no
communication, where a sharded one would all-gather every layer on every pass.

`Ranks` is the small interface train_rl uses; `SingleProcess` is the same interface
for the seed's one-process layer partition, where every call is a no-op.
"""

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from alignment.checkpoint import ownership_problem, save_model_atomically
from alignment.errors import UserError


class SingleProcess:
    """One process (the seed's `--policy_parallel layers`): reductions are identities."""

    rank, world_size, is_main = 0, 1, True

    def all_true(self, flag: bool) -> bool:
        return flag

    def any_true(self, flag: bool) -> bool:
        return flag

    def mean(self, value: float) -> float:
        return value

    def sum(self, value: float) -> float:
        return value

    def max(self, value: float) -> float:
        return value

    def gather(self, items: list) -> list:
        return items

    def barrier(self) -> None:
        pass

    def full_weights(self, model):
        """(name, tensor) pairs of the whole model, checkpoint naming, on every rank."""
        return ((name, tensor.detach()) for name, tensor in model.state_dict().items())

    def full_state_dict_on_main(self, model) -> dict:
        return model.state_dict()

    def optimizer_state_on_main(self, model, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def close(self) -> None:
        pass


class TorchDistributed(SingleProcess):
    """A torchrun launch: NCCL between GPUs, gloo on CPUs."""

    def __init__(self):
        if "RANK" not in os.environ:
            raise UserError("--policy_parallel fsdp needs a torchrun launch: torchrun --nproc_per_node N -m alignment.train_rl --policy_parallel fsdp ...")
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"
        if self.device != "cpu":
            torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl" if self.device != "cpu" else "gloo")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0

    def _reduce(self, value: float, op) -> float:
        tensor = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=op)
        return tensor.item()

    def all_true(self, flag: bool) -> bool:
        return self._reduce(1.0 if flag else 0.0, dist.ReduceOp.MIN) > 0

    def any_true(self, flag: bool) -> bool:
        return self._reduce(1.0 if flag else 0.0, dist.ReduceOp.MAX) > 0

    def mean(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.SUM) / self.world_size

    def sum(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.SUM)

    def max(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.MAX)

    def gather(self, items: list) -> list:
        """Every rank's list, concatenated in rank order, on every rank."""
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, items)
        return [item for part in gathered for item in part]

    def barrier(self) -> None:
        dist.barrier()

    def full_weights(self, model):
        # one all-gather per parameter, every rank in the same order; tied weights once
        from torch.distributed.tensor import DTensor

        for name, parameter in model.named_parameters():
            tensor = parameter.detach()
            yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    def full_state_dict_on_main(self, model) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def close(self) -> None:
        """Every rank leaves together: none exits while rank 0 still writes the run's last files.

        Then a pause with the GIL released: gloo's worker threads free the last collectives'
        tensors after those complete, and freeing a tensor Python made takes the GIL. A rank
        whose interpreter began shutting down first aborted ("terminate called without an
        active exception", SIGABRT in ~AsyncAllgatherCoalescedWork, in ~1.5% of two-rank
        launches on a loaded CPU), and torchrun then killed the other ranks mid-write.
        """
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()  # a backend's worker threads live on while the model's device mesh holds it
            time.sleep(0.5)


def check_launch(args) -> None:
    """Several processes (torchrun) train one policy only under --policy_parallel fsdp."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and args.policy_parallel != "fsdp":
        raise UserError(f"a launch of {world_size} processes (torchrun) needs --policy_parallel fsdp: with --policy_parallel {args.policy_parallel} "
                        f"every rank would train a copy of its own and write the same logs and checkpoint; pass --policy_parallel fsdp, "
                        f"or start one process (python -m alignment.train_rl)")


def setup(args):
    """`Ranks` for this launch: TorchDistributed under fsdp, else SingleProcess."""
    return TorchDistributed() if args.policy_parallel == "fsdp" else SingleProcess()


def shard_policy(model, compute_dtype=torch.float32) -> None:
    """FSDP2: shard each decoder layer, then the rest (embeddings, norm, lm_head).

    The shards keep the parameters' own dtype (fp32 master weights by default);
    when that is wider than `compute_dtype`, FSDP2 gathers them as `compute_dtype`
    for forward and backward and reduces gradients in fp32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    stored = next(model.parameters()).dtype
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype != stored else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def load_optimizer_state(model, optimizer, state: dict) -> None:
    """Load a full, name-keyed optimizer state into any layout (one GPU, layers, any FSDP world size)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def rank_slice(items: list, ranks) -> list:
    """This rank's contiguous share of `items` (all of them in one process).

    Shares differ by at most one and together hold every item exactly once, whatever
    the count (evaluation sets); training batches are equal shares, as check_fsdp_sizes
    makes them divisible by the world size.
    """
    start, stop = (len(items) * r // ranks.world_size for r in (ranks.rank, ranks.rank + 1))
    return items[start:stop]


def save_policy(ranks, model, tokenizer, path, step: int, total_steps: int, run: dict) -> Path:
    """Gather the full weights (a collective under torchrun); rank 0 writes the HF folder, its
    manifest saying after which step of how many (an epoch's checkpoint of a longer run, or the result)
    and the run's record (its flags: a later command that only evaluates it is checked against them).

    Returns where the weights went (rank 0's answer; `path` on the other ranks). When `path` changed
    under the run so that the tool may no longer replace it (a file added to it, another folder put
    there), they go to a free sibling `<path>.step<N>` instead, with a warning: a refused save must
    not throw away the steps trained since the last one."""
    state_dict = ranks.full_state_dict_on_main(model)
    target = Path(path)
    if ranks.is_main:
        if problem := ownership_problem(target, "rl_checkpoint"):
            target = diverted_path(target, step)
            print(f"warning: {path} {problem}, so the policy after step {step} was not saved there; it goes to {target} instead "
                  f"(move the added files away, then {target} to {path}, to have it where the run was told to save it)", flush=True)
        save_model_atomically(model, tokenizer, target, "rl_checkpoint", state_dict=state_dict,
                              record={"step": step, "total_steps": total_steps, "run": run})
    ranks.barrier()
    return target


def diverted_path(path: Path, step: int) -> Path:
    """The first of `<path>.step<N>`, `<path>.step<N>-2`, ... that does not exist (nothing there is replaced)."""
    for attempt in range(1, 1000):
        candidate = path.with_name(f"{path.name}.step{step}" + (f"-{attempt}" if attempt > 1 else ""))
        if not candidate.exists():
            return candidate
    raise UserError(f"{path}: no free folder {path.name}.step{step}-N beside it to save the policy into; free one and run again")


def check_fsdp_sizes(args, ranks) -> None:
    """Batch sizes must split evenly over the ranks (whole prompts per rank)."""
    if args.rollout_batch_size % ranks.world_size:
        raise UserError(f"--rollout_batch_size {args.rollout_batch_size} must be divisible by the {ranks.world_size} ranks (each takes whole prompts)")
    if args.dynamic_sampling and args.dynamic_sampling_prompts % ranks.world_size:
        raise UserError(f"--dynamic_sampling_prompts {args.dynamic_sampling_prompts} must be divisible by the {ranks.world_size} ranks (each takes whole prompts)")
    if (args.train_batch_size // ranks.world_size) % args.train_mini_batch_size or args.train_batch_size % ranks.world_size:
        raise UserError(f"--train_batch_size {args.train_batch_size} / {ranks.world_size} ranks must be a multiple of --train_mini_batch_size {args.train_mini_batch_size}")


def reduce_reward_meta(meta: dict, raw_rewards, ranks) -> dict:
    """Reward statistics over every rank's rollouts."""
    if ranks.world_size == 1:
        return meta
    rewards = torch.tensor(ranks.gather(raw_rewards.tolist()))
    return {
        "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(), "reward_max": rewards.max().item(), "reward_min": rewards.min().item(),
        "format_reward_mean": ranks.mean(meta["format_reward_mean"]), "answer_reward_mean": ranks.mean(meta["answer_reward_mean"]),
        "fraction_groups_all_equal": ranks.mean(meta["fraction_groups_all_equal"]),
        "fraction_groups_all_right": ranks.mean(meta["fraction_groups_all_right"]),
    }


def reduce_totals(totals: dict, ranks) -> dict:
    """Per-rank means become global means (equal shares); token counts add up."""
    if ranks.world_size == 1:
        return totals
    reduced = dict(totals)
    for key in ("loss", "entropy", "clip_fraction", "kl_ref"):
        reduced[key] = ranks.mean(totals[key])
    reduced["tokens"] = int(ranks.sum(totals["tokens"]))
    reduced["flops"] = ranks.sum(totals["flops"])
    for key in ("sampler_abs_diff", "sampler_ratio", "sampler_tokens", "tis_capped"):  # sums over every rank's tokens
        reduced[key] = ranks.sum(totals[key])
    reduced["sampler_ratio_max"] = ranks.max(totals["sampler_ratio_max"])
    return reduced
