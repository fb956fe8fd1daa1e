#!/usr/bin/env bash
# The GPU checks and figures the open issues ask for, in parts, each meant to fit one 10-minute
# call on an H200 (per-run timeouts). Run from a checkout with gguf importable; OUT names a
# folder for the JSON files; a COMMIT file in the tree names the commit when .git is absent.
# Since the twenty-first session (part s30a on) CUDA pages experts by default wherever the host
# budget holds every expert (`--expert-paging auto`); earlier parts measured the streamed store
# there: add `--expert-paging off` to run them as they ran.
#   bench/scripts/gpu_figures.sh check   GPU tests of the kernels, graphs and expert tiers;
#                                        kernel timings; greedy text on the GPU against the CPU
#                                        reference; the tiny pair's speculation on the GPU
#   bench/scripts/gpu_figures.sh models  30B-A3B and 8B: prefill, decode, concurrency, verify
#                                        cost, prefix reuse, --deterministic cost
#   bench/scripts/gpu_figures.sh experts 30B-A3B with ~50/25/10% of experts on the device: zero-copy
#                                        placement, then streaming (50%)
#   bench/scripts/gpu_figures.sh tune    the changed kernels' GPU tests; launch-shape sweeps (MoE
#                                        decode, dense decode GEMV, decode attention)
#   bench/scripts/gpu_figures.sh host    path switches (mmq vs dequantize), host time per step,
#                                        the batch-1 decode profile
#   bench/scripts/gpu_figures.sh q8|q30  the models part's 8B run / 30B runs without verify curve
#   bench/scripts/gpu_figures.sh final   tiny-pair speculation (also --deterministic); 30B with
#                                        bf16 weight copies
#   bench/scripts/gpu_figures.sh diag    every kernel test; MoE path switch points; 30B prefill
#                                        profiles at 512 and 2048 tokens, with and without the
#                                        bf16 weight copies
#   bench/scripts/gpu_figures.sh kern    30B prefill, prefix reuse, batched decode; dequantizer
#                                        sweep; GPU tests of the new kernels
#   bench/scripts/gpu_figures.sh sweep2  prefill attention, MoE mmq, zero-copy MoE sweeps; GPU
#                                        tests of the fused FFN, attention and graphs
#   bench/scripts/gpu_figures.sh final2  GPU tests; 30B and 8B figures; greedy GPU vs CPU;
#                                        zero-copy experts at 8 GiB
#   bench/scripts/gpu_figures.sh check2  GPU-marked tests of graphs, models, fusions; tiny-pair
#                                        speculation
#   bench/scripts/gpu_figures.sh profile 30B-A3B: host time per decode step; top kernels of a
#                                        512-token prefill and of decode steps at 1, 8 and 32
#   bench/scripts/gpu_figures.sh pdl     GPU tests of the PDL kernels; greedy GPU vs CPU; 30B-A3B
#                                        decode with PDL and without, interleaved
#   bench/scripts/gpu_figures.sh fin3a   tiny-pair speculation (2 rounds); 8B figures
#   bench/scripts/gpu_figures.sh fin3b   30B-A3B figures: prefill, decode at 0 and 32k, concurrency
#   bench/scripts/gpu_figures.sh spechost host profiles of the tiny pair's speculation modes
#   bench/scripts/gpu_figures.sh after   plain decode of the tiny target before and after forced
#                                        draft-model / n-gram drafting in the same process
#   bench/scripts/gpu_figures.sh spec30  30B-A3B: plain against --speculative auto (n-gram) in one run
#   bench/scripts/gpu_figures.sh probe   the tiny pair's step phases per speculative mode (gc
#                                        frozen or not); MoE and GEMV kernel timings; ncu of the
#                                        MoE decode kernels
#   bench/scripts/gpu_figures.sh probe2  router launch shapes; 30B-A3B prefix reuse at 32k
#   bench/scripts/gpu_figures.sh ab3     GPU tests of the router and the dequantize path; 30B-A3B
#                                        decode with the router's old and new launch shape,
#                                        interleaved; prefix reuse at 32k
#   bench/scripts/gpu_figures.sh once    GPU tests of the MoE mmvq path; the "once" gate/up sweep
#   bench/scripts/gpu_figures.sh fin4    30B-A3B decode with the tile and the "once" MoE gate/up;
#                                        30B figures; tiny-pair speculation and step phases;
#                                        greedy GPU vs CPU; GPU tests of the once kernel
#   bench/scripts/gpu_figures.sh dip     the tiny pair's step phases, auto and draft modes, with
#                                        each round's verify/exploration steps per proposer
#   bench/scripts/gpu_figures.sh dgraph  tiny-pair speculation on copy prompts with the draft
#                                        model's decode graphs on
#   bench/scripts/gpu_figures.sh link    zero-copy promotion's GPU test; host-link bandwidth
#                                        (DMA, zero-copy kernel); 30B-A3B
#                                        zero-copy experts at 8 GiB with the weight pointers'
#                                        alignment hint on the pointer, then on the address
#                                        (before 7f951f1)
#   bench/scripts/gpu_figures.sh spec5   GPU tests of the draft model and the new quant types,
#                                        their GEMV's GB/s; the tiny pair's step phases with plain decode twice
#                                        (the noise floor) and the draft warmed up at load
#   bench/scripts/gpu_figures.sh mmq     ncu of the MoE's batched-decode (mmq) kernels at 32
#                                        tokens, 22% of copy bandwidth in the fourth session
#   bench/scripts/gpu_figures.sh q30c    30B-A3B figures (fin6's bench run alone)
#   bench/scripts/gpu_figures.sh phases  the tiny pair's step phases (fin6's first half)
#   bench/scripts/gpu_figures.sh gtest   GPU tests of the grouped MoE and the picker; phases
#   bench/scripts/gpu_figures.sh gsmall  the grouped MoE's shapes at 4-12 tokens and its down
#                                        kernel's at 16 and 32
#   bench/scripts/gpu_figures.sh fin6    the tiny pair's step phases (plain twice, draft, auto);
#                                        30B-A3B figures
#   bench/scripts/gpu_figures.sh grouped GPU tests of the draft model and the grouped MoE path;
#                                        its launch shapes against mmvq and mmq (T = 16-64);
#                                        30B-A3B at 16 and 32 requests with it and without
#   bench/scripts/gpu_figures.sh s7a     30B-A3B batch-1 decode profile; the tiny pair's step
#                                        phases (prose, copy, and prose sampled at temperature 1)
#   bench/scripts/gpu_figures.sh s7b     30B-A3B sampled decode with run-ahead of greedy steps only
#                                        and of sampled ones too; tiny-pair step phases
#   bench/scripts/gpu_figures.sh s7c     tiny-pair sampled step phases with run-ahead and without
#   bench/scripts/gpu_figures.sh s7d     tiny-pair step phases (sampled, prose, copy); dense GEMV
#                                        of every type on both paths; mmvq GPU tests
#   bench/scripts/gpu_figures.sh s7e     tiny-pair step phases (sampled, prose, copy); 30B-A3B
#                                        decode and concurrency, greedy and sampled
#   bench/scripts/gpu_figures.sh s7f     mmvq GPU tests; dense GEMV of every type, the code types'
#                                        mmvq against the tiled GEMM at 1-8 rows; their launch
#                                        shapes
#   bench/scripts/gpu_figures.sh s7g     grouped MoE GPU tests; 4-bit code type experts, grouped
#                                        against float; tiny-pair sampled step phases
#   bench/scripts/gpu_figures.sh s7h     tiny-pair sampled step phases, proposal rounds counted
#   bench/scripts/gpu_figures.sh s8a     tiny-pair sampled step phases, ramp restarts or not
#   bench/scripts/gpu_figures.sh s8b     tiny-pair step phases of every mode (sampled); greedy
#                                        speculation figures
#   bench/scripts/gpu_figures.sh s8c     30B verify-cost curve, prefix reuse, warm-prefix profile
#   bench/scripts/gpu_figures.sh s8d     build llama.cpp's lookup and speculative tools (CUDA)
#   bench/scripts/gpu_figures.sh s8e     llama.cpp's speculation on the tiny pair (GPU), then ours
#   bench/scripts/gpu_figures.sh s8f     30B verify-cost curve; tiny-pair sampled phases
#   bench/scripts/gpu_figures.sh s8g     tiny-pair sampled phases (prose)
#   bench/scripts/gpu_figures.sh s9a     padded Q6_K: GPU tests, kernels native vs padded, the
#                                        30B's decode native then padded (c1-32)
#   bench/scripts/gpu_figures.sh s9b     the same decode padded then native; greedy GPU vs CPU;
#                                        prefix reuse
#   bench/scripts/gpu_figures.sh s9c     launch shapes for padded Q6_K (dense once GEMV, MoE down)
#   bench/scripts/gpu_figures.sh s9d     8B and 30B figures; prefix reuse padded, then native
#   bench/scripts/gpu_figures.sh s9e     paired q/k + v projections: GPU tests, 30B decode A/B
#   bench/scripts/gpu_figures.sh s10a    the decode attention's q8 output: GPU tests, 30B decode A/B
#   bench/scripts/gpu_figures.sh s10b    the 8B's decode GEMV launch shapes; 8B figures
#   bench/scripts/gpu_figures.sh s10c    one-warp GEMV at M = 1: GPU tests, 8B and 30B decode A/B
#   bench/scripts/gpu_figures.sh s10d    greedy GPU vs CPU; 30B and 8B figures
#   bench/scripts/gpu_figures.sh s10e    prefix reuse at 32k; tiny-pair speculation
#   bench/scripts/gpu_figures.sh s10f    Nsight Compute on the 8B's decode GEMVs (M = 1)
#   bench/scripts/gpu_figures.sh s10g    Nsight Compute on the 30B's MoE decode kernels (T = 1)
#   bench/scripts/gpu_figures.sh s10h    30B decode with smaller MoE decode programs, A/B
#   bench/scripts/gpu_figures.sh s10i    MoE gate/up rows a program A/B; 30B figures
#   bench/scripts/gpu_figures.sh s11a    MoE down: expert split and warps, GPU tests and A/B
#   bench/scripts/gpu_figures.sh s11b    llama.cpp (built for sm_90) and moestream side by side
#   bench/scripts/gpu_figures.sh s11c    batched MoE (grouped) gate/up warps and rows, A/B at 16-32
#   bench/scripts/gpu_figures.sh s11d    one-warp dense GEMV from K = 2048, A/B on the 30B
#   bench/scripts/gpu_figures.sh s12a    `moestream tune`: GPU tests, demo and 30B tuned, greedy
#                                        text and the 30B's decode with the cache and without
#   bench/scripts/gpu_figures.sh s12b    the 30B's decode with the tune cache and without;
#                                        tiny-pair sampled step phases (prose, 10 rounds)
#   bench/scripts/gpu_figures.sh s13a    GPU kernel tests, greedy GPU vs CPU, the 30B synthesised
#   bench/scripts/gpu_figures.sh s13b    the 30B tuned (compiles ahead), decode A/B with the cache
#   bench/scripts/gpu_figures.sh s13c    8 requests, grouped gate/up one warp vs two
#   bench/scripts/gpu_figures.sh s14a    reproducible MoE arithmetic and native CPU experts: GPU bits
#                                        vs the interpreter's and the C code's, greedy GPU vs CPU
#   bench/scripts/gpu_figures.sh s14b    the 30B: contraction off vs on; reproducible down vs default
#   bench/scripts/gpu_figures.sh s15a    per-expert down sums vs default; the 30B at 50% of experts
#                                        on the device, host experts over the link or on the CPU
#   bench/scripts/gpu_figures.sh s15b    the same at 25% and 10%
#   bench/scripts/gpu_figures.sh s16a    host experts' text at three placements; native speed
#                                        after the AVX2 work; the 30B at 50 / 10% with the CPU
#   bench/scripts/gpu_figures.sh s17a    host experts' GPU tests; the 30B's CPU share swept at 50%
#   bench/scripts/gpu_figures.sh s18a    host experts' GPU text test x6; share 0-0.6 at 50%;
#                                        OpenMP threads spinning
#   bench/scripts/gpu_figures.sh s18b    the prefill stage: GPU test; 512/4096-token prefill
#   bench/scripts/gpu_figures.sh s18c    the GPU MoE bits against the exact interpreters
#   bench/scripts/gpu_figures.sh where   GPU-marked graph tests, greedy GPU vs CPU; tiny-pair
#                                        speculation; 30B-A3B decode with and without PDL;
#                                        profiles of a warm 32k prefix-cache prefill and of
#                                        batch-1 decode
set -uo pipefail
part=${1:?usage: gpu_figures.sh check|check2|diag|kern|sweep2|final2|models|experts|profile|tune|host|q8|q30|final|where|pdl|fin3a|fin3b|spechost|after|spec30|probe|probe2|ab3|once|fin4|dip|dgraph|link|spec5|mmq|grouped|fin6|gsmall|q30c|phases|gtest|s7a|s7b|s7c|s7d|s7e|s7f|s7g|s7h|s8a|s8b|s8c|s8d|s8e|s8f|s8g|s9a|s9b|s9c|s9d|s9e|s16a|s17a|s18a|s18b|s18c}
out=${OUT:-/tmp/gpu-figures}
mkdir -p "$out" /tmp/r
export PYTHONUNBUFFERED=1
ms() { python3 -c "import sys; from moestream.cli import main; sys.exit(main())" "$@"; }
bench() {  # bench NAME SECONDS ARGS...: one bench run, its tables, its JSON in $out
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -c "import sys; from moestream.cli import main; sys.exit(main())" \
    bench "$@" --out "/tmp/r/$name" > "/tmp/r/$name.log" 2>&1
  local rc=$?
  # the report once it ran to its end; else each section's table as it ended, and where it
  # stopped
  echo "[$name rc=$rc]"; if [[ $rc == 0 ]]; then sed -n '/^# moestream bench/,$p' \
    "/tmp/r/$name.log" | grep -v "^- \|^$\|wrote" | head -80; else grep -v "^$" \
    "/tmp/r/$name.log" | tail -40; fi
  cp "/tmp/r/$name/result.json" "$out/$name.json" 2>/dev/null
  cp "/tmp/r/$name.log" "$out/$name.log" 2>/dev/null  # what a cut run printed
}
disk() {  # disk G SECONDS CONCURRENCY: the 30B with G GiB of experts on the device and the
  # rest read from the file at every miss (O_DIRECT, no host tier); JSON disk_gG
  bench "disk_g$1" "$2" /tmp/q30.gguf --device cuda --kv-cache-gib 4 \
    --gpu-expert-cache-gib "$1" --host-expert-cache-gib 0 --expert-direct-io \
    --prompt-lens 32 --decode-depths 0 --decode-tokens 16 --repeats 2 --concurrency "$3" \
    --concurrency-prompt 32
}
copy_wait_arms() {  # copy_wait_arms TAG TOKENS REPEATS: batch-1 decode of the 30B, 50% of the
  # experts in slots, the rest streamed from pinned host memory, with the store's I/O threads
  # spinning (False) and asleep (True) on their copies' events, in turn (F T F T); each arm's
  # log appended to $out/TAG_ARM.log, its decode row printed
  local arm rc
  for arm in False True False True; do
    timeout 100 python3 -c "import sys, moestream.experts.store as s
s.COPY_WAIT_BLOCKING = $arm
from moestream.cli import main; sys.exit(main())" bench /tmp/q30.gguf --device cuda \
      --kv-cache-gib 4 --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 \
      --prompt-lens 32 --decode-depths 0 --decode-tokens "$2" --repeats "$3" \
      --out "/tmp/r/$1_$arm" > "/tmp/r/$1_$arm.log" 2>&1
    rc=$?
    cat "/tmp/r/$1_$arm.log" >> "$out/$1_$arm.log"
    echo "blocking=$arm rc=$rc $(grep -A4 '^## decode' "/tmp/r/$1_$arm.log" | tail -1)"
  done
}
queue_arm() {  # queue_arm NAME ARM SECONDS ARGS...: one bench run with the host tier's demand
  # misses queued on the compute stream (True) or loaded by the demand pool (False)
  local name=$1 arm=$2 limit=$3; shift 3
  timeout "$limit" python3 -c "import sys, moestream.experts.store as s
s.QUEUE_HOST_LOADS = $arm
from moestream.cli import main; sys.exit(main())" bench "$@" --out "/tmp/r/${name}_$arm" \
    > "/tmp/r/${name}_$arm.log" 2>&1
  echo "$name queue=$arm rc=$? $(grep -A4 '^## decode' "/tmp/r/${name}_$arm.log" | tail -1)"
  grep -i "stall ms\|hit rate\|^| aggregate\|^| 8 " "/tmp/r/${name}_$arm.log" | head -6
  cp "/tmp/r/${name}_$arm.log" "$out/${name}_$arm.log"
  cp "/tmp/r/${name}_$arm/result.json" "$out/${name}_$arm.json" 2>/dev/null
}
bench_run() {  # bench_run NAME SECONDS ARGS...: one `moestream bench` run, its decode row and
  # expert counters printed, log and JSON kept
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m moestream.cli bench "$@" --out "/tmp/r/$name" > "/tmp/r/$name.log" 2>&1
  echo "$name rc=$? $(grep -A4 '^## decode' "/tmp/r/$name.log" | tail -1)"
  grep -i "hit rate\|read share\|admissions\|link_reads\|^| aggregate\|^| 8 " "/tmp/r/$name.log" | head -6
  cp "/tmp/r/$name.log" "$out/$name.log"
  cp "/tmp/r/$name/result.json" "$out/$name.json" 2>/dev/null
}
synth() {  # synth LIKE NAME [MIX]: /tmp/NAME.gguf in LIKE's shapes (MIX default Q4_K_M)
  [[ -f /tmp/$2.gguf ]] || python3 -c "from moestream.weights.synth import synth_gguf
synth_gguf('$1', '${3:-Q4_K_M}', '/tmp/$2.gguf', progress=False)"
}
host_gpu_tests() {  # host_gpu_tests N LIMIT: the host-expert GPU tests N times, each with
  # the driver's error log (CUDA_LOG_FILE), all output into gputests.txt
  for i in $(seq 1 "$1"); do
    CUDA_LOG_FILE="$out/cudalog$i.txt" timeout "$2" python3 -m pytest \
      tests/experts/test_host_compute_gpu.py -q -p no:cacheprovider --tb=short \
      > /tmp/r/gputest.txt 2>&1
    { echo "== run $i"; cat /tmp/r/gputest.txt; } >> "$out/gputests.txt"; tail -1 /tmp/r/gputest.txt
  done
}
poll_ab() {  # poll_ab: host functions, then poll mode, each in its own process: the batch-1
  # profile at 50% on the device (CPU share 0.5), the sweep at 50% and at 10%
  local p prof=(/tmp/q30.gguf --device cuda --steps 8 --kv-cache-gib 4 --gpu-expert-cache-gib 8.8
    --host-expert-cache-gib 24 --expert-zero-copy --expert-cpu-fraction 0.5)
  for p in 0 1; do
    MOESTREAM_HOST_POLL=$p timeout 100 python3 bench/profile_decode.py "${prof[@]}" 2>&1 \
      | grep -v "USDT\|_warn_once\|UserWarning" | tee "$out/profile_poll$p.md" | head -8
    MOESTREAM_HOST_POLL=$p timeout 120 python3 bench/hybrid_sweep.py /tmp/q30.gguf \
      --gpu-expert-cache-gib 8.8 --fractions 0.5 --batches 1,8 --tokens 64 2>&1 \
      | tee "$out/sweep50_poll$p.md" | tail -2
    MOESTREAM_HOST_POLL=$p timeout 100 python3 bench/hybrid_sweep.py /tmp/q30.gguf \
      --gpu-expert-cache-gib 1.76 --fractions 0.5 --batches 1,8 --tokens 64 2>&1 \
      | tee "$out/sweep10_poll$p.md" | tail -2
  done
}
# The runs the parts share (each part names what it runs).
q30() {  # q30 [EXTRA ARGS...]: the 30B's prefill, decode at depths, concurrency
  bench q30 300 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512,4096 \
    --decode-depths 0,4096,32768 --decode-tokens 64 --repeats 3 --concurrency 1,2,4,8,16,32 \
    --concurrency-prompt 128 "$@"
}
q8() {
  bench q8 100 /tmp/q8.gguf --device cuda --kv-cache-gib 16 --prompt-lens 512,4096 \
    --decode-depths 0,32768 --decode-tokens 64 --repeats 3
}
prefix() {
  bench prefix 120 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512 \
    --decode-depths 0 --decode-tokens 16 --repeats 2 --prefix-reuse 32768:31744
}
q30wc() {  # q30wc SECONDS CONCURRENCY: bf16 copies of all weights but the head (~58 GiB)
  bench q30wc "$1" /tmp/q30.gguf --device cuda --kv-cache-gib 24 --weight-cache-gib 64 \
    --prompt-lens 512,4096 --decode-depths 0 --decode-tokens 32 --repeats 3 \
    --concurrency "$2" --concurrency-prompt 128 --prefix-reuse 32768:31744
}
spec() {  # spec SECONDS ROUNDS: the tiny pair's speculation, then under batch-invariant kernels
  timeout "$1" python3 bench/spec_figures.py --device cuda --rounds "$2" --prompts 2 \
    --tokens 128 --json "$out/spec_gpu.json" 2> "$out/spec_gpu.err" | tail -20
  # no divergence expected under --deterministic (exit status 1 otherwise)
  timeout "$1" python3 bench/spec_figures.py --device cuda --deterministic --rounds 1 \
    --prompts 2 --tokens 128 2> /dev/null | tail -20; echo "[spec deterministic rc=$?]"
}
host_time() {  # host_time SECONDS BATCHES: host (Python) time per decode step (issue #4 item 4)
  timeout "$1" python3 bench/host_overhead.py /tmp/q30.gguf --device cuda --batches "$2" \
    --steps 50 > "$out/host_overhead.txt" 2>&1
  echo "[host_overhead rc=$?]"; head -60 "$out/host_overhead.txt"
}
profile_b() {  # profile_b BATCH: top kernels of a 512-token prefill and of decode steps
  timeout 150 python3 bench/profile_steps.py /tmp/q30.gguf --kv-cache-gib 8 --prefill 512 \
    --batch "$1" --decode-tokens 16 --rows 40 > "$out/profile_b$1.txt" 2>&1
  echo "[profile b=$1 rc=$?]"; grep -v "^USDT\|^$" "$out/profile_b$1.txt" | head -90
}
ab_decode() {  # ab_decode WHAT ARM PRELUDE SECONDS: one arm of an A/B of a model's decode
  # (/tmp/$AB_MODEL.gguf, the 30B by default; batch 1 and 8 requests, or AB_CONC; AB_TOKENS
  # timed tokens, 64 by default); PRELUDE is Python run before the CLI (the arm's patch)
  timeout "$4" python3 -c "${3}import sys; from moestream.cli import main; sys.exit(main())" \
    bench "/tmp/${AB_MODEL:-q30}.gguf" --device cuda --kv-cache-gib 8 --prompt-lens 512 \
    --decode-depths 0 --decode-tokens "${AB_TOKENS:-64}" --repeats 3 \
    --concurrency "${AB_CONC:-1,8}" --concurrency-prompt 128 --out "/tmp/r/ab_$2" \
    > /tmp/r/ab.log 2>&1
  echo "[$1 $2 rc=$?]"; grep "^| 0 \|^| 1 \|^| 8 \|^| 16 \|^| 32 " /tmp/r/ab.log
  cp "/tmp/r/ab_$2/result.json" "$out/ab_$1_$2.json" 2>/dev/null
}
hyb() {  # hyb PERCENT GIB FRACTION: the 30B with GIB of experts on the device (PERCENT of
  # them), the rest in pinned host memory, FRACTION of those computed by the host's cores
  bench "hyb${1}_f$3" 170 /tmp/q30.gguf --device cuda --kv-cache-gib 4 --gpu-expert-cache-gib "$2" \
    --host-expert-cache-gib 24 --expert-zero-copy --expert-cpu-fraction "$3" --prompt-lens 32 \
    --decode-depths 0 --decode-tokens 32 --repeats 3 --concurrency 8 --concurrency-prompt 32
}
onoff_ab() {  # onoff_ab WHAT PRELUDE: ab_decode's arms off1, on1, on2, off2 (32 tokens), the
  # off arms run after PRELUDE
  local arm
  for arm in off1 on1 on2 off2; do
    AB_TOKENS=32 ab_decode "$1" "$arm" "$([[ $arm == off* ]] && echo "$2")" 100
  done
}
cfg_ab() {  # cfg_ab MODULE NAME=FIELDS...: the 30B's decode (ab_decode, 32 tokens) per arm in
  # turn, FIELDS replacing those of moestream.kernels.MODULE.DEFAULT_CONFIG (none: the default)
  local cfg="import dataclasses, moestream.kernels.$1 as m; m.DEFAULT_CONFIG = dataclasses.replace(m.DEFAULT_CONFIG"
  local what=$1 arm pre
  shift
  for arm in "$@"; do
    pre=""; [[ -n ${arm#*=} ]] && pre="$cfg, ${arm#*=}); "
    AB_TOKENS=32 ab_decode "$what" "${arm%%=*}" "$pre" 100
  done
}
moe_ab() { cfg_ab moe_mmvq "$@"; }
tune_ab() {  # the 30B's decode without and with /tmp/mcache (off, on, on, off; 32 tokens)
  local arm
  for arm in off1 on1 on2 off2; do
    MOESTREAM_CACHE_DIR=/tmp/mcache MOESTREAM_TUNE_CACHE=${arm%?} AB_TOKENS=32 \
      ab_decode tune "$arm" "" 100
  done
}
tune_model() {  # tune_model FILE NAME SECONDS BATCHES: `moestream tune` into /tmp/mcache
  timeout "$3" python3 -c "import sys; from moestream.cli import main; sys.exit(main())" tune \
    "$1" --device cuda --cache-dir /tmp/mcache --batch-sizes "$4" 2> "/tmp/r/tune_$2.err" \
    | tee "$out/tune_$2.txt"
  local rc=${PIPESTATUS[0]}
  echo "[tune $2 rc=$rc]"; [[ $rc == 0 ]] && echo "$2" >> /tmp/mcache/tuned || tail -5 "/tmp/r/tune_$2.err"
}  # moe_ab NAME=FIELDS...: cfg_ab on the MoE mmvq path
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
[[ -f COMMIT ]] && export MOESTREAM_COMMIT=$(cat COMMIT) && echo "commit $MOESTREAM_COMMIT"
case $part in
  check)
    timeout 330 python3 -m pytest tests/kernels tests/runner tests/experts tests/engine -q \
      -p no:cacheprovider --maxfail=8 -rf 2>&1 | tail -15
    python3 bench/kernels_gpu.py --only mmvq,moe,dequant,cached 2>&1 | tee "$out/kernels.log" | tail -40
    timeout 120 python3 bench/mmq_gpu.py 2>&1 | tee "$out/mmq.log" | tail -18
    python3 bench/greedy_gpu_vs_cpu.py --tokens 200 --prompts 4 --json "$out/greedy.json" | tail -12
    spec 150 2
    ;;
  models)
    synth qwen3-30b-a3b q30; synth qwen3-8b q8
    q30 --verify-curve 1,2,4,8,16 --verify-batches 1,4,16
    bench q30det 150 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512,4096 \
      --decode-depths 0 --decode-tokens 64 --repeats 3 --concurrency 8,32 --deterministic
    q8
    prefix
    q30wc 150 1,8,16,32
    ;;
  experts)
    synth qwen3-30b-a3b q30
    # zero-copy placement (41 / 30 tok/s at 8 / 4 GiB on 2026-11-29; 64-token prompts and
    # concurrency 8 did not finish in 75 s), then streaming slots
    for gib in 8 4 1.6; do
      bench "zc$gib" 150 /tmp/q30.gguf --device cuda --kv-cache-gib 4 --gpu-expert-cache-gib "$gib" \
        --host-expert-cache-gib 24 --expert-zero-copy --prompt-lens 32 --decode-depths 0 \
        --decode-tokens 16 --repeats 2
    done
    bench exp8 150 /tmp/q30.gguf --device cuda --kv-cache-gib 4 --gpu-expert-cache-gib 8 \
      --host-expert-cache-gib 24 --prompt-lens 32 --decode-depths 0 --decode-tokens 16 --repeats 2
    ;;
  profile)
    synth qwen3-30b-a3b q30
    host_time 200 1,8,32
    for b in 1 8 32; do profile_b "$b"; done
    ;;
  tune)
    # launch shapes: one run picks the defaults (bench/RESULTS.md)
    timeout 130 python3 -m pytest tests/kernels/test_moe_kernel.py tests/kernels/test_mmvq.py \
      tests/kernels/test_paged_attention.py tests/kernels/test_router.py \
      tests/kernels/test_norm_rope.py tests/layers/test_q8_fusion.py -q -p no:cacheprovider -x \
      -rf 2>&1 | tail -6 | tee "$out/pytest.txt"
    timeout 230 python3 bench/kernels_gpu.py --sweep-moe 2>&1 | tee "$out/sweep_moe.log" | tail -40
    timeout 100 python3 bench/mmvq_sweep.py 2>&1 | tee "$out/sweep_mmvq.log" | tail -40
    timeout 100 python3 bench/attention_gpu.py --quick 2>&1 | tee "$out/attention.log" | tail -40
    ;;
  host)
    timeout 120 python3 bench/mmq_gpu.py --switch 2>&1 | tee "$out/switch.log" | tail -40
    synth qwen3-30b-a3b q30
    host_time 120 1,8
    profile_b 1
    ;;
  diag)
    # every kernel test on the GPU; the MoE path switch points; where a prefill's time goes
    timeout 240 python3 -m pytest tests/kernels -q -p no:cacheprovider -rf 2>&1 | tail -8 \
      | tee "$out/pytest_kernels.txt"
    timeout 100 python3 bench/mmq_gpu.py --switch 2>&1 | tee "$out/switch.log" | tail -30
    synth qwen3-30b-a3b q30
    for wc in 0 64; do
      timeout 150 python3 bench/profile_steps.py /tmp/q30.gguf --kv-cache-gib 8 --batch 0 \
        --prefill 512,2048 --rows 30 --weight-cache-gib $wc > "$out/profile_prefill_wc$wc.txt" 2>&1
      echo "[profile prefill wc=$wc rc=$?]"
      grep "^## \|^wall" "$out/profile_prefill_wc$wc.txt"
    done
    ;;
  kern)
    # the 30B's prefill (prefill graphs), prefix reuse and batched decode; the grouped MoE and
    # dequantizer launch sweeps; the new kernels' GPU tests (and the engine with prefill graphs)
    synth qwen3-30b-a3b q30
    bench q30k 170 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512,4096 \
      --decode-depths 0 --decode-tokens 32 --repeats 3 --concurrency 16,32 \
      --concurrency-prompt 128 --prefix-reuse 32768:31744
    timeout 100 python3 bench/dequant_sweep.py --quick 2>&1 | tee "$out/sweep_dequant.log" | tail -30
    timeout 130 python3 -m pytest tests/kernels/test_moe_align.py \
      tests/kernels/test_dequant_mm.py tests/runner/test_cuda_graph.py -q -p no:cacheprovider \
      -rf 2>&1 | tail -8 | tee "$out/pytest_kern.txt"
    ;;
  sweep2)
    # prefill attention, MoE mmq and zero-copy MoE launch shapes; GPU tests of the changed paths
    timeout 110 python3 bench/prefill_attention_gpu.py --quick 2>&1 | tee "$out/sweep_prefill_attn.log" | tail -30
    timeout 80 python3 bench/kernels_gpu.py --sweep-moe-mmq 2>&1 | tee "$out/sweep_moe_mmq.log" | tail -8
    timeout 80 python3 bench/kernels_gpu.py --sweep-moe-host 2>&1 | tee "$out/sweep_moe_host.log" | tail -8
    timeout 90 python3 -m pytest tests/kernels/test_swiglu.py tests/kernels/test_prefill_attention.py \
      tests/runner/test_cuda_graph.py tests/models/test_vs_transformers.py -q -p no:cacheprovider \
      -x -rf 2>&1 | tail -8 | tee "$out/pytest_sweep2.txt"
    ;;
  final2)
    # GPU tests of the changed paths; the 30B and 8B figures; greedy text against the CPU;
    # zero-copy experts at 8 GiB on the device
    timeout 90 python3 -m pytest tests/kernels/test_swiglu.py tests/kernels/test_prefill_attention.py \
      tests/runner/test_cuda_graph.py tests/models/test_vs_transformers.py -q -p no:cacheprovider \
      -rf 2>&1 | tail -6 | tee "$out/pytest_final.txt"
    synth qwen3-30b-a3b q30; synth qwen3-8b q8
    bench q30 240 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512,4096 \
      --decode-depths 0,32768 --decode-tokens 32 --repeats 3 --concurrency 1,8,16,32 \
      --concurrency-prompt 128 --prefix-reuse 32768:31744
    bench q8 100 /tmp/q8.gguf --device cuda --kv-cache-gib 16 --prompt-lens 512,4096 \
      --decode-depths 0,32768 --decode-tokens 32 --repeats 3
    timeout 70 python3 bench/greedy_gpu_vs_cpu.py --tokens 200 --prompts 4 \
      --json "$out/greedy.json" 2>&1 | tail -12
    bench zc8 80 /tmp/q30.gguf --device cuda --kv-cache-gib 4 --gpu-expert-cache-gib 8 \
      --host-expert-cache-gib 24 --expert-zero-copy --prompt-lens 32 --decode-depths 0 \
      --decode-tokens 16 --repeats 2
    ;;
  check2)
    # the GPU-marked tests of graphs, models and fusions; the tiny pair's speculation
    timeout 150 python3 -m pytest tests/runner/test_cuda_graph.py tests/runner/test_verify_graphs.py \
      tests/models/test_vs_transformers.py tests/layers/test_q8_fusion.py -m gpu -q \
      -p no:cacheprovider -rf 2>&1 | tail -8 | tee "$out/pytest_gpu.txt"
    timeout 150 python3 bench/spec_figures.py --device cuda --rounds 1 --prompts 2 --tokens 128 \
      --json "$out/spec_gpu.json" 2> "$out/spec_gpu.err" | tail -20
    ;;
  where)
    timeout 120 python3 -m pytest tests/runner/test_cuda_graph.py tests/runner/test_verify_graphs.py \
      tests/runner/test_prefill_graphs.py tests/layers/test_q8_fusion.py -m gpu -q \
      -p no:cacheprovider -rf 2>&1 | tail -4 | tee "$out/pytest_gpu.txt"
    timeout 70 python3 bench/greedy_gpu_vs_cpu.py --tokens 200 --prompts 4 \
      --json "$out/greedy.json" 2>&1 | tail -6
    timeout 100 python3 bench/spec_figures.py --device cuda --rounds 1 --prompts 2 --tokens 128 \
      --json "$out/spec_gpu.json" 2> "$out/spec_gpu.err" | tail -20
    synth qwen3-30b-a3b q30
    for pdl in 1 0; do
      MOESTREAM_PDL=$pdl bench "q30_pdl$pdl" 90 /tmp/q30.gguf --device cuda --kv-cache-gib 8 \
        --prompt-lens 512 --decode-depths 0 --decode-tokens 64 --repeats 3 --concurrency 1,8
    done
    timeout 200 python3 bench/profile_steps.py /tmp/q30.gguf --kv-cache-gib 24 --prefill "" \
      --batch 1 --decode-tokens 16 --rows 30 --prefix-reuse 32768:31744 > "$out/profile.txt" 2>&1
    echo "[profile rc=$?]"; grep "^## \|^wall" "$out/profile.txt"
    ;;
  pdl)
    timeout 150 python3 -m pytest tests/kernels/test_pdl.py tests/kernels/test_router.py \
      tests/runner/test_cuda_graph.py tests/runner/test_verify_graphs.py -q -p no:cacheprovider \
      -rf 2>&1 | tail -4
    timeout 70 python3 bench/greedy_gpu_vs_cpu.py --tokens 200 --prompts 4 \
      --json "$out/greedy.json" 2>&1 | tail -3
    synth qwen3-30b-a3b q30
    i=0
    for pdl in 1 0 0 1; do
      i=$((i + 1))
      MOESTREAM_PDL=$pdl bench "q30_pdl${pdl}_r$i" 90 /tmp/q30.gguf \
        --device cuda --kv-cache-gib 8 --prompt-lens 512 --decode-depths 0 --decode-tokens 64 \
        --repeats 3 --concurrency 1,8 2>&1 | grep "rc=\|^| 0 \|^| 1 \|^| 8 "
    done
    ;;
  fin3a)
    timeout 200 python3 bench/spec_figures.py --device cuda --rounds 2 --prompts 2 --tokens 128 \
      --json "$out/spec_gpu.json" 2> "$out/spec_gpu.err" | tail -16
    synth qwen3-8b q8
    bench q8 150 /tmp/q8.gguf --device cuda --kv-cache-gib 16 --prompt-lens 512,4096 \
      --decode-depths 0,32768 --decode-tokens 32 --repeats 3
    ;;
  fin3b)
    synth qwen3-30b-a3b q30
    bench q30 400 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512,4096 \
      --decode-depths 0,32768 --decode-tokens 32 --repeats 3 --concurrency 1,8,16,32 \
      --concurrency-prompt 128
    ;;
  spechost)
    for mode in off ngram draft; do
      timeout 100 python3 bench/spec_host_profile.py --mode "$mode" --rows 22 \
        > "$out/spec_host_$mode.txt" 2>&1
      grep -v "^USDT\|^$\|Ordered\|List reduced" "$out/spec_host_$mode.txt" | cut -c1-150 | head -32
    done
    ;;
  after)
    timeout 200 python3 bench/spec_after_draft.py --repeats 3 2>&1 | grep -v "^USDT" | tee "$out/after.txt"
    ;;
  spec30)
    synth qwen3-30b-a3b q30
    bench q30spec 280 /tmp/q30.gguf --device cuda --kv-cache-gib 8 --speculative auto \
      --prompt-lens 512 --decode-depths 0 --decode-tokens 128 --repeats 3
    ;;
  probe)
    for kind in copy prose; do
      timeout 150 python3 bench/spec_phases.py --kind $kind --rounds 6 2> /dev/null \
        | tee "$out/phases_$kind.txt"
    done
    timeout 150 python3 bench/spec_phases.py --kind copy --rounds 6 --freeze 2> /dev/null \
      | tee "$out/phases_copy_freeze.txt"
    timeout 200 python3 bench/kernels_gpu.py --only moe,mmvq 2>&1 | tee "$out/kernels.log" | tail -30
    timeout 200 ncu --kernel-name regex:'_gate_up_mmvq_kernel|_down_mmvq_kernel' --launch-count 4 \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis python3 bench/kernels_gpu.py --only moe --quick \
      > "$out/ncu_moe.txt" 2>&1
    echo "[ncu rc=$?]"; grep -E "mmvq_kernel|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Waves Per|Memory Throughput" "$out/ncu_moe.txt" | head -40
    ;;
  probe2)
    timeout 120 python3 bench/kernels_gpu.py --sweep-router 2>&1 | tee "$out/sweep_router.log"
    synth qwen3-30b-a3b q30
    prefix
    ;;
  ab3)
    timeout 200 python3 -m pytest tests/kernels/test_dequant_mm.py tests/kernels/test_router.py \
      tests/kernels/test_swiglu.py -q -p no:cacheprovider 2>&1 | tail -3
    synth qwen3-30b-a3b q30
    # the router's launch shape before (64 programs of 4 warps) and now, interleaved
    old='import moestream.kernels.router as r; r.fused_route.__kwdefaults__.update(programs_per_token=64, num_warps=4); '
    for shape in old new old new; do
      pre=""; [[ $shape == old ]] && pre=$old
      ab_decode router "$shape" "$pre" 150
    done
    prefix
    ;;
  once)
    timeout 200 python3 -m pytest tests/kernels/test_moe_kernel.py -q -p no:cacheprovider -k mmvq \
      2>&1 | tail -3
    timeout 300 python3 bench/kernels_gpu.py --sweep-moe-once 2>&1 | tee "$out/sweep_moe_once.log"
    ;;
  fin4)
    synth qwen3-30b-a3b q30
    # the MoE gate/up kernel: the tile kernel's default shape, then the "once" default
    tile='import moestream.kernels.moe_mmvq as m; m.DEFAULT_CONFIG = m.MoeMmvqConfig(); '
    for arm in tile once; do
      pre=""; [[ $arm == tile ]] && pre=$tile
      ab_decode moe "$arm" "$pre" 100
    done
    bench q30 200 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512,4096 \
      --decode-depths 0,32768 --decode-tokens 32 --repeats 3 --concurrency 1,8,16,32 \
      --concurrency-prompt 128
    timeout 130 python3 bench/spec_figures.py --device cuda --rounds 3 --prompts 2 --tokens 128 \
      --json "$out/spec_gpu.json" 2> "$out/spec_gpu.err" | tail -16
    timeout 60 python3 bench/spec_phases.py --kind prose --rounds 3 2> /dev/null \
      | tee "$out/phases_prose.txt"
    timeout 90 python3 bench/greedy_gpu_vs_cpu.py --tokens 200 --prompts 4 \
      --json "$out/greedy.json" | tail -8
    timeout 60 python3 -m pytest tests/kernels/test_moe_kernel.py -q -p no:cacheprovider \
      -k "once or cfg3" 2>&1 | tail -3
    ;;
  dip)
    for kind in prose copy; do
      timeout 100 python3 bench/spec_phases.py --kind $kind --rounds 6 --modes plain,auto,draft \
        2>&1 | grep -v "^USDT" | tee "$out/phases_$kind.txt"
    done
    ;;
  dgraph)  # the draft model's decode graphs switched on (they are off by default)
    timeout 110 python3 - <<'PY' 2>&1 | grep -v "^USDT" | tail -24
