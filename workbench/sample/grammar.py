"""Structured outputs: decoding constrained to a JSON schema, a regex, a choice list or a grammar.

The grammar engine is xgrammar (the one vLLM and SGLang use). The pieces and the data flow:

- `StructuredOutputsParams` says what one request's output must match (vLLM's field names). It is
  validated when constructed; it is compiled later, by the compiler below.
- `GrammarCompiler` is built once per tokenizer. It turns params into an xgrammar
  `CompiledGrammar`: the grammar over bytes plus, for each grammar position, a precomputed split
  of the whole vocabulary into tokens that are always / never / sometimes allowed there.
  Compiling takes milliseconds for small schemas and up to seconds for large ones (long bounded
  repetitions), so compiled grammars are cached, keyed by the params.
- `GrammarState` is one sequence's position in its grammar (xgrammar's `GrammarMatcher`). It is per
  sequence because two requests with the same schema are at different points of it. Each decode
  step the engine asks every constrained sequence to `fill_bitmask` its row of a batch *token
  bitmask*: an int32 tensor of shape (batch, ceil(vocab_size / 32)) in which bit j of word i is 1
  when token 32 * i + j may come next. `apply_bitmask` then sets the logits of the forbidden tokens
  to -inf in place, only on the constrained rows, so the sampler (temperature, top-k/p, greedy...)
  chooses among allowed tokens only. After sampling, `accept(token_id)` advances the state.
- `rollback(n)` undoes the last n accepted tokens: speculative decoding accepts a run of draft
  tokens into the state to get the masks for the verification step, then takes back the rejected
  ones.
- The end: when the text so far is a complete match and nothing may follow, the mask allows only
  the stop tokens (the engine's end-of-sequence ids). Accepting one terminates the state; from then
  on only stop tokens are allowed and accepted, so an engine step that runs past the end (e.g.
  ignore_eos) still gets a valid mask.

The tokenizer's special tokens (SmolLM2's <|im_start|>, <repo_name>, ...) are never allowed:
xgrammar would otherwise treat their text "<|im_start|>" as ordinary characters inside strings.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from workbench.extras import require

try:
    import xgrammar as xgr
except ImportError:       # the 'structured' extra; GrammarCompiler names it when a request needs it
    xgr = None

from workbench.structured.params import StructuredOutputsParams, choice_to_ebnf

# The grammar a `json_object` request compiles to: any JSON object (OpenAI's response_format
# {"type": "json_object"}).
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
# Longest whitespace run allowed between JSON tokens: unbounded, a model (or a random one) can
# emit whitespace until max_tokens; 16 still allows pretty-printing a few levels deep.
MAX_WHITESPACE = 16


# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed check.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _xgrammar_message(err: Exception) -> str:
    return _XGR_PREFIX.sub("", str(err).strip())


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer, with an LRU cache of compiled grammars.

    vocab_size is the width of the model's logits (49152 for SmolLM2), which may exceed the
    tokenizer's vocabulary: the bitmask has that many bits per row, and ids beyond the tokenizer's
    are always masked. stop_token_ids are the ids that end a sequence (default: the tokenizer's
    eos_token_id); give the engine's full end-of-sequence set.
    """

    def __init__(self, tokenizer, vocab_size: int, *, stop_token_ids: Iterable[int] | None = None,
                 max_threads: int = 2, cache_size: int = 128):
        if xgr is None:
            require("xgrammar", "structured outputs")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size!r} is invalid: it must be the model's logits "
                             "width, an integer >= 1")
        if stop_token_ids is None:
            stop_token_ids = [tokenizer.eos_token_id]
        self.stop_token_ids = sorted({int(t) for t in stop_token_ids if t is not None})
        if not self.stop_token_ids or not all(0 <= t < vocab_size for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} is invalid: at least one id "
                             f"is needed, each in [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.tokenizer_info = _tokenizer_info(tokenizer, vocab_size, self.stop_token_ids)
        self.special_token_ids = frozenset(self.tokenizer_info.special_token_ids)
        # One cache, ours: xgrammar's own would hold a second copy of every grammar.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads,
                                             cache_enabled=False)
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        # The row a terminated state writes: only the stop tokens.
        self.stop_only_row = torch.zeros(xgr.get_bitmask_shape(1, vocab_size)[1], dtype=torch.int32)
        for t in self.stop_token_ids:
            word = int(self.stop_only_row[t // 32]) & 0xFFFFFFFF | (1 << (t % 32))
            self.stop_only_row[t // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """A (batch_size, ceil(vocab_size / 32)) int32 CPU bitmask, all tokens allowed."""
        return xgr.allocate_token_bitmask(batch_size, self.vocab_size)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar for params, from the cache when seen before.

        Raises ValueError naming the field and xgrammar's message when the schema, regex or
        grammar is not one xgrammar accepts.
        """
        key = params.cache_key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        kind, text, compact = key
        any_ws = not compact
        try:
            ws = MAX_WHITESPACE if any_ws else None
            if kind == "json":
                compiled = self._compiler.compile_json_schema(text, any_whitespace=any_ws,
                                                              max_whitespace_cnt=ws)
            elif kind == "json_object":
                compiled = self._compiler.compile_json_schema(_ANY_OBJECT_SCHEMA,
                                                              any_whitespace=any_ws,
                                                              max_whitespace_cnt=ws)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(text)
            elif kind == "choice":
                compiled = self._compiler.compile_grammar(choice_to_ebnf(params.choice))
            else:
                compiled = self._compiler.compile_grammar(text)
        except RuntimeError as err:
            raise ValueError(f"{kind}={getattr(params, kind)!r} is invalid: "
                             f"{_xgrammar_message(err)}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def cache_len(self) -> int:
        return len(self._cache)

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh per-sequence state at the start of params' grammar."""
        return GrammarState(self.compile(params), self)


def _tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: each token's text, with special tokens blanked out.

    xgrammar detects the encoding (byte-level BPE, byte fallback, ...) from a Hugging Face
    tokenizer, but marks as special only the ids whose text is empty; SmolLM2's special tokens
    have text, so they are blanked here, which makes xgrammar mask them everywhere.
    """
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
    encoded = [""] * vocab_size
    for text, idx in tokenizer.get_vocab().items():
        if idx < vocab_size:
            encoded[idx] = text
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {idx for idx, tok in added.items() if getattr(tok, "special", False)}
    special.update(getattr(tokenizer, "all_special_ids", []) or [])
    for idx in special:
        if idx < vocab_size:
            encoded[idx] = ""
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids,
                             add_prefix_space=detected.add_prefix_space)


class GrammarState:
    """One sequence's progress through its compiled grammar (wraps xgrammar's GrammarMatcher).

    Made by GrammarCompiler.new_state. Each step: fill_bitmask (before sampling), then accept (the
    sampled token). Rollback is unlimited in xgrammar >= 0.2 (its Earley parser keeps every step),
    so any number of accepted tokens can be taken back.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, compiler: GrammarCompiler):
        self._matcher = xgr.GrammarMatcher(compiled)
        self._compiler = compiler
        self._stop_ids = frozenset(compiler.stop_token_ids)
        # Tokens accepted so far, the terminating stop token and the stop tokens after it included.
        self.num_accepted = 0
        self._stops_after_end = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row] (a CPU int32 bitmask).

        Returns whether the row forbids anything (False: every token is allowed, so applying it
        may be skipped). Does not change the state.
        """
        if self._matcher.is_terminated():
            bitmask[row].copy_(self._compiler.stop_only_row)
            return True
        return self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar does not allow it."""
        token_id = int(token_id)
        if self._matcher.is_terminated():
            if token_id not in self._stop_ids:
                return False
            self._stops_after_end += 1
        elif token_id in self._compiler.special_token_ids:
            return False  # xgrammar rejects these too, but logs a warning for each
        elif not 0 <= token_id < self._compiler.vocab_size \
                or not self._matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (rejected speculative drafts)."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) \
                or not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"num_tokens={num_tokens!r} is invalid: it must be an integer in "
                             f"[0, {self.num_accepted}] (the tokens accepted so far)")
        extra = min(num_tokens, self._stops_after_end)
        self._stops_after_end -= extra
        if num_tokens > extra:
            self._matcher.rollback(num_tokens - extra)
        self.num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        """True once a stop token has been accepted at the end of a complete match."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the text so far is a complete match (a stop token may come next)."""
        return self._matcher.is_completed()

    def reset(self) -> None:
        """Back to the start of the grammar (a preempted sequence that recomputes its output)."""
        self._matcher.reset()
        self.num_accepted = 0
        self._stops_after_end = 0


