"""RL fine-tuning of language models on GSM8K (GRPO and its variants), one readable module per step.

`python -m alignment.<tool>` imports this package first, while Python still holds "-m" in
sys.argv[0]. The cyclic garbage collector then stays off while the tool imports torch,
transformers and vLLM: each full collection those imports set off walks every object imported
so far (~650,000), 0.5-1 CPU-s of each tool's start on a 2-core CPU. The tool turns it back
on first thing (`resume_collector`, called by `errors.run_cli` and the grader worker), with what
the imports built frozen, so later collections skip it too. Imported any other way, the
package leaves the collector alone.
"""

import gc
import sys

_collector_paused = False


def pause_collector() -> None:
    """Turn the cyclic garbage collector off until `resume_collector` (a tool's start: only imports run)."""
    global _collector_paused
    _collector_paused = gc.isenabled()
    gc.disable()


def resume_collector() -> bool:
    """Turn the collector back on if `pause_collector` turned it off; True if it did (the objects built until
    now are then frozen: call `gc.unfreeze()` before the process exits, as triton's nanobind reports frozen
    objects as leaks)."""
    global _collector_paused
    if not _collector_paused:
        return False
    _collector_paused = False
    gc.freeze()
    gc.enable()
    return True


if sys.argv[:1] == ["-m"] and any(arg.startswith("alignment.") for arg in sys.orig_argv[1:]):
    pause_collector()
