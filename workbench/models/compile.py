"""The model's forward under torch.compile, with attention left opaque (vLLM's design, in small).

Why: at batch 1 on a CPU, a decode step of a 135M model launches about 1,500 small PyTorch
operations (each RMSNorm alone is eight), and their dispatch costs more than the arithmetic.
torch.compile (TorchInductor) traces the forward once and generates fused C++ (or Triton) kernels
for every run of pointwise operations between the matmuls: residual add + RMSNorm becomes one
kernel, rotary of q and k one, SiLU x up one.

What cannot be traced well is attention over the paged cache: its shapes (context length, block
tables, how sequences group) change every step, and it writes into the cache. So attention is a
custom operator, `torch.ops.workbench.attention(q, k, v, layer)`, that the compiler sees as one
opaque call returning a tensor of known shape. At run time it reads the step's metadata (cache,
block tables, backend) from a context the runner sets around the call: vLLM's
`unified_attention` + forward context, which is how vLLM compiles the rest of the model.

The compiled graph then depends only on the number of tokens in the step, which is marked dynamic,
so one compilation serves every batch size and prefill length. The pointwise arithmetic is the
same as the eager reference (RMSNorm in fp32, cast where transformers casts), but fused kernels may
sum in another order, so compiled outputs match eager to rounding, not always bit for bit.
"""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import torch

from workbench.config import onednn_bf16_prepack_reason
from workbench.layers.ops import TorchOps


@dataclass
class _Step:
    kv_caches: list
    meta: object
    backend: object
    scale: float


_step: _Step | None = None


@contextlib.contextmanager
def attention_context(kv_caches, meta, backend, scale: float):
    """Make this step's cache, metadata and backend visible to torch.ops.workbench.attention."""
    global _step
    previous, _step = _step, _Step(kv_caches, meta, backend, scale)
    try:
        yield
    finally:
        _step = previous


