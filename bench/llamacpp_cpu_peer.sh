#!/bin/bash
# llama.cpp against minivllm on the CPU, on the default model's GGUF (its Q4_1 file), two threads each, the same
# prompts through bench/serve.py (256 random tokens in, 128 out, EOS ignored) at concurrency 1 and 16; then
# llama-bench's own pp256/tg128. minivllm runs once per QUANTS entry (default: its default, then none; `compile`:
# its default with --compile).
#
# llama.cpp from the llama-cpp-python sdist (pip download llama-cpp-python --no-deps --no-binary :all:), its
# vendor/llama.cpp built for this CPU without -march=native (AMX instructions stop the process on VMs that hide it):
#   cmake -S . -B build -G Ninja -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
#         -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DLLAMA_CURL=OFF && ninja -C build llama-server llama-bench
#   LLAMA_CPP_BIN=.../build/bin bench/llamacpp_cpu_peer.sh
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
BIN=${LLAMA_CPP_BIN:?set LLAMA_CPP_BIN to the build/bin folder of llama.cpp}
MODEL_DIR=${MINIVLLM_CACHE:-$HOME/.cache/minivllm}/SmolLM2-135M-Instruct
GGUF=$(ls $MODEL_DIR/*.gguf)
TOK=$MODEL_DIR
OUTDIR=${OUTDIR:-$REPO/bench/out/llamacpp-cpu}; mkdir -p $OUTDIR
PY=${PYTHON:-$REPO/.venv/bin/python}
cd $REPO
bench() {  # name port concurrency prompts
  $PY bench/serve.py --base-url http://127.0.0.1:$2 --tokenizer $TOK --num-prompts $4 --max-concurrency $3 \
    --random-input-len 256 --random-output-len 128 --ignore-eos --no-plots --disable-tqdm \
    --result-dir $OUTDIR --result-filename $1-c$3.json > $OUTDIR/$1-c$3.log 2>&1
  echo "== $1 c=$3 rc=$?"; grep -E "Output token throughput|Mean TPOT|Median TPOT|Mean TTFT|Successful" $OUTDIR/$1-c$3.log
}
wait_up() { for i in $(seq 1 120); do curl -sf http://127.0.0.1:$1/v1/models >/dev/null && return 0; sleep 1; done; return 1; }
echo "llama-bench:"; $BIN/llama-bench -m $GGUF -t 2 -p 256 -n 128 2>&1 | grep -E "pp256|tg128"
$BIN/llama-server -m $GGUF -t 2 -tb 2 -c 16384 --parallel 16 --port 8091 > $OUTDIR/llama-server.log 2>&1 &
LS=$!; wait_up 8091 || echo "llama-server did not start"
bench llamacpp 8091 1 8; bench llamacpp 8091 16 48
kill $LS; wait $LS 2>/dev/null
for Q in ${QUANTS:-default none}; do
  case $Q in default) EXTRA="";; compile) EXTRA="--compile";; *) EXTRA="--quantization $Q";; esac
  PYTHONPATH=$REPO $PY -m server.cli serve --port 8092 $EXTRA > $OUTDIR/minivllm-$Q.log 2>&1 &
  MV=$!; wait_up 8092 || echo "minivllm did not start"
  bench minivllm-$Q 8092 1 8; bench minivllm-$Q 8092 16 48
  kill -INT $MV; wait $MV 2>/dev/null
done
