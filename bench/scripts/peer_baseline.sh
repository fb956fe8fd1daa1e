#!/usr/bin/env bash
# On a CUDA machine: measure copy bandwidth, write the synth benchmark models, build llama.cpp
# and run llama-bench on them (the peer figures for bench/RESULTS.md).
# usage: bench/scripts/peer_baseline.sh LLAMA_SRC(.tgz|dir) WORKDIR
set -uo pipefail
src=$1; work=$2
mkdir -p "$work"
here=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
(bash "$here/build_llamacpp.sh" "$src" "$work/llama" 90 > "$work/build.out" 2>&1;
 echo "build exit $?" >> "$work/build.out") &
python3 "$here/copy_bandwidth.py" 4
for spec in qwen3-30b-a3b qwen3-8b; do
  /usr/bin/time -f "synth $spec: %e s" python3 -c "
from moestream.weights.synth import synth_gguf
synth_gguf('$spec', 'Q4_K_M', '$work/$spec-Q4_K_M.gguf', progress=False)"
done
ls -la "$work"/*.gguf
wait
tail -3 "$work/build.out"
lb="$work/llama/out/bin/llama-bench"
for spec in qwen3-30b-a3b qwen3-8b; do
  m="$work/$spec-Q4_K_M.gguf"
  "$lb" -m "$m" -ngl 99 -fa 1 -p 512,4096 -n 0 -r 3 -o md
  "$lb" -m "$m" -ngl 99 -fa 1 -p 0 -n 128 -d 0,4096,32768 -r 3 -o md
done
