"""python -m kernels.cpu: build the CPU kernels now (once per machine) and say whether they run."""
from . import describe

print(f"[kernels.cpu] {describe()}")
