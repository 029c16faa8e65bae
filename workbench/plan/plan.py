"""MemoryPlan: what `memory_plan` found, with a few readable lines."""
from __future__ import annotations

from dataclasses import dataclass

GB = 10**9


def gb(n: int | float) -> str:
    return f"{n / GB:,.1f} GB"


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes are plain integers. Per-GPU figures are those of the fullest pipeline stage (the most
    weights and the most layers' KV cache), so they bound every GPU of the deployment."""

    model: str
    source: str
    dtype: str
    weight_format: str | None
    kv_cache_dtype: str
    batch: int
    context: int
    tp: int
    pp: int
    ep: int
    num_gpus: int
    params_total: int
    params_active: int               # per token: routed experts counted experts_per_token times
    weight_bytes_total: int          # the whole model, once
    weight_bytes_per_gpu: int
    kv_bytes_per_token: int          # all layers, whole model
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_sequence: int       # one sequence of `context` tokens, whole model
    kv_bytes_batch: int              # `batch` such sequences, whole model
    kv_bytes_batch_per_gpu: int
    activation_bytes_per_gpu: int    # peak of one prefill chunk (see memory_plan)
    total_bytes_per_gpu: int         # weights + KV of the batch + activations
    gpu_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    kv_budget_bytes: int | None = None   # usable memory - weights - activations, at least 0
    max_sequences: int | None = None     # sequences of `context` tokens whose KV fits the budget
    reason: str | None = None            # why max_sequences is 0

    @property
    def kv_bytes_per_sequence_per_gpu(self) -> int:
        return self.kv_bytes_per_token_per_gpu * self.context

    def describe(self) -> str:
        layout = f"tp={self.tp} pp={self.pp} ep={self.ep}: {self.num_gpus} GPU(s)"
        weights = self.weight_format or self.dtype
        params = f"{self.params_total / 1e9:,.2f} B parameters"
        if self.params_active != self.params_total:
            params += f" ({self.params_active / 1e9:,.2f} B active per token)"
        lines = [
            f"{self.model} ({self.source}), {params}",
            f"weights ({weights}): {gb(self.weight_bytes_total)} in all, "
            f"{gb(self.weight_bytes_per_gpu)} per GPU at {layout}",
            f"KV cache ({self.kv_cache_dtype}): {self.kv_bytes_per_token:,} bytes per token, "
            f"{gb(self.kv_bytes_per_sequence)} per {self.context}-token sequence, "
            f"{gb(self.kv_bytes_batch_per_gpu)} per GPU for {self.batch} sequence(s)",
            f"activations: {gb(self.activation_bytes_per_gpu)} per GPU; "
            f"total {gb(self.total_bytes_per_gpu)} per GPU"]
        if self.gpu_memory_gb is not None:
            fit = (f"{self.max_sequences} sequence(s) of {self.context} tokens fit"
                   if not self.reason else f"0 sequences fit: {self.reason}")
            lines.append(f"on {self.gpu_memory_gb:g} GB GPUs at {self.gpu_memory_utilization:g}: "
                         f"KV budget {gb(self.kv_budget_bytes)} per GPU; {fit}")
        return "\n".join(lines)
