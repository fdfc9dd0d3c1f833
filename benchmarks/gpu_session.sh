#!/usr/bin/env bash
# The kernels' and the step loop's work on a lent GPU (H100/H200), in parts. Run from the
# repository root on the GPU machine, whose image already has jax (CUDA), flax and pytest;
# nothing is installed. Run with PYTHONPATH=$PWD. Several parts run in one call (a machine
# start-up costs minutes of the lease), each in turn, each under its own limit in seconds
# (PART:SECONDS), so that one that overruns leaves time for the rest. Every part is checked
# before the first one runs. Tables and logs go to $OUTDIR (default $OUT, else .).
#
#   bash benchmarks/gpu_session.sh check   # compiled kernel tests (-m gpu), first half
#   bash benchmarks/gpu_session.sh check2  # the other half + a small bench
#   bash benchmarks/gpu_session.sh quick   # ~15 compiled cases: decode, mixed, split-K, int8, d80
#   bash benchmarks/gpu_session.sh decode  # decode batch 1..256 x context 1k..32k, profiled
#   bash benchmarks/gpu_session.sh prefill # prefill chunks 512..8k and the mixed batch, profiled
#   bash benchmarks/gpu_session.sh sweep   # short-context decode (KV-split ladder) + prefill 2k
#   bash benchmarks/gpu_session.sh sweep-long  # decode at 4k and 32k context
#   bash benchmarks/gpu_session.sh sweep-big   # decode batch 256 at 1k and 4k: tuned entries
#   bash benchmarks/gpu_session.sh ladder  # short-context decode: profiled, then swept (no prefill)
#   bash benchmarks/gpu_session.sh short   # short-context decode vs jax's kernel, profiled (no sweep)
#   bash benchmarks/gpu_session.sh engine  # 1B step loop: decode windows vs single steps, profiled
#   bash benchmarks/gpu_session.sh engine1b  # 1B step loop, windows of 8, batch 1 and 256 profiled (HLO=1: + HLO; CB=1: CUDA graphs)
#   bash benchmarks/gpu_session.sh engine8b  # 8B step loop at ~1k context, batch 1 and 256
#   bash benchmarks/gpu_session.sh quant8b   # 8B at bf16, int4 g64, int8: batch 1 and 64 (three engines)
#   bash benchmarks/gpu_session.sh loop    # 1B step loop: as is, greedy twin off, launcher thread off; profiled
#   bash benchmarks/gpu_session.sh moe     # Qwen3-30B-A3B shape, decode batch 1 and 64 (H200)
#   bash benchmarks/gpu_session.sh lmhead  # the LM head's matmul by weight layout (tied or not)
#   bash benchmarks/gpu_session.sh threads # 1B cold/warm start-up and decode, compiles 1 vs 16 at a time
#   bash benchmarks/gpu_session.sh rows1b  # 1B step loop, batch 1 / 64 / 256, batch 1 profiled
#   bash benchmarks/gpu_session.sh long    # decode batch 1 / 64 / 256 at 4k and 16k context vs jax's kernel
#   bash benchmarks/gpu_session.sh prefill-big  # prefill chunks 2048 and 8192 only
#   bash benchmarks/gpu_session.sh sweep-mid    # the KV-split / warps ladder at batch 64 x 4k (one row)
#   bash benchmarks/gpu_session.sh lora8b   # 8B shape, batch 64 over 16 rank-16 adapters vs base; an adapter's load
#   bash benchmarks/gpu_session.sh int4mm   # int4 matmul forms (8 of the 8B's MLPs): engine, halves, uint4 vs bf16
#   bash benchmarks/gpu_session.sh start8b  # 8B shape as HF safetensors: `jaxinfer generate` cold, then warm
#   bash benchmarks/gpu_session.sh moe:300 engine1b:270   # one call, two parts
#
# Size the limits for a cold machine (a 15-minute lease fits one command of at most 600 s after
# a start of 1-2 minutes). Seen on an H200, 2026-11-26: `moe` 112 s of random weights (since
# halved) and 125 s of compile before its first row; `engine1b` had not finished its cold start
# (with the HLO dump) after 140 s; `ladder`'s profiled command alone took ~150 s.
#
# Seen on an H100, 2026-11-26: `quick` ran 13 of its 17 cases in 80 s; `short` ~30 s; `engine8b`
# 2 min 40 s to its first row (cold) and ~3 min 40 s in all; `engine1b` ~2 min 30 s in all.
# Seen on an H200, 2026-11-26 (third lease): `lmhead` printed one row in 45 s; `sweep-big`'s 1k
# row took ~165 s (its 4k row did not start in 170 s); `engine8b` compiled 44 variants, ~3 min
# cold, and needed ~240 s to its batch-256 row (it now compiles only its rows' 14).
# Seen on an H100, 2026-11-28: `loop` 104 s in all (three 1B engines, the cache warm after the
# first); `engine8b` 88 s; `short` ~40 s; `prefill` reached the 4096 chunk in 190 s (~100 s of
# it XLA constant-folding the reference, since fixed); `lmhead` two rows in 40 s.
# Measured then (RESULTS.md): the greedy twin took the 1B batch-1 step 2.26 -> 1.60 ms and its
# device idle 51% -> 14%; the launcher thread changed nothing with the twin on; 8B batch 256
# 11,294 tok/s, batch 1 5.95 ms (95% of the floor). Next: `prefill:200` (chunks 2048-8192, the
# 50% goal is far), `sweep-long:200` (the 80% goal is for 4k context and up), `threads:300`,
# and the 1B batch-1 profile's full kernel list (`engine1b`): busy 1.69 ms against a 0.92 ms floor.
# Seen on an H200, 2026-11-29: `engine8b:195 long:110 rows1b:100 quick:55 prefill-big:65` took
# 280 s in all on a fresh machine (engine8b 78 s, long 50 s, rows1b 54 s; quick reached its
# limit after 7 cases); the machine started in ~36 s. A `--sweep` row costs ~9 s a config (two
# rows of ~17 configs in 330 s): sweep one row per call. Next: the 1B batch-1 step's kernel count
# and idle share (19.8%), batch 64 at 4k (44% of the copy rate), prefill (17-26% of matmul).
# Seen on an H200, 2026-11-29 (second lease): `lora8b:240 quant8b:235` 385 s (lora8b 148 s;
# quant8b ~65 s an engine: bf16 and int4 finished, int8 did not); `start8b` 149 s (transformers
# wrote the 15 GB in 37 s); `sweep-mid` 104 s for its 17 configs. Next: `int4mm` (the int4
# matmul's forms), `start8b` again (the loader now transposes on the device), `lora8b` again
# (the fused fields' share sliced, not multiplied), then `quant8b` with the winning int4 form.
# Copy the tables into benchmarks/RESULTS.md with the date and the device.
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: gpu_session.sh PART[:SECONDS] ..." >&2; exit 2; }
out=${OUTDIR:-${OUT:-.}}
py=${PYTHON:-python3}
bench=(benchmarks/bench_attention.py)
parts="check check2 quick lora8b start8b int4mm rows1b long prefill-big sweep-mid decode prefill sweep sweep-long sweep-big ladder short engine engine1b engine8b quant8b loop moe lmhead threads"
for arg in "$@"; do
  part=${arg%%:*} limit=${arg#*:}
  [ "$limit" != "$arg" ] || limit=0
  if [[ " $parts " != *" $part "* || ! "$limit" =~ ^[0-9]+$ ]]; then
    echo "unknown part: $arg (want one of: $parts, each optionally :SECONDS)" >&2
    exit 2
  fi
done
mkdir -p "$out"

run_part() {
  local part=$1
  case $part in
    check)  # every GPU case compiled (~5-10 s of compile each); `check2` runs the rest
      JAXINFER_KERNELS=compiled $py -m pytest -q -m gpu -p no:cacheprovider tests/pallas_kernels \
          -k "not default_configs and not gpu_configs" -rf 2>&1 | tee -a "$out/gpu_$part.txt" ;;
    check2)
      JAXINFER_KERNELS=compiled $py -m pytest -q -m gpu -p no:cacheprovider tests/pallas_kernels \
          -k "default_configs or gpu_configs" -rf 2>&1 | tee -a "$out/gpu_$part.txt"
      $py "${bench[@]}" --scenarios decode,prefill --batches 8 --contexts 4096 --chunks 1024 \
          | tee "$out/attention_check.md" ;;
    quick)
      JAXINFER_KERNELS=compiled $py -m pytest -q -m gpu -p no:cacheprovider \
          tests/pallas_kernels/test_kernels.py -rf -k "test_batches or decode_split or \
          int8_kv_bf16 or test_head_dims and 80" 2>&1 | tee -a "$out/gpu_$part.txt" ;;
    lora8b)  # the LoRA issue's GPU goal: batch 64 over 16 adapters >= 0.85x base; load < 1 s
      $py benchmarks/bench_lora.py --shape llama-3.1-8b --batch 64 --adapters 16 --rank 16 \
          --max-tokens 96 --prompt-len 256 --rounds 3 | tee "$out/lora_8b.md"
      $py benchmarks/bench_lora.py --load-shape llama-3.1-8b --rank 16 | tee "$out/lora_8b_load.md" ;;
    int4mm)  # which int4 form reads fewer bytes than bf16 on this GPU (~1 min)
      $py benchmarks/bench_int4.py | tee "$out/int4_forms.md" ;;
    start8b)  # the start-up issue's GPU row: weights to first token <= 20 s warm. Random weights
      # of the shape written as bf16 safetensors by transformers on the GPU (~40 s), a test
      # tokenizer beside them; `jaxinfer generate` on them in a new process, cold then warm
      local w=/tmp/start8b
      rm -rf $w && mkdir -p $w
      $py -c "import json, sys; sys.path.insert(0, 'benchmarks'); from shapes import hf_config; \
json.dump(hf_config('llama-3.1-8b'), open('$w/shape.json', 'w'))"
      $py -c "import sys; sys.path.insert(0, 'benchmarks'); from hf_baseline import _random_model; \
_random_model('$w/shape.json', '$w/weights', 'cuda')"
      cp tests/fixtures/hf/llama3_chat/tokenizer.json tests/fixtures/hf/llama3_chat/tokenizer_config.json $w/weights/
      echo "[$(date +%T)] weights written: $(du -sh $w/weights | cut -f1)"
      $py benchmarks/bench_startup.py --cases generate --rounds 2 --jaxinfer "$py -m jaxinfer.cli" \
          --model $w/weights --workdir $w/caches | tee "$out/startup_8b.md" ;;
    rows1b)  # the 1B rows: batch 1 / 64 / 256 at the default launch, batch 1 traced
      $py benchmarks/bench_engine.py --shape llama-3.2-1b --prompt-lens 128 --batches 1 64 256 \
          --new-tokens 48 --profile --profile-batches 1 --token-buckets 1 64 256 2048 \
          | tee "$out/engine_1b_rows.md" ;;
    long)  # the 80%-of-copy-rate goal is for 4k context and up; 256 x 16k is 17 GB of KV
      $py "${bench[@]}" --scenarios decode --batches 1,64,256 --contexts 4096,16384 \
          --max-kv-tokens 4194304 --skip-reference --budget 0.3 | tee "$out/attention_long.md" ;;
    prefill-big)  # the 50%-of-matmul-rate goal is for chunks of 2048 and up
      $py "${bench[@]}" --scenarios prefill --chunks 2048,8192 --skip-reference --budget 0.3 \
          | tee "$out/attention_prefill_big.md" ;;
    sweep-mid)  # 44% of the copy rate on the H200 (2026-11-29): the farthest decode row from 80%
      $py "${bench[@]}" --sweep --write-table --skip-reference --skip-jax --scenarios decode \
          --batches 64 --contexts 4096 --budget 0.2 | tee "$out/attention_sweep_mid.md"
      cp pallas_kernels/gpu_tuned.json "$out/" ;;
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
    sweep-big)  # the batch the 8B's 10k tok/s goal runs at; an engine part after it uses the entries
      $py "${bench[@]}" --sweep --write-table --skip-reference --skip-jax --scenarios decode \
          --batches 256 --contexts 1024,4096 --budget 0.5 | tee "$out/attention_sweep_big.md"
      cp pallas_kernels/gpu_tuned.json "$out/" ;;
    ladder)  # where short-context decode time goes (kernel or XLA glue), then the swept configs
      $py "${bench[@]}" --scenarios decode --batches 1,64,256 --contexts 1024 --profile \
          --skip-reference --budget 0.5 | tee "$out/attention_ladder_profile.md"
      $py "${bench[@]}" --sweep --write-table --skip-reference --skip-jax --scenarios decode \
          --batches 64,256 --contexts 1024 --budget 0.5 | tee "$out/attention_ladder.md"
      cp pallas_kernels/gpu_tuned.json "$out/" ;;
    short)
      $py "${bench[@]}" --scenarios decode --batches 1,64,256 --contexts 1024 --profile \
          --skip-reference --budget 0.5 | tee "$out/attention_short_profile.md" ;;
    engine)  # the step loop, 1B shape: decode windows of 4 vs single steps, with the device profile
      for k in 4 1; do
        $py benchmarks/bench_engine.py --shape llama-3.2-1b --prompt-lens 128 --batches 1 16 64 256 \
            --new-tokens 48 --num-decode-steps "$k" --profile --profile-batches 1 64 \
            | tee "$out/engine_1b_k$k.md"
      done ;;
    engine1b)  # HLO=1 adds the decode window's optimized HLO (what XLA fused, copied, launched)
      rm -rf /tmp/hlo_1b
      if [ "${HLO:-0}" = 1 ]; then
        export XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/hlo_1b --xla_dump_hlo_module_re=.*decode_window.*"
      fi
      if [ "${CB:-0}" = 1 ]; then  # CUDA graphs over the window, its loop and conditionals included
        export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CONDITIONAL,WHILE"
      fi
      $py benchmarks/bench_engine.py --shape llama-3.2-1b --prompt-lens 128 --batches 1 16 64 256 \
          --new-tokens 48 --profile --profile-batches 1 256 --token-buckets 1 16 64 256 2048 \
          | tee "$out/engine_1b.md"
      if [ -d /tmp/hlo_1b ]; then (cd /tmp/hlo_1b && find . -name '*after_optimizations.txt' \
          -print0 | tar -czf "$out/hlo_1b.tar.gz" --null -T -); fi ;;
    engine8b)  # the 8B shape at ~1k context, with CUDA graphs as on 2026-11-23; batch 256
      # prefills for 128 steps, so it needs 192 new tokens for a stretch where every request
      # decodes. Only the buckets its rows run in (each decode batch, the prefill budget): 14
      # variants, not the 44 of every power of two, whose cold compile took ~3 min on an H200
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CONDITIONAL,WHILE" \
      $py benchmarks/bench_engine.py --shape llama-3.1-8b --prompt-lens 1024 --batches 1 256 \
          --new-tokens 192 --profile --profile-batches 1 --token-buckets 1 256 2048 \
          | tee "$out/engine_8b.md" ;;
    quant8b)  # the 8B shape's weights as bf16, int4 g64 (a W4A16 checkpoint's bytes: GPTQ, AWQ and
      # compressed-tensors land in this layout) and int8 per channel (W8A16 / W8A8), batch 1 and 64
      # at ~1k context: the stored-quantization issue's goal, int4 batch 1 faster than bf16
      for q in none int4 int8; do
        $py benchmarks/bench_engine.py --shape llama-3.1-8b --prompt-lens 1024 --batches 1 64 \
            --new-tokens 64 --token-buckets 1 64 2048 --quantization $q | tee "$out/engine_8b_$q.md"
      done ;;
    loop)  # as is, then the greedy twin off, then the launcher thread off; few buckets, so each
      # engine compiles a handful of variants
      for run in default "greedy-variant off" "dispatch-thread off"; do
        flags=() name=${run// /_}
        [ "$run" = default ] || flags=("--${run% *}" "${run#* }")
        $py benchmarks/bench_engine.py --shape llama-3.2-1b --prompt-lens 128 --batches 1 64 \
            --new-tokens 48 --profile --profile-batches 1 64 --token-buckets 1 64 2048 \
            "${flags[@]}" | tee "$out/engine_1b_$name.md"
      done ;;
    threads)  # the warm-up's compile pool on a GPU: one compile at a time (the default) or 16
      for n in 1 16; do
        JAXINFER_COMPILE_THREADS=$n $py benchmarks/bench_engine.py --shape llama-3.2-1b --startup \
            --prompt-lens 128 --batches 1 64 --new-tokens 48 --token-buckets 1 64 2048 \
            | tee "$out/engine_1b_threads$n.md"
      done ;;
    lmhead)  # why the 1B's tied head reads at half the rate of every other matmul (~20 s)
      $py benchmarks/bench_lm_head.py | tee "$out/lm_head.md" ;;
    moe)  # 61 GB of bf16 weights: an H200 (or int8 weights on an H100); three token buckets
      # keep its 48 layers' cold start to a few variants
      $py benchmarks/bench_engine.py --shape qwen3-30b-a3b --prompt-lens 128 --batches 1 64 \
          --new-tokens 32 --prefill-len 512 --token-buckets 1 64 512 --profile --profile-batches 64 \
          | tee "$out/engine_moe.md" ;;
  esac
}

status=0
for arg in "$@"; do
  part=${arg%%:*} limit=${arg#*:}
  [ "$limit" != "$arg" ] || limit=0
  { echo "[$(date +%T)] before part $part"; nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv; } \
      >> "$out/gpu_info.txt" 2>&1 || true
  echo "[$(date +%T)] part $part (limit ${limit:-none} s)" >&2
  if [ "$limit" -gt 0 ]; then
    export -f run_part; export out py bench
    timeout --kill-after=10 "$limit" bash -c "set -o pipefail; $(declare -p bench); run_part $part"
  else
    run_part "$part"
  fi
  rc=$?
  [ $rc -eq 0 ] || { echo "[$(date +%T)] part $part ended with status $rc" >&2; status=$rc; }
  # A part cut off by its limit may still be releasing the GPU (XLA holds 75% of it): wait up
  # to 30 s for its memory, so that the next part is not timed beside it.
  for _ in $(seq 30); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
    [[ "$used" =~ ^[0-9]+$ && "$used" -gt 2048 ]] || break
    sleep 1
  done
done
exit $status