def fill_bitmasks(states: Sequence[GrammarState | None], bitmask: torch.Tensor) -> list[int]:
    """Fill row i of bitmask for every states[i] that is not None; return the rows filled.

    The returned rows are the ones to pass to apply_bitmask; None marks an unconstrained sequence.
    """
    rows = []
    for row, state in enumerate(states):
        if state is not None:
            state.fill_bitmask(bitmask, row)
            rows.append(row)
    return rows


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set logits[r, t] = -inf in place for each row r in rows and each token t that bitmask[r]
    forbids; other rows are left alone.

    logits is (batch, vocab) float32/bfloat16/float16, on any device (the bitmask is copied there);
    bitmask has at least vocab bits per row. CPU tensors use xgrammar's single-threaded C++ kernel
    (a small, steady share of a decode step even when other work shares the cores: chapter 10's
    report records the grammar's overhead per step, `python -m workbench.course.report
    notebooks/10_production.ipynb`), CUDA ones its Triton kernel.
    """
    if len(rows) == 0:
        return
    width = logits.shape[-1]
    if bitmask.shape[-1] * 32 < width:
        raise ValueError(f"bitmask covers {bitmask.shape[-1] * 32} tokens but logits have {width}: "
                         "allocate it with the model's logits width")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=list(rows))
