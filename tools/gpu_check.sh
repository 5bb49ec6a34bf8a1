#!/usr/bin/env bash
# The GPU checks in one run, for a CUDA machine that has its own Python, torch, Triton and
# transformers but no package index (shardwork is not installed there: the packages' src
# folders go on PYTHONPATH, and pure-Python wheels it lacks are installed from a folder).
#
#   bash tools/gpu_check.sh OUT [WHEELS]
#
# OUT: where the log and the GPU result tables go. WHEELS (default .whl): wheels
# to install into a scratch folder first — tyro and its needs (trainer), torchtitan 0.3.0 and
# spmd_types (dense-step peer), megatron-core (router peer), fla-core and
# flash-linear-attention (Gated DeltaNet kernels). Fetch them on a machine with an index:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform \
#     manylinux_2_28_x86_64 -d .whl torchtitan==0.3.0 spmd_types==0.2.3 megatron-core==0.19.2 \
#     fla-core==0.6.0 flash-linear-attention==0.6.0 tyro docstring-parser typeguard shtab
#
# Each stage has its own time limit, so one that hangs leaves the others' results; the stages
# run one after another so that no timing shares the GPU with another stage.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_check.sh OUT [WHEELS]}
WHEELS=${2:-.whl}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee "$LOG") 2>&1
export PYTHONUNBUFFERED=1

stage() { printf '\n=== %s (%s, %ss)\n' "$1" "$(date -u +%H:%M:%S)" "$SECONDS"; }
limited() { local seconds=$1; shift; timeout -k 10 "$seconds" "$@" || echo "--- exit $? (124: over ${seconds}s)"; }
# Result tables are copied out after each stage, so a later stage that overruns loses nothing.
keep() { cp benchmarks/results/*cuda* benchmarks/results/*gpu* "$OUT"/ 2>/dev/null || true; }

stage "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)"

SITE=/tmp/shardwork-site
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl
fi
PYTHONPATH=$(ls -d "$PWD"/packages/*/src | paste -sd:):$SITE
export PYTHONPATH

stage "dense training step: shardwork vs transformers, TorchTitan and Megatron-Core (1B, bf16)"
limited 170 python3 benchmarks/dense_step.py --shape 1b --device cuda --backends auto torch \
    --rounds 5 --steps 3 --peer-path "$SITE"
keep

stage "router: fused Triton vs Megatron-Core unfused (and TE where present)"
limited 50 python3 benchmarks/moe_router_gpu.py --tokens 8192 65536 --repeats 20
keep

stage "tests: fused-kernels on CUDA (every kernel test) and every -m gpu test"
limited 110 python3 -m pytest -q -p no:cacheprovider -o addopts="" --import-mode=importlib \
    -n 8 --timeout 120 -m "not slow" packages/fused-kernels/tests
# One file at a time, verbose: a hang names its test and costs only its own file's limit.
for tests in packages/parallel-state/tests packages/dist-checkpoint/tests \
    packages/dist-optimizer/tests/test_sharded_state.py packages/models/tests/test_hybrid_kernels.py; do
    limited 150 python3 -m pytest -v -p no:cacheprovider -o addopts="" --import-mode=importlib \
        --timeout 120 --timeout-method thread -m gpu "$tests"
done

stage "trainer: shardwork-train's default job on the GPU"
limited 60 python3 -m shardwork.trainer --schedule.train_steps 40 --logging.run_dir "$OUT/run" --logging.progress lines --logging.tensorboard false \
    --checkpoint.dir "$OUT/run/ckpt"

stage "fused kernels vs torch eager (LLM shapes)"
limited 80 python3 benchmarks/kernels.py --size llm --repeats 5
keep

stage "done"
rm -rf "$OUT/run"
ls -la "$OUT"
