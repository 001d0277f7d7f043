"""The rollout engine in its own process, so it generates while the policy trains.

train_rl --rollout_staleness N (one step off policy for N = 1): the trainer sends the
next batches' prompts before it trains on the current one, and the engine process
generates them meanwhile. An engine process, not a thread: vLLM's scheduling and
detokenisation would fight the training loop for the GIL.

Requests run in the order they are sent, so a weight load sent after batch k+1's
prompts reaches the engine after batch k+1 and before batch k+2: each batch is
sampled by the weights that were sent before it. `RolloutsAhead` records which
weights version that was, so train_rl can log (and bound) the staleness.

Weights cross the process boundaries packed by torch.multiprocessing's reductions
(`rollout.pack_tensors`): CPU tensors in shared memory, CUDA tensors as IPC handles
(no copy through the host), opened where they are copied in (for vLLM on a GPU, its
engine-core process). The trainer sends a copy (the policy keeps training while the
engine has not yet loaded it) and holds it until the engine has.
"""

import atexit
import functools
import os
import pickle
import queue
import signal
import time
import traceback

import torch
import torch.multiprocessing

from alignment.rollout import build_engine, pack_tensors


class SamplerProcessError(RuntimeError):
    """The engine process failed; the message holds its traceback."""


def _serve(make_engine, requests, replies, trainer_pid: int, threads: int | None) -> None:
    # Signals are the trainer's to handle: it finishes the step, saves, then closes us. A
    # process group of our own keeps Ctrl-C and `kill -TERM -<pgid>` (what Slurm and shells
    # send) from this process and vLLM's engine core, which it may start; both are ignored here too.
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    try:
        engine = make_engine()
    except BaseException:
        replies.put((0, "error", traceback.format_exc(), 0.0))
        return
    replies.put((0, "ready", None, 0.0))
    while True:
        try:
            ticket, kind, payload = requests.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != trainer_pid:  # the trainer died without closing us (killed): end with it, within a second
                break
            continue
        if kind == "stop":
            break
        started = time.perf_counter()  # the engine's own time for the request (the overlap's measure)
        try:
            if kind == "generate":
                prompts, sampling, seed = payload
                torch.manual_seed(seed)  # the HF backend samples from torch's RNG
                result = engine.generate(prompts, sampling)
            else:  # "load": packed tensors (IPC handles / shared memory), opened where they are copied in
                if hasattr(engine, "load_packed"):
                    engine.load_packed(payload)
                else:
                    engine.load_weights(pickle.loads(payload))
                result = None
            replies.put((ticket, "done", result, time.perf_counter() - started))
        except BaseException:
            replies.put((ticket, "error", traceback.format_exc(), 0.0))
    engine.close()


class SamplerProcess:
    """An engine (vLLM or HF, as `build_engine` makes it) served by a child process.

    `submit` returns a ticket at once and `result(ticket)` waits for it; `generate`
    and `load_weights` keep the in-process engine's interface (evaluation uses them).
    `seconds` holds how long the engine process spent on the last finished request of
    each kind ("generate", "load"): the trainer's own timings only see the waits.
    """

    def __init__(self, backend: str, model_path, device: str, dtype: torch.dtype, seed: int, args, shares_gpu: bool = False,
                 engine_process: bool | None = None):
        context = torch.multiprocessing.get_context("spawn")
        self._requests, self._replies = context.Queue(), context.Queue()
        # On a GPU, vLLM's engine core in a process of its own again: its front end's per-token
        # Python (stop strings, log-probs) then overlaps the GPU steps (bench/RESULTS.md). On a
        # CPU there is no device to overlap with, and vLLM's CPU backend would start its engine
        # core and a worker as two more spawned processes (~15 s on 2 cores): there the engine
        # runs inside this process, on one thread, while the trainer computes on the others
        # (tiny task, 8 one-step-off steps on 2 cores: 19-20 s against 38 s, steps 0.62 s against 0.79).
        if engine_process is None:
            engine_process = device != "cpu"
        threads = 1 if device == "cpu" else None
        make_engine = functools.partial(build_engine, backend, str(model_path), device, dtype, seed, args, shares_gpu=shares_gpu,
                                        engine_process=engine_process)
        # not a daemon: vLLM's engine core may be a process of its own, and daemons may have no
        # children; the trainer closes it on exit (atexit), and it ends itself if the trainer dies
        self._process = context.Process(target=_serve, args=(make_engine, self._requests, self._replies, os.getpid(), threads),
                                        name="sampler")
        self._process.start()
        atexit.register(self.close)
        self._dtype = dtype
        self._tickets, self._results, self._held, self._kinds = 0, {}, {}, {}
        self.seconds = {}
        self.result(0)  # the engine is up (or its start-up error is raised here)

    def submit(self, prompts: list[str], sampling, seed: int) -> int:
        return self._send("generate", (list(prompts), sampling, seed))

    def load_weights(self, named_tensors) -> None:
        """Queue a weight load behind the requests already sent; returns at once. The tensors
        are copied in the engine's dtype (fp32 master weights travel as bf16 on GPUs)."""
        tensors = [(name, tensor.detach().to(self._dtype, copy=True) if tensor.is_floating_point() else tensor.detach().clone())
                   for name, tensor in named_tensors]
        ticket = self._send("load", pack_tensors(tensors))
        self._held[ticket] = tensors  # alive until the engine has loaded them (IPC handles)

    def generate(self, prompts: list[str], sampling) -> list:
        return self.result(self.submit(prompts, sampling, torch.initial_seed() % 2**31))

    def result(self, ticket: int):
        while ticket not in self._results:
            try:
                done, status, payload, seconds = self._replies.get(timeout=5.0)
            except queue.Empty:
                if not self._process.is_alive():
                    raise SamplerProcessError(f"the sampler process died (exit code {self._process.exitcode}) with requests pending") from None
                continue
            self._held.pop(done, None)
            kind = self._kinds.pop(done, None)
            if kind:
                self.seconds[kind] = seconds
            if status == "error":
                raise SamplerProcessError(f"the sampler process failed:\n{payload}")
            if kind != "load":  # loads are waited for by nobody
                self._results[done] = payload
        return self._results.pop(ticket)

    def close(self) -> None:
        atexit.unregister(self.close)
        if self._process.is_alive():
            self._requests.put((-1, "stop", None))
            self._process.join(timeout=60)
        if self._process.is_alive():
            self._process.terminate()
        self._held.clear()

    def _send(self, kind: str, payload) -> int:
        self._tickets += 1
        self._kinds[self._tickets] = kind
        self._requests.put((self._tickets, kind, payload))
        return self._tickets


class RolloutsAhead:
    """Rollout batches sent to a SamplerProcess before their step, and the weights
    version each was sampled with (the last version sent before it)."""

    def __init__(self, sampler: SamplerProcess):
        self.sampler = sampler
        self.pending = {}  # step -> (ticket, weights version)

    def send(self, step: int, prompts: list[str], sampling, seed: int, weights_version: int) -> None:
        if step not in self.pending:
            self.pending[step] = (self.sampler.submit(prompts, sampling, seed), weights_version)

    def take(self, step: int, prompts: list[str], sampling, seed: int, weights_version: int) -> tuple[list, int]:
        """This step's generations (sent now if they were not sent ahead) and their weights version."""
        self.send(step, prompts, sampling, seed, weights_version)
        ticket, version = self.pending.pop(step)
        return self.sampler.result(ticket), version
