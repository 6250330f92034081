#!/usr/bin/env bash
# The GPU checks as one prepared, time-boxed run (an H200 from the device tool), most wanted first:
#   1. the kernel tests (flash attention, grouped GEMM, gated delta, SSD) on real Triton lowering,
#   2. the gated delta rule's tokens/s, a decay per head (Gated DeltaNet) and per key channel
#      (Kimi Delta Attention): the Pallas kernel against the lax chunked walk and the
#      token-by-token recurrence (benchmarks/gated_delta.py),
#   3. attention TFLOP/s: our flash kernel vs cuDNN (and vs XLA with a window and sinks),
#   4. a ~1.2B Llama in bf16 through the real training loop (llama_1b.yml) with each attention
#      implementation: tokens/s, TFLOP/s per device and MFU (6·N_matmul + attention FLOPs per
#      token, see README's Benchmarks).
# Each part has its own time limit so that one stall does not cost the others. Logs go to $OUT
# (or /tmp/gpu_check). The device image lacks grain, qwix, array_record and portpicker: carry
# their wheels in .whl (device README) and this installs them.
set -uo pipefail
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda JAXTRAIN_COMPILATION_CACHE=off
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$out/env.txt"
python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__,
jax.devices())" 2>&1 | tee -a "$out/env.txt"

part() {  # part NAME SECONDS COMMAND...: run with a limit, log to $out/NAME.log, show the tail
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-8}" "$out/$name.log"
    echo "=== $name: rc $rc in $((SECONDS - t0)) s"
}

TAIL=30 part kernel_tests 130 python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" \
    -n 4 --dist loadfile tests/kernels
TAIL=6 part gdn_bench 80 python3 benchmarks/gated_delta.py --lengths 1024,4096,16384 --batch 4
TAIL=5 part kda_bench 60 python3 benchmarks/gated_delta.py --lengths 4096,16384 --batch 4 \
    --per-channel
TAIL=6 part attention 80 python3 benchmarks/attention.py --shape 8x4096x32x8x128 \
    --shape 1x32768x32x8x128 --impls flash,cudnn --iters 10
TAIL=4 part attention_window 40 python3 benchmarks/attention.py --shape 4x8192x64x8x64 \
    --window 128 --sinks --impls flash,xla --iters 10
for impl in flash cudnn_flash_jax dot_product; do
    TAIL=11 part "llama_1b_$impl" 40 python3 benchmarks/throughput.py \
        benchmarks/configs/llama_1b.yml "attention=$impl" --steps 6 --warmup 2
done
