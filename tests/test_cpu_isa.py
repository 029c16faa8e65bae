"""kernels/cpu on every instruction set this machine can execute, not only its best one.

The rest of the suite runs the build `best_isa()` picks. Here the kernel tests run again in a
subprocess per lower build (`WORKBENCH_ISA=avx2`, ...), so an AVX-512 machine also tests the AVX2
code that most laptops run and the portable code that ARM builds, and the portable sources are
compiled for aarch64 when a cross compiler is installed (`./run test` installs Debian's)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.kernels.cpu import ISA_FLAGS, SOURCES, available, best_isa, runnable_isas

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TESTS = ["tests/test_cpu_kernels.py", "tests/test_cpu_attention.py", "tests/test_fused_decode.py"]
LOWER = [isa for isa in runnable_isas() if isa != best_isa()]


@pytest.mark.skipif(not available()[0], reason=f"kernels/cpu cannot build here: {available()[1]}")
@pytest.mark.parametrize("isa", LOWER)
def test_kernel_tests_pass_on_a_lower_instruction_set(isa):
    env = {**os.environ, "WORKBENCH_ISA": isa}
    # The torch.compile variants test how the operators enter a graph (their fake kernels), which
    # does not depend on the ISA: the best build's run of the same files covers them.
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "-m", "not slow", "-k", "not compiled", *KERNEL_TESTS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1], done.stdout[-500:]


CROSS = shutil.which("aarch64-linux-gnu-g++")


@pytest.mark.skipif(CROSS is None, reason="no aarch64 cross compiler (apt-get install "
                    "g++-aarch64-linux-gnu; ./run test installs it as root)")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_portable_build_compiles_for_arm(source):
    from torch.utils.cpp_extension import include_paths
    includes = [f"-I{p}" for p in include_paths()]
    cmd = [CROSS, "-std=c++17", "-fsyntax-only", "-O2", "-march=armv8.2-a+bf16", *includes,
           *ISA_FLAGS["default"][1], str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, " ".join(cmd) + "\n" + done.stderr[-4000:]
