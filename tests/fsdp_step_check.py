"""One GRPO update on a fixed batch, in one process or under torchrun with FSDP2.

    python tests/fsdp_step_check.py MODEL OUT [one_step_off]                         # one process
    torchrun --nproc_per_node 2 tests/fsdp_step_check.py MODEL OUT [one_step_off]    # two ranks, gloo

Each rank takes whole groups of the same global batch; OUT gets the loss and the
updated weights (rank 0), which tests/test_distributed.py compares across launches.
`one_step_off`: the batch carries a sampler's log-probs (the start model's, shifted by
fixed noise), so the update weights each token by truncated importance sampling, as
train_rl --rollout_staleness does.
"""

import sys
from pathlib import Path

import torch

from alignment import distributed
from alignment.distributed import rank_slice, reduce_totals
from alignment.grpo import normalize_group_rewards
from alignment.optim import build_scheduler
from alignment.policy_update import UpdateSettings, score_with, sequence_lengths, update_policy
from alignment.rollout import load_hf_model, load_tokenizer
from alignment.sft_helpers import tokenize_rollout_ids

model_path, out, one_step_off = sys.argv[1], Path(sys.argv[2]), sys.argv[3:] == ["one_step_off"]
launched = "RANK" in __import__("os").environ
ranks = distributed.TorchDistributed() if launched else distributed.SingleProcess()
tokenizer = load_tokenizer(model_path)
model = load_hf_model(model_path, "cpu", torch.float32)

# the global batch: 4 prompts x group 4, fixed responses and rewards
generator = torch.Generator().manual_seed(0)
prompts = [f"User: Ava has {i} apples.\nAssistant: <think>" for i in range(4) for _ in range(4)]
responses = [torch.randint(0, len(tokenizer) - 1, (int(n),), generator=generator).tolist() for n in torch.randint(3, 12, (16,), generator=generator)]
raw = (torch.rand(16, generator=generator) > 0.5).float()
advantages, _ = normalize_group_rewards(raw, 4, 1e-6, True)
rows = rank_slice(list(range(16)), ranks)
batch = {**tokenize_rollout_ids([prompts[i] for i in rows], [responses[i] for i in rows], tokenizer),
         "raw_rewards": raw[rows], "advantages": advantages[rows]}
batch["lengths"] = sequence_lengths(batch["response_mask"])
if one_step_off:  # the same noise on every launch: drawn for all 16 rows, this rank's rows taken
    noise = 0.5 * torch.randn(16, batch["labels"].shape[1], generator=torch.Generator().manual_seed(1))[rows]
    start = score_with(model, batch, 4, "cpu", chunk_size=0)
    batch["sampler_log_probs"] = torch.where(batch["response_mask"], start + noise, torch.tensor(float("nan")))
if launched:
    distributed.shard_policy(model)
# this rank's share of the step's 16 sequences (each rank averages its own; FSDP averages the ranks)
args = UpdateSettings(train_batch_size=16 // ranks.world_size, train_mini_batch_size=4, loss_type="reinforce_with_baseline", logprob_chunk_size=0,
                      one_step_off=one_step_off, tis_cap=1.5)
# SGD, so equal weights mean equal gradients: Adam's first step is lr * sign(g), which
# turns float-order noise in a near-zero gradient (advantages cancel within a group)
# into a full +-lr difference
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
totals = reduce_totals(update_policy(model, optimizer, build_scheduler(optimizer, 0, 1), batch, args, "cpu", ranks=ranks), ranks)
weights = ranks.full_state_dict_on_main(model)
if ranks.is_main:
    torch.save({"loss": totals["loss"], "grad_norm": totals["grad_norm"], "tis_capped": totals["tis_capped"], "sampler_ratio_max": totals["sampler_ratio_max"],
                "weights": {k: v.detach().cpu() for k, v in weights.items()}}, out)
ranks.close()
