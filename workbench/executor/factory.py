"""The executor an engine runs on: its own process, workers it spawns, or torchrun's processes."""
from __future__ import annotations

from pathlib import Path

from workbench.compress.checkpoint import is_pruned_checkpoint
from workbench.config import EnginePlan
from workbench.executor.distributed import DistributedExecutor, check_layout, worker_spec
from workbench.executor.launch import start_under_torchrun, torchrun_rank
from workbench.executor.uniproc import UniProcExecutor
from workbench.kv.block_manager import BlockManager


def make_executor(plan: EnginePlan, checkpoint: Path, args, tokenizer, blocks: BlockManager):
    """One process (the model built here), or one worker process per rank: spawned by the engine,
    or torchrun's own."""
    if plan.config.world_size == 1:
        return UniProcExecutor(plan, checkpoint, tokenizer, blocks)
    if is_pruned_checkpoint(checkpoint):
        # The workers load transformers-shaped layers (models/loader.py), one width and one head
        # count for all; a pruned folder's per-layer shapes need load_pruned.
        raise ValueError(f"model={plan.config.model!r} is a pruned checkpoint, and the parallel "
                         "engine loads unpruned ones: use one process")
    if torchrun_rank() is not None:
        return start_under_torchrun(plan, checkpoint, args)
    layout = check_layout(plan, args)
    spec = worker_spec(plan, checkpoint, layout)
    # Spawned CPU workers share this machine's memory: they load one at a time (worker.py).
    spec.staggered_load = plan.kernels.device.type == "cpu"
    return DistributedExecutor(spec, layout)
