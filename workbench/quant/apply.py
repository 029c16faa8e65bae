"""quantize_model: replace a loaded model's projections with quantized layers, by one method.

    model (bf16/fp32 nn.Linear weights)
      -> [calibration windows -> per-layer input statistics]      gptq, awq, smoothquant only
      -> per projection: a quantized weight (formats.py) by the method's rule
      -> Int8Linear / Int4Linear / W8A8Linear in place of nn.Linear (linear.py)

Every decoder projection is quantized (qkv_proj, o_proj, gate_up_proj, down_proj) and, unless
`quantize_lm_head=False`, the LM head too: at 49152 x 576 it is a fifth of SmolLM2's weights and
the largest single read of every decode step. The tied embedding table stays in the model's dtype
(a step reads one row of it). The LM head is INT8 (per channel, round-to-nearest) in every method:
on SmolLM2 an INT4 head adds clearly to the mean KL on held-out text while an INT8 head adds about
nothing over the bf16 one (`python -m workbench.bench quant --methods int4-g32 int4-g32-bf16head`
compares the INT8 head with the bf16 one), for half a byte more per head weight read per token
than INT4. GPTQ, AWQ and SmoothQuant treat the decoder layers, where their statistics come from.
"""
from __future__ import annotations

import torch

from workbench.config.quant import CALIBRATED, METHODS, QuantConfig  # noqa: F401 (re-exported)
from workbench.models.llama import LlamaModel
from workbench.quant.awq import quantize_awq
from workbench.quant.gptq import quantize_gptq
from workbench.quant.mixed import quantize_mixed
from workbench.quant.rtn import projections, quantize_lm_head, rtn_layer
from workbench.quant.smoothquant import quantize_smoothquant

@torch.no_grad()
def quantize_model(model: LlamaModel, cfg: QuantConfig, calibration: list[list[int]] | None = None
                   ) -> LlamaModel:
    """Quantize `model` in place by `cfg.method`; calibrated methods need token windows."""
    dtype = model.embed_tokens.weight.dtype
    if cfg.method in ("int8", "int4"):
        # Only (owner, name) pairs are listed up front, so each full-precision layer is freed as
        # soon as its quantized replacement is in place, not all of them at the end.
        for owner, attr in [(owner, attr) for _, owner, attr, _ in projections(model)]:
            setattr(owner, attr, rtn_layer(getattr(owner, attr), cfg.method, cfg.group_size, dtype))
    elif cfg.method == "mixed":    # its own errors name a missing calibration
        quantize_mixed(model, cfg, calibration)
    else:
        if not calibration:
            raise ValueError(f"quantization={cfg.method!r} needs calibration windows")
        if cfg.method == "gptq":
            quantize_gptq(model, cfg, calibration)
        elif cfg.method == "awq":
            quantize_awq(model, cfg, calibration)
        else:
            quantize_smoothquant(model, cfg, calibration)
    if cfg.quantize_lm_head:
        quantize_lm_head(model)
    return model
