"""Round-to-nearest: every decoder projection of a model, and its INT8 or INT4 replacement with
scales from the weights alone (the baseline every calibrated method is measured against)."""
from __future__ import annotations

import torch
from torch import nn

from workbench.layers.formats import quantize_int4, quantize_int8
from workbench.layers.linear import Int4Linear, Int8Linear, QuantLinear
from workbench.models.llama import LlamaModel

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def projections(model: LlamaModel):
    """(name, parent module, attribute, nn.Linear) of every decoder projection."""
    for i, layer in enumerate(model.layers):
        for path in PROJECTIONS:
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            yield f"layers.{i}.{path}", owner, attr, getattr(owner, attr)


def rtn_layer(linear: nn.Linear, method: str, group_size: int, dtype: torch.dtype) -> QuantLinear:
    if method == "int8":
        return Int8Linear(quantize_int8(linear.weight.data), dtype)
    return Int4Linear(quantize_int4(linear.weight.data, group_size), dtype)


def quantize_lm_head(model: LlamaModel) -> None:
    model.lm_head = rtn_layer(model.lm_head, "int8", 0, model.lm_head.weight.dtype)
