"""python -m kernels.cpu: build the CPU kernels now (once per machine) and say whether they run."""
from . import available

ok, reason = available()
print("[kernels.cpu] AVX-512 kernels (GEMV, paged decode attention): " + ("built and loaded" if ok else f"not used ({reason})"))
