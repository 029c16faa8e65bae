"""python -m workbench.kernels.cpu: build the CPU kernels now (once per machine) and say whether they run."""
from . import describe

print(f"[workbench.kernels.cpu] {describe()}")
