"""plan_step: the driver's half of a step, from the scheduler's batch to the StepInputs that a
model runner (in this process or in every worker) turns into one packed forward pass."""
from __future__ import annotations

from workbench.engine.scheduler import ScheduledBatch
from workbench.kv.block_manager import BlockManager, BlockOps
from workbench.worker.model_runner import StepInputs


def plan_step(batch: ScheduledBatch, blocks: BlockManager, ops: BlockOps | None = None
              ) -> StepInputs:
    """The driver's half of a step: which tokens go in and which rows come out as logits.

    A sequence gets logits when this step reaches its last token; with drafted tokens, one row per
    draft too (row j scores draft j + 1; the last row is the bonus position). Prompt logprobs need
    the rows of the prompt positions this step covers (position j predicts prompt token j + 1)."""
    rows, tables, logit_rows, prompt_rows, end = [], [], [], {}, 0
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        rows.append((seq.scheduled_tokens(seq.num_computed_tokens, n), seq.num_computed_tokens))
        tables.append(blocks.tables[seq.request_id])
        end += n
        k = len(seq.spec_token_ids)
        if seq.num_computed_tokens + n == seq.num_tokens + k:
            logit_rows.extend(range(end - 1 - k, end))
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_done:
            first = len(seq.prompt_logprobs or [None]) - 1   # continue where the last chunk stopped
            last = min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1)
            if last > first:
                prompt_rows[i] = (first, end - n + (first - seq.num_computed_tokens), last - first)
    return StepInputs(rows, tables, logit_rows, prompt_rows, [ops] if ops else [])