import runpy
import sys

import moestream.spec.draft as d

init = d.DraftModelProposer.__init__


def with_graphs(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.use_graphs = True


d.DraftModelProposer.__init__ = with_graphs
sys.argv = ["spec_figures.py", "--device", "cuda", "--rounds", "2", "--prompts", "2",
            "--tokens", "128", "--kinds", "copy"]
runpy.run_path("bench/spec_figures.py", run_name="__main__")
PY
    ;;
  link)
    timeout 120 python3 -m pytest tests/experts/test_zero_copy.py -q -p no:cacheprovider -m gpu \
      2>&1 | tail -3
    timeout 120 python3 bench/host_link.py --json "$out/host_link.json" 2>&1 | tail -14
    synth qwen3-30b-a3b q30
    # the hint on the address integer, as before 7f951f1 (the cast dropped it)
    cat > /tmp/r/old_align.py <<'PY'
import triton
import triton.language as tl


@triton.jit
def aligned_address(addr):
    return tl.multiple_of(addr, 16).to(tl.pointer_type(tl.uint8))
PY
    old='import sys; sys.path.insert(0, "/tmp/r"); import old_align; import moestream.kernels.moe_mmvq as m; m._aligned_address = old_align.aligned_address; '
    for arm in new old; do  # ~2.5 min each (the 30B's experts into pinned memory first)
      pre=""; [[ $arm == old ]] && pre=$old
      timeout 150 python3 -c "${pre}import sys; from moestream.cli import main; sys.exit(main())" \
        bench /tmp/q30.gguf --device cuda --kv-cache-gib 4 --gpu-expert-cache-gib 8 \
        --host-expert-cache-gib 24 --expert-zero-copy --prompt-lens 32 --decode-depths 0 \
        --decode-tokens 16 --repeats 2 --out "/tmp/r/zc_$arm" > /tmp/r/zc.log 2>&1
      echo "[zero-copy 8 GiB, hint $arm rc=$?]"; grep "^| 0 \|zero-copy\|host link" /tmp/r/zc.log
      cp "/tmp/r/zc_$arm/result.json" "$out/zc_$arm.json" 2>/dev/null
    done
    ;;
  spec5)
    timeout 150 python3 -m pytest tests/spec/test_draft.py tests/kernels/test_quant_matmul.py \
      -q -p no:cacheprovider -x 2>&1 | tail -3
    # the float GEMV of every type at N=12288 K=4096 (IQ4_XS, MXFP4, Q4_0: new kernels)
    timeout 120 python3 bench/kernels_gpu.py --only gemv 2>&1 | tee "$out/kernels_gemv.log" \
      | grep -E "^\| gemv|copy bandwidth"
    # a Q4_0 model through the new 32-value-block kernels, as CUDA graphs and eager
    synth qwen3-0.6b q06_q40 Q4_0
    for arm in graphs eager; do
      flag=""; [[ $arm == eager ]] && flag=--enforce-eager
      timeout 120 python3 -c "import sys; from moestream.cli import main; sys.exit(main())" \
        generate /tmp/q06_q40.gguf --device cuda -p "The quick brown fox" --max-tokens 48 \
        --temperature 0 $flag > "/tmp/r/q40_$arm.txt" 2> "/tmp/r/q40_$arm.err"
      echo "[Q4_0 generate, $arm rc=$?]"; tail -c 240 "/tmp/r/q40_$arm.txt"; echo
    done
    cmp -s /tmp/r/q40_graphs.txt /tmp/r/q40_eager.txt && echo "same text" || echo "texts differ"
    for kind in prose copy; do
      timeout 150 python3 bench/spec_phases.py --kind $kind --rounds 6 \
        --modes plain,plain#2,draft,auto 2>&1 | grep -v "^USDT" | tee "$out/phases_$kind.txt"
    done
    ;;
  mmq)
    timeout 300 ncu --kernel-name regex:'_moe_gate_up_kernel|_moe_down_kernel' --launch-count 4 \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats \
      python3 bench/kernels_gpu.py --only moe > "$out/ncu_mmq.txt" 2>&1
    echo "[ncu rc=$?]"; grep -E "_kernel|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Waves Per|Memory Throughput|Stall|Eligible" "$out/ncu_mmq.txt" | head -60
    ;;
  grouped)
    timeout 150 python3 -m pytest tests/spec/test_draft.py tests/kernels/test_moe_grouped.py \
      -q -p no:cacheprovider -x 2>&1 | tail -3
    timeout 300 python3 bench/kernels_gpu.py --sweep-moe-grouped 2>&1 \
      | tee "$out/sweep_moe_grouped.log" | grep -v "^  T=.*grouped" | tail -14
    synth qwen3-30b-a3b q30
    # the model with the grouped path for 17-64 tokens (A = 129..512), then as it is
    on='import moestream.kernels.moe as m; m.GROUPED_MIN_ASSIGNMENTS = 129; m.GROUPED_MAX_ASSIGNMENTS = 512; '
    for arm in grouped default; do
      pre=""; [[ $arm == grouped ]] && pre=$on
      timeout 150 python3 -c "${pre}import sys; from moestream.cli import main; sys.exit(main())" \
        bench /tmp/q30.gguf --device cuda --kv-cache-gib 8 --prompt-lens 128 --decode-depths 0 \
        --decode-tokens 32 --repeats 2 --concurrency 16,32 --concurrency-prompt 128 \
        --out "/tmp/r/grp_$arm" > /tmp/r/grp.log 2>&1
      echo "[30B concurrency, $arm rc=$?]"; grep "^| 16 \|^| 32 " /tmp/r/grp.log
      cp "/tmp/r/grp_$arm/result.json" "$out/grp_$arm.json" 2>/dev/null
    done
    ;;
  gsmall)  # the grouped MoE at 4-12 tokens (mmvq's range) and its down kernel's shapes
    timeout 400 python3 bench/kernels_gpu.py --sweep-moe-grouped-small 2>&1 \
      | tee "$out/sweep_moe_grouped_small.log" | grep -v "^  T=.*grouped" | tail -14
    ;;
  fin6)  # the tiny pair's step phases with the picker's re-timing; 30B figures, grouped MoE
    for kind in prose copy; do
      timeout 100 python3 bench/spec_phases.py --kind $kind --rounds 4 \
        --modes plain,plain#2,draft,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_$kind.txt"
    done
    synth qwen3-30b-a3b q30
    bench q30 280 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512,4096 \
      --decode-depths 0,32768 --decode-tokens 32 --repeats 3 --concurrency 1,8,16,32 \
      --concurrency-prompt 128
    ;;
  gtest)  # GPU tests of the grouped MoE and the MoE path choice; then `phases`
    timeout 100 python3 -m pytest tests/kernels/test_moe_grouped.py tests/spec/test_picker.py \
      -q -p no:cacheprovider 2>&1 | tail -2
    bash "$0" phases
    ;;
  phases)  # the tiny pair's step phases alone (fin6's first half), 6 rounds
    for kind in prose copy; do
      timeout 150 python3 bench/spec_phases.py --kind $kind --rounds 6 \
        --modes plain,plain#2,draft,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_$kind.txt"
    done
    ;;
  q30c)  # the 30B figures alone (fin6's bench run)
    synth qwen3-30b-a3b q30
    bench q30 280 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512,4096 \
      --decode-depths 0,32768 --decode-tokens 32 --repeats 3 --concurrency 1,8,16,32 \
      --concurrency-prompt 128
    ;;
  s7a)  # the 30B's batch-1 decode profile; the tiny pair's step phases, also sampled at T=1
    synth qwen3-30b-a3b q30
    profile_b 1
    for kind in prose copy; do
      timeout 130 python3 bench/spec_phases.py --kind $kind --rounds 6 \
        --modes plain,plain#2,draft,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_$kind.txt"
    done
    timeout 130 python3 bench/spec_phases.py --kind prose --rounds 6 --temperature 1.0 \
      --modes plain,plain#2,draft,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_t1.txt"
    ;;
  s7b)  # sampled decode (temperature 1): the 30B with run-ahead for greedy steps only (old)
    # and for sampled ones too (new), interleaved; the tiny pair's step phases, sampled and not
    synth qwen3-30b-a3b q30
    old='import moestream.runner.model_runner as m; from moestream.sampling import argmax_only; '
    old+='m.ModelRunner._aheadable = lambda self, reqs: self.logits_processor is None and '
    old+='all(argmax_only(s.sampling_params) for s in reqs); '
    for arm in old new new old; do
      pre=""; [[ $arm == old ]] && pre=$old
      timeout 110 python3 -c "${pre}import sys; from moestream.cli import main; sys.exit(main())" \
        bench /tmp/q30.gguf --device cuda --kv-cache-gib 8 --prompt-lens 128 --decode-depths 0 \
        --decode-tokens 48 --repeats 3 --concurrency 1,16 --concurrency-prompt 128 \
        --temperature 1.0 --out "/tmp/r/t1_$arm" > /tmp/r/t1.log 2>&1
      echo "[30B sampled, $arm rc=$?]"; grep "^| 0 \|^| 1 \|^| 16 " /tmp/r/t1.log
      cp "/tmp/r/t1_$arm/result.json" "$out/t1_${arm}_$RANDOM.json" 2>/dev/null
    done
    timeout 130 python3 bench/spec_phases.py --kind prose --rounds 6 --temperature 1.0 \
      --modes plain,plain#2,draft,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_t1.txt"
    timeout 100 python3 bench/spec_phases.py --kind prose --rounds 4 \
      --modes plain,plain#2,draft,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_prose.txt"
    ;;
  s7c)  # the tiny pair's sampled steps with run-ahead and without (plain!), runner parts timed
    timeout 150 python3 bench/spec_phases.py --kind prose --rounds 6 --temperature 1.0 \
      --modes plain,plain!,plain#2,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_t1.txt"
    timeout 100 python3 bench/spec_phases.py --kind prose --rounds 4 \
      --modes plain,plain! 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_prose.txt"
    ;;
  s7d)  # tiny-pair step phases (sampled at T=1, prose, copy) with the runner's parts; the
    # dense GEMV of every type (float and integer-dot paths); the mmvq GPU tests
    timeout 150 python3 bench/spec_phases.py --kind prose --rounds 6 --temperature 1.0 \
      --modes plain,plain!,plain#2,draft,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_t1.txt"
    for kind in prose copy; do
      timeout 130 python3 bench/spec_phases.py --kind $kind --rounds 6 \
        --modes plain,plain#2,draft,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_$kind.txt"
    done
    timeout 120 python3 bench/kernels_gpu.py --only gemv 2>&1 | tee "$out/kernels_gemv.log" \
      | grep -E "^\| (gemv|mmvq)|copy bandwidth|passed|failed"
    timeout 150 python3 -m pytest tests/kernels/test_mmvq.py -q -p no:cacheprovider 2>&1 | tail -3
    ;;
  s7e)  # tiny-pair step phases (sampled at T=1, prose, copy); the 30B greedy and sampled
    for t in 1.0 0; do
      k=prose; [[ $t == 0 ]] && k="prose copy"
      for kind in $k; do
        timeout 130 python3 bench/spec_phases.py --kind $kind --rounds 6 --temperature $t \
          --modes plain,plain#2,draft,auto 2>&1 | grep -v "^USDT\|^round" \
          | tee "$out/phases_${kind}_t$t.txt"
      done
    done
    synth qwen3-30b-a3b q30
    for t in 0 1.0; do
      bench "q30_t$t" 120 /tmp/q30.gguf --device cuda --kv-cache-gib 8 --prompt-lens 128 \
        --decode-depths 0 --decode-tokens 48 --repeats 3 --concurrency 1,8,16,32 \
        --concurrency-prompt 128 --temperature $t
    done
    ;;
  s7f)  # the mmvq GPU tests; the dense GEMV of every type (float path, mmvq and the tiled GEMM
    # of the 4-bit code types at 1-8 rows)
    timeout 150 python3 -m pytest tests/kernels/test_mmvq.py tests/kernels/test_invariant_ops.py \
      -q -p no:cacheprovider 2>&1 | tail -3
    timeout 150 python3 bench/kernels_gpu.py --only gemv 2>&1 | tee "$out/kernels_gemv.log" \
      | grep -E "^\| (gemv|mmvq|gemm)|copy bandwidth|passed|failed"
    timeout 240 python3 bench/mmvq_sweep.py --types Q4_0,IQ4_NL,IQ4_XS,MXFP4 2>&1 \
      | tee "$out/mmvq_sweep_codes.log" | sed -n '/^best per shape/,$p'
    ;;
  s7g)  # the grouped MoE's GPU tests (4-bit code types included); code-type experts, grouped
    # against the float path; the tiny pair's sampled step phases, 10 rounds
    timeout 170 python3 -m pytest tests/kernels/test_moe_grouped.py -q -p no:cacheprovider 2>&1 \
      | tail -3
    timeout 150 python3 bench/kernels_gpu.py --only moecodes 2>&1 | tee "$out/kernels_moecodes.log" \
      | grep -E "^\| moe|copy bandwidth|passed|failed"
    timeout 150 python3 bench/spec_phases.py --kind prose --rounds 10 --temperature 1.0 \
      --modes plain,plain#2,draft,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_t1.txt"
    ;;
  s7h)  # the tiny pair's sampled step phases with proposal rounds counted (n-gram alone, auto)
    timeout 150 python3 bench/spec_phases.py --kind prose --rounds 6 --temperature 1.0 \
      --modes plain,plain#2,ngram,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_t1.txt"
    ;;
  s8a)  # the tiny pair's sampled step phases: auto against auto with the old ramp restarts;
    # greedy copy and prose (auto still drafts where it pays)
    timeout 200 python3 bench/spec_phases.py --kind prose --rounds 10 --temperature 1.0 \
      --modes plain,plain#2,auto,auto+restart 2>&1 | grep -v "^USDT\|^round" \
      | tee "$out/phases_t1.txt"
    for kind in copy prose; do
      timeout 100 python3 bench/spec_phases.py --kind $kind --rounds 4 --modes plain,auto 2>&1 \
        | grep -v "^USDT\|^round" | tee "$out/phases_$kind.txt"
    done
    ;;
  s8b)  # the tiny pair: sampled step phases of every mode (10 rounds) and of sampled copy
    # prompts; greedy speculation figures (tau, speedup), also under --deterministic
    timeout 200 python3 bench/spec_phases.py --kind prose --rounds 10 --temperature 1.0 \
      --modes plain,plain#2,ngram,draft,auto 2>&1 | grep -v "^USDT\|^round" \
      | tee "$out/phases_t1.txt"
    timeout 100 python3 bench/spec_phases.py --kind copy --rounds 4 --temperature 1.0 \
      --modes plain,plain#2,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_copy_t1.txt"
    spec 150 2
    ;;
  s8c)  # the tiny pair's speculation under --deterministic (3 rounds); the 30B: verify-cost
    # curve, prefix reuse; where the warm 32k prefix step's time goes
    timeout 120 python3 bench/spec_figures.py --device cuda --deterministic --rounds 3 \
      --prompts 2 --tokens 128 --json "$out/spec_det.json" 2> /dev/null | tail -16
    synth qwen3-30b-a3b q30
    bench q30v 200 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512 \
      --decode-depths 0 --decode-tokens 32 --repeats 2 --verify-curve 1,2,4,8,16 \
      --verify-batches 1,4,16 --prefix-reuse 32768:31744
    timeout 150 python3 bench/profile_steps.py /tmp/q30.gguf --kv-cache-gib 24 --prefill "" \
      --batch 1 --decode-tokens 16 --rows 30 --prefix-reuse 32768:31744 > "$out/profile.txt" 2>&1
    echo "[profile rc=$?]"; grep "^## \|^wall" "$out/profile.txt"
    ;;
  s8d)  # build llama.cpp's llama-lookup and llama-speculative for sm_90 into .llama/build
    # (source: the trimmed vendor/llama.cpp of the llama-cpp-python sdist in .llama/src)
    timeout 560 bash bench/scripts/build_llamacpp.sh .llama/src .llama/build 90 \
      "llama-lookup llama-speculative"; echo "[build rc=$?]"; tail -3 .llama/build/build.log
    ;;
  s8e)  # llama.cpp's n-gram lookup and draft model on the tiny pair on the GPU, then ours
    timeout 300 python3 bench/llamacpp_spec.py .llama/build/out/bin --ngl 99 --rounds 3 \
      --prompts 2 --tokens 128 --json "$out/llamacpp_spec_gpu.json" 2>&1 | tail -12
    timeout 150 python3 bench/spec_figures.py --device cuda --rounds 3 --prompts 2 \
      --tokens 128 --json "$out/spec_gpu.json" 2> "$out/spec_gpu.err" | grep "^|\|^commit"
    ;;
  s8f)  # the 30B verify-cost curve with run-ahead off in its timed steps; the tiny pair's
    # sampled step phases (prose, copy), 10 rounds each
    synth qwen3-30b-a3b q30
    bench q30v 150 /tmp/q30.gguf --device cuda --kv-cache-gib 8 --prompt-lens 128 \
      --decode-depths 0 --decode-tokens 16 --repeats 3 --verify-curve 1,2,4,8,16 \
      --verify-batches 1,4,16
    for kind in prose copy; do
      timeout 130 python3 bench/spec_phases.py --kind $kind --rounds 10 --temperature 1.0 \
        --modes plain,plain#2,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_${kind}_t1.txt"
    done
    ;;
  s8g)  # the tiny pair's sampled step phases (prose), 10 rounds
    timeout 150 python3 bench/spec_phases.py --kind prose --rounds 10 --temperature 1.0 \
      --modes plain,plain#2,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_t1.txt"
    ;;
  s9a)  # GPU tests of padded Q6_K and the expert tiers; Q6_K native against padded kernels;
    # the 30B's decode with Q6_K native, then padded (the first two arms of an A/B)
    timeout 150 python3 -m pytest tests/kernels/test_padded_q6k.py -q -p no:cacheprovider 2>&1 \
      | tail -3
    timeout 100 python3 -m pytest tests/experts -m gpu -q -p no:cacheprovider 2>&1 | tail -3
    timeout 150 python3 bench/kernels_gpu.py --sweep-q6k-layout 2>&1 | tee "$out/q6k_layout.log"
    synth qwen3-30b-a3b q30
    native='import moestream.models.base as b; b.CausalLM.pad_q6_k = False; '
    export AB_CONC=1,8,16,32
    ab_decode q6k native1 "$native" 110
    ab_decode q6k padded1 "" 110
    ;;
  s9b)  # the padded-Q6_K GPU tests; the A/B's other two arms (padded, then native); greedy GPU
    # vs CPU; prefix reuse
    timeout 100 python3 -m pytest tests/kernels/test_padded_q6k.py -q -p no:cacheprovider 2>&1 \
      | tail -3
    synth qwen3-30b-a3b q30
    native='import moestream.models.base as b; b.CausalLM.pad_q6_k = False; '
    export AB_CONC=1,8,16,32
    ab_decode q6k padded2 "" 110
    ab_decode q6k native2 "$native" 110
    timeout 90 python3 bench/greedy_gpu_vs_cpu.py --tokens 200 --prompts 4 \
      --json "$out/greedy.json" | tail -8
    prefix
    ;;
  s9c)  # launch shapes for padded Q6_K: the dense "once" GEMV, the MoE down kernel
    timeout 520 python3 bench/kernels_gpu.py --sweep-q6k-padded 2>&1 | tee "$out/q6k_padded.log" \
      | grep -v "^    T="
    ;;
  s9d)  # the 8B and 30B figures with padded Q6_K's launch shapes; prefix reuse, padded then
    # native
    synth qwen3-8b q8; q8
    synth qwen3-30b-a3b q30
    bench q30 280 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512,4096 \
      --decode-depths 0,32768 --decode-tokens 32 --repeats 3 --concurrency 1,8,16,32 \
      --concurrency-prompt 128
    prefix
    native='import moestream.models.base as b; b.CausalLM.pad_q6_k = False; '
    timeout 120 python3 -c "${native}import sys; from moestream.cli import main; sys.exit(main())" \
      bench /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512 --decode-depths 0 \
      --decode-tokens 16 --repeats 2 --prefix-reuse 32768:31744 --out /tmp/r/prefix_native \
      > /tmp/r/prefix_native.log 2>&1
    echo "[prefix native rc=$?]"; grep "^| cold\|^| warm" /tmp/r/prefix_native.log
    cp /tmp/r/prefix_native/result.json "$out/prefix_native.json" 2>/dev/null
    ;;
  s9e)  # GPU tests of the paired projections; the 30B's batch-1 decode without and with them,
    # interleaved (off, on, on, off)
    timeout 60 python3 -m pytest tests/kernels/test_padded_q6k.py -q -p no:cacheprovider \
      -k "pair" 2>&1 | tail -3
    timeout 90 python3 -m pytest tests/layers/test_q8_fusion.py tests/runner/test_cuda_graph.py \
      -m gpu -q -p no:cacheprovider 2>&1 | tail -3
    synth qwen3-30b-a3b q30
    unpaired='import moestream.layers.linear as l; l.PAIR_PROJECTIONS = False; '
    for arm in off1 on1 on2 off2; do
      pre=""; [[ $arm == off* ]] && pre=$unpaired
      timeout 100 python3 -c "${pre}import sys; from moestream.cli import main; sys.exit(main())" \
        bench /tmp/q30.gguf --device cuda --kv-cache-gib 8 --prompt-lens 512 \
        --decode-depths 0 --decode-tokens 32 --repeats 3 --out "/tmp/r/pair_$arm" \
        > /tmp/r/pair.log 2>&1
      echo "[pair $arm rc=$?]"; grep "^| 0 " /tmp/r/pair.log
      cp "/tmp/r/pair_$arm/result.json" "$out/pair_$arm.json" 2>/dev/null
    done
    ;;
  s10a)  # GPU tests of the decode attention's q8 output; the 30B's batch-1 decode without and
    # with it, interleaved (off, on, on, off)
    timeout 120 python3 -m pytest tests/kernels/test_paged_attention.py -q -p no:cacheprovider \
      2>&1 | tail -3
    timeout 150 python3 -m pytest tests/layers/test_q8_fusion.py tests/runner/test_cuda_graph.py \
      -m gpu -q -p no:cacheprovider 2>&1 | tail -3
    synth qwen3-30b-a3b q30
    onoff_ab oq8 'import moestream.layers.attention as a; a.DECODE_OUT_Q8 = False; '
    ;;
  s10b)  # launch shapes of the 8B's decode GEMVs; the 8B figures with the fixed decode clock
    timeout 300 python3 bench/kernels_gpu.py --sweep-once-8b > "$out/once_8b.log" 2>&1
    echo "[sweep rc=$?]"; grep -A7 "^MMVQ once\|^copy" "$out/once_8b.log"
    synth qwen3-8b q8; q8
    ;;
  s10c)  # GPU tests of the one-warp GEMV shape; the 8B's and the 30B's decode without and with
    # it, interleaved (off, on, on, off)
    timeout 120 python3 -m pytest tests/kernels/test_mmvq.py -q -p no:cacheprovider 2>&1 | tail -2
    off='import moestream.kernels.mmvq as m; m.LONG_K_ONE_WARP = False; '
    for model in q8 q30; do
      if [[ $model == q8 ]]; then synth qwen3-8b q8; else synth qwen3-30b-a3b q30; fi
      AB_MODEL=$model onoff_ab "w1_$model" "$off"
    done
    ;;
  s10d)  # the 30B and 8B figures at the session's last kernel change; greedy GPU vs CPU
    timeout 90 python3 bench/greedy_gpu_vs_cpu.py --tokens 200 --prompts 8 \
      --json "$out/greedy.json" 2>&1 | tail -12
    synth qwen3-30b-a3b q30
    bench q30 280 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512,4096 \
      --decode-depths 0,32768 --decode-tokens 32 --repeats 3 --concurrency 1,8,16,32 \
      --concurrency-prompt 128
    synth qwen3-8b q8; q8
    ;;
  s10e)  # prefix reuse at 32k; the tiny pair's speculation (plain, then --deterministic)
    synth qwen3-30b-a3b q30; prefix
    spec 130 2
    ;;
  s10f)  # Nsight Compute on the 8B's decode GEMVs at M = 1 (what holds them under 75% of copy)
    timeout 300 ncu --kernel-name regex:_mmvq_once_kernel --clock-control none \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis \
      python3 bench/gemv_launches.py > "$out/ncu_gemv.txt" 2>&1
    echo "[ncu rc=$?]"; grep -E "x [0-9]+ Q|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Waves Per|Eligible|Issued Warp|No Eligible|Stall" "$out/ncu_gemv.txt" | head -120
    ;;
  s10g)  # Nsight Compute on the 30B's MoE decode kernels at T = 1
    timeout 300 ncu --kernel-name regex:'_gate_up_once_kernel|_down_mmvq_kernel' --launch-count 6 \
      --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --section InstructionStats python3 bench/gemv_launches.py --moe > "$out/ncu_moe1.txt" 2>&1
    echo "[ncu rc=$?]"; grep -E "_kernel|Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occ|Registers Per|Waves Per|Eligible|Issued Warp|Stall|Block Limit|Executed Ipc" "$out/ncu_moe1.txt" | head -90
    ;;
  s10h)  # the 30B's decode with MoE decode launch shapes of more, smaller programs (run 7's ncu:
    # both MoE kernels fill under half a wave at T = 1), in turn with the default
    synth qwen3-30b-a3b q30
    moe_ab base1= d2="down_block_n=2" d2w2="down_block_n=2, down_warps=2" \
      d1w2="down_block_n=1, down_warps=2" u4="up_block_n=4" base2=
    ;;
  s10i)  # the MoE gate/up with 4 rows a program (the default now) against 8 (before), 2, and 4
    # with one warp, in turn; then the 30B figures at the default
    synth qwen3-30b-a3b q30
    moe_ab u8a="up_block_n=8" u4a= u2="up_block_n=2" u4w1="up_warps=1" u4b= u8b="up_block_n=8"
    bench q30 200 /tmp/q30.gguf --device cuda --kv-cache-gib 24 --prompt-lens 512,4096 \
      --decode-depths 0,32768 --decode-tokens 32 --repeats 3 --concurrency 1,8,16,32 \
      --concurrency-prompt 128
    timeout 90 python3 -m pytest tests/kernels/test_moe_kernel.py -q -p no:cacheprovider \
      -k "mmvq_matches_its_reference or dispatches" 2>&1 | tail -2
    ;;
  s11a)  # GPU tests of the MoE down kernel's expert split; the 30B's decode with the down
    # kernel's experts over 2, 4 and 8 programs and with 1 or 2 warps, in turn with the default
    timeout 150 python3 -m pytest tests/kernels/test_moe_kernel.py -q -p no:cacheprovider \
      -k "down_split or mmvq_matches_its_reference or dispatches" 2>&1 | tail -2
    synth qwen3-30b-a3b q30
    moe_ab base1= s2="down_split=2" s4="down_split=4" s8="down_split=8" w2="down_warps=2" \
      w1="down_warps=1" base2=
    ;;
  s11b)  # issue #4's figures side by side in one call: llama.cpp's llama-bench, built here for
    # sm_90 from .llama/src (the llama-cpp-python sdist's vendor/llama.cpp), then moestream's
    # bench, on the same synth files, model by model (the build overlaps only the synth).
    # Run from the checkout itself (with .snap, .whl and .llama/src the tree passes 64 MiB):
    # carry .llama/src and the gguf wheel alone.
    date +"%T build"
    (timeout 400 bash bench/scripts/build_llamacpp.sh .llama/src /tmp/llama 90 \
      "llama-bench llama-batched-bench" > /tmp/r/build.out 2>&1
      echo "[build rc=$?]" >> /tmp/r/build.out) &
    synth qwen3-30b-a3b q30; synth qwen3-8b q8
    wait; tail -3 /tmp/r/build.out; date +%T
    for m in q30 q8; do
      { timeout 80 /tmp/llama/out/bin/llama-bench -m /tmp/$m.gguf -ngl 99 -fa 1 -p 512,4096 \
          -n 0 -r 3 -o md
        timeout 100 /tmp/llama/out/bin/llama-bench -m /tmp/$m.gguf -ngl 99 -fa 1 -p 0 -n 128 \
          -d 0,32768 -r 3 -o md; } 2>&1 | grep -v "^ggml_\|^  Device\|^load" \
        | tee "$out/llama_bench_$m.md"
      date +%T
      if [[ $m == q30 ]]; then kv=24; lim=150; else kv=16; lim=110; fi
      bench $m $lim /tmp/$m.gguf --device cuda --kv-cache-gib $kv --prompt-lens 512,4096 \
        --decode-depths 0,32768 --decode-tokens 32 --repeats 3
      date +%T
    done
    ;;
  s11c)  # the batched MoE path (grouped, 16-64 tokens) with this session's lesson from the mmvq
    # gate/up (more programs of one warp): the 30B at 16 and 32 requests, in turn with the
    # default. sm_90 builds (`python bench/sm90_builds.py --decode`), 2 assignments a block
    # (T <= 40): 8 rows / 2 warps 114 registers, 8 / 1 168, 4 / 2 78, 4 / 1 102, none spilling;
    # at 4 a block 8 rows / 1 warp spills (1,160 bytes), the others do not.
    synth qwen3-30b-a3b q30
    AB_CONC=16,32 cfg_ab moe_grouped base1= w1="up_warps=1" r4w1="up_block_n=4, up_warps=1" \
      r4="up_block_n=4" base2=
    ;;
  s11d)  # one warp for the dense "once" GEMV at M = 1 from K = 2048 (8 groups: the 30B's q/k/v)
    # against the default (from K = 4096), in turn
    synth qwen3-30b-a3b q30
    k2='import moestream.kernels.mmvq as m; m.ONE_WARP_MIN_GROUPS = 8; '
    for arm in base1 k2a k2b base2; do
      AB_TOKENS=32 ab_decode w1k2 "$arm" "$([[ $arm == k2* ]] && echo "$k2")" 100
    done
    ;;
  s12a)  # `moestream tune`: GPU tests of the tuner and of the grouped gate/up's warps; the demo
    # model tuned, its greedy text with the cache and without; the 30B tuned (batch 1 and 2)
    timeout 150 python3 -m pytest tests/kernels/test_tuning.py tests/kernels/test_moe_grouped.py \
      -q -p no:cacheprovider -k "tun or bits" 2>&1 | tail -3
    tune_model moestream/data/tiny-qwen3-moe-Q4_K_M.gguf demo 120 1,2,4,8
    for c in on off; do
      MOESTREAM_CACHE_DIR=/tmp/mcache MOESTREAM_TUNE_CACHE=$c timeout 60 python3 -c \
        "import sys; from moestream.cli import main; sys.exit(main())" generate --device cuda \
        -p "The history of the city" --max-tokens 64 --temperature 0 > "/tmp/r/gen_$c.txt" 2>&1
    done
    cmp /tmp/r/gen_on.txt /tmp/r/gen_off.txt && echo "[greedy text: same with the cache and without]"
    synth qwen3-30b-a3b q30; tune_model /tmp/q30.gguf q30 240 1,2
    ;;
  s12b)  # the 30B's decode with s12a's cache and without, in turn (off, on, on, off; the 30B
    # tuned again if this is a fresh machine); the tiny pair sampled at temperature 1 (prose, 10
    # rounds): plain, plain again (the noise floor) and auto, after the n-gram scan and the idle
    # budget of 0.25%
    synth qwen3-30b-a3b q30
    grep -q q30 /tmp/mcache/tuned 2>/dev/null || tune_model /tmp/q30.gguf q30 240 1,2
    tune_ab
    timeout 200 python3 bench/spec_phases.py --kind prose --rounds 10 --temperature 1.0 \
      --modes plain,plain#2,auto 2>&1 | grep -v "^USDT\|^round" | tee "$out/phases_t1.txt"
    ;;
  s13a)  # next session (then s13b, s13c): the 30B tuned with its compiles ahead (`--jobs`); its decode at 1 and 8
    # requests with the cache and without, in turn; 8 requests with the grouped gate/up in one
    # warp (the default since 2026-12-01) and in two, in turn. First the GPU tests of the
    # kernels whose K-quant min term became an explicit fma (b04ed07), the grouped gate/up's
    # bits across warps and rows among them, and greedy text GPU vs CPU.
    timeout 200 python3 -m pytest tests/kernels/test_mmvq.py tests/kernels/test_moe_grouped.py \
      tests/kernels/test_moe_kernel.py tests/kernels/test_tuning.py -q -p no:cacheprovider \
      2>&1 | tail -4
    timeout 90 python3 bench/greedy_gpu_vs_cpu.py --tokens 200 --prompts 8 \
      --json "$out/greedy.json" 2>&1 | tail -3
    synth qwen3-30b-a3b q30
    ;;
  s13b)  # s13a's tune and its decode A/B (needs s13a's /tmp/q30.gguf on a warm machine)
    synth qwen3-30b-a3b q30; tune_model /tmp/q30.gguf q30 330 1,2
    tune_ab
    ;;
  s13c)  # s13a's 8-request grouped gate/up A/B
    synth qwen3-30b-a3b q30
    AB_CONC=8 cfg_ab moe_grouped w1a= w2a="up_warps=2" w2b="up_warps=2" w1b=
    ;;
  s14a)  # next session (then s14b): the decode MoE kernels' reproducible arithmetic
    # (kernels/exact.py: contraction off, SiLU from correctly rounded operations) and the native
    # CPU experts (moestream/native): GPU tests (GPU bits against the interpreter's and against
    # the C code's at the 30B's shapes), greedy text GPU vs CPU; the 30B synthesised
    timeout 300 python3 -m pytest tests/native/test_native_gpu.py tests/kernels/test_exact.py \
      tests/kernels/test_moe_grouped.py -q -p no:cacheprovider -rf 2>&1 | tail -4
    timeout 90 python3 bench/greedy_gpu_vs_cpu.py --tokens 200 --prompts 8 \
      --json "$out/greedy.json" 2>&1 | tail -3
    timeout 60 python3 bench/native_experts.py --threads 1,4,8,16 | tee "$out/native.md"
    synth qwen3-30b-a3b q30
    ;;
  s14b)  # the 30B's decode at 1 and 8 requests: contraction off (the default: arms on1, on2)
    # against on (arms off1, off2: FP_EXACT emptied; SiLU stays exact); then the down kernel in
    # its reproducible launch (moe_mmvq.REPRODUCIBLE_DOWN) against the default, in turn
    lscpu | grep -i "model name\|^cpu(s)\|thread\|socket\|mhz\|flags" | cut -c1-400
    synth qwen3-30b-a3b q30
    onoff_ab exact "import moestream.kernels.exact as e; e.FP_EXACT.clear(); "
    moe_ab base1= rep1="down_experts=1, down_tree=True, down_rows=False" \
      rep2="down_experts=1, down_tree=True, down_rows=False" base2=
    ;;
  s15a)  # the down kernel's per-expert reduction (down_each: the reproducible bits at 8
    # experts a chunk) against the default; the native GPU tests; the 30B at half its experts
    # on the device, the rest read across the host link (fraction 0) or a third of them
    # computed by the host's cores
    timeout 150 python3 -m pytest tests/native/test_native_gpu.py -q -p no:cacheprovider -rf \
      2>&1 | tail -4
    synth qwen3-30b-a3b q30
    moe_ab base1= each1="down_each=True, down_tree=True, down_rows=False" \
      each2="down_each=True, down_tree=True, down_rows=False" base2=
    hyb 50 8.8 0; hyb 50 8.8 0.33
    ;;
  s15b)  # host experts as CUDA host functions (graphs stay on): the GPU test of the text at
    # three placements; the 30B at 50, 25 and 10% of its experts on the device, link only or a
    # third of the host experts computed by the host's cores
    timeout 120 python3 -m pytest tests/experts/test_host_compute_gpu.py -q -p no:cacheprovider \
      -rf 2>&1 | tail -4
    synth qwen3-30b-a3b q30
    hyb 50 8.8 0.33; hyb 25 4.4 0; hyb 25 4.4 0.33; hyb 10 1.76 0; hyb 10 1.76 0.33
    ;;
  s16a)  # next session: what this one could not run. The text of host-computed experts at
    # three placements (graphs on) and the GPU-vs-interpreter bits; the native experts on the
    # host's 16 cores after the AVX2 float lanes and word-mask scales; the 30B at 50 and 10%
    # with a third of the host experts on the CPU (batch 1 and 8 requests)
    timeout 200 python3 -m pytest tests/experts/test_host_compute_gpu.py \
      tests/kernels/test_exact.py -q -p no:cacheprovider -rf 2>&1 | tail -4
    timeout 90 python3 bench/native_experts.py --threads 1,8,16 | tee "$out/native.md"
    synth qwen3-30b-a3b q30
    hyb 50 8.8 0.33; hyb 10 1.76 0.33
    ;;
  s17a)  # the host's rows added after the GPU's own down (the GPU no longer waits for them
    # before its down): the GPU tests of host experts, then the CPU share swept at 50% of the
    # 30B's experts on the device (one load, shares re-marked between arms)
    lscpu | grep -i "model name\|^flags" | cut -c1-2000
    timeout 200 python3 -m pytest tests/experts/test_host_compute_gpu.py tests/native \
      -q -p no:cacheprovider -rfs 2>&1 | tail -4
    synth qwen3-30b-a3b q30
    timeout 330 python3 bench/hybrid_sweep.py /tmp/q30.gguf --gpu-expert-cache-gib 8.8 \
      --fractions 0,0.33,0.5,0.67,0.85 --batches 1,8 2>&1 | tee "$out/sweep50.md" | tail -14
    ;;
  s18a)  # the GPU text test of host experts six times (it failed once in 7 runs, details
    # lost); the 30B at 50% with the CPU share near 0.5, the routing copies on the side stream;
    # then with OpenMP's threads spinning between layers instead of sleeping
    for i in 1 2 3 4 5 6; do
      timeout 100 python3 -m pytest tests/experts/test_host_compute_gpu.py -q -p no:cacheprovider \
        --tb=short > /tmp/r/gputest.txt 2>&1
      { echo "== run $i"; cat /tmp/r/gputest.txt; } >> "$out/gputests.txt"; tail -1 /tmp/r/gputest.txt
    done
    synth qwen3-30b-a3b q30
    timeout 220 python3 bench/hybrid_sweep.py /tmp/q30.gguf --gpu-expert-cache-gib 8.8 \
      --fractions 0,0.4,0.5,0.6 --batches 1,8 --tokens 64 2>&1 | tee "$out/sweep50.md" | tail -10
    OMP_WAIT_POLICY=active timeout 150 python3 bench/hybrid_sweep.py /tmp/q30.gguf \
      --gpu-expert-cache-gib 8.8 --fractions 0.5 --batches 1,8 --tokens 64 2>&1 \
      | tee "$out/sweep50_active.md" | tail -4
    ;;
  s18b)  # prefill with host experts: the prefill stage's GPU test, then the 30B at 50% (CPU
    # share 0.5) without and with the stage (prediction: 512-token prefill 1,000-2,500 tok/s
    # with it, against ~75 without; 4096 tokens 1,500-4,000)
    timeout 150 python3 -m pytest tests/experts/test_host_compute_gpu.py -q -p no:cacheprovider \
      --tb=short -k stage 2>&1 | tail -3
    synth qwen3-30b-a3b q30
    zc=(/tmp/q30.gguf --device cuda --kv-cache-gib 8 --gpu-expert-cache-gib 8.8
      --host-expert-cache-gib 24 --expert-zero-copy --expert-cpu-fraction 0.5 --decode-depths 0
      --decode-tokens 32 --repeats 2)
    bench pre50 150 "${zc[@]}" --prompt-lens 512
    bench pre50s 200 "${zc[@]}" --prompt-lens 512,4096 --expert-prefill-stage
    ;;
  s19a)  # correctness first: both host-expert GPU tests five times (the text test failed once
    # in 7 runs, details lost), then the GPU's MoE bits against the exact interpreters to its end
    for i in 1 2 3 4 5; do
      timeout 90 python3 -m pytest tests/experts/test_host_compute_gpu.py -q -p no:cacheprovider \
        --tb=long > /tmp/r/gputest.txt 2>&1
      { echo "== run $i"; cat /tmp/r/gputest.txt; } >> "$out/gputests.txt"; tail -1 /tmp/r/gputest.txt
    done
    timeout 300 python3 -m pytest tests/kernels/test_exact.py -q -p no:cacheprovider -rfs \
      --durations=3 2>&1 | tee "$out/exact.txt" | tail -8
    ;;
  s19b)  # the capture failure of a fresh machine: caches cleared before each run, the CUDA
    # driver's error log and the kernels compiled inside a capture; then the MoE bits against
    # the exact interpreter's (reference computed on a CPU: bench/exact_bits.py)
    for i in 1 2 3; do
      rm -rf ~/.triton/cache ~/.cache/moestream
      CUDA_LOG_FILE="$out/cudalog$i.txt" timeout 100 python3 .diag/capture_probe.py \
        tests/experts/test_host_compute_gpu.py -q -p no:cacheprovider -k every_placement \
        --tb=short -s > /tmp/r/g.txt 2>&1
      { echo "== run $i"; grep -v "^\s*$" /tmp/r/g.txt | grep -v "capturing=False"; } >> "$out/probe.txt"
      tail -1 /tmp/r/g.txt
    done
    python3 bench/exact_bits.py compare .diag/exact_ref.pt 2>&1 | tail -5
    # where a batch-1 step at half the experts on the device waits: the GPU's idle gaps
    synth qwen3-30b-a3b q30
    for f in 0.5 0; do
      timeout 150 python3 bench/profile_decode.py /tmp/q30.gguf --device cuda --steps 8 \
        --kv-cache-gib 4 --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 \
        --expert-zero-copy --expert-cpu-fraction $f 2>&1 | grep -v USDT \
        | tee "$out/profile_f$f.md" | head -22
    done
    ;;
  s19c)  # the host's cores: transparent huge pages, the native experts on each kind of memory
    # (1 and 16 threads); then the batch-1 profile at half the experts on the device with
    # OpenMP's threads spinning, and with 8 threads
    cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag
    grep -m1 "model name" /proc/cpuinfo; nproc
    for m in numpy small huge pinned; do
      timeout 90 python3 bench/native_experts.py --threads 1,16 --experts 32 --rounds 3 \
        --memory $m 2>&1 | tee "$out/native_$m.md" | grep -v "^|---" | head -12
    done
    synth qwen3-30b-a3b q30
    prof=(/tmp/q30.gguf --device cuda --steps 8 --kv-cache-gib 4 --gpu-expert-cache-gib 8.8
      --host-expert-cache-gib 24 --expert-zero-copy --expert-cpu-fraction 0.5)
    OMP_WAIT_POLICY=active timeout 120 python3 bench/profile_decode.py "${prof[@]}" 2>&1 \
      | grep -v "USDT\|_warn_once\|UserWarning" | tee "$out/profile_active.md" | head -9
    timeout 120 python3 bench/profile_decode.py "${prof[@]}" --expert-cpu-threads 8 2>&1 \
      | grep -v "USDT\|_warn_once\|UserWarning" | tee "$out/profile_t8.md" | head -9
    ;;
  s19d)  # the native experts' own thread pool (workers spin 2 ms after a call, then sleep;
    # OpenMP's team slept between layers): the GPU tests of host experts twice; the native
    # experts on pinned memory; the batch-1 profile at 50% with 16 and 15 threads (prediction:
    # host call 256 -> 150-190 us, step 25.6 -> 20-22 ms); the CPU share at 50% and at 10%
    host_gpu_tests 2 90
    timeout 60 python3 bench/native_experts.py --threads 1,16 --experts 32 --rounds 3 \
      --memory pinned 2>&1 | tee "$out/native.md" | tail -6
    synth qwen3-30b-a3b q30
    prof=(/tmp/q30.gguf --device cuda --steps 8 --kv-cache-gib 4 --gpu-expert-cache-gib 8.8
      --host-expert-cache-gib 24 --expert-zero-copy --expert-cpu-fraction 0.5)
    for t in 16 15; do
      timeout 100 python3 bench/profile_decode.py "${prof[@]}" --expert-cpu-threads $t 2>&1 \
        | grep -v "USDT\|_warn_once\|UserWarning" | tee "$out/profile_t$t.md" | head -8
    done
    timeout 150 python3 bench/hybrid_sweep.py /tmp/q30.gguf --gpu-expert-cache-gib 8.8 \
      --fractions 0.5,0.67 --batches 1,8 --tokens 64 2>&1 | tee "$out/sweep50.md" | tail -6
    timeout 110 python3 bench/hybrid_sweep.py /tmp/q30.gguf --gpu-expert-cache-gib 1.76 \
      --fractions 0.5 --batches 1,8 --tokens 64 2>&1 | tee "$out/sweep10.md" | tail -4
    ;;
  s19e)  # no garbage collection inside a capture (an old graph's executable destroyed there
    # invalidated it: the fresh-machine failure); the host experts' threads one per core less
    # one (16 spinning workers starved the process): GPU tests twice, then the 30B at 50% with
    # 15 and 14 threads and at 10% with 15 (prediction: 50% batch 1 above OpenMP's 65.6)
    host_gpu_tests 2 80
    synth qwen3-30b-a3b q30
    timeout 140 python3 bench/hybrid_sweep.py /tmp/q30.gguf --gpu-expert-cache-gib 8.8 \
      --fractions 0.5 --threads 15,14 --batches 1,8 --tokens 64 2>&1 | tee "$out/sweep50.md" | tail -5
    timeout 100 python3 bench/hybrid_sweep.py /tmp/q30.gguf --gpu-expert-cache-gib 1.76 \
      --fractions 0.5 --threads 15 --batches 1,8 --tokens 64 2>&1 | tee "$out/sweep10.md" | tail -3
    ;;
  s20a)  # next session: host experts answered by the native poller thread instead of a CUDA
    # host function (MOESTREAM_HOST_POLL=1; prepared, never run on a GPU): the GPU tests (text
    # with and without it), the batch-1 profile at 50% both ways (prediction: the GPU's wait a
    # layer 340 -> 250-290 us), the sweep at 50% and 10% both ways
    CUDA_LOG_FILE="$out/cudalog.txt" timeout 120 python3 -m pytest \
      tests/experts/test_host_compute_gpu.py -q -p no:cacheprovider --tb=short 2>&1 \
      | tee "$out/gputests.txt" | tail -2
    synth qwen3-30b-a3b q30
    poll_ab
    ;;
  s20b)  # next session: the grouped MoE with chains of blocks a program (an expert's later
    # blocks find its rows in the SM's caches; prepared, never run on a GPU): its GPU tests,
    # then the layer at T = 8-64 with chains of 1-8 (prediction: 2 or 4 -10-25% at T = 32)
    timeout 200 python3 -m pytest tests/kernels/test_moe_grouped.py -q -p no:cacheprovider \
      -rf 2>&1 | tail -3
    timeout 300 python3 bench/kernels_gpu.py --sweep-moe-chain 2>&1 | tee "$out/chain.log" \
      | tail -8
    ;;
  s21a)  # the host's inputs by one kernel on the current stream before the gate/up (copies
    # on the side stream waited behind the gate/up's reads of host memory: s20a's idle gaps),
    # the post at its end in poll mode: GPU tests, the batch-1 profile at 50%, the sweep at
    # 50% and 10% with and without poll mode (prediction: 50% batch 1 45.6 -> 60-70 with host
    # functions, 51.9 -> 65-80 polled; 8 requests 82.8 -> 95-120)
    host_gpu_tests 1 120
    synth qwen3-30b-a3b q30
    poll_ab
    ;;
  s21b)  # the grouped MoE's chains (s20b: its GPU tests, the layer at T = 8-64 with chains of
    # 1-8; prediction 2 or 4 -10-25% at T = 32); then poll mode, now the default, at 25% on
    # the device (batch 1 and 8) and at 50% with a CPU share of 0.6 (prediction: 25% batch 1
    # 50.9 -> 55-65, above llama.cpp's 55.9)
    timeout 120 python3 -m pytest tests/kernels/test_moe_grouped.py -q -p no:cacheprovider \
      -rf 2>&1 | tail -3
    timeout 170 python3 bench/kernels_gpu.py --sweep-moe-chain 2>&1 | tee "$out/chain.log" \
      | tail -12
    synth qwen3-30b-a3b q30
    timeout 100 python3 bench/hybrid_sweep.py /tmp/q30.gguf --gpu-expert-cache-gib 4.4 \
      --fractions 0.5 --batches 1,8 --tokens 64 2>&1 | tee "$out/sweep25.md" | tail -2
    timeout 100 python3 bench/hybrid_sweep.py /tmp/q30.gguf --gpu-expert-cache-gib 8.8 \
      --fractions 0.6 --batches 1,8 --tokens 64 2>&1 | tee "$out/sweep50_f06.md" | tail -2
    ;;
  s22a)  # next session: poll mode and host functions side by side in one process (the
    # sweep's --modes; graphs dropped and recaptured at each change) at 25% and 50% on the
    # device, shares 0.5 and 0.6 (sixteenth session: 25% settled nothing, 28-52 tok/s).
    # Each arm prints as measured: a cut run keeps what it measured
    synth qwen3-30b-a3b q30
    timeout 250 python3 bench/hybrid_sweep.py /tmp/q30.gguf --gpu-expert-cache-gib 4.4 \
      --fractions 0.5,0.6 --modes poll,host --batches 1,8 --tokens 64 2>&1 \
      | tee "$out/sweep25_modes.md" | tail -10
    timeout 250 python3 bench/hybrid_sweep.py /tmp/q30.gguf --gpu-expert-cache-gib 8.8 \
      --fractions 0.5,0.6 --modes poll,host --batches 1,8 --tokens 64 2>&1 \
      | tee "$out/sweep50_modes.md" | tail -10
    ;;
  s22b)  # next session: who takes the host's cores at 50% (poll mode). The step's thread waited
    # for its tokens spinning (CUDA's default) beside an OpenMP team of 16 on 16 cores; it now
    # sleeps when host experts are on (HostReader.set_blocking). The sweep's --wait spin,block
    # against --threads 16,15,14 (prediction: block narrows batch 1's spread, 42-70 in s21a,
    # and lifts its median 5-15%; 15 threads with spin about the same as 16 with block);
    # first the native experts' calls of 2 and 4 experts with and without a busy process
    # beside them (development CPU, team of 2 on 2 cores: mean 0.45 -> 3.6 ms, median 0.43 ->
    # 0.51)
    timeout 90 python3 bench/native_experts.py --threads 16,15 --experts 32 --rounds 3 \
      --per-token 2,4 --gap-us 100 --spinners 0,1 2>&1 | tee "$out/native_gap.md" | tail -10
    synth qwen3-30b-a3b q30
    timeout 300 python3 bench/hybrid_sweep.py /tmp/q30.gguf --gpu-expert-cache-gib 8.8 \
      --fractions 0.6 --threads 16,15,14 --wait spin,block --batches 1,8 --tokens 64 2>&1 \
      | tee "$out/sweep50_wait.md" | tail -10
    ;;
  s22c)  # next session: issue #7's "rest on disk" figures (never run on the H200): the 30B
    # streamed by the expert store with no host tier, every miss an O_DIRECT read of the file
    # (--expert-direct-io: the page cache bypassed on every read, not once), at 50% and 25%
    # of the experts on the device, batch 1 and 8 requests; the store's counters (hit rates,
    # disk bytes, stall per token) come with each JSON. Prediction: disk-bound, 2-8 tok/s at
    # 50% (uniform routing misses ~4 experts a layer, ~0.3 GB a token from the disk)
    synth qwen3-30b-a3b q30
    df -h /tmp | tail -1
    for g in 8.8 4.4; do disk $g 200 1,8; done
    ;;
  s22d)  # next session: the grouped chains' sweep alone, with the time it needs (s21b's 170 s
    # reached three rows at T = 8, where chain 2 was slower: 112 against 96 us); T = 32 first
    # (prediction, s20b's: chains of 2-4 10-25% faster at T = 32, or nothing: then drop them)
    timeout 560 python3 bench/kernels_gpu.py --sweep-moe-chain 2>&1 | tee "$out/chain.log" \
      | tail -24
    ;;
  s23a)  # s22b within one call: the native experts beside a busy process on the H200's host
    # (calls of 2 and 4 experts, 100 us apart); the step's wait spinning or blocking at 50% on
    # the device (share 0.6) with 16 and 15 threads; first the host experts' GPU tests.
    # Prediction: block narrows batch 1's spread (42-70 in s21a) and lifts its median 5-15%;
    # 15 threads spinning about as fast as 16 blocking
    host_gpu_tests 1 120  # the pack kernel's copy loop, a while loop since review: first GPU run
    timeout 60 python3 bench/native_experts.py --threads 16,15 --experts 32 --rounds 3 \
      --per-token 2,4 --gap-us 100 --spinners 0,1 2>&1 | tee "$out/native_gap.md" | tail -10
    synth qwen3-30b-a3b q30
    timeout 250 python3 bench/hybrid_sweep.py /tmp/q30.gguf --gpu-expert-cache-gib 8.8 \
      --fractions 0.6 --threads 16,15 --wait spin,block --batches 1,8 --tokens 64 2>&1 \
      | tee "$out/sweep50_wait.md" | tail -8
    ;;
  s23b)  # the rest on disk (s22c: O_DIRECT reads, no host tier) at 50% and 25%, batch 1 and 8
    # requests (prediction: disk-bound, 2-8 tok/s at 50%); then the 25% sweep with 16 and 15
    # threads (share 0.6, blocking wait; 25% was unsettled: 34.8, 28.2-52.2)
    synth qwen3-30b-a3b q30
    df -h /tmp | tail -1
    for g in 8.8 4.4; do disk $g 150 1,8; done
    timeout 150 python3 bench/hybrid_sweep.py /tmp/q30.gguf --gpu-expert-cache-gib 4.4 \
      --fractions 0.6 --threads 16,15 --batches 1,8 --tokens 64 2>&1 \
      | tee "$out/sweep25_threads.md" | tail -6
    ;;
  s23c)  # s23b's disk runs with the time they need (150 s cut both in the concurrency part):
    # the rest on disk, O_DIRECT, no host tier, 50% and 25% on the device; batch 1 from the
    # decode part, 8 requests from the concurrency part (prediction: 2-8 tok/s at 50%)
    synth qwen3-30b-a3b q30
    for g in 8.8 4.4; do disk $g 235 8; done
    ;;
  s23d)  # 16 against 15 threads at 10% on the device (s23a/s23b: 15 led at 50% and 25%), then
    # the rest on disk at 25% (s23c's second run, cut at 235 s in its concurrency part)
    synth qwen3-30b-a3b q30
    timeout 160 python3 bench/hybrid_sweep.py /tmp/q30.gguf --gpu-expert-cache-gib 1.76 \
      --fractions 0.5 --threads 16,15 --batches 1,8 --tokens 64 2>&1 \
      | tee "$out/sweep10_threads.md" | tail -6
    disk 4.4 225 8
    ;;
  s24a)  # next session: the rest on disk at 25% with the time its 8 requests need (cut at
    # 225-235 s twice; 50% took ~90 s in all); each section's table now prints as it ends
    # (prediction: batch 1 4-7 tok/s, under 50%'s 9.0)
    synth qwen3-30b-a3b q30
    disk 4.4 500 8
    ;;
  s30a)  # paged experts (the GPU pages routed experts into slots itself; decode steps are
    # whole graphs): GPU tests, then 50% greedy and temperature 1 beside resident. Prediction:
    # 50% greedy 200-320 tok/s (resident ~490; streamed 77-81), temperature 1 150-280
    timeout 150 python3 -m pytest tests/experts/test_paged.py -q -p no:cacheprovider --tb=short \
      2>&1 | tail -4
    synth qwen3-30b-a3b q30
    base=(/tmp/q30.gguf --device cuda --kv-cache-gib 4 --prompt-lens 32 --decode-depths 0
      --decode-tokens 32 --repeats 2)
    bench_run paged50 120 "${base[@]}" --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 \
      --expert-paging
    bench_run paged50_t1 120 "${base[@]}" --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 \
      --expert-paging --temperature 1.0
    bench_run resident 100 "${base[@]}"
    ;;
  s30b)  # paged at 25% and 10% (temperature 1), 8 requests at 50%, and streamed 50% greedy
    # beside it. Prediction: 25% t1 100-200 (streamed 40.6, llama.cpp 55.9); 10% t1 50-120
    # (llama.cpp 47.2); c8 t1 at 50% 300-600 aggregate (streamed 113)
    synth qwen3-30b-a3b q30
    base=(/tmp/q30.gguf --device cuda --kv-cache-gib 4 --prompt-lens 32 --decode-depths 0
      --decode-tokens 32 --repeats 2)
    bench_run paged25_t1 120 "${base[@]}" --gpu-expert-cache-gib 4.4 --host-expert-cache-gib 24 \
      --expert-paging --temperature 1.0
    bench_run paged10_t1 120 "${base[@]}" --gpu-expert-cache-gib 1.76 --host-expert-cache-gib 24 \
      --expert-paging --temperature 1.0
    bench_run paged50_c8 150 "${base[@]}" --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 \
      --expert-paging --temperature 1.0 --concurrency 8 --concurrency-prompt 32
    bench_run streamed50 100 "${base[@]}" --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24
    ;;
  s30c)  # paged experts: the GPU test again (one request at a time), the pager's own cost
    # (bench/paging.py), then 25% greedy, 50% and 25% temperature 1 with counters by phase,
    # and streamed 25% temperature 1 beside. Prediction: 0 missing 4-6 us a forward, copies
    # 35-45 GB/s; 25% greedy 230-280 tok/s
    timeout 100 python3 -m pytest tests/experts/test_paged.py -q -p no:cacheprovider --tb=short \
      -k gpu 2>&1 | tail -3
    timeout 90 python3 bench/paging.py 2>&1 | tee "$out/paging.md" | tail -30
    synth qwen3-30b-a3b q30
    base=(/tmp/q30.gguf --device cuda --kv-cache-gib 4 --prompt-lens 32 --decode-depths 0
      --decode-tokens 32 --repeats 2)
    bench_run paged25 120 "${base[@]}" --gpu-expert-cache-gib 4.4 --host-expert-cache-gib 24
    bench_run paged50_t1b 120 "${base[@]}" --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 \
      --temperature 1.0
    bench_run streamed25_t1 100 "${base[@]}" --gpu-expert-cache-gib 4.4 --host-expert-cache-gib 24 \
      --expert-paging off --temperature 1.0
    ;;
  s30d)  # paged experts through the resident model's own MoE call (slots, or a stage the
    # routed experts are gathered into): GPU tests (tokens equal to resident at 1 and 4 slots,
    # 1 and 3 requests), the pager's and the gather's own cost, then 50% greedy / t1, 25% t1 and
    # resident. Prediction: 50% greedy 300-340 (the address path gave 325.7), t1 270-300,
    # 25% t1 210-250 (the stage takes ~2.7 slots a layer)
    timeout 150 python3 -m pytest tests/experts/test_paged.py -q -p no:cacheprovider --tb=short \
      > "$out/gputests.txt" 2>&1; tail -3 "$out/gputests.txt"
    timeout 90 python3 bench/paging.py 2>&1 | tee "$out/paging.md" | tail -12
    synth qwen3-30b-a3b q30
    base=(/tmp/q30.gguf --device cuda --kv-cache-gib 4 --prompt-lens 32 --decode-depths 0
      --decode-tokens 32 --repeats 2)
    bench_run paged50 100 "${base[@]}" --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24
    bench_run paged50_t1 100 "${base[@]}" --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 \
      --temperature 1.0
    bench_run paged25_t1 100 "${base[@]}" --gpu-expert-cache-gib 4.4 --host-expert-cache-gib 24 \
      --temperature 1.0
    bench_run resident 80 "${base[@]}"
    ;;
  s30e)  # paged experts (slots or the stage), the rest of the figures: 25% greedy, 10%
    # temperature 1, 8 requests at 50% temperature 1. Prediction: 25% greedy 250-290; 10% t1
    # 150-180; 8 requests at 50% 350-450 aggregate (the stage's gather copies every routed
    # expert there: 8 x 8 > 61 slots)
    synth qwen3-30b-a3b q30
    base=(/tmp/q30.gguf --device cuda --kv-cache-gib 4 --prompt-lens 32 --decode-depths 0
      --decode-tokens 32 --repeats 2)
    bench_run paged25 90 "${base[@]}" --gpu-expert-cache-gib 4.4 --host-expert-cache-gib 24
    bench_run paged10_t1 90 "${base[@]}" --gpu-expert-cache-gib 1.76 --host-expert-cache-gib 24 \
      --temperature 1.0
    bench_run paged50_c8 110 "${base[@]}" --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 \
      --temperature 1.0 --concurrency 8 --concurrency-prompt 32
    ;;
  s31a)  # next session: what issue #7 still lacks with paged experts: 8 requests at 25% and
    # 10%, and the GPU tests after 52e66d0. Prediction: 8 requests t1 25% 300-420 aggregate,
    # 10% 180-300
    timeout 150 python3 -m pytest tests/experts/test_paged.py -q -p no:cacheprovider --tb=short \
      > "$out/gputests.txt" 2>&1; tail -3 "$out/gputests.txt"
    synth qwen3-30b-a3b q30
    base=(/tmp/q30.gguf --device cuda --kv-cache-gib 4 --prompt-lens 32 --decode-depths 0
      --decode-tokens 32 --repeats 2 --temperature 1.0 --concurrency 8 --concurrency-prompt 32)
    bench_run paged25_c8 110 "${base[@]}" --gpu-expert-cache-gib 4.4 --host-expert-cache-gib 24
    bench_run paged10_c8 110 "${base[@]}" --gpu-expert-cache-gib 1.76 --host-expert-cache-gib 24
    ;;
  s32a)  # paged experts with the next layer's prediction prefetched on a side stream (default
    # on; the decode counters no longer count the captures' warm-ups): the GPU tests (graphs
    # with the side stream inside), then the trained tiny MoE at 3 of 8 slots with and without
    # the prediction, in turn, beside resident; the pager's fixed cost. Prediction: tests pass;
    # tiny model: on >= off + 5% (its router predicts ~85% of the next layer's experts), both
    # below resident; 16-byte experts: 5-15 us a forward that admits, less with more warps
    timeout 200 python3 -m pytest tests/experts/test_paged.py tests/runner/test_cuda_graph.py \
      -q -p no:cacheprovider --tb=short > "$out/gputests.txt" 2>&1; tail -3 "$out/gputests.txt"
    # the fixed cost of a forward that admits (s30's 1-expert forward: ~23 us over its bytes)
    timeout 80 python3 bench/paging.py --shapes 4x4 --repeats 10 2>&1 | tee "$out/paging.md" \
      | tail -16
    tiny=(moestream/data/tiny-qwen3-moe-Q4_K_M.gguf --device cuda --kv-cache-gib 1
      --prompt-lens 32 --decode-depths 0 --decode-tokens 128 --repeats 3)
    for arm in on off on off; do
      bench_run "tiny3_$arm" 60 "${tiny[@]}" --gpu-expert-cache-gib 0.0058 \
        --host-expert-cache-gib 1 --expert-prediction $arm
    done
    bench_run tiny_resident 60 "${tiny[@]}"
    ;;
  s32d)  # after run 1 (s32a): the copy kernel's chunks dealt to the grid (all of a forward's
    # copies in flight at once), the pager program at 8 warps, prefill graphs' counters in the
    # prefill row: the GPU tests, the pager's cost, then the synth 30B 25% t1 with the
    # prediction on and off. Prediction: 1 missing 83.7 -> 65-75 us, 16-byte 8 missing
    # 54.7 -> 15-30 us; 25% t1 222 -> 235-260 (either arm)
    timeout 150 python3 -m pytest tests/experts/test_paged.py -q -p no:cacheprovider --tb=short \
      -k "gpu or kernel or gather or prepare" > "$out/gputests.txt" 2>&1
    tail -3 "$out/gputests.txt"
    timeout 80 python3 bench/paging.py --shapes 4x4 --pager-warps 8 --repeats 10 2>&1 \
      | tee "$out/paging.md" | tail -16
    synth qwen3-30b-a3b q30
    base=(/tmp/q30.gguf --device cuda --kv-cache-gib 4 --prompt-lens 32 --decode-depths 0
      --decode-tokens 32 --repeats 2)
    for arm in on off; do
      bench_run "p25_t1_$arm" 100 "${base[@]}" --gpu-expert-cache-gib 4.4 \
        --host-expert-cache-gib 24 --temperature 1.0 --expert-prediction $arm
    done
    ;;
  s32e)  # after run 2 (s32d): prediction only for forwards the slots serve (run 2's 32-token
    # prompts, 78% precise, held the gate open for the decode tokens after them, 30% precise:
    # 25% t1 fell 225.9 -> 173.2): 25% t1 on and off, then resident. Prediction: on within 5%
    # of off (the gate closes at 30%), off 220-235, resident 470-490
    synth qwen3-30b-a3b q30
    base=(/tmp/q30.gguf --device cuda --kv-cache-gib 4 --prompt-lens 32 --decode-depths 0
      --decode-tokens 32 --repeats 2)
    for arm in on off; do
      bench_run "p25_t1_$arm" 100 "${base[@]}" --gpu-expert-cache-gib 4.4 \
        --host-expert-cache-gib 24 --temperature 1.0 --expert-prediction $arm
    done
    bench_run resident 80 "${base[@]}"
    ;;
  s32f)  # after run 3 (s32e: on 210.4 vs off 223.3 at 25% t1, the empty gate open for the
    # first forwards): the gate starts as if 8 experts had been named and none routed. 25% t1
    # and 50% greedy with the prediction on (the default); 8 requests (temperature 1) at 25%
    # and 10%. Prediction: 25% t1 218-228 (off 223.3), 50% greedy 315-335; 8 requests 25%
    # 300-420 aggregate, 10% 180-300
    synth qwen3-30b-a3b q30
    base=(/tmp/q30.gguf --device cuda --kv-cache-gib 4 --prompt-lens 32 --decode-depths 0
      --decode-tokens 32 --repeats 2)
    bench_run p25_t1_on 100 "${base[@]}" --gpu-expert-cache-gib 4.4 --host-expert-cache-gib 24 \
      --temperature 1.0
    bench_run p50_on 90 "${base[@]}" --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24
    c8=(--temperature 1.0 --concurrency 8 --concurrency-prompt 32)
    bench_run paged25_c8 120 "${base[@]}" "${c8[@]}" --gpu-expert-cache-gib 4.4 \
      --host-expert-cache-gib 24
    bench_run paged10_c8 120 "${base[@]}" "${c8[@]}" --gpu-expert-cache-gib 1.76 \
      --host-expert-cache-gib 24
    ;;
  s32g)  # the GPU tests at the session's last code (the gate's prior, prediction only where
    # the slots serve); the rest on disk at 10% (the streamed store, O_DIRECT, no host tier),
    # batch 1. Prediction: tests pass; disk 10% 1-5 tok/s
    timeout 150 python3 -m pytest tests/experts/test_paged.py -q -p no:cacheprovider --tb=short \
      -k "gpu or kernel or gather or prepare" > "$out/gputests.txt" 2>&1
    tail -3 "$out/gputests.txt"
    synth qwen3-30b-a3b q30
    disk 1.76 300 1
    ;;
  s32h)  # the paged GPU tests at the session's last code; issue #5's grouped chains (a program
    # takes 2 consecutive blocks of one expert, so the second reads it from the SM's caches):
    # their GPU bits test, then the 30B at 16 and 32 requests, chain 1 (default) and 2 in
    # turn. Prediction: tests pass; chain 2 +5-15% at 32 requests, +0-10% at 16
    timeout 100 python3 -m pytest tests/experts/test_paged.py -q -p no:cacheprovider --tb=short \
      -k gpu > "$out/gputests.txt" 2>&1; tail -3 "$out/gputests.txt"
    timeout 150 python3 -m pytest tests/kernels/test_moe_grouped.py -q -p no:cacheprovider \
      --tb=short -k chains > "$out/chaintests.txt" 2>&1; tail -3 "$out/chaintests.txt"
    synth qwen3-30b-a3b q30
    AB_CONC=16,32 cfg_ab moe_grouped chain1= chain2="chain=2"
    ;;
  s35a)  # next session, issue #5 (16 requests at 1.95x): the grouped MoE's down kernel in tiles
    # (down_tiles 4: 4 x 8 rows a program, one group a step across them, no masked group; sm_90
    # SASS 85 instructions a row against 144, 165 registers against 96): its GPU tests, the
    # down sweep, then the 30B at 16 and 32 requests both ways. Prediction: the down kernel
    # 58 -> 40-50 us at T = 16, 16 requests +3-8%
    (synth qwen3-30b-a3b q30 > /tmp/r/synth.out 2>&1) &
    timeout 150 python3 -m pytest tests/kernels/test_moe_grouped.py tests/kernels/test_padded_q6k.py \
      -q -p no:cacheprovider --tb=short -k "tiles or rows_bits or padded_experts" \
      > "$out/gputests_tiles.txt" 2>&1
    tail -3 "$out/gputests_tiles.txt"
    timeout 180 python3 bench/kernels_gpu.py --sweep-moe-down 2>&1 | tee "$out/sweep_down.txt" \
      | tail -4
    wait
    AB_CONC=16,32 cfg_ab moe_grouped tiles1= tiles4="down_tiles=4"
    ;;
  s35e)  # next session, after s35a: the alignment's tile in one pass over 128 assignments
    # (_TILE 16384, 16 warps: 128 registers, no spill in the sm_90 build) against two (8192, 8
    # warps; 12.3 us a layer at 16 requests in s34a's profile): `--time-align` both ways, the
    # 30B at 16 and 32 requests both ways; then Nsight Compute on the grouped kernels (the down
    # sweep's first launches). Prediction: the one-pass tile 12.3 -> 7-9 us, 16 requests +1-3%
    tile="import moestream.kernels.moe_align as a; a._TILE = 16384; a.ALIGN_WARPS = 16; "
    (synth qwen3-30b-a3b q30 > /tmp/r/synth.out 2>&1) &
    timeout 60 python3 bench/kernels_gpu.py --time-align 2>&1 | tee "$out/align_8192.txt" | tail -22
    timeout 60 python3 -c "${tile}import runpy, sys; sys.argv = ['kernels_gpu.py', \
'--time-align']; runpy.run_path('bench/kernels_gpu.py', run_name='__main__')" 2>&1 \
      | tee "$out/align_16384.txt" | tail -22
    wait
    AB_CONC=16,32 AB_TOKENS=32 ab_decode align two "" 100
    AB_CONC=16,32 AB_TOKENS=32 ab_decode align one "$tile" 100
    timeout 150 ncu --kernel-name regex:'_down_grouped_kernel|_gate_up_grouped_kernel' \
      --launch-skip 4 --launch-count 2 --section SpeedOfLight --section LaunchStats \
      --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section SchedulerStats python3 bench/kernels_gpu.py --sweep-moe-down \
      > "$out/ncu_grouped.txt" 2>&1
    echo "[ncu rc=$?]"; grep -E "_kernel|Duration|DRAM Throughput|Achieved Occupancy|Registers \
Per|Waves Per|Memory Throughput|Stall|Eligible" "$out/ncu_grouped.txt" | head -50
    ;;
  s35b)  # next session, issue #7 (25% sampled at 0.46x of resident): the pager pairing up to 8
    # admissions one at a time (commit ea39d12, reverted untimed; as a patch on the kernel as it
    # stands: `git diff HEAD ea39d12 -- moestream/kernels/expert_pager.py > .whl/pairing.patch`,
    # carried with .whl; it passes the pager's CPU tests against `page_ref`): the pager's own
    # cost (16-byte experts) and the 30B at 25% sampled, as it stands, then patched; then the
    # rest on disk at 10%. Predictions: a 16-byte forward with 1 missing 16.3 -> 6-10 us; 25%
    # sampled +3-8%; disk 10% 1-5 tok/s
    synth qwen3-30b-a3b q30
    p25=(/tmp/q30.gguf --device cuda --kv-cache-gib 4 --prompt-lens 32 --decode-depths 0
      --decode-tokens 32 --repeats 2 --temperature 1.0 --gpu-expert-cache-gib 4.4
      --host-expert-cache-gib 24)
    timeout 90 python3 bench/paging.py --shapes 4x4 --pager-warps 8 2>&1 | tee "$out/paging_ranks.txt" | tail -12
    bench_run p25_t1_ranks 100 "${p25[@]}"
    patch -p1 < .whl/pairing.patch && echo "[patched]"
    timeout 90 python3 bench/paging.py --shapes 4x4 --pager-warps 8 2>&1 | tee "$out/paging_pairs.txt" | tail -12
    bench_run p25_t1_pairs 100 "${p25[@]}"
    patch -R -p1 < .whl/pairing.patch && echo "[unpatched]"
    disk 1.76 180 1
    ;;
  s35c)  # next session, issue #5's prefix target (warm 32k step 5.8% of cold; ~10 ms of its
    # 104 ms the GPU waits): where the GPU waits in the warm step (before its first kernel,
    # between kernels, after its last: profile_steps.py's idle_gaps), then the bench's prefix
    # figure. Prediction: most of the wait before the first kernel (the lookup's hashing,
    # ~5 ms on a slow CPU) and after the last (the sampled token's read-back)
    synth qwen3-30b-a3b q30
    timeout 150 python3 bench/profile_steps.py /tmp/q30.gguf --kv-cache-gib 8 --prefill "" \
      --batch 0 --rows 30 --prefix-reuse 32768:31744 > "$out/profile_prefix.txt" 2>&1
    echo "[profile rc=$?]"; grep -v "^USDT\|^$" "$out/profile_prefix.txt" | head -24
    prefix
    ;;
  s35d)  # next session, issue #5: the dense projections at 16-32 rows (s34a: mmq ~13-18 us a
    # launch, 2-3 a layer, ~0.33 TB/s): bf16 copies of every layer's attention weights (1.69
    # GiB for the 30B; `--weight-cache-gib` now caches attention and dense weights before any
    # expert) multiplied by cuBLAS from ops.CACHED_MIN_M rows: mmq against the copies per M
    # (where CACHED_MIN_M should be), then the 30B at 16 and 32 requests without and with
    # 1.75 GiB of copies. Prediction: copies faster from 8 rows; 16 / 32 requests +8-15% /
    # +5-10%
    (synth qwen3-30b-a3b q30 > /tmp/r/synth.out 2>&1) &
    timeout 120 python3 bench/mmq_gpu.py --cached 2>&1 | tee "$out/mmq_cached.txt"
    wait
    AB_CONC=16,32 AB_TOKENS=32 ab_decode wcache none "" 100
    timeout 100 python3 -c "import sys; from moestream.cli import main; sys.exit(main())" \
      bench /tmp/q30.gguf --device cuda --kv-cache-gib 8 --prompt-lens 512 --decode-depths 0 \
      --decode-tokens 32 --repeats 3 --concurrency 16,32 --concurrency-prompt 128 \
      --weight-cache-gib 1.75 --out /tmp/r/ab_wcache > /tmp/r/ab.log 2>&1
    echo "[wcache 1.75 rc=$?]"; grep "^| 0 \|^| 16 \|^| 32 " /tmp/r/ab.log
    cp /tmp/r/ab_wcache/result.json "$out/ab_wcache_175.json" 2>/dev/null
    ;;
  s35f)  # next session, issue #5: mmq's split-K partials summed by the last program of each tile
    # to arrive (mmq.FUSED_SPLIT_SUM) instead of two torch launches (~10 us a layer-step of the
    # 30B at 16 requests): its GPU test, then the 30B at 16 and 32 requests off and on, in turn.
    # Prediction: 16 / 32 requests +2-5%
    (synth qwen3-30b-a3b q30 > /tmp/r/synth.out 2>&1) &
    timeout 120 python3 -m pytest tests/kernels/test_mmq.py -q -p no:cacheprovider --tb=short \
      > "$out/gputests_mmq.txt" 2>&1; tail -3 "$out/gputests_mmq.txt"
    wait
    fused="import moestream.kernels.mmq as m; m.FUSED_SPLIT_SUM = True; "
    AB_CONC=16,32 AB_TOKENS=32 ab_decode fused off1 "" 100
    AB_CONC=16,32 AB_TOKENS=32 ab_decode fused on1 "$fused" 100
    AB_CONC=16,32 AB_TOKENS=32 ab_decode fused off2 "" 100
    AB_CONC=16,32 AB_TOKENS=32 ab_decode fused on2 "$fused" 100
    ;;
  s34d)  # the session's last kernel code on the GPU, to completion: the grouped MoE and its
    # alignment (s34b and s34c cut them at 120-150 s, 11 passing), then the paged experts' GPU
    # tests (whose stage takes the grouped path); each file's output kept as it runs
    timeout 150 python3 -m pytest tests/kernels/test_moe_grouped.py tests/kernels/test_moe_align.py \
      -q -p no:cacheprovider --tb=short -rA > "$out/gputests_grouped.txt" 2>&1
    tail -3 "$out/gputests_grouped.txt"
    timeout 100 python3 -m pytest tests/experts/test_paged.py -q -p no:cacheprovider --tb=short \
      -k gpu > "$out/gputests_paged.txt" 2>&1; tail -3 "$out/gputests_paged.txt"
    ;;
  s34c)  # after s34b (the block bound: 16 / 32 requests 1,578.8 / 2,362.7 -> 1,747.8 / 2,523.6):
    # mmq's K split down to one group a program (SPLIT_MIN_GROUPS 4 -> 1; s34b's sweep: v 21.7
    # -> 13.6 us, o 16.1 -> 15.0, q+k+v 19.4 -> 18.0 at M = 16). GPU tests of mmq and the grouped
    # MoE; the 30B at 16 and 32 requests with the old split, then at 1-32 with the new (issue #5's
    # curve); the paged 10% at 8 requests, temperature 1 (issue #7: 67.1 aggregate last session,
    # llama.cpp -ncmoe 48 57.6 in s34a). Predictions: the new split +2-4% at 16 and 32 requests;
    # paged 10% x 8 within 5% of 67.1 or above
    (synth qwen3-30b-a3b q30 > /tmp/r/synth.out 2>&1) &
    timeout 150 python3 -m pytest tests/kernels/test_mmq.py tests/kernels/test_moe_grouped.py \
      -q -p no:cacheprovider --tb=short -x > "$out/gputests.txt" 2>&1; tail -3 "$out/gputests.txt"
    wait
    AB_CONC=16,32 AB_TOKENS=32 ab_decode split old "import moestream.kernels.mmq as m; \
m.SPLIT_MIN_GROUPS = 4; " 100
    AB_CONC=1,2,4,8,16,32 AB_TOKENS=32 ab_decode split new "" 170
    bench_run paged10_c8 130 /tmp/q30.gguf --device cuda --kv-cache-gib 4 --prompt-lens 32 \
      --decode-depths 0 --decode-tokens 32 --repeats 2 --temperature 1.0 --concurrency 8 \
      --concurrency-prompt 32 --gpu-expert-cache-gib 1.76 --host-expert-cache-gib 24
    ;;
  s34b)  # issue #5's batched decode (s34a's profile at 16 requests: the grouped MoE's down
    # kernel 61.8 us a layer for ~90 MB, 1.4 TB/s; its gate/up 53.6; the align 12.3; the dense
    # projections' mmq ~13 us a launch on 32-160 programs): the grouped kernels' GPU tests
    # (chains removed, blocks bounded by max_blocks); mmq's K splits on the 30B's projections;
    # the down kernel's rows / groups / warps; then the 30B at 16 and 32 requests with the old
    # block bound and the new (cdiv(A, 2) + min(E, A) = 192 -> 128 blocks at 16 requests).
    # Predictions: the new bound +1-4% at 16 requests; some split > default faster at M = 16
    (synth qwen3-30b-a3b q30 > /tmp/r/synth.out 2>&1) &
    timeout 120 python3 -m pytest tests/kernels/test_moe_grouped.py tests/kernels/test_moe_align.py \
      -q -p no:cacheprovider --tb=short -x > "$out/gputests.txt" 2>&1; tail -3 "$out/gputests.txt"
    timeout 100 python3 bench/mmq_gpu.py --split 2>&1 | tee "$out/mmq_split.txt"
    timeout 200 python3 bench/kernels_gpu.py --sweep-moe-down 2>&1 | tee "$out/sweep_down.txt" \
      | grep -v "^ *$" | tail -45
    wait
    AB_CONC=16,32 AB_TOKENS=32 ab_decode bound old "import triton, moestream.kernels.moe_align \
as a; a.max_blocks = lambda n, e, bm: triton.cdiv(n, bm) + min(e, n); " 100
    AB_CONC=16,32 AB_TOKENS=32 ab_decode bound new "" 100
    ;;
  s34a)  # issue #7's batch 8 against llama.cpp with experts on the CPU at the same GPU memory
    # (ANCHORS.md's batch-1 placements: -ncmoe 24 / 36 / all 48 layers), llama.cpp built here
    # from .llama/src.tgz (vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist from PyPI,
    # models/docs/media/benches/tools/ui and the unused ggml backends removed; git-ignored;
    # carry it with .whl); llama-batched-bench at 1 and 8 sequences, 32-token prompts, 32
    # tokens each. The paged GPU tests at the last code (while it builds). Then where a step's
    # time goes at 16 requests and in the warm 32k prefix step (issue #5). moestream's 8
    # requests (twenty-second session): 50% 452.4, 25% 119.5, 10% 67.1 aggregate. Prediction:
    # llama.cpp at 1 sequence within 5% of ANCHORS.md (80.8 / 55.9 / 47.2); 8 sequences
    # 100-250 tok/s aggregate at each (its CPU reads each routed expert once a step)
    (timeout 420 bash bench/scripts/build_llamacpp.sh .llama/src.tgz /tmp/llama 90 \
      "llama-batched-bench" > /tmp/r/build.out 2>&1; echo "[build rc=$?]" >> /tmp/r/build.out) &
    synth qwen3-30b-a3b q30
    timeout 150 python3 -m pytest tests/experts/test_paged.py -q -p no:cacheprovider --tb=short \
      -k "gpu or kernel or gather or prepare" > "$out/gputests.txt" 2>&1
    tail -3 "$out/gputests.txt"
    wait; tail -2 /tmp/r/build.out
    for n in 24 36 48; do
      timeout 100 /tmp/llama/out/bin/llama-batched-bench -m /tmp/q30.gguf -ngl 99 -fa 1 \
        -ncmoe $n -c 4096 -npp 32 -ntg 32 -npl 1,8 2>&1 | grep "^|" | tee "$out/llama_c8_$n.md"
    done
    timeout 150 python3 bench/profile_steps.py /tmp/q30.gguf --kv-cache-gib 8 --prefill "" \
      --batch 16 --decode-tokens 16 --rows 30 --prefix-reuse 32768:31744 \
      > "$out/profile_b16_prefix.txt" 2>&1
    echo "[profile rc=$?]"; grep -v "^USDT\|^$" "$out/profile_b16_prefix.txt" | head -100
    ;;
  s33a)  # next session: issue #7's batch 8 against llama.cpp with experts on the CPU at the
    # same GPU memory (ANCHORS.md's batch-1 placements: -ncmoe 24 / 36 / all 48 layers), built
    # here from .llama/src (vendor/llama.cpp of the llama-cpp-python sdist from PyPI: `pip
    # download --no-deps --no-binary :all: llama-cpp-python`, unpacked; git-ignored; carry it
    # with .whl); llama-batched-bench at 1 and 8 sequences,
    # 32-token prompts, 32 tokens each. moestream's 8 requests (twenty-second session): 50%
    # 452.4, 25% 119.5, 10% 67.1 aggregate. Prediction: llama.cpp 8 sequences 100-250 tok/s
    # aggregate at each (its CPU reads each routed expert once a step)
    (timeout 400 bash bench/scripts/build_llamacpp.sh .llama/src /tmp/llama 90 \
      "llama-batched-bench" > /tmp/r/build.out 2>&1; echo "[build rc=$?]" >> /tmp/r/build.out) &
    synth qwen3-30b-a3b q30
    wait; tail -2 /tmp/r/build.out
    for n in 24 36 48; do
      timeout 120 /tmp/llama/out/bin/llama-batched-bench -m /tmp/q30.gguf -ngl 99 -fa 1 \
        -ncmoe $n -c 4096 -npp 32 -ntg 32 -npl 1,8 2>&1 | grep "^|" | tee "$out/llama_c8_$n.md"
    done
    ;;
  s32b)  # the synth 30B with the prediction on and off (its random routers predict poorly:
    # the gate should keep it mostly off): 25% temperature 1 and 50% greedy, then resident.
    # Prediction: on within 5% of off at both (25% t1 ~222, 50% greedy ~323)
    synth qwen3-30b-a3b q30
    base=(/tmp/q30.gguf --device cuda --kv-cache-gib 4 --prompt-lens 32 --decode-depths 0
      --decode-tokens 32 --repeats 2)
    for arm in on off; do
      bench_run "p25_t1_$arm" 100 "${base[@]}" --gpu-expert-cache-gib 4.4 \
        --host-expert-cache-gib 24 --temperature 1.0 --expert-prediction $arm
    done
    for arm in on off; do
      bench_run "p50_$arm" 100 "${base[@]}" --gpu-expert-cache-gib 8.8 \
        --host-expert-cache-gib 24 --expert-prediction $arm
    done
    bench_run resident 80 "${base[@]}"
    ;;
  s32c)  # issue #7's missing figures: 8 requests at temperature 1 with 25% and 10% paged; the
    # rest on disk at 10% (O_DIRECT, no host tier: the streamed store). Prediction: 8 requests
    # 25% 300-420 aggregate, 10% 180-300; disk 10% 1-5 tok/s
    synth qwen3-30b-a3b q30
    base=(/tmp/q30.gguf --device cuda --kv-cache-gib 4 --prompt-lens 32 --decode-depths 0
      --decode-tokens 32 --repeats 2 --temperature 1.0 --concurrency 8 --concurrency-prompt 32)
    bench_run paged25_c8 130 "${base[@]}" --gpu-expert-cache-gib 4.4 --host-expert-cache-gib 24
    bench_run paged10_c8 130 "${base[@]}" --gpu-expert-cache-gib 1.76 --host-expert-cache-gib 24
    disk 1.76 240 1
    ;;
  s28a)  # the host tier's demand misses queued on the compute stream (a copy on the GPU's own
    # stream, no hand-off to an I/O thread; s27b's question: a demand miss stalled ~770 us
    # where its 3 MB copy needs ~60-120 us) against the demand pool, in turn (T F T F), batch 1,
    # 50% from host memory, greedy; then sampled at temperature 1, batch 1 and 8 requests.
    # Prediction: greedy 73 -> 85-110 tok/s, stall 5.4 -> < 1 ms a decode token (the GPU waits
    # for the copies instead); temperature 1: 35-60. First the graph and GPU exactness tests
    synth qwen3-30b-a3b q30
    timeout 200 python3 -m pytest tests/runner/test_piecewise.py tests/runner/test_cuda_graph.py \
      tests/experts/test_exactness.py -q -p no:cacheprovider --tb=short 2>&1 | tail -4
    h50=(/tmp/q30.gguf --device cuda --kv-cache-gib 4 --gpu-expert-cache-gib 8.8
      --host-expert-cache-gib 24 --prompt-lens 32 --decode-depths 0 --decode-tokens 32)
    for arm in True False True False; do queue_arm q50 "$arm" 80 "${h50[@]}" --repeats 2; done
    queue_arm t1_q50 True 120 "${h50[@]}" --repeats 2 --temperature 1.0 --concurrency 8 \
      --concurrency-prompt 32
    ;;
  s28b)  # temperature 1 at a quarter from host memory and half from the disk (queued loads);
    # zero-copy with host cores at 50% sampled, and greedy with placement rebalanced every 8
    # steps instead of 64 (the greedy loops' experts promoted within the timed decode).
    # Prediction: host 25% t1 20-40; disk 50% t1 8-18; zero-copy t1 60-75 (greedy 71.7);
    # zero-copy greedy rebalanced every 8 steps > 90
    # First the host's time at each cut of the chains (s28c: GPU idle 148 us after each
    # routing read; prediction: the hook itself 40-70 us of it, the launch 10-20)
    synth qwen3-30b-a3b q30
    timeout 100 python3 bench/profile_decode.py /tmp/q30.gguf --device cuda --steps 16 \
      --kv-cache-gib 4 --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 2>&1 \
      | grep -v "USDT\|_warn_once\|UserWarning" | tee "$out/profile_cuts.md" | head -16
    t1=(--device cuda --kv-cache-gib 4 --prompt-lens 32 --decode-depths 0
      --decode-tokens 32 --repeats 2 --temperature 1.0)
    bench t1_host25 100 /tmp/q30.gguf "${t1[@]}" --gpu-expert-cache-gib 4.4 \
      --host-expert-cache-gib 24
    bench t1_zc50 100 /tmp/q30.gguf "${t1[@]}" --gpu-expert-cache-gib 8.8 \
      --host-expert-cache-gib 24 --expert-zero-copy --expert-cpu-fraction 0.6
    bench zc50_rb8 100 /tmp/q30.gguf --device cuda --kv-cache-gib 4 --prompt-lens 32 \
      --decode-depths 0 --decode-tokens 64 --repeats 2 --gpu-expert-cache-gib 8.8 \
      --host-expert-cache-gib 24 --expert-zero-copy --expert-cpu-fraction 0.6 \
      --expert-rebalance-steps 8
    bench t1_disk50 120 /tmp/q30.gguf "${t1[@]}" --gpu-expert-cache-gib 8.8 \
      --host-expert-cache-gib 0 --expert-direct-io
    ;;
  s27c)  # next session: the I/O threads' copy wait with chains of graphs, spinning (the
    # default since the nineteenth session) against asleep (how s26d measured 73.0 tok/s), in
    # turn, 50% from host memory, batch 1. Prediction: spinning 3-10% faster (eager: a stall
    # of 4.25 against 5.09 ms a decode token)
    synth qwen3-30b-a3b q30
    copy_wait_arms copy_wait 32 3
    ;;
  s29a)  # next session: the prediction's prefetch gate (held while under half of what it
    # would load is routed) against always prefetching (PREFETCH_MIN_USE = 0), in turn (on, off,
    # on, off), 50% from host memory, batch 1 greedy then sampled. Prediction: decode evictions
    # roughly halve, greedy +5-15%; sampled no worse
    synth qwen3-30b-a3b q30
    for t in 0 1.0; do
      for arm in 0.5 0 0.5 0; do
        timeout 80 python3 -c "import sys, moestream.experts.store as s
