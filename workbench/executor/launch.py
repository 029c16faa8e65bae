"""Running under torchrun, on one machine or several:

    torchrun --nproc-per-node 2 -m workbench generate "Hello" --tensor-parallel-size 2
    # two machines, one pipeline stage each (run on both, node-rank 0 and 1):
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr HOST0 --master-port 29500 \
        -m workbench generate "Hello" --pipeline-parallel-size 2

Every torchrun process runs the same command. Rank 0 builds the LLM (the driver: scheduler,
sampler, detokenizer), posts the workers' WorkerSpec in torchrun's own store, and runs its own
worker in a thread; every other rank only serves steps. The rest is the spawned path's code.
"""
from __future__ import annotations

import os
import pickle
import threading

import torch.distributed as dist

from workbench.executor.distributed import DistributedExecutor, check_layout, worker_spec
from workbench.executor.worker import connect, serve, wait_key


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _store():
    """A client of torchrun's store (MASTER_ADDR:MASTER_PORT), under our own key prefix."""
    from datetime import timedelta
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                         timeout=timedelta(seconds=300))
    return dist.PrefixStore("workbench", base)


def start_under_torchrun(plan, checkpoint, args):
    """Rank 0: publish the spec, start this rank's worker in a thread, return the executor."""
    rank, world = torchrun_rank()
    layout = check_layout(plan, args)
    if layout.world_size != world:
        raise ValueError(f"{layout.describe()} needs {layout.world_size} processes, but torchrun "
                         f"started {world}: set --nproc-per-node x --nnodes to {layout.world_size}")
    store = _store()
    spec = worker_spec(plan, checkpoint, layout)
    store.set("spec", pickle.dumps(spec))

    def own_worker():
        _, device = connect(spec, 0, world, store=store)
        try:
            serve(spec, 0, store, device, parent_pid=None)
        finally:
            dist.destroy_process_group()

    thread = threading.Thread(target=own_worker, name="workbench-worker-0", daemon=True)
    thread.start()
    return DistributedExecutor(spec, layout, store=store, procs=[thread])


def serve_rank() -> int:
    """Ranks other than 0: wait for rank 0's spec, then serve steps until it says stop."""
    rank, world = torchrun_rank()
    store = _store()
    wait_key(store, "spec", max_sleep=0.1)
    spec = pickle.loads(store.get("spec"))
    _, device = connect(spec, rank, world, store=store)
    try:
        serve(spec, rank, store, device, parent_pid=None)
    finally:
        dist.destroy_process_group()
    return 0
