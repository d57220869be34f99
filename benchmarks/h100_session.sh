#!/usr/bin/env bash
# The GPU figures of the README, in two calls that fit one lent GPU's 15 minutes:
#   bash benchmarks/h100_session.sh 1   # serving (+ HLO), GPT-2-size LM, int4/int8 forms,
#                                       # the float8 loss step per step, diagnostics (~8 min)
#   bash benchmarks/h100_session.sh 2   # the float8 sweep's wide end, the overhead (~5 min)
# Everything goes to stdout and, where $OUT is set, to $OUT/gpu<part>.log; the float8
# steps' and serving programs' optimized HLO goes to $OUT/hlo<part>.tar.gz (read its GEMMs without a GPU).
# The package needs google-re2, which the GPU image lacks: carry its wheel in .whl/
# and this script installs it first. Once, on the machine that sends the call:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl google-re2
# then call the device with carry=[".whl"]. Python 3.12 and jax 0.11.2 are the image's;
# check a change under them first (a 3.12 venv with jax==0.11.2 runs every script on a CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:-1}"
out="${OUT:-/tmp}"
log="$out/gpu$part.log"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export BENCH_HLO_DIR=/tmp/hlo; mkdir -p "$BENCH_HLO_DIR"
run() {  # run NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S)): $*" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | grep -v "^\s*h = \|^\s*x = \|UserWarning" | tee -a "$log"
  echo "=== $name rc=${PIPESTATUS[0]} ($(date -u +%H:%M:%S))" | tee -a "$log"
}
{ date -u; nvidia-smi -L; python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"; } 2>&1 | tee -a "$log"
# What the run of 2026-11-26 (one H200, docs/benchmarks.md) left to measure, in the order
# that matters. A GPU compiles slowly (its autotuner times each GEMM): every step has its
# own limit and prints as it goes, so a step cut short still leaves what it measured.
if [[ "$part" == 1 ]]; then
  run serving 40 python3 benchmarks/serving_bench.py --dim 8192 --repeats 30
  run gpt2 190 python3 benchmarks/linen_overhead_bench.py --layers 12 --dim 768 --heads 12 --batch 16 --seq 1024 --repeats 10 --float8 --only "flax dtype=bfloat16,jp.linen.apply,float8 projections (current)"
  run forms 70 python3 benchmarks/int4_block_forms.py --dim 8192 --repeats 30 --batches 1 32 64 128 256
  run float8_trace 110 python3 benchmarks/float8_bench.py --tokens 8192 --width 8192 --hidden 8192 --repeats 5 --steps 40 --log-steps 40 --variants float8,f8_cur,bf16
  run diagnostics 90 python3 benchmarks/diagnostics_bench.py --dims 1024 --repeats 5
else
  run sweep 170 python3 benchmarks/float8_bench.py --tokens 8192 --sweep 4096,8192 --repeats 8
  run overhead 120 python3 benchmarks/linen_overhead_bench.py --layers 8 --dim 1024 --heads 8 --batch 16 --seq 512 --repeats 10 --only "by hand (tree.map astype),jp.linen.apply,flax dtype=bfloat16"
fi
tar czf "$out/hlo$part.tar.gz" -C "$BENCH_HLO_DIR" . 2>/dev/null
echo "=== done ($(date -u +%H:%M:%S))" | tee -a "$log"
