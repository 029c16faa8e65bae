"""OutputProcessor: appends each sampled token to its sequence, detokenizes, and decides when it ends.

A sequence finishes with
- "stop": the end-of-sequence token (unless `ignore_eos`), a `stop_token_ids` entry, or a stop
  string, once it has `min_tokens` tokens. A stop string is cut from the text together with everything after it;
- "length": `max_tokens` generated, or the context (`max_model_len`) is full.

Text is decoded from all output tokens each time (not token by token): a character can span tokens
(UTF-8 pieces of an emoji, say), and only the whole sequence decodes it correctly. Streaming emits the
part of the text that can no longer change: it holds back an incomplete character and any suffix that
could still grow into a stop string, so a stop string is never partly emitted.
"""
from __future__ import annotations

import time

from workbench.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from workbench.engine.sequence import Sequence, SequenceStatus
from workbench.sample.sampler import top_logprobs


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def logprob_dict(self, token_id: int, info) -> dict[int, Logprob]:
        chosen_lp, rank, top = info
        entries = {tid: Logprob(lp, r + 1, self.decode([tid])) for r, (tid, lp) in enumerate(top)}
        entries[token_id] = Logprob(chosen_lp, rank, self.decode([token_id]))
        return entries

    def append_token(self, seq: Sequence, token_id: int, logprob_info=None) -> None:
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        seq.output_token_ids.append(token_id)
        if logprob_info is not None:
            if seq.logprobs is not None:        # else only best_of's ranking needs the logprob
                seq.logprobs.append(self.logprob_dict(token_id, logprob_info))
            seq.cumulative_logprob += logprob_info[0]
        params = seq.params
        may_stop = len(seq.output_token_ids) >= params.min_tokens  # vLLM: no stop before then
        if self.tokenizer is not None:
            previous_len = len(seq.text)
            seq.text = self.decode(seq.output_token_ids)
            if may_stop and self._check_stop_strings(seq, previous_len):
                return
        if may_stop and token_id in self.eos_token_ids and not params.ignore_eos:
            self.finish(seq, "stop", None)
        elif may_stop and token_id in params.stop_token_ids:
            self.finish(seq, "stop", token_id)
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish(seq, "length", None)

    def append_tokens(self, seq: Sequence, tokens: list[int], infos: list) -> None:
        """Append one step's tokens (several after an accepted draft) until one finishes the
        sequence; a token its grammar refuses ends it with "abort" (the mask forbids it)."""
        for token, info in zip(tokens, infos):
            if seq.grammar is not None and not seq.grammar.accept(token):
                self.finish(seq, "abort", None)
                return
            self.append_token(seq, token, info)
            if seq.is_finished:
                return

    def extend_prompt_logprobs(self, seq: Sequence, first: int, logprobs) -> None:
        """The prompt logprobs of positions first + 1, ... from a step's log-softmax rows."""
        for k in range(logprobs.shape[0]):
            token = seq.prompt_token_ids[first + k + 1]
            info = top_logprobs(logprobs[k], token, seq.params.prompt_logprobs)
            seq.prompt_logprobs.append(self.logprob_dict(token, info))

    def _check_stop_strings(self, seq: Sequence, previous_len: int) -> bool:
        stops = seq.params.stop_list
        if not stops:
            return False
        # Only text near the end can contain a new match: a stop string may straddle the boundary.
        start = max(0, previous_len - max(len(s) for s in stops))
        hits = [(seq.text.find(s, start), s) for s in stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        seq.text = seq.text[:index]
        self.finish(seq, "stop", stop)
        return True

    def finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.status = SequenceStatus.FINISHED
        seq.finished_time = time.perf_counter()

    @staticmethod
    def stable_text_len(seq: Sequence) -> int:
        """How much of seq.text a stream may emit now without ever having to take it back."""
        text = seq.text
        if seq.is_finished:
            return len(text)
        end = len(text)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 character; the next token completes it
            end -= 1
        held = 0
        for stop in seq.params.stop_list:
            for k in range(min(len(stop) - 1, end), 0, -1):  # longest suffix that starts `stop`
                if text[end - k:end] == stop[:k]:
                    held = max(held, k)
                    break
        return end - held

    @staticmethod
    def completion(seq: Sequence, index: int) -> CompletionOutput:
        tracked = seq.logprobs is not None or seq.params.ranks_samples
        return CompletionOutput(
            index=index, text=seq.text, token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            cumulative_logprob=seq.cumulative_logprob if tracked else None,
            logprobs=seq.logprobs)

    def to_request_output(self, seq: Sequence) -> RequestOutput:
        """One CompletionOutput per sample: all n in order, or with best_of the n of highest
        cumulative logprob, best first. Latencies are the first sample's; the request finishes
        when its last sample does."""
        members = seq.members or [seq]
        if seq.params.ranks_samples:
            members = sorted(members, key=lambda m: -m.cumulative_logprob)[:seq.params.n]
        completions = [self.completion(m, i) for i, m in enumerate(members)]
        done = [m.finished_time for m in (seq.members or [seq]) if m.finished_time is not None]
        metrics = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                                 seq.last_token_time, max(done) if done else None,
                                 len(seq.output_token_ids), seq.spec_steps, seq.spec_proposed,
                                 seq.spec_accepted,
                                 [a / p for a, p in zip(seq.spec_accepted_at, seq.spec_proposed_at)])
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_token_ids), completions,
                             seq.group_finished, seq.prompt_logprobs, metrics)
