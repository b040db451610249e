#!/usr/bin/env bash
# The one script to run on a lent GPU machine, a few minutes in all (each step has a cap):
#   1. scripts/bootstrap.sh test
#   2. pytest -m gpu -v                       (tests/gpu: cuda offload, copies, link probe,
#                                              decode CUDA graphs captured and replayed vs eager)
#   3. bench/gpu_check.py                     (pinned H2D/D2H GB/s, ftrs vs torch, link bound)
#   4. bench/offload.py --quick --copy-backend cuda   (demo model, or a tiny one offline)
#      bench/hybrid.py --device cuda              (offload, hybrid, all experts on the CPU over the
#                                                  real link paced to 0.1..8 GB/s and unpaced;
#                                                  the Q4_K_M demo, or bench/shaped.py's offline)
#   5. TRITON_INTERPRET=0 pytest -m "" tests/kernel_checks (the Triton kernels compiled, on the GPU; no syncs)
#   6. bench/kernels.py                       (each kernel vs its torch reference, and the
#                                              decode step with vs without CUDA graphs, JSON)
#   7. bench/speculative.py --device cuda     (n-gram drafts off and on: tok/s, acceptance,
#                                              same tokens; resident, and offload over the link)
#      bench/kv_cache.py --device cuda        (the int8 KV cache beside bf16: bytes, KL, decode
#                                              tok/s at 128 and 1,024 tokens; the Q4_K_M demo only)
# Exits non-zero when the GPU tests fail (their pytest status) or any other step fails.
# Without a GPU it says so, runs only the CPU-safe parts (the gpu tests must all skip, the
# timed-copy refusals of tests/test_core.py, gpu_check's one line, the kernel tests under
# Triton's interpreter, bench/kernels.py timing the references) and exits 0 if they pass.
# GPU_CHECK_NO_BOOTSTRAP=1 skips step 1 (a rerun on a machine already set up).
# GPU_CHECK_PY=python3 uses that interpreter instead of .venv's and skips step 1: for an offline
# GPU machine whose own Python already has torch and triton, with ftrs importable (PYTHONPATH).
# scripts/offline-bundle.sh prepares that elsewhere: `source .offline/env.sh` on the host, then
# GPU_CHECK_PY=python3 scripts/gpu-check.sh.
# GPU_CHECK_MODEL=DIR benches that checkpoint instead of building the demo (offline hosts).
# GPU_CHECK_KERNEL_TESTS=PATHS runs those kernel tests instead of all of tests/kernel_checks.
# GPU_CHECK_HYBRID_THREADS="4 8" runs the hybrid sweep again with the CPU kernels on that many
# threads each (a host of fewer cores: where the device's share of the experts should pay).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_CHECK_PY:-.venv/bin/python}
[ -n "${GPU_CHECK_PY:-}" ] && GPU_CHECK_NO_BOOTSTRAP=1
start=$SECONDS
failed=()

step() {  # step NAME CAP_SECONDS CMD...: run with a time cap, record a failure
  local name=$1 cap=$2 t0=$SECONDS rc
  shift 2
  echo "== $name (cap ${cap}s)"
  timeout --kill-after=10 "$cap" "$@"
  rc=$?
  [ "$rc" -eq 124 ] && echo "!! $name: over ${cap}s, stopped" >&2
  [ "$rc" -ne 0 ] && failed+=("$name (exit $rc)")
  echo "== $name: exit $rc, $((SECONDS - t0))s"
  return "$rc"
}

if [ "${GPU_CHECK_NO_BOOTSTRAP:-0}" = 1 ]; then
  echo "== bootstrap skipped (GPU_CHECK_NO_BOOTSTRAP=1)"
elif ! step bootstrap 150 scripts/bootstrap.sh test; then
  if "$PY" -c "import ftrs._core" 2>/dev/null; then
    echo "!! bootstrap failed (offline?): going on with the ftrs already in .venv," \
         "whose extension may predate this checkout" >&2
    failed=()
  else
    echo "gpu-check: bootstrap failed and no usable ftrs in .venv" >&2
    exit 1
  fi
fi

