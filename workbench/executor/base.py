"""The executor's contract: what the engine core asks of whatever runs the model.

    apply_block_ops(ops)    block copies that must happen now (before a drafter reads the cache)
    submit(inputs) -> n     post one step's StepInputs; a pipeline keeps several in flight
    result(n)               that step's StepResult, in submission order
    close()                 release processes, threads and files
"""
from __future__ import annotations

from dataclasses import dataclass, field

from workbench.worker.model_runner import ForwardOutput


@dataclass
class StepResult:
    output: ForwardOutput
    pack_s: float = 0.0                 # seconds spent packing the inputs into tensors (in-process)
    comm: dict = field(default_factory=dict)   # parallel engines: collectives, stage spans, ...
