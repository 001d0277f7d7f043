"""Folders this tool owns: written atomically, checked on the way back in, one writer at a time.

Every folder train_rl and train_sft write (the SFT and RL checkpoints, the training
state, the temporary evaluation checkpoint) is written whole into a sibling temp folder
and only then swapped in, so a crash mid-write never costs the previous one. A folder
cannot be renamed over a non-empty one, so the swap is two renames: `<path>` to its
backup, then the temp folder to `<path>`; a crash between them leaves both, and the next
run to take the path finishes the swap (`recover_checkpoint`), or, when the new folder
does not check out against its manifest, renames the backup back.

The tool's own names beside `<path>` are hidden and carry its name, so that no name a
user picks (`<path>.old`, `<path>.tmp`, `<path>.lock`) is ever touched:
`.<name>.alignment-tmp-<pid>-<thread>` (the temp folder, marked as this tool's for this
path from its first moment), `.<name>.alignment-old` (the backup, always a folder this
tool wrote) and `.<name>.alignment-lock` (the lock file). Leftovers are recovered only
under the path's lock, and only when the folder says this tool wrote it for this path.

Each folder carries MANIFEST_NAME: who wrote it, what kind of folder it is (KINDS),
the size and SHA-256 of every file (and, for a training state, the flags that define
the run and the id of the run that wrote it). So the tool
- replaces or removes a folder only when its manifest names the kind about to be
  written AND the folder holds exactly the manifest's files: a user's folder, a folder
  of another kind (an SFT checkpoint as --state_dir), or one where a user added a file
  is refused at start-up, naming the extra files, with nothing touched
  (`check_output_path`); a training state is removed only by the run that wrote it;
- gives every output its own folder: two roles on one path, or one inside another, are
  refused before anything loads (`check_distinct_outputs`);
- finds a damaged file (truncated, zeroed, deleted) before using it (`verify_manifest`,
  `check_saved_model`, which also reads a foreign checkpoint's safetensors headers);
- writes a marker into each log folder it uses, and refuses a folder of the user's, or
  one holding another training run's logs (`claim_log_folder`).
`OutputLock` keeps a second run off the same paths (an exclusive `flock` on the lock
file, released by the kernel when the process dies, so never stale), and the swap
itself is serialised per path, within a process and across processes.
"""

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from alignment.errors import UserError

MANIFEST_NAME = "alignment_manifest.json"
LOG_MARKER_NAME = "alignment_log.json"
TEMP_MARKER_NAME = "alignment_temp.json"  # inside a temp folder from its creation until the swap: whose it is, for which path
WRITER = "alignment"
# What a folder holds; a folder is replaced only by a write of its own kind.
KINDS = ("sft_checkpoint", "rl_checkpoint", "eval_checkpoint", "training_state")


# ------------------------------------------------------------------ ownership


