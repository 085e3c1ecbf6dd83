#!/usr/bin/env bash
# One call on a lent GPU machine (torch and JAX with CUDA preinstalled, no network): the W7gpu
# implementations side by side, each in its own bench run under its own time limit so that one
# that hangs or fails leaves the others' numbers; then W2 and W3 on the GPU; Wattn's GPU form
# (seq 8192, bf16); a compatibility pass of the unit tests on that machine's torch and JAX (CPU
# backend; the bench's own end-to-end tests, marked slow, left out). Logs (the bench's end in its
# BENCH_JSON line) go to $OUT, one file per run. The limits add up to more than one call's 600 s;
# the runs took about 300 s (W7gpu, before jax_plain), 120 (W2, W3) and 40 on an H200; Wattn and
# W7gpu's jax_plain are not timed there yet. An argument names the runs to make, e.g.
# `gpu_run.sh w7ref,wattn` (default: all); call it with timeout_s 600.
# `python -m tools.bench.pipeline_probe` (a pipelined window step by step, with Python's garbage
# collections) is left out: run it on its own when pipelined steps look wrong.
set -u
only=${1:-}
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

wanted() { [[ -z $only || ",$only," == *",$1,"* ]]; }
bench() {  # name limit_s args...
  local name=$1 limit=$2
  shift 2
  wanted "$name" || return 0
  timeout "$limit" $py -m tools.bench --gpu "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $?"
  grep -v '^BENCH_JSON' "$OUT/$name.log" | tail -n 14
}
bench w7ref 190 --workloads W7gpu --impls eager,inductor,jax,jax_plain --warmup 3 --steps 10
bench w7spmd 130 --workloads W7gpu --impls spmd_torch --warmup 3 --steps 10
bench w7compile 150 --workloads W7gpu --impls spmd_compile --warmup 3 --steps 10
bench w23 130 --workloads W2,W3 --impls jax,spmd_torch,spmd_compile
bench wattn 200 --workloads Wattn --warmup 1 --steps 3
if wanted tests; then
  JAX_PLATFORMS=cpu timeout 40 $py -m pytest -q -x -p no:cacheprovider -m "not slow" tests/unit \
    tests/compile >"$OUT/tests.log" 2>&1
  echo "== tests: exit $?"; tail -n 5 "$OUT/tests.log"
fi
