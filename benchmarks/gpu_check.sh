#!/usr/bin/env bash
# The GPU checks of issue 26 as one prepared run (an H200 from the device tool):
#   1. the kernel tests on real Triton/Mosaic lowering,
#   2. the step breakdown of a ~1.2B Llama in bf16 with flash attention (llama_1b.yml),
#   3. its throughput: tokens/s, TFLOP/s per device and MFU (6·N_matmul + attention FLOPs per
#      token, see README's Benchmarks), against the chip's dense bf16 peak.
# Logs and the breakdown's JSON go to $OUT (or /tmp/gpu_check). The device image lacks grain:
# carry its wheel (device README: pip download ... grain) and install it before calling this.
set -uo pipefail
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda JAXTRAIN_COMPILATION_CACHE=off
cfg=benchmarks/configs/llama_1b.yml
python3 -m pytest -q tests/kernels -m "slow or not slow" 2>&1 | tee "$out/kernels.log" | tail -5
python3 benchmarks/step_breakdown.py "$cfg" --warmup 3 --steps 5 --json "$out/breakdown.json" \
    2>&1 | tee "$out/breakdown.txt" | tail -60
python3 benchmarks/throughput.py "$cfg" --steps 10 --warmup 3 2>&1 | tee "$out/throughput.txt" \
    | tail -12
