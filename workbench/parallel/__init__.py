"""Parallelism on torch.distributed: tensor (tensor.py), pipeline (pipeline.py) and expert
(moe.py) parallel shards in worker processes (worker.py), driven over a TCPStore (executor.py),
launched by the engine or by torchrun (launch.py). Every collective is counted (comm.py)."""
from __future__ import annotations

import os

from .layout import Layout


def check_layout(config, args) -> Layout:
    """Model-dependent checks, in the driver, before any process starts."""
    from .pipeline import stage_layers
    from .tensor import check_tensor_parallel
    layout = Layout(config.tensor_parallel_size, config.pipeline_parallel_size,
                    config.expert_parallel_size)
    check_tensor_parallel(args, layout.tensor)
    stage_layers(args.num_hidden_layers, layout.pipeline)
    if config.moe_config is not None:
        e, k = config.moe_config["num_experts"], config.moe_config["top_k"]
        if args.intermediate_size % e:
            raise ValueError(f"moe_config['num_experts']={e} is invalid for this model: "
                             f"intermediate_size={args.intermediate_size} must split evenly")
        if k > e:
            raise ValueError(f"moe_config['top_k']={k} is invalid: it must be <= num_experts={e}")
        if e % layout.expert:
            raise ValueError(f"expert_parallel_size={layout.expert} is invalid: num_experts={e} "
                             "must split evenly over the ranks")
    if config.torch_device.type == "cuda":
        import torch
        if layout.world_size > torch.cuda.device_count():
            raise ValueError(f"{layout.describe()} is invalid here: there are only "
                             f"{torch.cuda.device_count()} CUDA devices (one per worker)")
    return layout


def worker_spec(config, checkpoint, layout: Layout):
    from .worker import WorkerSpec
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // layout.world_size)
    return WorkerSpec(
        checkpoint=str(checkpoint), dtype=str(config.torch_dtype).removeprefix("torch."),
        device=config.torch_device.type, max_model_len=config.max_model_len,
        num_kv_blocks=config.num_kv_blocks, block_size=config.block_size,
        num_cpu_blocks=config.num_cpu_blocks, kv_cache_dtype=config.kv_cache_dtype,
        attention_backend=config.attention_backend, tensor=layout.tensor,
        pipeline=layout.pipeline, expert=layout.expert, moe=config.moe_config,
        num_threads=threads, store_host="", store_port=0,
        sequence_parallel=config.sequence_parallel)


def start_workers(config, checkpoint, args):
    """Spawn one process per rank (the engine's own launch), or, under torchrun, use its."""
    from .executor import DistributedExecutor
    from .launch import start_under_torchrun, torchrun_rank
    if torchrun_rank() is not None:
        return start_under_torchrun(config, checkpoint, args)
    layout = check_layout(config, args)
    spec = worker_spec(config, checkpoint, layout)
    # Spawned CPU workers share this machine's memory: they load one at a time (worker.py).
    spec.staggered_load = config.torch_device.type == "cpu"
    return DistributedExecutor(spec, layout)
