"""Triton kernels of the workbench: one file per kernel family, each with its launcher and a
plain-PyTorch reference that is its specification.

The engine reaches kernels only through `workbench.attention.backends` (and, later, the quantized
linear layers), so every kernel can be switched off and compared with its reference in one place.
On CPU, the tests run the kernels through Triton's interpreter (`TRITON_INTERPRET=1`).

Name clash: Hugging Face publishes an unrelated package whose import name is also `kernels`;
transformers probes for it. See docs/kernels.md ("Our `kernels` and Hugging Face's").
"""
import os as _os

# Triton 3.9 warns until told whether to fuse multiply-adds: keep its current default (fused).
# The fused RMSNorm and rotary kernels round explicitly where the reference rounds, so fusion
# cannot change their results.
_os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
