"""The driver's side of a parallel engine: start the workers, post steps, collect outputs, and
notice a worker that died.

    LLM(tensor_parallel_size=2)          the notebook's process: scheduler, sampler, detokenizer
        │  TCPStore  "step/n" ──►  worker 0 ─┐ all-reduce ┌─ worker 1     (spawned processes)
        │            ◄── "out/n/stage"       └────────────┘
The driver never joins the process group, so a notebook kernel holds no distributed state and
can build and close engines freely. Under torchrun the workers are torchrun's processes instead
(workbench/executor/launch.py); everything after the store is the same.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workbench.config import EnginePlan
from workbench.executor.base import StepResult
from workbench.executor.worker import WorkerSpec, wait_key, worker_main
from workbench.net import free_port
from workbench.parallel.comm import merge_stats
from workbench.parallel.layout import Layout
from workbench.parallel.pipeline import stage_layers
from workbench.parallel.tensor import check_tensor_parallel


class WorkerDied(RuntimeError):
    pass


def _stop(store, next_step: int, procs) -> None:
    """Ask the workers to exit; kill the ones that do not within a few seconds."""
    try:
        store.set(f"step/{next_step}", pickle.dumps(("stop",)))
    except Exception:
        pass
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive() and hasattr(p, "kill"):   # a process; rank 0's thread under torchrun
            p.kill()                               # has been asked to stop and is a daemon
            p.join(1)


MAIN_GUARD_HINT = (
    "Worker processes start by importing your __main__ module. In a script, build a parallel "
    "LLM under a main guard:\n\n    if __name__ == \"__main__\":\n        llm = LLM(tensor_parallel_size=2)\n"
    "        ...\n\n(notebooks and the Python prompt need nothing).")


def refuse_start_while_bootstrapping() -> None:
    """In a worker that is still importing the parent's __main__ (a script without a main guard
    building a parallel LLM at top level), say so instead of multiprocessing's bootstrapping
    error, which names nothing of ours (vLLM does the same)."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError("LLM(...) with parallel workers was called while a worker process was "
                           "importing the script that started it.\n" + MAIN_GUARD_HINT)


class DistributedExecutor:
    """Posts StepInputs to the workers and returns their outputs, in order."""

    def __init__(self, spec: WorkerSpec, layout, store=None, procs=None, start_timeout: float = 600):
        self.layout, self.spec, self.plan = layout, spec, spec.plan
        self.next_step = 0
        self._pending_ops: list = []
        self.procs = procs or []
        if store is None:
            spec.store_host, spec.store_port = "127.0.0.1", free_port()
            store = dist.TCPStore(spec.store_host, spec.store_port, None, True,
                                  timeout=timedelta(seconds=60), wait_for_workers=False)
            refuse_start_while_bootstrapping()
            ctx = mp.get_context("spawn")      # fork would copy the notebook's threads and state
            self.procs = [ctx.Process(target=worker_main, args=(spec, r, os.getpid()),
                                      daemon=True, name=f"workbench-worker-{r}")
                          for r in range(layout.world_size)]
            for p in self.procs:
                p.start()
        self.store = store
        self._finalizer = weakref.finalize(self, _stop, store, 0, self.procs)
        self._wait_ready(start_timeout)

    # ------------------------------------------------------------------ liveness
    def _check_workers(self) -> None:
        for r, p in enumerate(self.procs):
            if not p.is_alive():
                self.close()
                raise WorkerDied(f"worker rank {r} ({p.name}) died with exit code "
                                 f"{getattr(p, 'exitcode', None)}; "
                                 "the engine is closed and its requests are lost: build a new LLM")

    def _raise_posted_error(self) -> None:
        for r in range(self.layout.world_size):
            if self.store.check([f"error/{r}"]):
                kind, msg, trace = pickle.loads(self.store.get(f"error/{r}"))
                self.close()
                if kind == "ValueError":
                    raise ValueError(f"worker rank {r}: {msg}")
                raise WorkerDied(f"worker rank {r} failed with {kind}: {msg}; the engine is "
                                 f"closed.\nThe worker's traceback:\n{trace}")

    def _wait(self, key: str, timeout: float | None = None) -> bytes:
        start, last_check = time.monotonic(), 0.0

        def healthy() -> bool:
            nonlocal last_check
            now = time.monotonic()
            if now - last_check > 0.2:          # a dead worker is noticed within 0.2 s
                last_check = now
                self._raise_posted_error()
                self._check_workers()
                if timeout is not None and now - start > timeout:
                    self.close()
                    raise WorkerDied(f"the workers did not answer {key!r} in {timeout:.0f} s")
            return True

        wait_key(self.store, key, healthy, max_sleep=0.005)
        return self.store.get(key)

    def _wait_ready(self, timeout: float) -> None:
        try:
            for r in range(self.layout.world_size):
                self._wait(f"ready/{r}", timeout)
        except WorkerDied as e:
            raise WorkerDied(f"{e}\n{MAIN_GUARD_HINT}") from None

    # ------------------------------------------------------------------ steps
    def apply_block_ops(self, ops) -> None:
        """Block copies to make before anything else: they go with the next step posted."""
        if ops:
            self._pending_ops.append(ops)

    def submit(self, step) -> int:
        """Post a step; returns its number. Does not wait: pipeline stages overlap."""
        if self._pending_ops:
            step = dataclasses.replace(step, ops=self._pending_ops + step.ops)
            self._pending_ops = []
        n = self.next_step
        self.store.set(f"step/{n}", pickle.dumps(("step", step)))
        self.next_step += 1
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, self.store, self.next_step, self.procs)
        return n

    def result(self, n: int) -> StepResult:
        """Step n's logits rows (from the last stage) and, per stage: communication counts,
        (start, end) of its first rank on time.monotonic's clock, the bytes it sent per
        collective as (algorithm, ring ideal), and its residual-stream bytes."""
        stats, spans, sent, residual, out = [], [], [], [], None
        for stage in range(self.layout.pipeline):
            key = f"out/{n}/{stage}"
            o, s, b, w, r = pickle.loads(self._wait(key))
            self.store.delete_key(key)
            stats.append(s)
            spans.append(b)
            sent.append(w)
            residual.append(r)
            if o is not None:
                out = o
        self.store.delete_key(f"step/{n}")
        return StepResult(out, comm={"comm": merge_stats(*stats), "comm_sent": merge_stats(*sent),
                                     "residual_bytes": residual, "stage_spans": spans})

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


def check_layout(plan: EnginePlan, args) -> Layout:
    """Model-dependent checks, in the driver, before any process starts."""
    config = plan.config
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
    if plan.kernels.device.type == "cuda" and layout.world_size > torch.cuda.device_count():
        raise ValueError(f"{layout.describe()} is invalid here: there are only "
                         f"{torch.cuda.device_count()} CUDA devices (one per worker)")
    return layout


def worker_spec(plan: EnginePlan, checkpoint, layout: Layout) -> WorkerSpec:
    threads = plan.config.num_threads or max(1, (os.cpu_count() or 1) // layout.world_size)
    return WorkerSpec(checkpoint=str(checkpoint), plan=plan, num_threads=threads,
                      store_host="", store_port=0)
