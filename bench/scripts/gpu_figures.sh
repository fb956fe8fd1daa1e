#!/usr/bin/env bash
# The GPU checks and figures the open issues ask for, in three parts, each meant to fit one
# 10-minute call on an H200 (per-run timeouts; not yet run end to end) (run from a checkout with gguf importable; OUT names a folder for the JSON files).
#   bench/scripts/gpu_figures.sh check   GPU tests of the kernels, graphs and expert tiers;
#                                        greedy text on the GPU against the CPU reference
#   bench/scripts/gpu_figures.sh models  30B-A3B and 8B: prefill, decode, concurrency, verify
#                                        cost, prefix reuse, --deterministic cost
#   bench/scripts/gpu_figures.sh experts 30B-A3B with ~50/25/10% of experts on the device: zero-copy
#                                        placement, then streaming (50/25%)
set -uo pipefail
part=${1:?usage: gpu_figures.sh check|models|experts}
out=${OUT:-/tmp/gpu-figures}
mkdir -p "$out" /tmp/r
export PYTHONUNBUFFERED=1
ms() { python3 -c "import sys; from moestream.cli import main; sys.exit(main())" "$@"; }
bench() {  # bench NAME SECONDS ARGS...: one bench run, its tables, its JSON in $out
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -c "import sys; from moestream.cli import main; sys.exit(main())" \
    bench "$@" --out "/tmp/r/$name" > "/tmp/r/$name.log" 2>&1
  echo "[$name rc=$?]"; grep -v "^- \|^$\|wrote\|^bench: " "/tmp/r/$name.log" | head -80
  cp "/tmp/r/$name/result.json" "$out/$name.json" 2>/dev/null
}
synth() {
  [[ -f /tmp/$2.gguf ]] || python3 -c "from moestream.weights.synth import synth_gguf
synth_gguf('$1', 'Q4_K_M', '/tmp/$2.gguf', progress=False)"
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
[[ -f COMMIT ]] && export MOESTREAM_COMMIT=$(cat COMMIT) && echo "commit $MOESTREAM_COMMIT"
case $part in
  check)
    timeout 330 python3 -m pytest tests/kernels tests/runner tests/experts tests/engine -q \
      -p no:cacheprovider --maxfail=8 -rf 2>&1 | tail -15
    python3 bench/kernels_gpu.py --only mmvq,moe 2>&1 | tee "$out/kernels.log" | tail -30
    python3 bench/greedy_gpu_vs_cpu.py --tokens 200 --prompts 4 --json "$out/greedy.json" | tail -12
    ;;
  models)
    synth qwen3-30b-a3b q30; synth qwen3-8b q8
    bench q30 300 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512,4096 \
      --decode-depths 0,4096 --decode-tokens 64 --repeats 3 --concurrency 1,2,4,8,16,32 \
      --verify-curve 1,2,4,8,16 --verify-batches 1,4,16
    bench q30det 150 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512,4096 \
      --decode-depths 0 --decode-tokens 64 --repeats 3 --concurrency 8,32 --deterministic
    bench q8 90 /tmp/q8.gguf --device cuda --kv-cache-gib 16 --prompt-lens 512,4096 \
      --decode-depths 0,4096 --decode-tokens 64 --repeats 3
    bench prefix 120 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512 \
      --decode-depths 0 --decode-tokens 16 --repeats 2 --prefix-reuse 32768:31744
    ;;
  experts)
    synth qwen3-30b-a3b q30
    for gib in 8 4 1.6; do  # zero-copy placement first (fast if it works), then streaming
      bench "zc$gib" 120 /tmp/q30.gguf --device cuda --kv-cache-gib 4 --gpu-expert-cache-gib "$gib" \
        --host-expert-cache-gib 24 --expert-zero-copy --prompt-lens 128 --decode-depths 0 \
        --decode-tokens 64 --repeats 3 --concurrency 1,8 --concurrency-prompt 64
    done
    for gib in 8 4; do
      bench "exp$gib" 150 /tmp/q30.gguf --device cuda --kv-cache-gib 4 --gpu-expert-cache-gib "$gib" \
        --host-expert-cache-gib 24 --prompt-lens 128 --decode-depths 0 --decode-tokens 32 \
        --repeats 2 --concurrency 1,8 --concurrency-prompt 64
    done
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
