#!/usr/bin/env bash
# The kernels' and the step loop's work on a lent GPU (H100/H200), in parts that each fit one
# 10-minute device command. Run from the repository root on the GPU machine, whose image already
# has jax (CUDA), flax and pytest; nothing is installed. Run with PYTHONPATH=$PWD (a call that
# runs several parts saves machine start-ups). Tables and logs go to OUTDIR (default $OUT).
#
#   bash benchmarks/gpu_session.sh check   # compiled kernel tests (-m gpu), first half
#   bash benchmarks/gpu_session.sh check2  # the other half + a small bench
#   bash benchmarks/gpu_session.sh decode  # decode batch 1..256 x context 1k..32k, profiled
#   bash benchmarks/gpu_session.sh prefill # prefill chunks 512..8k and the mixed batch, profiled
#   bash benchmarks/gpu_session.sh sweep   # short-context decode (KV-split ladder) + prefill 2k
#   bash benchmarks/gpu_session.sh sweep-long  # decode at 4k and 32k context
#   bash benchmarks/gpu_session.sh engine  # 1B step loop: decode windows vs single steps, profiled
#   bash benchmarks/gpu_session.sh engine8b  # 8B step loop at ~1k context
#
# Copy the tables into benchmarks/RESULTS.md with the date and the device.
set -euo pipefail
part=${1:?usage: gpu_session.sh check|check2|decode|prefill|sweep|sweep-long|engine|engine8b [OUTDIR]}
out=${2:-${OUT:-.}}
mkdir -p "$out"
py=${PYTHON:-python3}
bench=(benchmarks/bench_attention.py)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv \
    > "$out/gpu_$part.txt" 2>&1 || true

case $part in
  check)  # every GPU case compiled (~5-10 s of compile each); `check2` runs the rest
    JAXINFER_KERNELS=compiled $py -m pytest -q -m gpu -p no:cacheprovider tests/pallas_kernels \
        -k "not default_configs and not gpu_configs" -rf 2>&1 | tee -a "$out/gpu_$part.txt" ;;
  check2)
    JAXINFER_KERNELS=compiled $py -m pytest -q -m gpu -p no:cacheprovider tests/pallas_kernels \
        -k "default_configs or gpu_configs" -rf 2>&1 | tee -a "$out/gpu_$part.txt"
    $py "${bench[@]}" --scenarios decode,prefill --batches 8 --contexts 4096 --chunks 1024 \
        | tee "$out/attention_check.md" ;;
  decode)
    $py "${bench[@]}" --scenarios decode --profile | tee "$out/attention_decode.md" ;;
  prefill)  # the mixed batch also runs as one call (without the decode split)
    $py "${bench[@]}" --scenarios prefill,mixed --profile | tee "$out/attention_prefill.md" ;;
  sweep)  # the rows slowest against jax's kernel, then a prefill chunk; writes the tuned table
    $py "${bench[@]}" --sweep --write-table --skip-reference --scenarios decode,prefill \
        --batches 64,256 --contexts 1024 --chunks 2048 | tee "$out/attention_sweep.md"
    cp pallas_kernels/gpu_tuned.json "$out/" ;;
  sweep-long)
    $py "${bench[@]}" --sweep --write-table --skip-reference --skip-jax --scenarios decode \
        --batches 1,64,256 --contexts 4096,32768 | tee "$out/attention_sweep_long.md"
    cp pallas_kernels/gpu_tuned.json "$out/" ;;
  engine)  # the step loop, 1B shape: decode windows of 4 vs single steps, with the device profile
    for k in 4 1; do
      $py benchmarks/bench_engine.py --shape llama-3.2-1b --prompt-lens 128 --batches 1 16 64 256 \
          --new-tokens 48 --num-decode-steps "$k" --profile --profile-batches 1 64 \
          | tee "$out/engine_1b_k$k.md"
    done ;;
  engine8b)  # the 8B shape at ~1k context (cold start ~2 min)
    $py benchmarks/bench_engine.py --shape llama-3.1-8b --prompt-lens 1024 --batches 1 64 256 \
        --new-tokens 32 --profile --profile-batches 1 | tee "$out/engine_8b.md" ;;
  *)
    echo "unknown part: $part (want check, check2, decode, prefill, sweep, sweep-long, engine or engine8b)" >&2
    exit 2 ;;
esac
