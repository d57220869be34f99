#!/usr/bin/env bash
# The GPU figures of the README, in two calls that fit one lent GPU's 15 minutes:
#   bash benchmarks/h100_session.sh 1   # float8 step per step, serving (+ HLO), GPT-2-size LM
#   bash benchmarks/h100_session.sh 2   # float8 sweep's wide end, diagnostics, overhead, int4
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
# that matters: why delayed scaling diverges (the loss and scales per step), the GPT-2-size
# LM, the serving HLO (why weight-only int8 did not beat bf16 there), then the sweep's wide
# end, diagnostics and the overhead at d=1024.
if [[ "$part" == 1 ]]; then
  run float8 170 python3 benchmarks/float8_bench.py --tokens 8192 --width 8192 --hidden 8192 --repeats 10 --steps 40 --log-steps 40
  run serving 90 python3 benchmarks/serving_bench.py --dim 8192 --repeats 30
  run gpt2 280 python3 benchmarks/linen_overhead_bench.py --layers 12 --dim 768 --heads 12 --batch 16 --seq 1024 --repeats 10 --float8
else
  run sweep 250 python3 benchmarks/float8_bench.py --tokens 8192 --sweep 4096,8192 --repeats 8
  run diagnostics 120 python3 benchmarks/diagnostics_bench.py --dims 1024 --repeats 5
  run overhead 150 python3 benchmarks/linen_overhead_bench.py --layers 8 --dim 1024 --heads 8 --batch 16 --seq 512 --repeats 10
  run int4_blocks 60 python3 benchmarks/int4_block_forms.py --dim 8192 --repeats 30 --batches 32 64 128
fi
tar czf "$out/hlo$part.tar.gz" -C "$BENCH_HLO_DIR" . 2>/dev/null
echo "=== done ($(date -u +%H:%M:%S))" | tee -a "$log"
