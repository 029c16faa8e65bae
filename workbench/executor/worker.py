"""One worker process of a parallel engine: a shard of the model, its share of the KV cache, and a
loop that runs the steps the driver posts.

Control plane: a torch.distributed TCPStore. The driver writes step n's StepInputs under
"step/{n}"; every worker reads it; the first rank of each stage writes "out/{n}/{stage}" (the last
stage's logits rows, and every stage's communication counts). The store is torch's own
rendezvous service, so the same code runs in processes the engine spawned and under torchrun.
Data plane: process groups (gloo on CPU, NCCL on CUDA) for all-reduce, send/recv, all-to-all.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from workbench.attention import get_attention_backend
from workbench.config import EnginePlan
from workbench.memory import release_memory
from workbench.models.loader import load_model, read_args
from workbench.parallel.comm import Comm, merge_stats
from workbench.parallel.layout import Layout
from workbench.parallel.moe import ExpertParallelMoE, MoEMLP
from workbench.parallel.pipeline import Stage, stage_layers
from workbench.parallel.sequence import TokenSplit, sequence_parallel_layer
from workbench.parallel.tensor import check_tensor_parallel, shard_layer, shard_vocabulary
from workbench.worker.builder import build_kv_cache
from workbench.worker.model_runner import ModelRunner


def wait_key(store, key: str, still_ok=lambda: True, max_sleep: float = 0.02) -> bool:
    """Poll until the key exists (store.wait with a timeout would log a C++ warning per
    timeout). Sleeps grow from 0.1 ms, so a step posted right away is seen right away. Returns
    False when still_ok() turns False."""
    sleep = 1e-4
    while not store.check([key]):
        if not still_ok():
            return False
        time.sleep(sleep)
        sleep = min(sleep * 2, max_sleep)
    return True


@dataclasses.dataclass
class WorkerSpec:
    """What a worker needs to build its shard (picklable, sent to spawned processes)."""
    checkpoint: str
    plan: EnginePlan                  # dtype, device, context, KV pool, backend, experts, SP
    num_threads: int
    store_host: str
    store_port: int
    collective_timeout_s: float = 120.0
    staggered_load: bool = False      # one rank loads at a time (processes spawned on one machine)

    @property
    def layout(self) -> Layout:
        c = self.plan.config
        return Layout(c.tensor_parallel_size, c.pipeline_parallel_size, c.expert_parallel_size)


def _groups(layout, rank: int):
    """Every rank creates every group, in the same order (torch.distributed requires it)."""
    mine = None
    for stage in range(layout.pipeline):
        ranks = layout.stage_ranks(stage)
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = Comm(group, ranks)
    return mine, Comm(None, list(range(layout.world_size)))


@contextlib.contextmanager
def _one_load_at_a_time(store, rank: int, staggered: bool):
    """Workers spawned on one machine load one after another: each first reads the whole
    checkpoint and then keeps its shard, so loading together would need world_size full copies of
    the model at once (the Binder budget of chapter 07). Rank r waits for rank r - 1's key."""
    if staggered and store is not None and rank > 0:
        wait_key(store, f"loaded/{rank - 1}")
    try:
        yield
    finally:
        if staggered and store is not None:
            store.set(f"loaded/{rank}", b"1")