s.PREFETCH_MIN_USE = $arm
from moestream.cli import main; sys.exit(main())" bench /tmp/q30.gguf --device cuda \
          --kv-cache-gib 4 --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 \
          --prompt-lens 32 --decode-depths 0 --decode-tokens 32 --repeats 2 --temperature $t \
          --out "/tmp/r/gate_${t}_$arm" > "/tmp/r/gate_${t}_$arm.log" 2>&1
        echo "t=$t min_use=$arm rc=$? $(grep -A4 '^## decode' "/tmp/r/gate_${t}_$arm.log" | tail -1)"
        grep "evictions device\|prefetch held" "/tmp/r/gate_${t}_$arm.log" | head -2
        cat "/tmp/r/gate_${t}_$arm.log" >> "$out/gate_${t}_$arm.log"
      done
    done
    ;;
  s28d)  # (ran at b730a2f; the deferral it compares was removed after this run, 2.4% slower a
    # step: both arms now run the same code) the hook trimmed (all-hit forwards pin in one pass, one counters update, no prefetch
    # work when the prediction is in slots, one policy record) and its bookkeeping deferred to
    # the store's thread: the cut timing with the bookkeeping deferred and kept on the compute
    # thread, in turn (s28b: before 107 us median, 10.37 ms a step), then batch 1 greedy and
    # temperature 1 (with 8 requests) at 50%, temperature 1 at 25%. Prediction: before 60-85
    # us kept, 25-50 deferred; 6.5-8 ms a step deferred; bench 50% greedy 85-120 tok/s
    synth qwen3-30b-a3b q30
    for arm in True False; do
      timeout 90 python3 -c "import runpy, sys, moestream.experts.prefetch as p
