"""AdamW and the learning-rate schedule used by SFT and RL."""

import math
import warnings

import torch


def build_optimizer(model, learning_rate: float, weight_decay: float, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW over trainable parameters; the fused CUDA kernel when every parameter is on a GPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, betas=tuple(betas), fused=fused or None)


def build_scheduler(optimizer, warmup_steps: int, total_steps: int, schedule: str = "constant", say=print) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant or cosine decay to 10% of the peak by `total_steps`. A warm-up longer than the
    run (it counts optimizer steps, not rollout steps) is noted (through `say`: rank 0's print under torchrun): the
    rate never reaches its peak."""
    if warmup_steps > total_steps > 0:
        say(f"note: --warmup_steps {warmup_steps} is longer than the run's {total_steps} optimizer steps: "
              f"the learning rate ends at {total_steps / warmup_steps:.1%} of its peak")

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "cosine" and total_steps > warmup_steps:
            progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def set_peak_learning_rate(optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, learning_rate: float) -> None:
    """After loading a saved optimizer and scheduler: make `learning_rate` the peak from now on.

    Both states carry the old rate (the param groups' `lr`/`initial_lr`, the scheduler's
    `base_lrs`); the current rate becomes the new peak times the schedule's factor at
    the step reached, so a resumed run with a new --learning_rate uses it at once.
    """
    scheduler.base_lrs = [learning_rate] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = learning_rate
        group["lr"] = learning_rate * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def skip_schedule_steps(scheduler: torch.optim.lr_scheduler.LambdaLR, steps: int) -> None:
    """Advance the schedule over `steps` optimizer steps that were skipped (a batch with no learning signal, a
    non-finite gradient): the schedule is planned over every optimizer step of the run, so the rate at a step is the
    plan's however many steps before it were skipped (a cosine still ends at its floor, a warm-up where it planned)."""
    with warnings.catch_warnings():  # torch warns of a schedule stepped before any optimizer step: here that is the point
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
        for _ in range(steps):
            scheduler.step()
