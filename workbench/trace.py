"""StepRecord: what one engine step did, for plots, metrics and tests.

Figures and metrics read these records; they never reach into the engine's internals.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StepRecord:
    step: int
    num_seqs: int            # sequences in this step's batch
    num_prefill_tokens: int  # prompt tokens processed this step
    num_decode_tokens: int   # generated tokens fed back this step (one per decoding sequence)
    num_waiting: int         # requests still queued after scheduling
    kv_tokens_used: int      # tokens whose K/V the cache holds after this step
    kv_tokens_reserved: int  # slots held by running sequences (used + reserved but empty)
    kv_tokens_total: int     # the cache's capacity in tokens
    num_finished: int        # requests that finished in this step
    schedule_s: float        # time spent choosing what runs
    prepare_s: float         # building input tensors and metadata
    forward_s: float         # the model's forward pass and the LM head
    sample_s: float          # sampling
    postprocess_s: float     # detokenization and stop checks
    total_s: float

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def as_dict(self) -> dict:
        return asdict(self)
