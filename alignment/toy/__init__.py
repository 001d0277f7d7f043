"""The CPU demo's toy world, apart from the method: a synthetic arithmetic task in GSM8K's
format (synthetic_task), tiny Qwen2 models with byte-level BPE tokenizers built on the fly
(tiny_model), and the pipeline that runs the real command-line tools on them (demo)."""