def read_manifest(path) -> dict | None:
    """The manifest of a folder this tool wrote, or None (no folder, no manifest, not ours)."""
    try:
        manifest = json.loads((Path(path) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("written_by") == WRITER else None


def copy_identity(manifest: dict | None) -> str | None:
    """Which copy of a checkpoint folder a manifest describes: the SHA-256 of the files it lists (names, sizes and
    SHA-256s), so that a save of other weights into the same folder differs; None without a manifest of ours.
    A folder this tool wrote has it as its folder_fingerprint."""
    return None if manifest is None else hashlib.sha256(json.dumps(manifest.get("files", {}), sort_keys=True).encode()).hexdigest()


def folder_copy_identity(path, manifest: dict | None = None) -> str | None:
    """Which copy of the model folder `path` is there now: its manifest's copy_identity (`manifest`, when the caller
    read it already), else, for a folder without one of ours (a training state's policy/, a folder from elsewhere),
    the SHA-256 of its files' names, sizes and modification times: any save into it differs, without reading
    gigabytes. None when `path` is not a folder (a hub id)."""
    manifest = manifest if manifest is not None else read_manifest(path)
    if manifest is not None:
        return copy_identity(manifest)
    path = Path(path)
    if not path.is_dir():
        return None
    stats = {str(file.relative_to(path)): [(stat := file.stat()).st_size, stat.st_mtime_ns] for file in sorted(path.rglob("*")) if file.is_file()}
    return "files:" + hashlib.sha256(json.dumps(stats, sort_keys=True).encode()).hexdigest()


def _is_empty_folder(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _files_under(folder: Path) -> set[str]:
    return {str(file.relative_to(folder)) for file in folder.rglob("*") if file.is_file() and file.name not in (MANIFEST_NAME, TEMP_MARKER_NAME)}


def ownership_problem(path, kind: str) -> str | None:
    """Why the tool may not replace or remove `path` with a folder of `kind`, or None when it may.

    It may when nothing is there, when the folder is empty, or when its manifest says this
    tool wrote it as `kind` and the folder holds exactly the files the manifest lists (a file
    the manifest lists but that is gone is damage to our own folder, not a user's file).
    """
    path = Path(path)
    if not path.exists():
        return None
    if not path.is_dir():
        return "is a file, not a folder"
    if _is_empty_folder(path):
        return None
    manifest = read_manifest(path)
    if manifest is None:
        return "holds files this tool did not write"
    if manifest.get("kind") != kind:
        return f"holds a {manifest.get('kind') or 'folder of no known kind'} this tool wrote, not a {kind}"
    extra = sorted(_files_under(path) - set(manifest.get("files", {})))
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        return f"holds files its manifest does not list ({shown}), added after this tool wrote it"
    return None


def check_output_path(path, flag: str, kind: str) -> None:
    """Start-up check of a folder this run will write as `kind`: replaceable (see
    `ownership_problem`) and writable. Run it after `recover_checkpoint`, under the lock.

    Raises UserError (nothing touched) otherwise.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder; pass a folder path (nothing was changed)")
    problem = ownership_problem(path, kind)
    if problem:
        raise UserError(f"{flag} {path} {problem}; pass another path or move them away (nothing was changed)")
    check_writable(path.parent, flag, path)


def real_output_path(path, flag: str, say=print) -> str:
    """`path` itself when it is not a symbolic link, else the folder it points to (dangling or not).

    A save swaps folders by renaming them: through a link it would move the link and write a
    folder beside it, and then fail. A link loop is one line."""
    if not Path(path).is_symlink():
        return str(path)
    try:
        resolved = Path(path).resolve()
    except (RuntimeError, OSError) as error:  # a loop: RuntimeError up to Python 3.12, OSError (ELOOP) after
        raise UserError(f"{flag} {path} is a symbolic link that cannot be followed ({error}); pass a real folder path") from None
    say(f"{flag} {path} is a symbolic link: writing to {resolved}")
    return str(resolved)


def check_distinct_outputs(paths_and_flags) -> None:
    """One folder, one role: no two outputs resolve (symlinks followed) to the same folder or
    one inside the other, and none is the root folder. One line naming both flags otherwise."""
    resolved = []
    for path, flag in paths_and_flags:
        real = Path(path).expanduser().resolve()
        if real == Path(real.anchor):
            raise UserError(f"{flag} {path} is the root folder; pass a folder below it")
        for other, other_flag in resolved:
            if real == other or real.is_relative_to(other) or other.is_relative_to(real):
                relation = "the same folder as" if real == other else ("inside" if real.is_relative_to(other) else "a folder that holds")
                raise UserError(f"{flag} {path} is {relation} {other_flag} ({other}); give each output its own folder (nothing was changed)")
        resolved.append((real, flag))


def check_start_kept(model, model_flag: str, output, output_flag: str) -> None:
    """The folder a run writes is not the model it starts from, nor a folder that holds it (the save swaps the whole
    folder: those start weights would be gone), nor a folder inside it (the run's files would change the start, whose
    fingerprint a --resume or a rerun checks; a folder from elsewhere is fingerprinted file by file). A hub id is
    left alone."""
    if not Path(model).exists():
        return
    start, real = Path(model).resolve(), Path(output).expanduser().resolve()
    if real == start or start.is_relative_to(real):
        relation = "the same folder as" if real == start else "a folder that holds"
        raise UserError(f"{output_flag} {output} is {relation} {model_flag} {model}, the weights this run starts from: its save would "
                        f"replace them; pass another {output_flag} (nothing was changed)")
    if real.is_relative_to(start):
        raise UserError(f"{output_flag} {output} is inside {model_flag} {model}, the folder this run starts from: the run's files would "
                        f"change it, and a --resume or a rerun would no longer find the start it recorded; pass a folder outside it "
                        f"(nothing was changed)")


def claim_log_folder(folder, flag: str, run_id: str | None = None, resuming: bool = False) -> None:
    """A log folder (TensorBoard events, steps.jsonl, metrics) is new, empty or marked as ours.

    A folder holding files without our marker is the user's: refused, since a run overwrites
    steps.jsonl, evals.jsonl and the final metrics there. A training run (`run_id`) also
    refuses a folder holding another run's logs: its steps.jsonl would be emptied and its
    curves mixed with the new run's in TensorBoard. Only the run that wrote them (the same
    id, a resumed run) continues them; a marker without an id predates ids and is taken as
    the resumed run's. A training run refuses a folder holding an SFT run's curves too (the
    same --run_name for both stages): TensorBoard would draw both runs' train/loss as one curve.
    Otherwise the marker is written, with the run's id.
    """
    folder = Path(folder)
    marker = folder / LOG_MARKER_NAME
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{flag} {folder} is a file, not a folder; pass another {flag.replace('/', ' or ')} (nothing was changed)")
    if folder.is_dir() and not _is_empty_folder(folder) and not marker.is_file():
        raise UserError(f"{flag} {folder} holds files this tool did not write; pass another {flag.replace('/', ' or ')}, or move them away (nothing was changed)")
    owner = log_folder_run_id(folder)
    earlier = run_logs(folder) if run_id is not None and owner != run_id and not (owner == "" and resuming) else None
    if earlier:
        raise UserError(f"{flag} {folder} holds the logs of an earlier run ({earlier}); pass another --run_name, "
                        f"or remove {folder} to replace them (nothing was changed)")
    if run_id is not None and (sft := sft_run_in(folder)):
        raise UserError(f"{flag} {folder} holds the curves of the SFT run that wrote {sft}; pass another --run_name for this RL run "
                        f"(TensorBoard would draw both as one run; nothing was changed)")
    check_writable(folder, flag)
    if owner is None or (run_id is not None and owner != run_id):
        folder.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"written_by": WRITER, "kind": "log_folder", **({"run_id": run_id} if run_id else {})}) + "\n")


def log_folder_run_id(folder) -> str | None:
    """The id of the training run a log folder is marked for ("" for a marker without one), or None (no marker)."""
    marker = Path(folder) / LOG_MARKER_NAME
    return _read_json(marker).get("run_id", "") if marker.is_file() else None


def check_sft_log_folder(folder, checkpoint_path) -> None:
    """An SFT rerun hides the earlier run's TensorBoard curves (train_sft.open_log): right for the run whose
    checkpoint it replaces, wrong for another SFT run's (another --checkpoint_path, the same default --run_name
    sft). The marker records the checkpoint its curves belong to; a folder with another's curves is refused.
    An RL run's folder (the same --run_name for both stages) is refused too: the rerun would hide its curves.
    Call it before claim_log_folder; record_sft_log_folder after."""
    folder = Path(folder)
    recorded = sft_run_in(folder)
    if recorded and not same_path(recorded, Path(checkpoint_path).absolute()):
        raise UserError(f"--log_dir/--run_name {folder} holds the curves of the SFT run that wrote {recorded}; this run writes "
                        f"{checkpoint_path}: pass another --run_name to keep both (nothing was changed)")
    rl_logs = run_logs(folder) or ("its TensorBoard curves" if log_folder_run_id(folder) and any(folder.glob("events.out.tfevents.*")) else "")
    if rl_logs:
        raise UserError(f"--log_dir/--run_name {folder} holds the logs of an RL run ({rl_logs}), whose curves this SFT run would hide in "
                        f"TensorBoard; pass another --run_name (nothing was changed)")


def sft_run_in(folder) -> str | None:
    """The SFT checkpoint whose curves a log folder holds (train_sft's marker records it; event files there), or None."""
    recorded = _read_json(Path(folder) / LOG_MARKER_NAME).get("sft_checkpoint")
    return recorded if recorded and any(Path(folder).glob("events.out.tfevents.*")) else None


def record_sft_log_folder(folder, checkpoint_path) -> None:
    marker = Path(folder) / LOG_MARKER_NAME
    marker.write_text(json.dumps({**_read_json(marker), "sft_checkpoint": str(Path(checkpoint_path).absolute())}) + "\n")


def start_model_name(model) -> str:
    """A start model as a manifest records it (`start_model`): a local folder's absolute path, or the hub id."""
    return str(Path(model).resolve()) if Path(model).exists() else str(model)


def same_path(recorded, expected) -> bool:
    """Whether a path a file records (a metrics.json's `model_path`) names `expected`: equal as written, or resolved."""
    return str(recorded) == str(expected) or Path(recorded).resolve() == Path(expected).resolve()


def start_over(run_dir, *folders) -> str:
    """'remove A and B': what to remove so that a rerun starts over. The log folder is named
    too when it holds a run's logs, since a new run refuses it (claim_log_folder)."""
    folders = [*folders, run_dir] if run_logs(Path(run_dir)) else list(folders)
    return "remove " + " and ".join(str(folder) for folder in folders)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def run_logs(folder: Path) -> str:
    """What a log folder holds of a training run's results, in words ("steps 1-40 in steps.jsonl"), or ""."""
    steps = []
    if (folder / "steps.jsonl").is_file():
        for line in (folder / "steps.jsonl").read_text(errors="replace").splitlines():
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
    if steps:
        return f"steps {min(steps)}-{max(steps)} in steps.jsonl"
    # TensorBoard files alone do not count: a run that failed before its first step leaves one. train_rl's
    # evaluate-only results do: a checkpoint's evaluation, which a new run's curves would join in TensorBoard
    return ", ".join(name for name in ("evals.jsonl", "final_eval_metrics.json", "eval_only_metrics.json")
                     if (folder / name).is_file() and (folder / name).stat().st_size)


def check_writable(folder, flag: str, target=None) -> None:
    """Create (and delete) a file in `folder`, or in its nearest existing ancestor."""
    folder = Path(folder)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
    target = target or folder
    if not existing.is_dir():
        raise UserError(f"{flag} {target}: {existing} is a file, so no folder can be made there; pass another path")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".alignment-write-check-"):
            pass
    except OSError as error:
        raise UserError(f"{flag} {target}: cannot write in {existing} ({error.strerror}); pass a writable path or fix its permissions") from None


# ------------------------------------------------------------------ integrity


def file_sha256(file) -> str:
    """SHA-256 of a file (checkpoint manifests; the training data's fingerprint for --resume)."""
    with open(file, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _file_table(folder: Path) -> dict:
    return {
        str(file.relative_to(folder)): {"bytes": file.stat().st_size, "sha256": file_sha256(file)}
        for file in sorted(folder.rglob("*"))
        if file.is_file() and file.name not in (MANIFEST_NAME, TEMP_MARKER_NAME)
    }


def folder_fingerprint(path, recorded: str | None = None) -> str:
    """SHA-256 naming a model folder's contents: of its manifest's file table when this tool wrote it (check_saved_model
    has checked the files against it), else of its files themselves (a folder from elsewhere; every file is read).

    The hidden files of a folder from elsewhere are not its contents: `hf download --local-dir` keeps its download
    notes under .cache/ and a file browser leaves .DS_Store, and either changed the fingerprint, so --resume refused a
    run from an unchanged model. A run's `recorded` fingerprint that counted them (an earlier version's) is returned
    when the folder still holds what it counted."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is not None:
        return copy_identity(manifest)
    table = _file_table(path)
    digest = lambda files: hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()  # noqa: E731
    fingerprint = digest({name: entry for name, entry in table.items() if not any(part.startswith(".") for part in Path(name).parts)})
    return recorded if recorded not in (None, fingerprint) and recorded == digest(table) else fingerprint


def verify_manifest(path, what: str) -> dict:
    """Check every file the manifest lists (present, same size, same SHA-256); return the manifest.

    Raises UserError naming the first damaged file. `what` says what the folder is for
    (it goes into the message, with the way forward).
    """
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        raise UserError(f"{path} has no readable {MANIFEST_NAME}, so it cannot be checked; {what}")
    for name, expected in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise UserError(f"{file} is missing (listed in {path / MANIFEST_NAME}); {what}")
        if file.stat().st_size != expected["bytes"]:
            raise UserError(f"{file} is damaged: {file.stat().st_size} bytes, {expected['bytes']} when written; {what}")
        if file_sha256(file) != expected["sha256"]:
            raise UserError(f"{file} is damaged: its SHA-256 differs from when it was written; {what}")
    return manifest


# ------------------------------------------------------------------ one writer


_held: dict[str, int] = {}  # lock file -> fd, for the run locks this process holds
_swap_guards: dict[str, threading.Lock] = {}
_swap_guards_lock = threading.Lock()


def _lock_file(path) -> Path:
    path = Path(path).absolute()
    return path.with_name(f".{path.name}.alignment-lock")


def _backup_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.alignment-old")


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.alignment-tmp-"


LOCK_CONTENT_PREFIX = "alignment lock, pid "


def _open_lock(lock: Path, flag: str, path) -> int:
    """Open (creating) the lock file of `path`; UserError when the folder is not writable or the
    file is not one this tool wrote (a lock file is empty or holds LOCK_CONTENT_PREFIX + pid)."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise UserError(f"{flag} {path}: cannot create its lock file {lock} ({error.strerror}); pass a writable path or fix its permissions") from None
    content = os.pread(fd, len(LOCK_CONTENT_PREFIX), 0).decode(errors="replace")
    if content and not LOCK_CONTENT_PREFIX.startswith(content):
        os.close(fd)
        raise UserError(f"{flag} {path}: {lock} is not a lock file this tool wrote; move it away (nothing was changed)")
    return fd


class OutputLock:
    """Exclusive, non-blocking locks on a run's output paths for as long as the run lives.

    A second run on any of them exits with one line naming the first one's PID.
    """

    def __init__(self, paths_and_flags):
        self.held = []
        try:
            for path, flag in paths_and_flags:
                self._acquire(_lock_file(path), flag, path)
        except BaseException:
            self.release()
            raise

    def _acquire(self, lock: Path, flag: str, path) -> None:
        if str(lock) in _held:
            return
        fd = _open_lock(lock, flag, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 128, 0).decode(errors="replace").removeprefix(LOCK_CONTENT_PREFIX).strip() or "unknown"
            os.close(fd)
            raise UserError(f"{flag} {path} is in use by another run (pid {owner}, lock {lock}); wait for it to end or pass another path") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{LOCK_CONTENT_PREFIX}{os.getpid()}\n".encode(), 0)
        _held[str(lock)] = fd
        self.held.append(str(lock))

    def release(self) -> None:
        for lock in self.held:
            os.close(_held.pop(lock))
        self.held = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


@contextmanager
def _swap_lock(path):
    """Serialise writers of one path: threads by a lock, processes by flock on its lock file.

    A process that holds the run lock for the path (OutputLock) already excludes other
    processes, so only the thread lock is taken then.
    """
    lock = _lock_file(path)
    with _swap_guards_lock:
        guard = _swap_guards.setdefault(str(lock), threading.Lock())
    with guard:
        if str(lock) in _held:
            yield
            return
        fd = _open_lock(lock, "writing", path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


# ------------------------------------------------------------------ atomic writes


def _temp_owner(temp: Path) -> str | None:
    """The path a temp folder was made for, when this tool made it (its marker, written first and kept until the swap)."""
    try:
        marker = json.loads((temp / TEMP_MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return marker.get("for") if isinstance(marker, dict) and marker.get("written_by") == WRITER else None


def _finished_temp(path: Path) -> Path | None:
    """The newest temp folder this tool made for `path` whose write finished: its manifest is
    written (the write's last step before the swap) and every file it lists checks out."""
    finished = []
    for temp in path.parent.glob(_temp_prefix(path) + "*") if path.parent.is_dir() else ():
        if temp.is_dir() and _temp_owner(temp) == str(path.absolute()):
            try:
                verify_manifest(temp, "")
                finished.append(((temp / MANIFEST_NAME).stat().st_mtime, temp))
            except Exception:  # no manifest yet, damaged, unreadable or of another shape: not a finished write
                continue
    return max(finished)[1] if finished else None


def _remove_written_folder(folder: Path) -> None:
    """Remove a folder this tool wrote, its manifest last: cut short, what is left still
    carries the manifest that lets recover_checkpoint know it and finish the removal."""
    for entry in folder.iterdir():
        if entry.name != MANIFEST_NAME:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    (folder / MANIFEST_NAME).unlink(missing_ok=True)
    folder.rmdir()


def recover_checkpoint(path) -> None:
    """Finish or undo what a writer of `path` that died mid-write left. A swap cut between
    its two renames (no `path`; the backup, and the new folder written whole) is finished:
    the new folder goes to `path`, the backup away. Without a whole new folder the backup
    goes back to `path` (or, with `path` there after all, away). Temp folders this tool made
    for `path` are then removed, finished or not: without a backup no swap had begun.

    Call it holding the path's lock (OutputLock, or write_atomically's own), so that no live
    writer, on this host or another, has a temp folder there. Only the tool's own hidden
    names are looked at, and only folders that say this tool wrote them for `path`: a
    user's `<path>.old` or `<path>.tmp` is never touched."""
    path = Path(path)
    backup = _backup_path(path)
    has_backup = backup.is_dir() and read_manifest(backup) is not None  # a backup is always a folder this tool wrote
    # only a swap the tool began is finished: `path` gone without a backup beside it is a user's doing (say, to start
    # over), and a temp left by a writer that died before its first rename must not bring that folder back
    if has_backup and not path.exists() and (finished := _finished_temp(path)) is not None:
        try:
            os.rename(finished, path)  # the swap's last rename, as the writer would have done it
            (path / TEMP_MARKER_NAME).unlink(missing_ok=True)
        except OSError:
            pass  # not finished: the backup goes back below
    if has_backup:
        if not path.exists():
            os.rename(backup, path)
        else:
            try:
                _remove_written_folder(backup)
            except OSError:
                pass  # its manifest stays until the last file is gone: the next recovery finishes the removal
    if not path.parent.is_dir():
        return
    for temp in sorted(path.parent.glob(_temp_prefix(path) + "*")):
        if temp.is_dir() and (_temp_owner(temp) == str(path.absolute()) or _is_empty_folder(temp)):
            shutil.rmtree(temp, ignore_errors=True)


def write_atomically(path, write_into, kind: str, record: dict | None = None) -> Path:
    """Call `write_into(temp_folder)`, add the manifest, then move the folder to `path`.

    `kind` (one of KINDS) names the folder; `record` adds fields to the manifest. Refuses
    (UserError) to replace a folder that is not a `kind` this tool wrote with exactly its
    files (`ownership_problem`). Any failure of the write (disk full, permissions, a
    serialiser's RuntimeError) raises UserError naming the path and the free space, removes
    the temp folder, and leaves the previous folder at `path` as it was.
    """
    path = Path(path)
    with _swap_lock(path):
        recover_checkpoint(path)
        problem = ownership_problem(path, kind)
        if problem:
            raise UserError(f"{path} {problem}; it was left as it is, and nothing was saved there")
        backup, made_backup = _backup_path(path), False  # only a backup this save made is put back or removed
        if path.exists() and not _is_empty_folder(path) and backup.exists() and read_manifest(backup) is None:
            # recovery leaves what the tool did not write: the swap would fail at its first rename, after the whole write
            raise UserError(f"{backup}, the name the save of {path} keeps its previous copy under while it swaps, holds "
                            f"something this tool did not write; move it away and run again ({path} was left as it is)")
        temp = path.with_name(f"{_temp_prefix(path)}{os.getpid()}-{threading.get_ident()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temp.mkdir()  # recover_checkpoint removed any earlier one of this name
            (temp / TEMP_MARKER_NAME).write_text(json.dumps({"written_by": WRITER, "for": str(path.absolute()), "pid": os.getpid()}) + "\n")
            write_into(temp)
            manifest = {"written_by": WRITER, "kind": kind, "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(record or {}), "files": _file_table(temp)}
            (temp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
            _fsync_tree(temp)
            if _is_empty_folder(path):
                path.rmdir()  # nothing to keep, and a backup is always a folder this tool wrote
            elif path.exists():
                os.rename(path, backup)
                made_backup = True
            os.rename(temp, path)
            _fsync_folder(path.parent)  # the swap itself survives a power loss, not only the files
        except Exception as error:  # OSError, and torch.save's RuntimeError on a full disk
            shutil.rmtree(temp, ignore_errors=True)
            if made_backup and not path.exists():
                os.rename(backup, path)  # the second rename failed: the previous folder goes back
            kept = f"the previous {path} is intact" if path.exists() else f"nothing was at {path} before"
            reason = (error.strerror if isinstance(error, OSError) and error.strerror else str(error).splitlines()[0] if str(error) else type(error).__name__)
            again = "run train_sft again (it keeps no resumable state)" if kind == "sft_checkpoint" else "run again (--resume continues from the last saved state)"
            raise UserError(f"could not write {path} ({reason}; {_free_space(path.parent)} free there); {kept}; "
                            f"free some space or check the path, and {again}") from None
        # saved: what is left only tidies up, and a failure here must not report the save as failed (the
        # caller would stop a run whose new folder is in place); recover_checkpoint removes a leftover backup whose manifest is left
        try:
            (path / TEMP_MARKER_NAME).unlink(missing_ok=True)  # in place now: no longer a temp folder
            if made_backup:
                _remove_written_folder(backup)
        except OSError as error:
            print(f"warning: saved {path}, but could not remove the previous copy {backup} ({error.strerror or error}); remove it by hand if it is still there")
    return path


def _free_space(folder: Path) -> str:
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return "unknown space"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if free >= size:
            return f"{free / size:.1f} {unit}"
    return f"{free} bytes"


def _fsync_tree(folder: Path) -> None:
    """Every file of `folder` and every folder's entries, its subfolders' (a state's policy/) included, on disk."""
    for entry in folder.rglob("*"):
        if entry.is_file():
            with open(entry, "rb") as handle:
                os.fsync(handle.fileno())
        elif entry.is_dir():
            _fsync_folder(entry)
    _fsync_folder(folder)


def _fsync_folder(folder: Path) -> None:
    """Put a folder's entries (the names of what was written or renamed in it) on disk, where the system allows it."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # a file system or platform that cannot sync a folder: the files themselves are synced
    finally:
        os.close(descriptor)


def remove_output(path, kind: str, run_id: str | None = None) -> bool:
    """Delete a folder this tool wrote as `kind`, holding exactly its manifest's files; with
    `run_id`, only if the run that wrote it (its manifest's run record) has that id. Anything
    else is left alone. Returns whether it was removed.

    The manifest goes last: a removal cut short (a kill, a busy file) leaves a folder that still
    says it is ours, holding a subset of its files, which a later call removes or a save replaces."""
    path = Path(path)
    if not path.is_dir() or _is_empty_folder(path) or ownership_problem(path, kind):
        return False
    if run_id is not None and (read_manifest(path).get("run") or {}).get("run_id") != run_id:
        return False
    try:
        _remove_written_folder(path)
    except OSError as error:
        print(f"warning: could not remove {path} ({error.strerror or error}); remove it by hand (what is left still carries "
              f"its manifest, so a later run may replace it)")
        return False
    return True


def save_model_atomically(model, tokenizer, path, kind: str, state_dict=None, record: dict | None = None) -> Path:
    """`save_pretrained` of model and tokenizer into `path`, atomically, with a manifest of `kind`.

    The result is an ordinary Hugging Face folder that transformers and vLLM load.
    `state_dict` overrides the model's own (full weights gathered from FSDP shards);
    `record` adds fields to the manifest (an RL checkpoint's step and the run's last step).
    """

    def write(folder):
        model.save_pretrained(folder, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(folder)

    return write_atomically(path, write, kind=kind, record=record)


def check_saved_model(path, what: str) -> None:
    """Before loading a checkpoint folder: every file its manifest lists is as written (size
    and SHA-256), when this tool wrote it; otherwise (a folder from the Hub, say) each
    safetensors file is as long as its own header says. UserError naming the file if not."""
    path = Path(path)
    if not path.is_dir():
        return  # a hub id: transformers fetches and checks it
    if read_manifest(path) is not None:
        verify_manifest(path, what)
        return
    for file in sorted(path.glob("*.safetensors")):
        expected = _safetensors_length(file)
        if expected is None:
            raise UserError(f"{file} is not a readable safetensors file (its header is damaged); {what}")
        if file.stat().st_size != expected:
            raise UserError(f"{file} is damaged: {file.stat().st_size} bytes, its header describes {expected}; {what}")


def _safetensors_header(file: Path) -> tuple[int, dict] | None:
    """(header length, header) of a safetensors file (its tensors' entries, no tensor read); None when it is unreadable."""
    try:
        with open(file, "rb") as handle:
            header_length = int.from_bytes(handle.read(8), "little")
            if not 0 < header_length <= min(100_000_000, file.stat().st_size):
                return None
            header = json.loads(handle.read(header_length))
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    return header_length, {name: entry for name, entry in header.items() if name != "__metadata__"}


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape as a safetensors file's header lists it; {} for an unreadable header."""
    read = _safetensors_header(file)
    try:
        return {name: tuple(entry["shape"]) for name, entry in read[1].items()} if read else {}
    except (KeyError, TypeError):
        return {}


def _safetensors_length(file: Path) -> int | None:
    """The byte length a safetensors file's header implies (8 + header + the end of the last tensor)."""
    read = _safetensors_header(file)
    if read is None:
        return None
    try:
        return 8 + read[0] + max((entry["data_offsets"][1] for entry in read[1].values()), default=0)
    except (KeyError, TypeError, IndexError):
        return None


# ------------------------------------------------------------------ training state


def save_training_state(state_dir, model, tokenizer, model_state: dict, optimizer_state: dict, scheduler, counters: dict, run: dict) -> Path:
    """Everything `--resume` needs, written atomically into `state_dir`.

    policy/ (HF format, full weights), optimizer.pt (full and keyed by parameter
    name, so it loads into one GPU, the layer partition or any FSDP world size),
    scheduler.pt, rng.pt (python, torch CPU and CUDA generators: tensors and plain
    values, loaded with weights_only) and counters.json (step, epoch, batch within the
    epoch, which fixes the data-loader position, and the TensorBoard step). `run` (the
    flags that define the run, the data's fingerprint, the run's id) goes into the
    manifest. Called on one process; the caller gathers the states.
    """
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

    return write_atomically(state_dir, write, kind="training_state", record={"run": run, "step": counters["step"]})


def has_training_state(state_dir) -> bool:
    """A complete training state (its manifest written last) is in `state_dir` (after
    `recover_checkpoint`, which the run that holds the lock does first)."""
    manifest = read_manifest(state_dir)
    return manifest is not None and manifest.get("kind") == "training_state"


def state_step(state_dir) -> int | None:
    manifest = read_manifest(state_dir)
    return manifest.get("step") if manifest else None


def _runs_folder(checkpoint_path) -> Path:
    """Where the RL runs started from `checkpoint_path` note their training states: a hidden folder beside it."""
    path = Path(checkpoint_path).resolve()
    return path.parent / f".{path.name}.alignment-runs"


def record_run_from(checkpoint_path, run_id: str, state_dir) -> None:
    """Note beside the start checkpoint (one this tool wrote) that run `run_id` keeps its training state in
    `state_dir`, so that `unfinished_runs_from` finds it wherever the run's folders are. Best effort: a parent
    folder that cannot be written is one train_sft cannot replace the checkpoint in either."""
    if read_manifest(checkpoint_path) is None:
        return
    notes = _runs_folder(checkpoint_path)
    try:
        notes.mkdir(exist_ok=True)
        (notes / f"{run_id}.json").write_text(json.dumps({"state_dir": str(Path(state_dir).resolve())}) + "\n")
    except OSError:
        pass


def forget_run_from(checkpoint_path, run_id: str) -> None:
    """The run has finished (its training state removed): its note beside the start checkpoint goes too."""
    notes = _runs_folder(checkpoint_path)
    try:
        (notes / f"{run_id}.json").unlink(missing_ok=True)
        notes.rmdir()  # only when no other run's note is left
    except OSError:
        pass


def unfinished_runs_from(checkpoint_path) -> list[tuple[Path, int | None]]:
    """The training states of unfinished RL runs that started from `checkpoint_path`: those beside it
    (folders of its parent, where train_rl's default `<checkpoint_path>.state` lies) and those its runs
    noted (`record_run_from`) wherever they keep them, whose run record's start-checkpoint fingerprint is
    this folder's. Each as (state folder, its step). Replacing the checkpoint would leave those runs unable
    to resume (--resume refuses another start checkpoint: the KL reference would be another model)."""
    path = Path(checkpoint_path).absolute()
    if read_manifest(path) is None or not path.parent.is_dir():
        return []
    candidates = [folder for folder in sorted(path.parent.iterdir()) if folder != path]
    for note in sorted(_runs_folder(path).glob("*.json")):
        try:
            candidates.append(Path(json.loads(note.read_text())["state_dir"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a note half written or edited: the states beside the checkpoint are still checked
    fingerprint, found, seen = None, [], set()
    for folder in candidates:
        # not a folder (a file, or a link that loops) is skipped before it is resolved; a state both beside the
        # checkpoint and noted, perhaps reached through a link, once
        if not folder.is_dir() or (real := folder.resolve()) in seen:
            continue
        seen.add(real)
        if has_training_state(folder):
            started_from = (read_manifest(folder).get("run") or {}).get("start_checkpoint_sha256")
            fingerprint = fingerprint or folder_fingerprint(path)
            if started_from == fingerprint:
                found.append((folder, state_step(folder)))
    return found


def load_training_state(state_dir, run_dir) -> dict | None:
    """The latest state written by `save_training_state`, checked, or None if there is none.

    Every file is verified against the manifest first; nothing is unpickled beyond
    tensors and plain values (`weights_only=True`), so a state from elsewhere cannot
    run code. Restores the RNG states as a side effect; returns counters plus
    `policy_path`, `optimizer`, `scheduler` and the manifest's `run` record.
    """
    import random

    import torch

    state_dir = Path(state_dir)
    if not has_training_state(state_dir):
        return None
    advice = f"the training state in {state_dir} cannot be resumed; {start_over(run_dir, state_dir)} to start over"
    manifest = verify_manifest(state_dir, advice)
    try:
        state = json.loads((state_dir / "counters.json").read_text())
        state["optimizer"] = torch.load(state_dir / "optimizer.pt", map_location="cpu", weights_only=True)
        state["scheduler"] = torch.load(state_dir / "scheduler.pt", map_location="cpu", weights_only=True)
        rng = torch.load(state_dir / "rng.pt", weights_only=True)
    except Exception as error:  # unpickling refused, or a file the manifest vouched for still does not parse
        raise UserError(f"{state_dir}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}; {advice}") from None
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    state["policy_path"] = str(state_dir / "policy")
    state["run"] = manifest.get("run", {})
    return state
