"""Drafters that run a model: the target quantized, the target's first layers, or a small model.

A draft model keeps K/V like the target, at the *same slots*: the sequence's block table (which the
scheduler grew for the 1 + k positions of this step) indexes the draft's cache too. So the draft
needs no allocator of its own, and a block copy or swap of the target's is mirrored on the
draft's cache (apply_block_ops). The draft model's cache holds valid K/V for the first
`computed[request]` positions of a sequence:

    propose:   feed tokens [computed, L) (catch-up: the last token, plus the last accepted draft
               when every draft was accepted), sample d_1 from its logits; feed d_1 at position L,
               sample d_2; ... up to d_k.  Now computed = L + k - 1 (d_k itself is never fed).
    rollback:  after verification the target keeps L + a positions (a drafts accepted), so
               computed = min(computed, target's num_computed_tokens).

Each round is one packed forward over every sequence that still needs drafts (continuous
batching for the draft too). A preemption resets `computed` to 0: the blocks may have changed.

"layer_skip" is the special case that needs no cache of its own: its first N layers are the
target's first N layers, so the target's K/V of those layers *are* the draft's (the draft writes
its guesses into the target's cache; verification overwrites the same slots), and the draft is
always caught up to the target's num_computed_tokens.

Correctness never depends on the draft: whatever it proposes, verification (rejection.py) emits
the target's distribution. A stale or wrong draft cache only lowers acceptance.
"""
from __future__ import annotations

import torch

from workbench.kv.paged_cache import PagedKVCache
from workbench.models.llama import LlamaModel
from workbench.worker.model_runner import pack
from workbench.models.fused_decode import MAX_QUERY_LEN
from workbench.spec.proposer import Draft
from workbench.sample.rejection import processed_probs


class ModelDrafter:
    def __init__(self, model: LlamaModel, kv_caches, cache: PagedKVCache | None, block_size: int,
                 backend, device: torch.device, kv_cache_dtype: str, generator: torch.Generator,
                 num_layers: int | None = None):
        """kv_caches: the per-layer (K, V) the draft reads and writes; `cache` owns them when
        they are the draft's own (None for layer_skip, which uses the target's first layers)."""
        self.model, self.kv_caches, self.cache = model, kv_caches, cache
        self.block_size, self.backend, self.device = block_size, backend, device
        self.kv_cache_dtype, self.generator = kv_cache_dtype, generator
        self.num_layers = num_layers
        self.forward = model     # or a FusedDecodeForward over it (build_drafter)
        self.computed: dict[str, int] = {}
        self.preemptions: dict[str, int] = {}

    @property
    def shares_target_cache(self) -> bool:
        return self.cache is None

    def _start(self, seq) -> int:
        """First position whose K/V the draft has not computed."""
        if self.shares_target_cache:
            return seq.num_computed_tokens
        if self.preemptions.get(seq.request_id, 0) != seq.num_preemptions:
            self.computed[seq.request_id] = 0
            self.preemptions[seq.request_id] = seq.num_preemptions
        return min(self.computed.get(seq.request_id, 0), seq.num_computed_tokens)

    @torch.inference_mode()
    def propose(self, seqs, ks, tables) -> list[Draft]:
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        live = [i for i, k in enumerate(ks) if k > 0]
        rows = {}
        for i in live:
            start = self._start(seqs[i])
            rows[i] = (seqs[i].token_slice(start, seqs[i].num_tokens), start)
        while live:
            ids, positions, meta = pack([rows[i] for i in live], [tables[i] for i in live],
                                        self.block_size, self.device, self.kv_cache_dtype)
            # a catch-up of a few tokens after the draft's cached context, not a prompt
            meta.decode_like = all(rows[i][1] > 0 and len(rows[i][0]) <= MAX_QUERY_LEN
                                   for i in live)
            hidden = self.forward(ids, positions, self.kv_caches, meta, self.backend,
                                  num_layers=self.num_layers)
            logits = self.model.compute_logits(hidden[meta.query_start_loc[1:] - 1])
            for r, i in enumerate(live):
                seq = seqs[i]
                if seq.params.greedy:
                    token = int(logits[r].argmax())
                else:
                    q = processed_probs(logits[r:r + 1], seq.params)[0].cpu()
                    token = int(torch.multinomial(q, 1, generator=seq.generator or self.generator))
                    probs[i].append(q)
                tokens[i].append(token)
                rows[i] = ([token], seq.num_tokens - 1 + len(tokens[i]))
            live = [i for i in live if len(tokens[i]) < ks[i]]
        for i, k in enumerate(ks):
            if k > 0 and not self.shares_target_cache:
                self.computed[seqs[i].request_id] = seqs[i].num_tokens - 1 + k
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def rollback(self, seq) -> None:
        """After verification: only the target's accepted positions are known-good."""
        if seq.request_id in self.computed:
            self.computed[seq.request_id] = min(self.computed[seq.request_id],
                                                seq.num_computed_tokens)

    def apply_block_ops(self, ops) -> None:
        if self.cache is not None and ops:
            self.cache.apply(ops)

    def release(self, request_id: str) -> None:
        self.computed.pop(request_id, None)
        self.preemptions.pop(request_id, None)