def build_shard(spec: WorkerSpec, rank: int, device: torch.device, store=None):
    """Load the checkpoint, keep this rank's part, allocate its KV cache."""
    plan, layout = spec.plan, spec.layout
    config, k = plan.config, plan.kernels
    group_comm, world_comm = _groups(layout, rank)
    layer_args = read_args(Path(spec.checkpoint))
    if layout.tensor > 1:
        check_tensor_parallel(layer_args, layout.tensor)
    split = TokenSplit(group_comm) if config.sequence_parallel else None
    moe = config.moe_config
    with _one_load_at_a_time(store, rank, spec.staggered_load):
        tp_rank = layout.group_rank(rank)

        def prepare_layer(i, layer):
            """This rank's part of one layer, made as soon as the layer is loaded, so that the
            whole model is never in memory: experts cut, then kept, or tensor slices kept."""
            if moe:
                layer.mlp = MoEMLP(layer.mlp, moe["num_experts"], moe["top_k"])
            if layout.tensor > 1:
                shard_layer(layer, layer_args, tp_rank, layout.tensor, group_comm)
            if split is not None:
                sequence_parallel_layer(layer, split)
            if layout.expert > 1:
                layer.mlp = ExpertParallelMoE(layer.mlp, group_comm)

        model = load_model(Path(spec.checkpoint), k.dtype, device, plan.max_model_len,
                           on_layer=prepare_layer)
        if layout.tensor > 1:
            shard_vocabulary(model, tp_rank, layout.tensor, group_comm)
            model.embed_tokens.split = split
        s = layout.stage_of(rank)
        layers = stage_layers(model.args.num_hidden_layers, layout.pipeline)[s]
        stage = Stage(model, layers, s, layout.pipeline, world_comm,
                      layout.peer(rank, s - 1) if s > 0 else None,
                      layout.peer(rank, s + 1) if s < layout.pipeline - 1 else None, split)
        release_memory()        # the full-size tensors and other stages' layers just dropped
    local_args = dataclasses.replace(
        model.args, num_hidden_layers=len(layers),
        num_key_value_heads=model.args.num_key_value_heads // layout.tensor)
    cache = build_kv_cache(local_args, plan, device)
    runner = ModelRunner(model, cache, None, get_attention_backend(k.attention_backend, device),
                         device)
    return layout, stage, runner, [group_comm, world_comm]


def run_step(stage, runner, step):
    """One micro-batch through this rank's stage; the logits rows on the last stage."""
    for ops in step.ops:
        runner.cache.apply(ops)
    ids, positions, meta = runner.pack(step.rows, step.tables)
    hidden = stage.forward(ids, positions, runner.cache.kv_caches, meta, runner.backend)
    return runner.logits(hidden, step) if stage.last else None


def serve(spec: WorkerSpec, rank: int, store, device: torch.device, parent_pid: int | None):
    """Build the shard, then run steps until "stop". Errors are posted for the driver to raise."""
    try:
        layout, stage, runner, comms = build_shard(spec, rank, device, store)
    except Exception as err:          # a bad layout or checkpoint: the driver raises it
        _post_error(store, rank, err)
        return
    store.set(f"ready/{rank}", b"1")
    try:
        _loop(spec, rank, store, device, parent_pid, layout, stage, runner, comms)
    except Exception as err:          # a failed step: the driver raises it instead of waiting
        _post_error(store, rank, err)
        raise


def _post_error(store, rank: int, err: Exception) -> None:
    store.set(f"error/{rank}", pickle.dumps((type(err).__name__, str(err),
                                             traceback.format_exc())))


def _loop(spec, rank, store, device, parent_pid, layout, stage, runner, comms) -> None:
    reports = layout.group_rank(rank) == 0
    n = 0
    while True:
        key = f"step/{n}"
        try:
            if not wait_key(store, key, lambda: parent_pid is None or os.getppid() == parent_pid):
                return                # the driver's process is gone
        except Exception:             # the store is gone with it
            return
        msg = pickle.loads(store.get(key))
        if msg[0] == "stop":
            return
        with torch.inference_mode():
            out = run_step(stage, runner, msg[1])
        if device.type == "cuda":
            torch.cuda.synchronize()
        # From the moment the stage had its inputs (a later stage first waits in recv for the
        # previous one: idle, not work) to its end. time.monotonic is CLOCK_MONOTONIC on Linux,
        # one clock for every process of a machine, so the driver can draw all stages together.
        span = (stage.work_start, time.monotonic())
        stats = merge_stats(*(c.take_stats() for c in comms if c is not None))
        sent = merge_stats(*(c.take_sent() for c in comms if c is not None))
        if reports:
            store.set(f"out/{n}/{stage.index}",
                      pickle.dumps((out, stats, span, sent, stage.residual_bytes)))
        n += 1


def connect(spec: WorkerSpec, rank: int, world_size: int, store=None):
    """Join the driver's store (or torchrun's) and the process group."""
    if store is None:
        store = dist.TCPStore(spec.store_host, spec.store_port, None, False,
                              timeout=timedelta(seconds=60))
    if spec.plan.kernels.device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world_size,
                            timeout=timedelta(seconds=spec.collective_timeout_s))
    return store, device


def worker_main(spec: WorkerSpec, rank: int, parent_pid: int) -> None:
    """Entry point of a process the engine spawned."""
    torch.set_num_threads(spec.num_threads)
    store, device = connect(spec, rank, spec.layout.world_size)
    try:
        serve(spec, rank, store, device, parent_pid)
    finally:
        dist.destroy_process_group()
