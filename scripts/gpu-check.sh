#!/usr/bin/env bash
# The GPU check, `make gpu-check PYTHON=python3`: torchspeed run from this checkout by an interpreter that has
# its own torch and reaches no package index (the lent GPU machine, a cluster node), its CUDA tests and
# a quick report run there. Everything goes to one folder ($GPU_OUT, default gpu-check/): verdict.txt,
# install.log, info.txt, pytest-gpu.log, plan-memory.md, bench.log and report/. The missing wheels come from .whl/
# (`make gpu-wheels` on a machine with an index). Exit status: 0 when the tests passed and the report was written.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
OUT=${GPU_OUT:-gpu-check}
TEST_S=${GPU_TEST_S:-200}     # the CUDA tests, at most (64-93 s on an H200; a torchrun hang is cut at 180 s)
BENCH_S=${GPU_BENCH_S:-300}   # the quick report, at most: 4.2 min on a bare H200 machine (each suite: TORCHSPEED_BENCH_BUDGET_S)
SITE="$PWD/.gpu-site"  # the wheels it installs; the interpreter's own environment is left as it is
rm -rf "$OUT" && mkdir -p "$OUT"
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.whl" PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
say() { echo "gpu-check: $*" | tee -a "$OUT/verdict.txt"; }

# 1. The interpreter's own packages are used (its torch, torchvision, ...), never replaced; what this check
#    adds goes to .gpu-site/ and this checkout, both on PYTHONPATH.
"$PY" -c 'import torch' 2>/dev/null || { say "FAILED: $PY has no torch; name the Python that holds PyTorch: make gpu-check PYTHON=..."; exit 1; }
rm -rf "$SITE" && mkdir -p "$SITE"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
V="$PY"
say "$("$V" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__} (the interpreter'"'"'s own)")')"

# 2. torchspeed from this checkout; its crop renderer compiled for this interpreter where a C compiler exists.
"$V" -c 'import torchspeed' || { say "FAILED: torchspeed does not import from this checkout"; exit 1; }
suffix=$("$V" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
if [ -f "torchspeed/data/_crops$suffix" ] || cc -O3 -ffp-contract=off -shared -fPIC torchspeed/data/_crops.c \
        -o "torchspeed/data/_crops$suffix" >>"$OUT/install.log" 2>&1; then
    say "torchspeed from this checkout, with the native crop renderer"
else
    say "torchspeed from this checkout, without the native crop renderer (no C compiler): crops are rendered in Python"
fi

# 3. The few packages such a machine lacks, from .whl/; each one missing is one line, and the check goes on.
for pair in lmdb:lmdb simplejpeg:simplejpeg torch-pruning:torch_pruning turbojpeg:turbojpeg; do
    package=${pair%%:*} module=${pair##*:}
    "$V" -c "import $module" 2>/dev/null && continue
    if "$V" -m pip install --no-deps --target "$SITE" "$package" >>"$OUT/install.log" 2>&1; then
        say "installed $package from .whl/"
    else
        say "going on without $package (no wheel for this Python in .whl/: run make gpu-wheels where an index is reachable)"
    fi
done
for pair in onnxruntime:"ONNX Runtime rows" openvino:"OpenVINO rows" nncf:"OpenVINO INT8 rows" nvidia.dali:"the DALI peer rows"; do
    module=${pair%%:*}
    "$V" -c "import $module" 2>/dev/null || say "going on without $module (${pair#*:} are skipped)"
done
"$V" -c 'import onnxruntime as o, sys; sys.exit("CUDAExecutionProvider" not in o.get_available_providers())' 2>/dev/null \
    || say "ONNX Runtime has no CUDA provider here (a CPU build): its GPU rows are skipped"

# 4. What the machine is, the CUDA tests (they fail, naming why, where no CUDA device runs a kernel), the quick report.
"$V" -m torchspeed info >"$OUT/info.txt" 2>&1
timeout "$TEST_S" "$V" -X faulthandler -m pytest -q -m gpu -p no:cacheprovider tests >"$OUT/pytest-gpu.log" 2>&1
tests=$?
say "CUDA tests: $(grep -E 'passed|failed|error|cannot run' "$OUT/pytest-gpu.log" | tail -1) (exit $tests; pytest-gpu.log)"
# The memory planner's prediction against CUDA's allocator (docs/train.md, "Memory"); it does not gate the verdict.
if "$V" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    timeout 90 "$V" docs/examples/plan_memory.py --device cuda --resnet-budget 6GiB --gpt-budget 4GiB \
        >"$OUT/plan-memory.md" 2>"$OUT/plan-memory.log"
    say "memory plan on cuda: exit $? (plan-memory.md)"
fi
TORCHSPEED_BENCH_BUDGET_S=${TORCHSPEED_BENCH_BUDGET_S:-20} timeout "$BENCH_S" "$V" -m torchspeed bench --quick --out "$OUT/report" >"$OUT/bench.log" 2>&1
bench=$?
if [ -f "$OUT/report/report.md" ]; then say "quick report: $OUT/report/report.md"; else say "quick report: none (exit $bench; bench.log)"; fi
if [ "$tests" -eq 0 ] && [ -f "$OUT/report/report.md" ]; then say "PASSED"; exit 0; fi
say "FAILED"; exit 1
