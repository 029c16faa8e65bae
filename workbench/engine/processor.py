"""Processor: requests in. A prompt (text, token ids or a chat) becomes the Sequences the scheduler
queues, after every field of the request has been checked against the model and the plan, so a bad
request raises a ValueError that names the field and leaves the engine as it was.

    prompt ─▶ apply_chat_template / tokenize ─▶ validate (lengths, ids, parameters, grammar)
           ─▶ one Sequence per sample (n, best_of), each with its seed, stop ids and grammar state
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from workbench.config import EnginePlan
from workbench.engine.sequence import Sequence
from workbench.sample.grammar import GrammarCompiler
from workbench.sampling_params import SamplingParams


def eos_token_ids(checkpoint: Path, tokenizer) -> set[int]:
    """End-of-sequence ids from config.json, generation_config.json and the tokenizer."""
    ids: set[int] = set()
    gen_cfg = checkpoint / "generation_config.json"
    cfg = json.loads((checkpoint / "config.json").read_text())
    sources = [cfg.get("eos_token_id")]
    if gen_cfg.is_file():
        sources.append(json.loads(gen_cfg.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for src in sources:
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list):
            ids.update(src)
    return ids


class Processor:
    def __init__(self, plan: EnginePlan, tokenizer, vocab_size: int, eos_ids: set[int]):
        self.plan, self.tokenizer, self.vocab_size = plan, tokenizer, vocab_size
        self.eos_token_ids = eos_ids
        self._grammars: GrammarCompiler | None = None   # built at the first structured request

    # ------------------------------------------------------------------------- prompts
    def apply_chat_template(self, conversation, add_generation_prompt: bool = True) -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError(f"model={self.plan.config.model!r} has no chat template")
        for i, m in enumerate(conversation):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]={m!r:.60} is invalid: each message is a dict "
                                 "with str 'role' and 'content'")
        ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                      tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers: BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """A str is tokenized; a list of ints is taken as token ids. Errors name the problem."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt='' is invalid: the prompt must contain at least one token")
            if self.tokenizer is None:
                raise ValueError(f"model={self.plan.config.model!r} has no tokenizer: pass "
                                 "token-id lists (list[int]) as prompts")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise ValueError("prompt=[] is invalid: the prompt must contain at least one token")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are invalid: ids must be in "
                                 f"[0, {self.vocab_size}) for this model's vocabulary")
            return None, list(prompt)
        raise ValueError(f"prompt={prompt!r:.80} is invalid: a prompt is a str or a list of "
                         "token ids (int)")

    # ------------------------------------------------------------------------- requests
    def process(self, prompt, params: SamplingParams | None, request_id: str, priority: int,
                arrival_time: float | None, is_taken: Callable[[str], bool]) -> list[Sequence]:
        """The request's sequences: the first is the one the scheduler queues; the others are its
        samples, which fork from it at their first token. Nothing is queued here."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params={params!r:.60} is invalid: pass a SamplingParams")
        text, ids = self.tokenize(prompt)
        self._check_length(ids)
        if params.stop_list and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none; "
                             "use stop_token_ids")
        if is_taken(request_id):
            raise ValueError(f"request_id={request_id!r} is invalid: it is already in use")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority={priority!r} is invalid: it must be an integer "
                             "(lower values are served first)")
        self._check_processors(params)
        max_num_seqs = self.plan.config.max_num_seqs
        if params.best_of > max_num_seqs:
            field = "best_of" if params.best_of > params.n else "n"
            raise ValueError(f"{field}={params.best_of} is invalid: a request's samples run "
                             f"together, at most max_num_seqs={max_num_seqs}")
        member_ids = [request_id] + [f"{request_id}#{i}" for i in range(1, params.best_of)]
        taken = [m for m in member_ids[1:] if is_taken(m)]
        if taken:
            raise ValueError(f"request_id={request_id!r} is invalid: its samples' ids {taken} "
                             "are already in use")
        members = [self._new_sequence(m, text, ids, params, priority, arrival_time, i)
                   for i, m in enumerate(member_ids)]
        if len(members) > 1:
            members[0].members = members
        return members

    def _check_length(self, ids: list[int]) -> None:
        plan = self.plan
        if not ids:
            raise ValueError("prompt is invalid: it tokenizes to 0 tokens; at least one is needed")
        limit = plan.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt is too long: {len(ids)} tokens, but max_model_len={limit} "
                             "must hold the prompt and at least one generated token")
        pool_tokens = plan.kv_cache_tokens
        contiguous = plan.config.kv_cache_layout == "contiguous"
        needed = max(len(ids) + 1, limit if contiguous else 0)
        if needed > pool_tokens:
            raise ValueError(f"prompt is too long for the KV cache: it needs {needed} token slots, "
                             f"and the pool holds {pool_tokens} (num_kv_blocks="
                             f"{plan.num_kv_blocks} x block_size={plan.config.block_size})")

    def _new_sequence(self, request_id, text, ids, params, priority, arrival_time,
                      index) -> Sequence:
        seq = Sequence(request_id, text, list(ids), params, priority=priority, index=index)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        if params.seed is not None:          # sample i draws from seed + i: its own stream
            seq.generator = torch.Generator().manual_seed(params.seed + index)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None and index == 0:
            seq.prompt_logprobs = [None]  # nothing predicts the first prompt token
        if params.min_tokens:
            eos = set() if params.ignore_eos else self.eos_token_ids
            seq.min_tokens_stop_ids = frozenset(eos | set(params.stop_token_ids))
        if params.bad_words:
            seq.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        if params.structured_outputs is not None:
            seq.grammar = self.grammars.new_state(params.structured_outputs)
        return seq

    @property
    def grammars(self) -> GrammarCompiler:
        """One xgrammar compiler for this tokenizer, built at the first structured request."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size,
                                             stop_token_ids=self.eos_token_ids)
        return self._grammars

    def _check_processors(self, params: SamplingParams) -> None:
        bad = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias keys {bad[:5]} are invalid: token ids must be in "
                             f"[0, {self.vocab_size}) for this model's vocabulary")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer, and this model has none; use "
                             "logit_bias with -100 for the token ids instead")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer, and this model has none")
            try:
                self.grammars.compile(params.structured_outputs)   # cached for later
            except ValueError as err:
                raise ValueError(f"structured_outputs.{err}") from None
            except ImportError as err:        # the engine serves on without the extra
                raise ValueError(str(err)) from None

    def _bad_words_token_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's tokens, alone and after a space (the same word tokenizes differently at
        the start of the text and inside it), as vLLM bans them."""
        out = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        return tuple(out)
