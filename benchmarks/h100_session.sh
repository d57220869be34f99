#!/usr/bin/env bash
# The GPU figures of the README, in two calls that fit one lent GPU's 15 minutes:
#   bash benchmarks/h100_session.sh 1   # serving (+ HLO; compile_for_serving's rows), the
#                                       # float8 loss per step with a one-step amax history
#                                       # (f8_h1) beside the default's, diagnostics at a
#                                       # larger step, int4 forms at 96 rows (~6 min)
#   bash benchmarks/h100_session.sh 2   # the float8 sweep at width 4096 (~6 min)
#   bash benchmarks/h100_session.sh kernel  # #48: the Pallas kernel's tiles, then serving
#                                       # with the winner at dims 8192 and 4096 (~9 min)
#   bash benchmarks/h100_session.sh kernel2 # #48 again: structure probes, serving 8 passes
#                                       # per call (~7 min)
#   bash benchmarks/h100_session.sh kernel3 # #48: CUDA-core rows, no weight mask (~5 min)
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
# What the two runs of 2026-11-26 (one H200 each, docs/benchmarks.md) left to measure, in
# the order that matters. A GPU compiles slowly (its autotuner times each GEMM; a width of
# the float8 sweep takes over 170 s): every step has its own limit and prints as it goes,
# so a step cut short still leaves what it measured.
if [[ "$part" == kernel ]]; then
  # #48: the Pallas kernel's tiles tuned (dims 8192 then 4096), then serving with the
  # tiles that won at dim 8192, 16 rows, int8 (one global TILES, as the library has).
  run tune 300 python3 benchmarks/pallas_tune.py --dims 8192 4096 --budget 230 --json "$out/tune.json"
  tiles=$(python3 -c "import json,sys; r=[r for r in json.load(open('$out/tune.json'))['rows'] if r['tiles'] and (r['dim'],r['rows'],r['format'])==(8192,16,'int8')]; print(json.dumps(min(r, key=lambda r: r['us'])['tiles']))" 2>/dev/null || echo '{}')
  run serving8192 140 python3 benchmarks/serving_bench.py --dim 8192 --repeats 20 --tiles "$tiles"
  run serving4096 90 python3 benchmarks/serving_bench.py --dim 4096 --repeats 20 --tiles "$tiles"
elif [[ "$part" == kernel2 ]]; then
  # #48, second call: the kernel with 16-row partial sums (the 1-row fix), probes of its
  # structure (no loop: one step per program; one pipeline stage; narrower tiles), then
  # serving timed 8 passes per call (the device's time, not the host's dispatch).
  run tune 230 python3 benchmarks/pallas_tune.py --dims 8192 4096 --budget 170 --json "$out/tune.json" \
    --tiles '{"out":64,"programs":528}' '{"out":64,"programs":1000000,"partials":1.0}' \
    '{"out":128,"programs":1000000,"partials":1.0}' '{"out":64,"programs":528,"stages":1}' \
    '{"out":64,"step":64,"programs":1056}' '{"out":32,"programs":1056}'
  tiles=$(python3 -c "import json,sys; r=[r for r in json.load(open('$out/tune.json'))['rows'] if r['tiles'] and (r['dim'],r['rows'],r['format'])==(8192,16,'int8')]; print(json.dumps(min(r, key=lambda r: r['us'])['tiles']))" 2>/dev/null || echo '{}')
  run serving8192 90 python3 benchmarks/serving_bench.py --dim 8192 --repeats 10 --loops 8 --tiles "$tiles"
  run serving4096 80 python3 benchmarks/serving_bench.py --dim 4096 --repeats 10 --loops 8 --tiles "$tiles"
elif [[ "$part" == kernel3 ]]; then
  # #48, third call: rows on CUDA cores (fma_rows=4: 1-4 rows without the 16-row dot) and
  # no weight mask (x's zero padding meets the weights past the input dimension), each
  # beside the tuned tiles and XLA's form at 1, 4 and 16 rows.
  run tune 300 python3 benchmarks/pallas_tune.py --dims 8192 4096 --rows 1 4 16 --budget 250 \
    --json "$out/tune.json" --tiles '{"out":64,"programs":528}' \
    '{"out":64,"programs":528,"fma_rows":4}' '{"out":64,"programs":528,"mask_weights":false}' \
    '{"out":64,"programs":528,"fma_rows":4,"mask_weights":false}' \
    '{"out":128,"programs":528,"fma_rows":4,"mask_weights":false}'
elif [[ "$part" == f8h1 ]]; then  # what a lease's last 4 minutes hold: #52's f8_h1, int4 forms
  run float8_h1 115 python3 benchmarks/float8_bench.py --tokens 8192 --width 8192 --hidden 8192 --repeats 3 --steps 40 --log-steps 40 --variants float8,f8_h1,bf16
  run forms 45 python3 benchmarks/int4_block_forms.py --dim 8192 --repeats 30 --batches 1 16 64 96 256
elif [[ "$part" == 1 ]]; then
  run serving 50 python3 benchmarks/serving_bench.py --dim 8192 --repeats 30
  run float8_h1 130 python3 benchmarks/float8_bench.py --tokens 8192 --width 8192 --hidden 8192 --repeats 3 --steps 40 --log-steps 40 --variants float8,f8_h1,bf16
  run diagnostics 120 python3 benchmarks/diagnostics_bench.py --dims 1024 --batch 64 --seq 512 --repeats 5
  run forms 60 python3 benchmarks/int4_block_forms.py --dim 8192 --repeats 30 --batches 1 16 96 256
else
  run sweep 330 python3 benchmarks/float8_bench.py --tokens 8192 --sweep 4096 --repeats 8
fi
tar czf "$out/hlo$part.tar.gz" -C "$BENCH_HLO_DIR" . 2>/dev/null
echo "=== done ($(date -u +%H:%M:%S))" | tee -a "$log"
