"""Atomic checkpoint writes: a crash mid-save never costs the previous checkpoint.

Every write goes to a fresh sibling folder `<path>.tmp-<pid>`; only when it is
complete does it replace `<path>`. A folder cannot be renamed over a non-empty
one, so the swap is two renames: `<path>` -> `<path>.old`, then tmp -> `<path>`.
A crash between them (microseconds) leaves `<path>.old`, which
`recover_checkpoint` renames back the next time anything reads the path.
"""

import os
import shutil
from pathlib import Path


def _siblings(path: Path, marker: str):
    return sorted(path.parent.glob(f"{path.name}.{marker}*")) if path.parent.exists() else []


def recover_checkpoint(path) -> None:
    """Undo a swap interrupted between its two renames; drop stale temp folders."""
    path = Path(path)
    old = path.with_name(path.name + ".old")
    if not path.exists() and old.exists():
        os.rename(old, path)
    elif old.exists():
        shutil.rmtree(old, ignore_errors=True)
    for temp in _siblings(path, "tmp-"):
        pid = temp.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or not _process_alive(int(pid)):
            shutil.rmtree(temp, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_atomically(path, write_into) -> Path:
    """Call `write_into(temp_folder)`, then move the folder to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_checkpoint(path)
    temp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    if temp.exists():
        shutil.rmtree(temp)
    temp.mkdir()
    write_into(temp)
    _fsync_tree(temp)
    old = path.with_name(path.name + ".old")
    if path.exists():
        os.rename(path, old)
    os.rename(temp, path)
    if old.exists():
        shutil.rmtree(old)
    return path


def _fsync_tree(folder: Path) -> None:
    for file in folder.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def save_model_atomically(model, tokenizer, path, state_dict=None) -> Path:
    """`save_pretrained` of model and tokenizer into `path`, atomically.

    The result is an ordinary Hugging Face folder that transformers and vLLM load.
    `state_dict` overrides the model's own (full weights gathered from FSDP shards).
    """

    def write(folder):
        model.save_pretrained(folder, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(folder)

    return write_atomically(path, write)


def save_training_state(state_dir, model, tokenizer, model_state: dict, optimizer_state: dict, scheduler, counters: dict) -> Path:
    """Everything `--resume` needs, written atomically into `state_dir`.

    policy/ (HF format, full weights), optimizer.pt (full and keyed by parameter
    name, so it loads into one GPU, the layer partition or any FSDP world size),
    scheduler.pt, rng.pt (python, torch CPU and CUDA generators) and counters.json
    (step, epoch, batch within the epoch, which fixes the data-loader position, and
    the TensorBoard step). Called on one process; the caller gathers the states.
    """
    import json
    import random

    import torch

    def write(folder):
        model.save_pretrained(folder / "policy", safe_serialization=True, state_dict=model_state)
        tokenizer.save_pretrained(folder / "policy")
        torch.save(optimizer_state, folder / "optimizer.pt")
        torch.save(scheduler.state_dict(), folder / "scheduler.pt")
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, folder / "rng.pt")
        (folder / "counters.json").write_text(json.dumps(counters, indent=2) + "\n")

    return write_atomically(state_dir, write)


def has_training_state(state_dir) -> bool:
    recover_checkpoint(state_dir)
    return (Path(state_dir) / "counters.json").is_file()


def remove_training_state(state_dir) -> None:
    shutil.rmtree(state_dir, ignore_errors=True)


def load_training_state(state_dir) -> dict | None:
    """The latest state written by `save_training_state`, or None if there is none.

    Restores the RNG states as a side effect; returns counters plus
    `policy_path`, `optimizer` and `scheduler` state dicts.
    """
    import json
    import random

    import torch

    state_dir = Path(state_dir)
    recover_checkpoint(state_dir)
    if not (state_dir / "counters.json").is_file():
        return None
    state = json.loads((state_dir / "counters.json").read_text())
    state["policy_path"] = str(state_dir / "policy")
    state["optimizer"] = torch.load(state_dir / "optimizer.pt", map_location="cpu", weights_only=True)
    state["scheduler"] = torch.load(state_dir / "scheduler.pt", map_location="cpu", weights_only=True)
    rng = torch.load(state_dir / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state
