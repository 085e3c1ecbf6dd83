#!/usr/bin/env bash
# One call on a lent GPU machine (torch and JAX with CUDA preinstalled, no network), sized for a
# session's device time (15 minutes, start-up included: one call of at most 600 s). The runs go
# in the order of issue 32's GPU targets, each bench in its own process under its own limit, so
# one that hangs or fails leaves the others' numbers; a run starts only while the call's budget
# (BUDGET_S, default 560 s) has its limit left, else it says it was left out:
#   w7      W7gpu (GPT-2 small): jax (cuDNN attention) and spmd_capture, the unchanged lazy loop
#           with automatic capture on (target: at least 0.9x JAX, pipelined tokens/s);
#   w7b     W7gpu: inductor, spmd_torch lazy (target: twice the lazy loop before issue 32) and
#           spmd_compile (target: at least 1.0x inductor); peak memory against JAX's;
#   wlong   Wlong (a Llama at seq 8192, bf16): jax and spmd_torch (target: trains where plain
#           attention cannot fit);
#   wlongplain  Wlong's jax_plain (expected out of memory), apart: a long compile that then
#           fails must not cost wlong its figures;
# and only where named: w7ref (eager, jax_plain), wlongcapture, w23 (W2 and W3), wattn (one
# attention layer at seq 8192) and tests (the unit tests on that machine's torch and JAX, CPU
# backend). An argument names the runs, e.g. `gpu_run.sh w7,wlong` (default:
# w7,w7b,wlong,wlongplain);
# call it with timeout_s 600. Logs (the bench's end in its BENCH_JSON line) go to $OUT, one file
# per run. `python -m tools.bench.pipeline_probe` (a pipelined window step by step, with
# Python's garbage collections) is left out: run it on its own when pipelined steps look wrong.
set -u
only=${1:-w7,w7b,wlong,wlongplain}
budget=${BUDGET_S:-560}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/gpu_run}
mkdir -p "$OUT"
py=python3
# The spmd_torch backend is an entry point: install this checkout (offline, no dependencies).
$py -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || echo "install failed"
{
  $py -c "import sys, torch, jax; print(sys.version.split()[0], torch.__version__, jax.__version__, jax.devices())"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
  nproc
} 2>&1 | tee "$OUT/env.txt"

wanted() { [[ ",$only," == *",$1,"* ]]; }
fits() {  # name limit_s: whether the call's budget still has limit_s left
  local left=$((budget - SECONDS))
  if ((left < $2)); then
    echo "== $1: left out (${left} s of the budget left, its limit is $2 s)"
    return 1
  fi
}
bench() {  # name limit_s args...
  local name=$1 limit=$2
  shift 2
  wanted "$name" && fits "$name" "$limit" || return 0
  timeout "$limit" $py -m tools.bench --gpu "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? after ${SECONDS} s"
  grep -v '^BENCH_JSON' "$OUT/$name.log" | tail -n 16
}
bench w7 150 --workloads W7gpu --impls jax,spmd_capture --warmup 3 --steps 10
bench w7b 200 --workloads W7gpu --impls inductor,spmd_torch,spmd_compile --warmup 3 --steps 10
bench wlong 170 --workloads Wlong --impls jax,spmd_torch --warmup 2 --steps 4
bench wlongplain 100 --workloads Wlong --impls jax_plain --warmup 2 --steps 4
bench wlongcapture 120 --workloads Wlong --impls spmd_capture --warmup 2 --steps 4
bench w7ref 150 --workloads W7gpu --impls eager,jax_plain --warmup 3 --steps 10
bench w23 130 --workloads W2,W3 --impls jax,spmd_torch,spmd_compile
bench wattn 200 --workloads Wattn --warmup 1 --steps 3
if wanted tests && fits tests 40; then
  JAX_PLATFORMS=cpu timeout 40 $py -m pytest -q -x -p no:cacheprovider -m "not slow" tests/unit \
    tests/compile >"$OUT/tests.log" 2>&1
  echo "== tests: exit $?"; tail -n 5 "$OUT/tests.log"
fi