p.DEFER_BOOKKEEPING = $arm
sys.argv = ['profile_decode.py', '/tmp/q30.gguf', '--device', 'cuda', '--steps', '16',
            '--kv-cache-gib', '4', '--gpu-expert-cache-gib', '8.8', '--host-expert-cache-gib', '24']
runpy.run_path('bench/profile_decode.py', run_name='__main__')" 2>&1 \
        | grep -v "USDT\|_warn_once\|UserWarning" > "$out/profile_cuts_$arm.md"
      echo "defer=$arm"; head -9 "$out/profile_cuts_$arm.md"
    done
    h50=(/tmp/q30.gguf --device cuda --kv-cache-gib 4 --gpu-expert-cache-gib 8.8
      --host-expert-cache-gib 24 --prompt-lens 32 --decode-depths 0 --decode-tokens 32)
    bench q50 90 "${h50[@]}" --repeats 3
    bench t1_q50 120 "${h50[@]}" --repeats 2 --temperature 1.0 --concurrency 8 \
      --concurrency-prompt 32
    bench t1_q25 100 /tmp/q30.gguf --device cuda --kv-cache-gib 4 --gpu-expert-cache-gib 4.4 \
      --host-expert-cache-gib 24 --prompt-lens 32 --decode-depths 0 --decode-tokens 32 \
      --repeats 2 --temperature 1.0
    ;;
  s28c)  # the GPU exactness test (its eager streamed model), then s27b's profile with queued
    # loads (s28a: stall 0.44 ms a decode token, yet ~14.7 ms a token with ~2 ms on the GPU)
    timeout 100 python3 -m pytest tests/experts/test_exactness.py -q -p no:cacheprovider \
      --tb=short -m gpu 2>&1 | tail -30
    OUT="$out" bash "$0" s27b
    ;;
  s27b)  # next session: where the chains' host time goes (s26d at 50% from host memory: a
    # 13.7 ms step of which 5.4 ms stall, ~2 ms GPU, ~170 us a layer between pieces; a demand
    # miss stalls ~770 us where its 3 MB copy needs ~60-120 us): py-spy of the main thread and
    # the store's threads (native frames: the driver's waits), then the GPU timeline
    synth qwen3-30b-a3b q30
    spy=/tmp/site/bin/py-spy
    timeout 200 "$spy" record --threads --idle --native --format raw -r 500 \
      -o "$out/spy_chains.txt" -- python3 -m moestream.cli bench /tmp/q30.gguf --device cuda \
      --kv-cache-gib 4 --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 --prompt-lens 32 \
      --decode-depths 0 --decode-tokens 64 --repeats 2 --out /tmp/r/spy_chains \
      > "$out/spy_chains.log" 2>&1
    echo "py-spy rc=$?"; grep -A4 '^## decode' "$out/spy_chains.log" | tail -1
    timeout 120 python3 bench/profile_decode.py /tmp/q30.gguf --device cuda --steps 8 \
      --kv-cache-gib 4 --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 2>&1 \
      | grep -v "USDT\|_warn_once\|UserWarning" | tee "$out/profile_chains.md" | head -24
    ;;
  s27a)  # next session: the chains of graphs (s26d) where the tokens do not loop: sampled at
    # temperature 1 (a synth file's greedy decode repeats a few tokens, 98% cache hits; the
    # tiny synth's file bytes a token doubled at temperature 1 on the CPU), batch 1 and 8
    # requests (8 fit the 50% graphs: 8 x 8 <= 64 slots), host memory at 50% and 25%, the
    # disk at 50%. Prediction: host memory 50% batch 1 35-60 tok/s (greedy 73.0), 25% 20-40;
    # disk 50% 8-18 (greedy 26.7). First the graph tests: the review's mends (0a45972) touched
    # both graph backends' capture and have not run on a GPU
    synth qwen3-30b-a3b q30
    timeout 150 python3 -m pytest tests/runner/test_piecewise.py tests/runner/test_cuda_graph.py \
      -q -p no:cacheprovider --tb=short 2>&1 | tail -4
    local_t=(--device cuda --kv-cache-gib 4 --prompt-lens 32 --decode-depths 0 --decode-tokens 32
      --repeats 2 --temperature 1.0 --concurrency 8 --concurrency-prompt 32)
    bench t1_host50 120 /tmp/q30.gguf "${local_t[@]}" --gpu-expert-cache-gib 8.8 \
      --host-expert-cache-gib 24
    bench t1_host25 120 /tmp/q30.gguf "${local_t[@]}" --gpu-expert-cache-gib 4.4 \
      --host-expert-cache-gib 24
    bench t1_disk50 150 /tmp/q30.gguf "${local_t[@]}" --gpu-expert-cache-gib 8.8 \
      --host-expert-cache-gib 0 --expert-direct-io
    ;;
  s26d)  # decode with streamed experts as chains of CUDA graphs (runner/piecewise.py): the
    # GPU test (graph bits = eager bits), then the figures s26b/s25a measured eagerly: the host
    # tier streamed into slots at 50% (eager 8.1-9.5 tok/s), the disk at 50% (6.7-7.6) and 25%
    # (3.6). Prediction: host tier 50% 60-150 tok/s; disk 50% 20-35 and 25% 5-8 (the stall,
    # 31 and 138 ms a token eagerly, is then most of a token)
    synth qwen3-30b-a3b q30
    timeout 120 python3 -m pytest tests/runner/test_piecewise.py -q -p no:cacheprovider \
      --tb=short 2>&1 | tail -4
    bench pw_host 90 /tmp/q30.gguf --device cuda --kv-cache-gib 4 --gpu-expert-cache-gib 8.8 \
      --host-expert-cache-gib 24 --prompt-lens 32 --decode-depths 0 --decode-tokens 32 \
      --repeats 3
    bench pw_disk50 90 /tmp/q30.gguf --device cuda --kv-cache-gib 4 \
      --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 0 --expert-direct-io \
      --prompt-lens 32 --decode-depths 0 --decode-tokens 24 --repeats 2
    bench pw_disk25 100 /tmp/q30.gguf --device cuda --kv-cache-gib 4 \
      --gpu-expert-cache-gib 4.4 --host-expert-cache-gib 0 --expert-direct-io \
      --prompt-lens 32 --decode-depths 0 --decode-tokens 24 --repeats 2
    ;;
  s26c)  # why the streamed decode's host is slow (s26b: the blocking wait did not help, 9.5
    # spin / 8.1 blocking tok/s; ~100-300 us of host time before every kernel): the resident
    # model's eager decode (no graphs) as the baseline of eager Python, then py-spy without
    # --idle over the streamed decode (samples only while the main thread runs: a thread that
    # waits for the GIL or a lock drops out)
    synth qwen3-30b-a3b q30
    bench eager 100 /tmp/q30.gguf --device cuda --kv-cache-gib 4 --enforce-eager \
      --prompt-lens 32 --decode-depths 0 --decode-tokens 24 --repeats 2
    spy=/tmp/site/bin/py-spy
    timeout 150 "$spy" record --threads --format raw -r 100 -o "$out/spy_active.txt" -- \
      python3 -m moestream.cli bench /tmp/q30.gguf --device cuda --kv-cache-gib 4 \
      --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 --prompt-lens 32 \
      --decode-depths 0 --decode-tokens 24 --repeats 2 --out /tmp/r/spy_active \
      > "$out/spy_active.log" 2>&1
    echo "py-spy rc=$?"; grep -A4 '^## decode' "$out/spy_active.log" | tail -1
    ;;
  s26b)  # the I/O threads' copy wait asleep (store.COPY_WAIT_BLOCKING) against spinning, in
    # turn, experts streamed into slots from pinned host memory at 50% on the device (s26a:
    # 5.3 tok/s, the GPU busy 2% of a step, every launch ~10x slower than eager), then the disk
    # at 50% and the GPU timeline with the new wait. Prediction: 5.3 -> 15-30 tok/s
    synth qwen3-30b-a3b q30
    copy_wait_arms wait 24 2
    cp /tmp/r/wait_True/result.json "$out/wait_True.json"
    bench disk_g8.8b 110 /tmp/q30.gguf --device cuda --kv-cache-gib 4 \
      --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 0 --expert-direct-io \
      --prompt-lens 32 --decode-depths 0 --decode-tokens 24 --repeats 2
    timeout 120 python3 bench/profile_decode.py /tmp/q30.gguf --device cuda --steps 8 \
      --kv-cache-gib 4 --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 2>&1 \
      | grep -v "USDT\|_warn_once\|UserWarning" | tee "$out/profile_stream.md" | head -24
    ;;
  s26a)  # the streamed slots' overhead: at 50% on the device, decode from the disk took
    # ~149 ms a token with 35 ms of it counted as stall (s25a's follow-up run); the host tier's
    # streaming gave 10.2 tok/s long ago. Where the rest goes: py-spy over the bench's
    # decode with the rest streamed from pinned host memory (no disk), then the GPU timeline
    synth qwen3-30b-a3b q30
    spy=/tmp/site/bin/py-spy; common=(/tmp/q30.gguf --device cuda --kv-cache-gib 4
      --gpu-expert-cache-gib 8.8 --prompt-lens 32 --decode-depths 0 --decode-tokens 32
      --repeats 2)
    timeout 170 "$spy" record --threads --idle --format raw -r 250 -o "$out/spy_host.txt" -- \
      python3 -m moestream.cli bench "${common[@]}" --host-expert-cache-gib 24 \
      --out /tmp/r/host_stream > "$out/host_stream.log" 2>&1
    echo "py-spy rc=$?"; sed -n '/^## decode/,/^## memory/p' "$out/host_stream.log" | head -50
    if [[ ! -s "$out/spy_host.txt" ]]; then
      timeout 170 python3 -m cProfile -o "$out/host_stream.prof" -m moestream.cli bench \
        "${common[@]}" --host-expert-cache-gib 24 --out /tmp/r/host_stream2 \
        > "$out/host_stream2.log" 2>&1; echo "cProfile rc=$?"
    fi
    timeout 150 python3 bench/profile_decode.py /tmp/q30.gguf --device cuda --steps 8 \
      --kv-cache-gib 4 --gpu-expert-cache-gib 8.8 --host-expert-cache-gib 24 2>&1 \
      | grep -v "USDT\|_warn_once\|UserWarning" | tee "$out/profile_stream.md" | head -40
    ;;
  s25a)  # next session: the disk tier's ceiling (the store's reader, O_DIRECT, random whole
    # experts of the 30B; prediction: 3-7 GB/s at 8 threads, so a 50% token's ~0.55 GB of
    # misses caps batch 1 at 5-13 tok/s, against the 9.0 measured), then s24a (the rest on
    # disk at 25%, cut twice) with the counters by phase (decode prefetch accuracy apart)
    synth qwen3-30b-a3b q30
    timeout 90 python3 bench/disk_read.py /tmp/q30.gguf --threads 1,4,8,16 --experts 256 \
      --rounds 3 2>&1 | tee "$out/disk_read.md" | tail -12
    disk 4.4 420 8
    ;;
  s18c)  # the GPU's MoE bits against the exact interpreters, to its end (cut at 200 s in s16a)
    timeout 560 python3 -m pytest tests/kernels/test_exact.py -q -p no:cacheprovider -rfs \
      --durations=3 2>&1 | tail -8
    ;;
  q8) synth qwen3-8b q8; q8 ;;
  q30) synth qwen3-30b-a3b q30; q30; prefix ;;
  final)
    spec 100 1
    synth qwen3-30b-a3b q30
    q30wc 280 1,16,32
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