# Defined with torch.library.Library rather than the @custom_op decorator: the decorator wraps
# every call in Python code of its own, and this op runs once per layer per step (30 calls in a
# SmolLM2 decode step), so that cost is paid 30 times a token (`python -m workbench.course.report
# notebooks/01_anatomy_of_speed.ipynb` times the compiled step).
_lib = torch.library.Library("workbench", "DEF")
_lib.define("attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Write k, v into layer `layer`'s cache and attend q to it, through the step's backend.
    (The cache write is a side effect on state the graph does not hold; the graph only needs
    the output.)"""
    if _step is None:
        raise RuntimeError("torch.ops.workbench.attention called outside attention_context()")
    k_cache, v_cache = _step.kv_caches[layer]
    return _step.backend.forward(q, k, v, k_cache, v_cache, _step.meta.for_layer(layer),
                                 _step.scale)


_lib.impl("attention", attention, "CompositeExplicitAutograd")


@torch.library.register_fake("workbench::attention")
def _(q, k, v, layer):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


# The guards Dynamo checks before every call of the compiled forward. By default it guards
# everything the trace read: for SmolLM2 thousands of checks on the model object (every module,
# parameter, hook dict and attribute) and on the globals the forward calls, run before every
# decode step (TORCH_LOGS=guards lists them; torch.profiler shows their time). The engine never
# changes the model after building it, so those checks cannot fail; vLLM drops them for the same
# reason. Kept: the checks that choose between compiled graphs, on the two inputs (dtype, and
# the token count, since Dynamo compiles a 1-token graph apart from the dynamic one) and the
# symbolic-shape conditions, plus the global state the graph was traced under (grad mode,
# default device). Without the input checks a 32-token prefill would run the 1-token graph; with
# them, it recompiles instead. The price: a model edited after the engine is built (a
# layer swapped, a weight replaced by another tensor) is not re-traced. A weight of another shape
# still fails loudly, in the size asserts the compiled code runs on its inputs. The gain is in
# decode tok/s of a compiled engine (`python -m workbench.course.report
# notebooks/01_anatomy_of_speed.ipynb` times its compiled rows).
_KEPT_GUARD_TYPES = {"SHAPE_ENV", "GRAD_MODE", "GLOBAL_STATE", "DEFAULT_DEVICE",
                     "TORCH_FUNCTION_STATE"}
_INPUTS = ("input_ids", "positions")      # the compiled forward's arguments


def keep_guards(entries) -> list[bool]:
    """guard_filter_fn for torch.compile: True for each guard to keep (see above)."""
    return [e.guard_type in _KEPT_GUARD_TYPES
            or (e.guard_type == "TENSOR_MATCH" and e.name in _INPUTS) for e in entries]


class CompiledForward:
    """A drop-in for `LlamaModel.__call__` in the runner: same arguments, same result."""

    def __init__(self, model, freeze: bool = False):
        self.model = model
        self.scale = model.layers[0].self_attn.scale
        # INT4 layers repack their weights for aten's CPU kernel on first use; do it now, so the
        # compiler traces a plain read of the packed weights rather than the repacking.
        dtype = model.embed_tokens.weight.dtype
        for m in model.modules():
            if hasattr(m, "_aten_pack") and m.packed.device.type == "cpu" and m.out_features % 16 == 0:
                m._aten_pack(dtype)
        # Dynamo keeps its compiled graphs on the function's code object, and allows 8 per code
        # object. All engines share `_forward`'s code, so a process that builds several compiled
        # engines (the test suite, a chapter comparing rows) would pile their graphs onto one
        # object and, past 8, fail (fullgraph=True). A private copy of the code per engine keeps
        # each engine's graphs (and the guards checked before every step) to its own.
        code = CompiledForward._forward.__code__.replace(co_name=f"_forward_{id(self):x}")
        forward = types.FunctionType(code, CompiledForward._forward.__globals__, code.co_name)
        # specialize_float: with dynamic=True Dynamo would also make every Python float it reads a
        # symbolic input, here the 61 RMSNorm eps values. Each one then costs a check in a Python
        # guard function before every step and a runtime argument of the fused kernels. They never
        # change, so they are compiled in as constants, which saves that Python work on every
        # decode step (chapter 01's report times compiled decode: `python -m
        # workbench.course.report notebooks/01_anatomy_of_speed.ipynb`).
        # freeze: Inductor's freezing. The weights become constants of the compiled code, and on
        # CPU every linear layer becomes mkldnn::_linear_pointwise over a weight prepacked once
        # into oneDNN's blocked layout. Unfrozen, aten::mm hands oneDNN the plain row-major
        # weight, which it may reorder on every call: more passes over the weights, on the
        # batched decode steps of offline-mixed most (`python -m workbench.bench floor` times
        # aten's linear against the prepacked one on the model's shapes). The price: the packed
        # copy is a second copy of the weights (the model's weight bytes again in RSS),
        # since the layer-skip drafter's eager forward and later compilations (the one-token graph
        # is compiled at the first decode step) read the originals.
        # (Set around the call, where compilation happens: passed in torch.compile's options it
        # does not take effect, torch 2.13.)
        compiled = torch.compile(types.MethodType(forward, self), dynamic=True, fullgraph=True,
                                 options={"guard_filter_fn": keep_guards})
        self._compiled = torch._dynamo.config.patch(specialize_float=True)(compiled)
        if freeze:
            self._compiled = torch._inductor.config.patch(freezing=True)(self._compiled)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        m, ops = self.model, TorchOps
        x = m.embed_tokens(input_ids)
        rope = ops.rope_inputs(m.rotary, positions, x.dtype)
        residual = None
        for i, layer in enumerate(m.layers):
            q, k, v, residual = layer.pre_attention(x, residual, rope, ops)
            attn = torch.ops.workbench.attention(q, k, v, i)
            x, residual = layer.post_attention(attn, residual, ops)
        return ops.rms_norm(x, m.norm.weight, m.norm.eps, residual)[0]

    def __call__(self, input_ids, positions, kv_caches, meta, backend, num_layers=None):
        if num_layers is not None:          # the layer-skip drafter's early exit: eager
            return self.model(input_ids, positions, kv_caches, meta, backend, num_layers)
        with attention_context(kv_caches, meta, backend, self.scale):
            return self._compiled(input_ids, positions)


class PrepackedLMHead:
    """The LM head as one oneDNN matmul over a weight reordered once into oneDNN's blocked layout
    (what freezing does to every linear layer inside the compiled graph). The head runs outside
    that graph, on only the rows that are sampled, so freezing alone leaves it on aten::mm, which
    hands oneDNN the row-major weight on every call. SmolLM2's head is 49152 x 576, a fifth of a
    decode step's multiply-adds, and the reorder saved on every call is a pass over all of it
    (`python -m workbench.bench floor` times aten's linear against the prepacked one on the
    model's shapes, the head included); the logits are bit-identical (oneDNN computes both).
    Costs a second copy of the weight (49152 x 576 x 2 bytes in bf16; the embedding keeps
    reading the original)."""

    def __init__(self, weight: torch.Tensor):
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32, as LlamaModel.compute_logits returns them."""
        if hidden.shape[0] == 0:
            return hidden.new_empty(0, self.out_features, dtype=torch.float32)
        return torch.ops.mkldnn._linear_pointwise(hidden, self.packed, None, "none", [],
                                                  "").float()

    @staticmethod
    def applies(model) -> bool:
        """A plain (unquantized) bf16 head on a CPU whose torch has oneDNN. (fp32 heads stay on
        aten: there torch's own GEMM differs from oneDNN's in rounding at some row counts, and
        the gain was measured for bf16 only.)"""
        w = getattr(model.lm_head, "weight", None)
        return (isinstance(model.lm_head, torch.nn.Linear) and w is not None
                and w.device.type == "cpu" and w.dtype == torch.bfloat16
                and torch.backends.mkldnn.is_available() and onednn_bf16_prepack_reason() is None)