if ! "$PY" -c "from ftrs.guard.link import cuda_usable; raise SystemExit(not cuda_usable())"; then
  echo "gpu-check: no GPU here (torch or the CUDA driver sees none): CPU-safe parts only"
  step "gpu tests skip" 120 "$PY" -m pytest -m gpu -q -rs tests/gpu
  step "timed-copy refusals" 60 "$PY" -m pytest -q tests/test_core.py -k timed_cuda_copies
  step "bench/gpu_check.py" 30 "$PY" bench/gpu_check.py
  step "kernel tests (interpreter)" 180 env TRITON_INTERPRET=1 "$PY" -m pytest -q tests/kernel_checks
  step "bench/kernels.py" 120 "$PY" bench/kernels.py
  [ ${#failed[@]} -eq 0 ] || { echo "gpu-check: FAILED: ${failed[*]}" >&2; exit 1; }
  echo "gpu-check: no GPU; CPU-safe parts passed in $((SECONDS - start))s"
  exit 0
fi

"$PY" -c "import torch; print('gpu-check on', torch.cuda.get_device_name(), 'torch', torch.__version__)"
step "pytest -m gpu" 200 "$PY" -m pytest -m gpu -v --timeout 120 --durations=15
tests_rc=$?
step "bench/gpu_check.py" 45 "$PY" bench/gpu_check.py

model=${GPU_CHECK_MODEL:-$(timeout 60 "$PY" -m ftrs models demo 2>/dev/null | tail -n 1)}
hybrid_model=demo-q4  # the Q4_K_M demo where it is built, else the fp32 demo
decode_model=()       # bench/kernels.py's decode rows: the demo
if [ -z "$model" ] || [ ! -e "$model" ]; then
  model=$(mktemp -d)/tiny-mixtral
  echo "!! the demo model is not available (offline?): offload bench on a tiny random mixtral," \
       "hybrid bench on bench/shaped.py's random demo-shaped Q4_K_M" >&2
  "$PY" -m ftrs models make-tiny --arch mixtral --out "$model" >/dev/null
  hybrid_model=shaped
  decode_model=(--decode-model "$model")
fi
step "bench/offload.py --copy-backend cuda" 60 \
  "$PY" bench/offload.py --quick --copy-backend cuda --model "$model"
step "bench/hybrid.py --device cuda" 200 "$PY" bench/hybrid.py --device cuda \
  --model "$hybrid_model" --links 0.1 0.5 2 8 0 --tokens 24 --slow-tokens 12 --rounds 2
for threads in ${GPU_CHECK_HYBRID_THREADS:-}; do
  step "bench/hybrid.py --device cuda --cpu-expert-threads $threads" 200 "$PY" bench/hybrid.py \
    --device cuda --model "$hybrid_model" --links 0.1 0.5 2 8 0 --tokens 24 --slow-tokens 12 \
    --rounds 2 --layer-passes 0 --cpu-expert-threads "$threads"
done
# shellcheck disable=SC2086  # a list of paths
step "kernel tests (compiled)" 150 env TRITON_INTERPRET=0 "$PY" -m pytest -v -m "" \
  ${GPU_CHECK_KERNEL_TESTS:-tests/kernel_checks} --timeout 120
kernels_rc=$?
[ "$tests_rc" -eq 0 ] && tests_rc=$kernels_rc
step "bench/kernels.py" 90 "$PY" bench/kernels.py "${decode_model[@]}"
step "bench/speculative.py --device cuda" 90 "$PY" bench/speculative.py --device cuda \
  --model "$model" --rounds 1 --tokens 32 --prompts 2 --ks 4,8
if [ "$hybrid_model" = demo-q4 ]; then  # last: the int8 KV cache beside bf16, on the device
  step "bench/kv_cache.py --device cuda" 90 "$PY" bench/kv_cache.py --device cuda --rounds 2 \
    --text-tokens 256
fi

echo "gpu-check: $((SECONDS - start))s in all"
if [ "$tests_rc" -ne 0 ]; then
  echo "gpu-check: GPU tests FAILED (pytest exit $tests_rc); failed steps: ${failed[*]}" >&2
  exit "$tests_rc"
fi
[ ${#failed[@]} -eq 0 ] || { echo "gpu-check: FAILED: ${failed[*]}" >&2; exit 1; }
echo "gpu-check: all passed"
