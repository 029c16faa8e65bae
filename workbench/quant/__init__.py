"""Quantization methods, offline algorithms over a loaded model: round-to-nearest, GPTQ, AWQ,
SmoothQuant and mixed precision (apply.py dispatches), their calibration text (calibration.py),
the windowed forward they calibrate with (forward.py), quality measures (metrics.py), quantized
checkpoints (checkpoint.py) and reference quantizers for lessons (reference.py). The layers they
produce are runtime layers (workbench/layers/)."""
