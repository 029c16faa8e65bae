"""Every kernel compiles for a Hopper GPU (sm_90) on this CPU-only machine, in the configurations
its launcher picks on a GPU: Triton's compiler and the ptxas inside its wheel need no GPU. This
catches what the interpreter cannot (compiler-only type errors, shared memory over the chip's
limit, register spills)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

PROGRAM = """
import json
from workbench.kernels.compile_check import compile_all
print(json.dumps([c.__dict__ for c in compile_all()]))
"""


def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    names = {c["name"] for c in compiled}
    assert names == {"flash_attention", "paged_decode_split", "paged_decode_merge", "rotary",
                     "rms_norm", "int8_weight_matmul", "int4_weight_matmul"}
    for c in compiled:
        assert c["shared_bytes"] <= 227 * 1024, c
        assert c["registers"] <= 255, c
        # The configurations the GPU targets are measured on must not spill: bf16 dense
        # FlashAttention at head_dim 64/128, paged decode, the pointwise and matmul kernels. The
        # varlen forms, head_dim 256 and fp32 are allowed some; see _tile_sizes.
        measured = not any(t in c["config"] for t in ("VARLEN=True", "HEAD_DIM=256", "ieee"))
        if measured:
            assert c["spill_bytes"] == 0, c
