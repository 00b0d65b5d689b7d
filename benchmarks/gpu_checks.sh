#!/usr/bin/env bash
# The GPU checks, as one command on a machine with one NVIDIA GPU and a CUDA JAX already installed:
#
#     bash benchmarks/gpu_checks.sh            # results and logs in $OUT (default /tmp/gpu_checks)
#
# Assembles the installed package's layout in a scratch folder (models/, meshes/ and train/ inside jaxpar/,
# as pyproject's package-dir maps them) and runs from there, so nothing is built or installed but the
# wheels in .whl/, for packages the machine lacks (starlette, uvicorn, tensorboardX). It prints the
# versions, then runs each benchmark
# under its own time limit so one that hangs or fails leaves the others their time:
#   generate.py --gpu   llama3-8b shape, bf16, decode at batch 1 and 64 against the HBM peak;
#   decode_gpu.py       llama3.2-1b decode step: host loop, chained on the device, host dispatch, kernels,
#                       beside the plain-JAX decoder, with and without command buffers (+ a profile);
#   lab_gpu.py          llama3.2-1b train and decode beside `jaxpar plan`'s predictions;
#   serve.py --quick    the engine under load (tiny model), on the GPU.
# Each writes its JSON as it goes; $OUT/checks.log keeps every run's output (six files come back in all).
set -u
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
LIMITS=${GPU_CHECK_LIMITS:-"100 110 150 120"}  # seconds: generate, decode, lab, serve (0: skip)
read -r T_GENERATE T_DECODE T_LAB T_SERVE <<<"$LIMITS"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
TREE=$(mktemp -d)
cp -r jaxpar benchmarks "$TREE"/ && for d in models meshes train; do cp -r "$d" "$TREE/jaxpar/$d"; done
cd "$TREE" || exit 1
export PYTHONPATH="$TREE${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, jax.devices())" 2>&1 | tee "$OUT/checks.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/checks.log"

check() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    [ "$limit" -gt 0 ] || return 0
    echo "== $name (limit ${limit} s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"/tmp/$name.log" 2>&1
    echo "== $name rc=$? in $((SECONDS - start)) s"
    tail -4 "/tmp/$name.log"
    { echo "== $name: $*"; cat "/tmp/$name.log"; } >>"$OUT/checks.log"
}
check generate "$T_GENERATE" python3 benchmarks/generate.py --gpu --out "$OUT/generate_gpu.json"
check decode "$T_DECODE" python3 benchmarks/decode_gpu.py --limit $((T_DECODE / 2 - 5)) --out "$OUT/decode_gpu.json" \
    --trace "$OUT/trace.tar.gz"
check lab "$T_LAB" python3 benchmarks/lab_gpu.py --out "$OUT/lab_gpu.json"
check serve "$T_SERVE" python3 benchmarks/serve.py --quick --out "$OUT/serve_gpu.json"
