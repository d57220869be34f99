#!/usr/bin/env bash
# The GPU figures of the README, in two parts of under ten minutes each (one lent H100):
#   bash benchmarks/h100_session.sh 1   # float8 step, QAT, serving, int4 block forms
#   bash benchmarks/h100_session.sh 2   # float8 crossover sweep, GPT-2-size LM, the rest
# Each benchmark's output goes to stdout and, where $OUT is set, to $OUT/<name>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
out="${OUT:-/tmp}"
run() {  # run NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S))"
  timeout "$limit" "$@" 2>&1 | grep -v "^\s*h = \|^\s*x = " | tee "$out/$name.log"
}
if [[ "${1:-1}" == 1 ]]; then
  nvidia-smi -L; python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
  run float8 240 python3 benchmarks/float8_bench.py --tokens 8192 --width 8192 --hidden 8192 --repeats 30 --steps 100
  run serving 150 python3 benchmarks/serving_bench.py --dim 8192 --repeats 50
  run int4_blocks 120 python3 benchmarks/int4_block_forms.py --dim 8192 --repeats 50
else
  run sweep 260 python3 benchmarks/float8_bench.py --tokens 8192 --sweep 768,1024,2048,4096,8192 --repeats 15
  run gpt2 120 python3 benchmarks/linen_overhead_bench.py --layers 12 --dim 768 --heads 12 --batch 16 --seq 1024 --repeats 20 --float8
  run overhead 60 python3 benchmarks/linen_overhead_bench.py --layers 8 --dim 1024 --heads 8 --batch 16 --seq 512 --repeats 20
  run diagnostics 60 python3 benchmarks/diagnostics_bench.py --repeats 10
  run loss_scaling 60 python3 benchmarks/loss_scaling_bench.py
fi
