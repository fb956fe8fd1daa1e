#!/usr/bin/env bash
# lm-evaluation-harness `local-completions` against `moestream serve`, end to end, offline.
#
#   bash bench/lm_eval_demo.sh [MODEL] [OUT_DIR]
#
# Starts `moestream serve MODEL` (default: the embedded demo model) on a free loopback port,
# runs the two local tasks of bench/lm_eval_task/ (perplexity of Python snippets, next-line
# multiple choice) through `lm_eval --model local-completions` unchanged, prints lm-eval's
# results table, writes its JSON and samples under OUT_DIR (default: a temporary folder), and
# stops the server. The tokenizer is the server's own (/tokenize, /detokenize, /tokenizer_info:
# tokenizer_backend=remote); loglikelihoods come from /v1/completions with echo + logprobs.
# Needs the optional extra: pip install 'lm-eval[api]>=0.4'. Env: MAX_LENGTH (lm-eval's window,
# default 512), LIMIT (documents per task, default all), THREADS (torch threads, default 1).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODEL="${1:-${MOESTREAM_MODEL:-moestream/data/tiny-qwen3-moe-Q4_K_M.gguf}}"
OUT="${2:-$(mktemp -d -t moestream-lmeval-XXXXXX)}"
MAX_LENGTH="${MAX_LENGTH:-512}"
THREADS="${THREADS:-1}"
NAME=moestream-demo

command -v lm_eval >/dev/null || { echo "lm_eval not found: pip install 'lm-eval[api]>=0.4'" >&2; exit 2; }
PORT="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"

# Offline: the datasets are local JSONL files; never try the hub.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_DATASETS_CACHE="$OUT/hf-datasets-cache"
mkdir -p "$OUT"

python bench/lm_eval_task/make_data.py >/dev/null  # deterministic: rewrites the same files

moestream serve "$MODEL" --host 127.0.0.1 --port "$PORT" --served-model-name "$NAME" \
    --device cpu --threads "$THREADS" --max-model-len $((MAX_LENGTH + 16)) \
    >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT

for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/server.log" >&2; exit 1; }
    sleep 0.2
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "server did not start" >&2; exit 1; }

LIMIT_ARGS=()
[[ -n "${LIMIT:-}" ]] && LIMIT_ARGS=(--limit "$LIMIT")
start=$(date +%s)
lm_eval run --model local-completions \
    --model_args "model=$NAME,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=remote,num_concurrent=1,max_retries=1,max_length=$MAX_LENGTH" \
    --tasks heldout_python_ppl heldout_python_next_line \
    --include_path bench/lm_eval_task \
    --output_path "$OUT/results" --log_samples \
    "${LIMIT_ARGS[@]}"
echo "lm_eval took $(( $(date +%s) - start )) s; results and samples in $OUT/results"
