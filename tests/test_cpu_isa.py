"""kernels/cpu on every instruction set this machine can execute, not only its best one.

The rest of the suite runs the build `best_isa()` picks. Here the kernel tests that check the
operators' numbers run again in a subprocess per lower build (`WORKBENCH_ISA=avx2`, ...), so an
AVX-512 machine also tests the AVX2 code that most laptops run and the portable code that ARM
builds, and the portable sources are compiled for aarch64 when a cross compiler is installed
(`./run test` installs Debian's)."""
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
# Tests of how the engine wires the operators in (which layers switch to them, which steps run
# fused, what the engine reports): no ISA changes that, so the best build's run covers them. The
# lower builds rerun every test that calls the operators and compares their numbers.
WIRING = ["test_quantized_engines_give_the_same_tokens_with_the_kernels",
          "test_fused_steps_give_the_unfused_tokens",
          "test_verifications_and_drafts_run_fused_with_the_plain_tokens",
          "test_speculative_decoding_runs_fused_and_unfused_steps_alike",
          "test_the_operator_runs_in_decode_only_steps_and_nowhere_else",
          "test_engine_tokens_and_logprobs_match_the_torch_backend",
          "test_the_engine_says_which_matmuls_it_runs", "test_auto_dtype_engine_says_what_it_stores",
          "test_num_parameters_counts_a_tied_head_once_whatever_copy_the_kernels_keep"]


def test_the_wiring_tests_left_to_the_best_build_exist():
    sources = "".join((ROOT / f).read_text() for f in KERNEL_TESTS)
    assert [name for name in WIRING if f"def {name}(" not in sources] == []


@pytest.mark.skipif(not available()[0], reason=f"kernels/cpu cannot build here: {available()[1]}")
@pytest.mark.parametrize("isa", LOWER)
def test_kernel_tests_pass_on_a_lower_instruction_set(isa):
    env = {**os.environ, "WORKBENCH_ISA": isa}
    # The torch.compile variants test how the operators enter a graph (their fake kernels), which
    # does not depend on the ISA either.
    skip = " and ".join(f"not {name}" for name in ["compiled", *WIRING])
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "-m", "not slow", "-k", skip, *KERNEL_TESTS], cwd=ROOT, env=env,
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
