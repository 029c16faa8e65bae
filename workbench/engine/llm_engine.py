"""LLMEngine: the step loop. One step = schedule, run the model, sample, process outputs.

    batch  = scheduler.schedule()          which sequences run, how many tokens each (and which
                                           blocks they hold, after any preemption or swap)
    runner.apply_block_ops(...)            swap-out, swap-in and copy-on-write block copies
    inputs = plan_step(batch, blocks)      token ids, positions, block tables, logits rows
    logits = runner.execute(inputs)        one forward pass for the whole batch (in this process,
                                           or posted to the workers of a parallel engine)
    tokens = sampler(logits)               one new token per sequence that finished its prompt
                                           (speculative decoding: the drafter proposes k tokens
                                           after scheduling; verify() keeps a prefix of them, plus
                                           one token, and the rejected slots are given back)
    output_processor.append_token(...)     detokenize, check stop conditions, finish
    scheduler.free_finished()              finished sequences give their blocks back at once

Every step leaves a StepRecord in `self.trace`. Requests are validated in `add_request` before
anything is queued, so a bad request raises a ValueError and leaves the engine as it was.
"""
from __future__ import annotations

import copy
import itertools
import json
import time
from pathlib import Path

import torch

from ..attention import get_attention_backend
from ..config import EngineConfig
from ..kv.block_manager import BlockManager
from ..kv.paged_cache import PagedKVCache, kv_bytes_per_token
from ..models.loader import load_model, load_tokenizer, read_args, resolve_checkpoint
from .logits_processors import History
from .output_processor import OutputProcessor
from ..outputs import RequestOutput
from ..compress.checkpoint import is_pruned_checkpoint, load_pruned, save_pruned
from ..quant.checkpoint import is_quantized_checkpoint, load_quantized, save_quantized
from ..parallel.comm import merge_stats
from .runner import ModelRunner, plan_step
from .sampler import Sampler, top_logprobs
from ..sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus
from ..spec.rejection import verify
from .trace import StepRecord


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.checkpoint = resolve_checkpoint(config.model)
        self.model_args = read_args(self.checkpoint)
        self.device, self.dtype = config.torch_device, config.torch_dtype
        config.finalize(self.model_args.max_position_embeddings,
                        kv_bytes_per_token(self.model_args, self.dtype, config.kv_cache_dtype))
        self.tokenizer = load_tokenizer(self.checkpoint)
        self.quantization = None                     # the method the weights carry, if any
        self.weights_stored_bf16 = 0                 # fp32 layers whose weights are kept in bf16
        self.pruned_manifest = None                  # pruning.json of a pruned checkpoint loaded
        self.blocks = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching,
            num_cpu_blocks=config.num_cpu_blocks,
            reserve_tokens=config.max_model_len if config.kv_cache_layout == "contiguous" else None)
        self.executor = None                         # the workers of a parallel engine
        self.offload = None                          # WeightOffload when cpu_offload_gb > 0
        self.model = self.cache = self.runner = None
        if config.world_size > 1:
            if is_pruned_checkpoint(self.checkpoint):
                # The workers load transformers-shaped layers (models/loader.py), one width and
                # one head count for all; a pruned folder's per-layer shapes need load_pruned.
                raise ValueError(f"model={config.model!r} is a pruned checkpoint, and the "
                                 "parallel engine loads unpruned ones: use one process")
            from ..parallel import start_workers
            self.executor = start_workers(config, self.checkpoint, self.model_args)
        else:
            self._load_model(config)
            if config.kv_tiers:
                self._attach_kv_tiers(config)
        self.backend = get_attention_backend(config.attention_backend, self.device,
                                             config.batch_invariant)
        # Pipeline parallelism keeps one micro-batch per stage in flight, each from its own
        # scheduler over the shared block pool (parallel/pipeline.py).
        self.schedulers = [Scheduler(c, self.blocks) for c in self._micro_batch_configs()]
        self.scheduler = self.schedulers[0]
        if len(self.schedulers) > 1:
            for sched in self.schedulers:
                sched.others_hold_blocks = self._others_hold_blocks(sched)
        self._in_flight: list = []                   # (scheduler, batch, ops, step number, times)
        if self.model is not None:                  # a single-process engine runs its own model
            self.runner = ModelRunner(self.model, self.cache, self.blocks, self.backend,
                                      self.device, compile=config.compile,
                                      fused_decode=config.use_fused_decode,
                                      cuda_graphs=self._graph_settings(config),
                                      freeze_weights=config.freeze_weights,
                                      row_invariant=config.batch_invariant and config.use_cpu_gemv)
        self.sampler = Sampler(config.seed)
        self.drafter = None
        if config.spec_config is not None:
            from ..spec import build_drafter
            self.drafter = build_drafter(config.spec_config, self)
        self.output_processor = OutputProcessor(self.tokenizer, self._eos_token_ids(),
                                                config.max_model_len)
        self.trace: list[StepRecord] = []
        self._request_counter = itertools.count()
        self._sequences: dict[str, Sequence] = {}
        self._grammars = None                        # structured outputs' compiler, when used

    def _load_model(self, config: EngineConfig) -> None:
        if is_quantized_checkpoint(self.checkpoint):
            for name, value in (("quantization", config.quantization),
                                ("pruning", config.pruning)):
                if value is not None:
                    raise ValueError(f"{name}={value!r} is invalid for {config.model}: it is "
                                     "already quantized; pass None")
            self.model, manifest = load_quantized(self.checkpoint, self.dtype, self.device,
                                                  config.max_model_len)
            self.quantization = manifest["method"]
        else:
            if is_pruned_checkpoint(self.checkpoint):
                if config.prune_config is not None:
                    raise ValueError(f"pruning={config.pruning!r} is invalid for {config.model}: "
                                     "it is already pruned; pass None")
                self.model, self.pruned_manifest = load_pruned(
                    self.checkpoint, self.dtype, self.device, config.max_model_len)
            else:
                self.model = load_model(self.checkpoint, self.dtype, self.device,
                                        config.max_model_len)
            joint = self._prunes_while_quantizing(config)
            if config.prune_config is not None:
                self._prune(config.prune_config, joint)
            if config.quant_config is not None:
                if not joint:
                    self._quantize(config.quant_config)
                elif config.quant_config.quantize_lm_head:
                    from ..quant.apply import quantize_lm_head
                    quantize_lm_head(self.model)
                self.quantization = config.quant_config.method
        if config.moe_config is not None:
            from ..parallel.moe import moefy
            moefy(self.model, **config.moe_config)
        if config.use_cpu_gemv:
            from ..models.cpu_gemv import store_weights_bf16, use_cpu_gemv
            use_cpu_gemv(self.model)
            if config.weight_dtype == torch.bfloat16 and self.dtype == torch.float32:
                self.weights_stored_bf16 = store_weights_bf16(self.model)
        if config.use_fused_decode:
            from ..models.fused_decode import fused_decode_unsupported
            why_not = fused_decode_unsupported(self.model)
            if why_not and config.fused_decode is True:
                raise ValueError(f"fused_decode=True is invalid for this model: {why_not}")
            if why_not:
                config.use_fused_decode, config.fused_decode_reason = False, why_not
        if config.batch_invariant:
            from ..models.batch_invariant import make_batch_invariant
            make_batch_invariant(self.model)
        if config.use_weight_offload:                # last: the layers' final parameters move
            from ..offload import offload_model
            self.offload = offload_model(self.model, config)
            from ..memory import release_memory
            release_memory()        # the offloaded layers' resident copies
        self.cache = PagedKVCache(self.model_args, config.num_kv_blocks, config.block_size,
                                  self.dtype, self.device, config.num_cpu_blocks,
                                  kv_cache_dtype=config.kv_cache_dtype)

    def _attach_kv_tiers(self, config: EngineConfig) -> None:
        """CPU and disk tiers under the pool (kv/tiers.py); the disk tier first indexes the files
        a former engine left under a manifest that matches this one (kv/disk_tier.py)."""
        from ..kv import disk_tier
        from ..kv.tier_store import TierStore
        from ..kv.tiers import KVTiers
        args, files = self.model_args, []
        if config.kv_disk_tier_bytes:
            manifest = {"format_version": disk_tier.FORMAT_VERSION, "model": str(config.model),
                        "quantization": self.quantization, "pruning": config.pruning,
                        "dtype": str(self.dtype).removeprefix("torch."),
                        "kv_cache_dtype": config.kv_cache_dtype, "block_size": config.block_size,
                        "num_layers": args.num_hidden_layers,
                        "num_kv_heads": args.num_key_value_heads, "head_dim": args.head_dim}
            files = disk_tier.open_directory(Path(config.kv_disk_tier_path), manifest)
        block_bytes = self.cache.bytes_per_token * config.block_size
        self.blocks.attach_tiers(KVTiers(config.num_cpu_tier_blocks, config.kv_disk_tier_bytes,
                                         block_bytes, files))
        self.cache.tier_store = TierStore(self.cache.kv_caches, config.block_size, self.device,
                                          config.num_cpu_tier_blocks, config.kv_disk_tier_path)

    @staticmethod
    def _graph_settings(config: EngineConfig) -> dict | None:
        if not config.cuda_graphs:
            return None
        return {"max_num_seqs": config.max_num_seqs, "max_model_len": config.max_model_len}

    def _others_hold_blocks(self, me: Scheduler):
        return lambda: any(other.running for other in self.schedulers if other is not me)

    def _micro_batch_configs(self) -> list[EngineConfig]:
        """One config per scheduler: with P stages, P schedulers share max_num_seqs."""
        p = self.config.pipeline_parallel_size
        if p == 1:
            return [self.config]
        out = []
        for v in range(p):
            c = copy.copy(self.config)
            c.max_num_seqs = max(1, -(-self.config.max_num_seqs // p))
            out.append(c)
        return out

    @property
    def kv_cache_tokens(self) -> int:
        return self.config.num_kv_blocks * self.config.block_size

    @property
    def kv_cache_bytes(self) -> int:
        """The KV pool's size for the whole model (a parallel engine's workers hold shares)."""
        return self.kv_cache_tokens * kv_bytes_per_token(self.model_args, self.dtype,
                                                         self.config.kv_cache_dtype)

    def close(self) -> None:
        """Stop the worker processes of a parallel engine (a single-process engine has none) and
        the weight offload's prefetch thread, deleting its files."""
        if self.executor is not None:
            self.executor.close()
        if self.offload is not None:
            self.offload.close()
            self.offload = None

    def _calibration(self, knob: str, cfg, calibrated: tuple) -> list[list[int]] | None:
        """The calibration windows cfg asks for when its method is one of `calibrated`, else None
        (`knob`: the engine argument that chose the method, for the error)."""
        if cfg.method not in calibrated:
            return None
        if self.tokenizer is None:
            raise ValueError(f"{knob}={cfg.method!r} calibrates on text and needs the model's "
                             "tokenizer, which this checkpoint lacks")
        from ..quant.calibration import calibration_windows
        return calibration_windows(self.tokenizer, cfg.num_calibration_windows,
                                   cfg.calibration_window_len)

    @staticmethod
    def _prunes_while_quantizing(config: EngineConfig) -> bool:
        """SparseGPT with GPTQ: one column loop prunes and quantizes (the SparseGPT paper's joint
        mode), so the pruned weights stay exact zeros; GPTQ after pruning would fill them in."""
        p, q = config.prune_config, config.quant_config
        return p is not None and q is not None and p.method == "sparsegpt" and q.method == "gptq"

    def _prune(self, cfg, joint: bool = False) -> None:
        from ..compress import semi_structured
        from ..compress.pruning import CALIBRATED, prune_model
        if cfg.semi_structured:            # refused before the calibration, not after it
            why_not = semi_structured.unsupported(self.device, self.dtype)
            if why_not is None and self.config.quant_config is not None:
                why_not = "quantization replaces the projections it would convert"
            if why_not:
                raise ValueError(f"pruning_config['semi_structured']=True is invalid here: "
                                 f"{why_not}")
        prune_model(self.model, cfg, self._calibration("pruning", cfg, CALIBRATED),
                    self.config.quant_config.group_size if joint else None)
        if joint:
            from ..memory import release_memory
            release_memory()        # the full-precision weights the INT4 layers replaced
        if cfg.semi_structured:
            semi_structured.to_semi_structured(self.model)
        # removing layers shrinks the KV cache too (built after this, from model_args)
        self.model_args.num_hidden_layers = self.model.args.num_hidden_layers = len(self.model.layers)

    def _quantize(self, cfg) -> None:
        from ..quant.apply import CALIBRATED, quantize_model
        calibration = self._calibration("quantization", cfg, CALIBRATED)
        quantize_model(self.model, cfg, calibration)
        from ..memory import release_memory
        release_memory()        # the full-precision weights the quantized layers replaced

    def save_pruned(self, path) -> str:
        """Write the pruned model as a folder that LLM(model=path) loads (compress/checkpoint.py)."""
        if self.config.prune_config is None:
            raise ValueError("save_pruned needs a pruned model: build the LLM with pruning=... "
                             "first")
        return str(save_pruned(self.model, self.config.prune_config, self.checkpoint, path))

    def save_quantized(self, path) -> str:
        """Write the quantized model as a folder that LLM(model=path) loads (quant/checkpoint.py)."""
        if self.quantization is None:
            raise ValueError("save_quantized needs a quantized model: build the LLM with "
                             "quantization=... first")
        cfg = self.config.quant_config
        group = cfg.group_size if cfg is not None else 0
        return str(save_quantized(self.model, self.quantization, group, self.checkpoint, path))

    def _eos_token_ids(self) -> set[int]:
        """End-of-sequence ids from config.json, generation_config.json and the tokenizer."""
        ids: set[int] = set()
        gen_cfg = self.checkpoint / "generation_config.json"
        cfg = json.loads((self.checkpoint / "config.json").read_text())
        sources = [cfg.get("eos_token_id")]
        if gen_cfg.is_file():
            sources.append(json.loads(gen_cfg.read_text()).get("eos_token_id"))
        if self.tokenizer is not None:
            sources.append(self.tokenizer.eos_token_id)
        for src in sources:
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, list):
                ids.update(src)
        return ids

    # ----------------------------------------------------------------------------- requests
    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """A str is tokenized; a list of ints is taken as token ids. Errors name the problem."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt='' is invalid: the prompt must contain at least one token")
            if self.tokenizer is None:
                raise ValueError(f"model={self.config.model!r} has no tokenizer: pass token-id "
                                 "lists (list[int]) as prompts")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise ValueError("prompt=[] is invalid: the prompt must contain at least one token")
            vocab = self.model_args.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are invalid: ids must be in "
                                 f"[0, {vocab}) for this model's vocabulary")
            return None, list(prompt)
        raise ValueError(f"prompt={prompt!r:.80} is invalid: a prompt is a str or a list of "
                         "token ids (int)")

    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> str:
        """Queue a request. `arrival_time` (time.perf_counter seconds) is when the request reached
        the system, if it waited outside the engine; TTFT and latency are measured from it."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params={params!r:.60} is invalid: pass a SamplingParams")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt is invalid: it tokenizes to 0 tokens; at least one is needed")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt is too long: {len(ids)} tokens, but max_model_len={limit} "
                             "must hold the prompt and at least one generated token")
        pool_tokens = self.config.num_kv_blocks * self.config.block_size
        needed = max(len(ids) + 1, limit if self.config.kv_cache_layout == "contiguous" else 0)
        if needed > pool_tokens:
            raise ValueError(f"prompt is too long for the KV cache: it needs {needed} token slots, "
                             f"and the pool holds {pool_tokens} (num_kv_blocks="
                             f"{self.config.num_kv_blocks} x block_size={self.config.block_size})")
        if params.stop_list and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none; "
                             "use stop_token_ids")
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self._sequences:
            raise ValueError(f"request_id={request_id!r} is invalid: it is already in use")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority={priority!r} is invalid: it must be an integer "
                             "(lower values are served first)")
        self._check_processors(params)
        member_ids = [request_id] + [f"{request_id}#{i}" for i in range(1, params.best_of)]
        if params.best_of > self.config.max_num_seqs:
            field = "best_of" if params.best_of > params.n else "n"
            raise ValueError(f"{field}={params.best_of} is invalid: a request's samples run "
                             f"together, at most max_num_seqs={self.config.max_num_seqs}")
        taken = [m for m in member_ids[1:] if m in self._sequences]
        if taken:
            raise ValueError(f"request_id={request_id!r} is invalid: its samples' ids {taken} "
                             "are already in use")
        members = [self._new_sequence(m, text, ids, params, priority, arrival_time, i)
                   for i, m in enumerate(member_ids)]
        seq = members[0]
        if len(members) > 1:
            seq.members = members
        for m in members:
            self._sequences[m.request_id] = m
        # With several schedulers (pipeline micro-batches), the one with the fewest requests.
        min(self.schedulers, key=lambda s: len(s.waiting) + len(s.running)).add(seq)
        return request_id

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
            eos = set() if params.ignore_eos else self.output_processor.eos_token_ids
            seq.min_tokens_stop_ids = frozenset(eos | set(params.stop_token_ids))
        if params.bad_words:
            seq.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        if params.structured_outputs is not None:
            seq.grammar = self._grammar_compiler().new_state(params.structured_outputs)
        return seq

    def _grammar_compiler(self):
        """One xgrammar compiler for this tokenizer, built at the first structured request."""
        if self._grammars is None:
            from ..structured.grammar import GrammarCompiler
            self._grammars = GrammarCompiler(self.tokenizer, self.model_args.vocab_size,
                                             stop_token_ids=self.output_processor.eos_token_ids)
        return self._grammars

    def _check_processors(self, params: SamplingParams) -> None:
        vocab = self.model_args.vocab_size
        bad = [t for t in params.logit_bias or {} if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias keys {bad[:5]} are invalid: token ids must be in "
                             f"[0, {vocab}) for this model's vocabulary")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer, and this model has none; use "
                             "logit_bias with -100 for the token ids instead")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer, and this model has none")
            try:
                self._grammar_compiler().compile(params.structured_outputs)   # cached for later
            except ValueError as err:
                raise ValueError(f"structured_outputs.{err}") from None

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

    def abort_request(self, request_id: str) -> None:
        head = self._sequences.get(request_id)
        for member in (head.members if head is not None and head.members else [head]):
            rid = member.request_id if member is not None else request_id
            seq = None
            for scheduler in self.schedulers:
                seq = seq or scheduler.abort(rid)
            if self.drafter is not None:
                self.drafter.release(rid)
            if seq is not None:
                seq.status = SequenceStatus.FINISHED
                seq.finished_time = time.perf_counter()
            self._sequences.pop(rid, None)

    def is_request_finished(self, request_id: str) -> bool:
        """Every sample of the request has finished (a group ends when its last member does)."""
        seq = self._sequences[request_id]
        if seq.members and seq.is_finished and not seq.forked:
            for m in seq.members[1:]:        # ended before its first token: the samples with it
                if not m.is_finished:
                    m.finish_reason, m.status = seq.finish_reason, SequenceStatus.FINISHED
                    m.finished_time = seq.finished_time
        return seq.group_finished

    def has_unfinished_requests(self) -> bool:
        return bool(self._in_flight) or any(s.has_unfinished() for s in self.schedulers)

    def get_sequence(self, request_id: str) -> Sequence | None:
        return self._sequences.get(request_id)

    def pop_output(self, request_id: str) -> RequestOutput:
        """The finished request's output; the engine forgets the request (all its samples)."""
        seq = self._sequences.pop(request_id)
        for m in (seq.members or [])[1:]:
            self._sequences.pop(m.request_id, None)
        return self.output_processor.to_request_output(seq)

    # ----------------------------------------------------------------------------- the step
    def step(self) -> list[Sequence]:
        """Run one iteration; returns the sequences that were scheduled in it.

        A pipeline-parallel engine first fills the pipeline (every scheduler without a batch in
        flight posts one), then completes the oldest batch: a step still returns one batch's
        sequences, but up to pipeline_parallel_size batches are being computed at any time."""
        if self.executor is None:
            return self._step_local()
        for scheduler in self.schedulers:
            if any(f[0] is scheduler for f in self._in_flight):
                continue
            t0 = time.perf_counter()
            batch = scheduler.schedule()
            ops = self.blocks.take_ops()
            if batch.empty:
                self._release_finished(scheduler.free_finished())
                continue
            t1 = time.perf_counter()
            inputs = plan_step(batch, self.blocks, ops)
            t2 = time.perf_counter()
            n = self.executor.submit(inputs)
            self._in_flight.append((scheduler, batch, ops, n, (t0, t1, t1, t2)))
        if not self._in_flight:
            return []
        scheduler, batch, ops, n, (t0, t1, t_draft, t2) = self._in_flight.pop(0)
        out, stats, spans, sent, residual = self.executor.result(n)
        t3 = time.perf_counter()
        comm = {"comm": merge_stats(*stats), "comm_sent": merge_stats(*sent),
                "residual_bytes": residual, "stage_spans": spans, "micro_batch":
                self.schedulers.index(scheduler), "num_in_flight": len(self._in_flight) + 1}
        return self._complete(scheduler, batch, ops, out, (t0, t1, t_draft, t2, t3), comm)

    def _step_local(self) -> list[Sequence]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        ops = self.blocks.take_ops()
        if batch.empty:
            self.runner.apply_block_ops(ops)      # a tier's deletions may be pending
            self._release_finished(self.scheduler.free_finished())   # ended for length, if any
            return []
        t1 = time.perf_counter()
        self.runner.apply_block_ops(ops)
        if self.drafter is not None:
            self.drafter.apply_block_ops(ops)
            self._draft(batch)
        t_draft = time.perf_counter()
        inputs = plan_step(batch, self.blocks)
        packed = self.runner.pack(inputs.rows, inputs.tables)
        t2 = time.perf_counter()
        out = self.runner.execute(inputs, packed)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # else forward_s would time only the kernel launches
        t3 = time.perf_counter()
        return self._complete(self.scheduler, batch, ops, out, (t0, t1, t_draft, t2, t3), {})

    def _complete(self, scheduler, batch, ops, out, times, comm) -> list[Sequence]:
        """Sample from the forward's logits, append the tokens, free what finished, record."""
        t0, t1, t_draft, t2, t3 = times
        sampled = [batch.seqs[i] for i in out.sample_indices]
        logits, forked = self._fork_groups(scheduler, sampled, out.logits)
        sampled += forked
        emitted = self._sample(sampled, logits)
        t4 = time.perf_counter()
        spec, spec_tokens = [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if i in out.prompt_logprobs:
                self._extend_prompt_logprobs(seq, *out.prompt_logprobs[i])
            seq.num_computed_tokens += n
        for seq, (tokens, infos, accepted) in zip(sampled, emitted):
            if seq.is_finished:               # aborted while its batch was in the pipeline
                continue
            drafted = len(seq.spec_token_ids)
            if drafted:
                # The K/V of rejected drafts were written but are not the sequence's: forget them.
                seq.num_computed_tokens -= drafted - accepted
                self._record_speculation(seq, drafted, accepted)
                spec.append((seq.request_id, drafted, accepted))
                spec_tokens.append((seq.request_id, list(seq.spec_token_ids), list(tokens)))
            for token, info in zip(tokens, infos):
                if seq.grammar is not None and not seq.grammar.accept(token):
                    self.output_processor.finish(seq, "abort", None)   # the mask forbids this
                    break
                self.output_processor.append_token(seq, token, info)
                if seq.is_finished:
                    break
            if seq.num_lookahead:
                seq.spec_token_ids, seq.spec_probs = [], None
                if not seq.is_finished:    # the blocks of rejected (or never drafted) slots go back
                    self.blocks.trim(seq.request_id, seq.num_tokens)
                    if hasattr(self.drafter, "rollback"):
                        self.drafter.rollback(seq)
        if self.blocks.enable_prefix_caching:   # after the appends: accepted drafts are tokens now
            for seq in batch.seqs + forked:
                self.blocks.index_full_blocks(seq.request_id, seq.all_token_ids,
                                              min(seq.num_computed_tokens, seq.num_tokens))
        finished = scheduler.free_finished()
        self._release_finished(finished)
        t5 = time.perf_counter()
        scheduler.observe_step(t5 - t0, batch.num_decode_tokens, batch.num_prefill_tokens)
        pool = self.blocks.pool
        self.trace.append(StepRecord(
            step=len(self.trace), num_seqs=len(batch.seqs),
            num_prefill_tokens=batch.num_prefill_tokens,
            num_decode_tokens=batch.num_decode_tokens,
            num_waiting=sum(len(s.waiting) for s in self.schedulers),
            num_running=sum(len(s.running) for s in self.schedulers),
            kv_tokens_used=sum(q.num_computed_tokens for s in self.schedulers for q in s.running),
            blocks_used=pool.num_used, blocks_cached=pool.num_cached, blocks_free=pool.num_free,
            blocks_total=pool.num_blocks, block_size=self.blocks.block_size,
            num_preempted=len(batch.preempted), blocks_swapped_out=len(ops.swap_out),
            blocks_swapped_in=len(ops.swap_in), blocks_copied=len(ops.copy),
            prefix_hit_tokens=batch.prefix_hit_tokens,
            scheduled=[(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)],
            preempted=[s.request_id for s in batch.preempted],
            sampled=[s.request_id for s in sampled],
            finished=[s.request_id for s in finished],
            block_tables={r: list(t) for r, t in self.blocks.tables.items()}
            if self.config.record_block_tables else None,
            spec=spec, spec_tokens=spec_tokens, num_draft_tokens=sum(d for _, d, _ in spec),
            num_accepted_tokens=sum(a for _, _, a in spec),
            schedule_s=t1 - t0, draft_s=t_draft - t1, prepare_s=t2 - t_draft, forward_s=t3 - t2,
            sample_s=t4 - t3, postprocess_s=t5 - t4, total_s=t5 - t0,
            prefill_budget=scheduler.prefill_budget, **comm))
        return batch.seqs

    def _fork_groups(self, scheduler, sampled: list[Sequence], logits: torch.Tensor):
        """Groups sampling their first token: the other members share the prompt's blocks now
        and draw from the same logits row. Returns the logits with those rows appended, and the
        new members (they run from the next step on)."""
        rows, r, extra, forked = {}, 0, [], []
        for seq in sampled:
            rows[id(seq)] = r
            r += 1 + len(seq.spec_token_ids)
        for seq in sampled:
            if not seq.members or seq.forked:
                continue
            seq.forked = True
            for child in seq.members[1:]:
                self.blocks.fork(seq.request_id, child.request_id)
                child.num_computed_tokens = seq.num_prompt_tokens
                child.first_scheduled_time = seq.first_scheduled_time
                child.status = SequenceStatus.RUNNING
                scheduler.running.append(child)
                extra.append(rows[id(seq)])
                forked.append(child)
        if extra:
            logits = torch.cat([logits, logits[extra]])
        return logits, forked

    # ----------------------------------------------------------------------------- speculation
    def _draft(self, batch) -> None:
        """Ask the drafter for the drafts the scheduler made room for; a sequence may get fewer
        (n-gram found no match), and then feeds fewer tokens (its spare block goes back after
        verification)."""
        idx = [i for i, s in enumerate(batch.seqs) if s.num_lookahead > 0]
        if not idx:
            return
        seqs = [batch.seqs[i] for i in idx]
        drafts = self.drafter.propose(seqs, [s.num_lookahead for s in seqs],
                                      [self.blocks.tables[s.request_id] for s in seqs])
        for i, seq, d in zip(idx, seqs, drafts):
            seq.spec_token_ids, seq.spec_probs = d.token_ids, d.probs
            unused = seq.num_lookahead - len(d.token_ids)
            batch.num_new_tokens[i] -= unused
            batch.num_lookahead_tokens -= unused

    def _sample(self, sampled: list[Sequence], logits: torch.Tensor):
        """Per sampled sequence: (tokens to append, their logprob infos, drafts accepted). Plain
        sequences go through the sampler together; sequences with drafts are verified."""
        rows, r = [], 0
        for seq in sampled:
            rows.append(r)
            r += 1 + len(seq.spec_token_ids)
        results = [None] * len(sampled)
        plain = [j for j, s in enumerate(sampled) if not s.spec_token_ids]
        if plain:
            picked = [rows[j] for j in plain]
            # Without drafts the rows are already in order: indexing would copy every logit
            # (36 x 49152 fp32 = 7 MB a step at offline-mixed's mean batch) for nothing.
            in_order = picked == list(range(len(logits)))
            bitmask, masked = self._grammar_masks([sampled[j].grammar for j in plain])
            sample = self.sampler(logits if in_order else logits[picked],
                                  [sampled[j].params for j in plain],
                                  [sampled[j].generator for j in plain],
                                  [self._history(sampled[j]) for j in plain], bitmask, masked)
            for m, j in enumerate(plain):
                results[j] = ([sample.token_ids[m]], [sample.logprobs[m]], 0)
        for j, seq in enumerate(sampled):
            if results[j] is not None:
                continue
            k = len(seq.spec_token_ids)
            block = logits[rows[j]:rows[j] + k + 1]
            target = self._mask_drafts(seq, block) if seq.grammar is not None else block
            v = verify(target, seq.spec_token_ids, seq.spec_probs, seq.params,
                       seq.generator or self.sampler.generator)
            infos = [None] * len(v.token_ids)
            if seq.params.logprobs is not None:
                lps = torch.log_softmax(block, dim=-1).cpu()
                infos = [top_logprobs(lps[t], tok, seq.params.logprobs)
                         for t, tok in enumerate(v.token_ids)]
            results[j] = (v.token_ids, infos, v.num_accepted)
        return results

    def _grammar_masks(self, grammars: list) -> tuple[torch.Tensor | None, list[int]]:
        """One bitmask row per sampled row; filled for the rows whose request has a grammar."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None, []
        bitmask = self._grammar_compiler().allocate_bitmask(len(grammars))
        for i in rows:
            grammars[i].fill_bitmask(bitmask, i)
        return bitmask, rows

    def _mask_drafts(self, seq: Sequence, block: torch.Tensor) -> torch.Tensor:
        """The k + 1 target rows of a drafted sequence under its grammar: row i's mask is the
        grammar's after drafts 1..i, so the state walks the drafts and then rolls back. A draft
        the grammar refuses ends the walk: its row gives it probability 0, so verification
        rejects it there and never reads the rows after."""
        from ..structured.grammar import apply_bitmask
        bitmask = self._grammar_compiler().allocate_bitmask(block.shape[0])
        walked, rows = 0, []
        for i in range(block.shape[0]):
            seq.grammar.fill_bitmask(bitmask, i)
            rows.append(i)
            if i == len(seq.spec_token_ids) or not seq.grammar.accept(seq.spec_token_ids[i]):
                break
            walked += 1
        seq.grammar.rollback(walked)
        block = block.clone()
        apply_bitmask(block, bitmask, rows)
        return block

    @staticmethod
    def _history(seq: Sequence) -> History | None:
        if not seq.params.uses_history:
            return None
        return History(seq.prompt_token_ids, seq.output_token_ids, seq.min_tokens_stop_ids,
                       seq.bad_words_token_ids)

    @staticmethod
    def _record_speculation(seq: Sequence, drafted: int, accepted: int) -> None:
        seq.spec_steps += 1
        seq.spec_proposed += drafted
        seq.spec_accepted += accepted
        grow = drafted - len(seq.spec_proposed_at)
        if grow > 0:
            seq.spec_proposed_at += [0] * grow
            seq.spec_accepted_at += [0] * grow
        for p in range(drafted):
            seq.spec_proposed_at[p] += 1
            seq.spec_accepted_at[p] += p < accepted

    def _release_finished(self, finished: list[Sequence]) -> None:
        if self.drafter is not None:
            for seq in finished:
                self.drafter.release(seq.request_id)

    def _extend_prompt_logprobs(self, seq: Sequence, first: int, logprobs: torch.Tensor) -> None:
        n_top = seq.params.prompt_logprobs
        for k in range(logprobs.shape[0]):
            token = seq.prompt_token_ids[first + k + 1]
            info = top_logprobs(logprobs[k], token, n_top)
            seq.prompt_logprobs.append(self.output_processor.logprob_dict(token, info))
