"""The executor of a single-process engine: the model, its KV cache and its runner live here, and a
step runs as soon as it is submitted."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from workbench.attention import get_attention_backend
from workbench.config import EnginePlan, after_build
from workbench.executor.base import StepResult
from workbench.kv.block_manager import BlockManager
from workbench.kv.tier_store import TierStore
from workbench.worker.builder import build_kv_cache, build_model
from workbench.worker.model_runner import ModelRunner, StepInputs


class UniProcExecutor:
    def __init__(self, plan: EnginePlan, checkpoint: Path, tokenizer, blocks: BlockManager):
        """blocks: the driver's block manager, which holds the scratch block CUDA graphs pad
        with, so that no sequence is ever given it."""
        self.built = build_model(plan, checkpoint, tokenizer)
        self.plan = plan = after_build(plan, self.built.fused_decode_unsupported)
        config, k = plan.config, plan.kernels
        self.cache = build_kv_cache(self.built.args, plan)
        if config.cache_config.kv_tiers:
            self.cache.tier_store = TierStore(self.cache.kv_caches, config.block_size, k.device,
                                              plan.num_cpu_tier_blocks, config.kv_disk_tier_path)
        self.backend = get_attention_backend(k.attention_backend, k.device, config.batch_invariant)
        graphs = ({"max_num_seqs": config.max_num_seqs, "max_model_len": plan.max_model_len}
                  if config.cuda_graphs else None)
        self.runner = ModelRunner(self.built.model, self.cache, blocks, self.backend, k.device,
                                  compile=config.compile, fused_decode=k.fused_decode,
                                  cuda_graphs=graphs, freeze_weights=config.freeze_weights,
                                  row_invariant=config.batch_invariant and k.cpu_gemv)
        self._results: dict[int, StepResult] = {}
        self._next = 0

    @property
    def model(self):
        return self.built.model

    def apply_block_ops(self, ops) -> None:
        self.runner.apply_block_ops(ops)

    def submit(self, inputs: StepInputs) -> int:
        t0 = time.perf_counter()
        packed = self.runner.pack(inputs.rows, inputs.tables)
        pack_s = time.perf_counter() - t0
        out = self.runner.execute(inputs, packed)
        if self.plan.kernels.device.type == "cuda":
            torch.cuda.synchronize()  # else the step's time would count only the kernel launches
        n, self._next = self._next, self._next + 1
        self._results[n] = StepResult(out, pack_s)
        return n

    def result(self, n: int) -> StepResult:
        return self._results.pop(n)

    def close(self) -> None:
        """Stop the weight offload's prefetch thread and delete its files."""
        if self.built.offload is not None:
            self.built.offload.close()
            self.built.offload = None
