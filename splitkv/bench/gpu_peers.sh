#!/usr/bin/env bash
# The peers benchmark (splitkv beside FlashInfer and SGLang's extend kernel) on a bare GPU machine, in one call
# that ends within PEERS_BUDGET_S seconds (default 540, for a 600-second call), keeping whatever finished.
#
#   bash splitkv/bench/gpu_peers.sh                          # the quick rows (--quick)
#   bash splitkv/bench/gpu_peers.sh --models llama3-8b       # a part of the full sweep (any row selection)
#   bash splitkv/bench/gpu_peers.sh --compile-only           # build (and pack) every row's modules, time nothing
#
# Run from the repository root. It needs, in the checkout (ignored by git, so named in the call's carry):
#   .whl/        flashinfer_python-0.6.13, apache_tvm_ffi-0.1.15.post2 (cp312) and sglang-0.5.10.post1 wheels
#                (python -m splitkv.bench.peers_sweep --fetch-wheels); sglang is read, not installed
#   .flashinfer/ optional: fijit*.tar.gz, FlashInfer modules an earlier call built (this script writes them to
#                $OUT); they are loaded without nvcc
# Steps, each under its own timeout: install the wheels into /tmp/site; install the prebuilt modules; build
# every missing FlashInfer module in one parallel ninja call while the Triton kernels compile, then run every
# probe against the float64 oracle (--compile-only); pack the built modules to $OUT; time the rows (JSON after
# every row; FlashInfer's modules from the AOT folder only); regenerate the .md and plot from the JSON (also a
# partial one); print a summary.
# Everything comes back through $OUT: peers_<gpu>_<part>.json / .md / .png, fijit*.tar.gz, peers_log.txt.
set -u
T0=$(date +%s)
BUDGET=${PEERS_BUDGET_S:-540}
RESERVE=${PEERS_RESERVE_S:-40}          # kept back for packing, the report and the summary
PEERS=${PEERS:-flashinfer,sglang}
OUT=${OUT:-/tmp/peers_out}
mkdir -p "$OUT"
LOG="$OUT/peers_log.txt"
exec > >(tee -a "$LOG") 2>&1
COMPILE_ONLY=0
ROWS=()
for a in "$@"; do
    if [ "$a" = "--compile-only" ]; then COMPILE_ONLY=1; else ROWS+=("$a"); fi
done
[ ${#ROWS[@]} -eq 0 ] && [ $COMPILE_ONLY = 0 ] && ROWS=(--quick)
PART=$(printf '%s' "${ROWS[*]}" | tr -c 'A-Za-z0-9.' '_' | sed 's/__*/_/g; s/^_//; s/_$//')
PART=${PART:-all}
STATUS=""

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() {  # step NAME CAP_SECONDS COMMAND...: run COMMAND under min(CAP, time left - RESERVE)
    local name=$1 cap=$2 lim t rc
    shift 2
    lim=$(( $(left) - RESERVE ))
    (( lim > cap )) && lim=$cap
    if (( lim < 15 )); then
        echo "== $name: not run, $(left) s left"; STATUS+="  $name: not run (no time left)"$'\n'; return 124
    fi
    echo "== $name (limit $lim s, $(left) s left): $*"
    t=$(date +%s)
    timeout -k 10 "$lim" "$@"; rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - t )) s"
    STATUS+="  $name: exit $rc, $(( $(date +%s) - t )) s$([ $rc = 124 ] && echo ' (timed out)')"$'\n'
    return $rc
}

echo "== $(date -u +%FT%TZ) $(nvidia-smi -L 2>/dev/null | head -1); $(nproc) cores; $(python3 -V 2>&1);" \
     "$(nvcc --version 2>/dev/null | tail -1); ninja $(ninja --version 2>/dev/null); rows: ${ROWS[*]}"
ls -la .whl .flashinfer 2>/dev/null | grep -v '^total'

export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-ws   # JIT builds (objects too); the libraries come back packed
export FLASHINFER_CUDA_ARCH_LIST=9.0a                # one target: sm_90a (fa3, wgmma), no other arch built
export FLASHINFER_LOGGING_LEVEL=${FLASHINFER_LOGGING_LEVEL:-warning}
# FlashInfer takes the toolkit from CUDA_HOME, else from `which nvcc`'s grandparent, and links every module with
# -L$CUDA_HOME/lib64 -lcudart -lcuda: find the real toolkit (nvcc may be a wrapper script), and give the linker
# libcudart.so and libcuda.so (the driver's libcuda.so.1) in a folder of their own, whatever the layout.
NVCC=$(command -v nvcc || true)
if [ -z "${CUDA_HOME:-}" ] && [ -n "$NVCC" ]; then
    for d in "$(sed -n 's#^exec \(/[^ ]*\)/bin/nvcc.*#\1#p' "$NVCC" 2>/dev/null | head -1)" \
             "$(dirname "$(dirname "$(readlink -f "$NVCC")")")" /usr/local/cuda; do
        if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then export CUDA_HOME=$d; break; fi
    done
fi
mkdir -p /tmp/cudalink
CUDART=$(find "${CUDA_HOME:-/nonexistent}" -name 'libcudart.so*' 2>/dev/null | sort | head -1)
LIBCUDA=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
[ -z "$LIBCUDA" ] && LIBCUDA=$(find ${LD_LIBRARY_PATH:+${LD_LIBRARY_PATH//:/ }} /usr/local/nvidia /usr/lib/x86_64-linux-gnu /usr/lib64 \
                                   -name 'libcuda.so.1' 2>/dev/null | head -1)
[ -n "$CUDART" ] && ln -sf "$CUDART" /tmp/cudalink/libcudart.so
[ -n "$LIBCUDA" ] && ln -sf "$LIBCUDA" /tmp/cudalink/libcuda.so
export FLASHINFER_EXTRA_LDFLAGS="-L/tmp/cudalink ${FLASHINFER_EXTRA_LDFLAGS:-}"
# fa3's templates include cutlass' tensor_fill.h, which includes curand_kernel.h: a toolkit without cuRAND (a
# pip-style one) gets the headers of the nvidia-curand package torch depends on (searched after the toolkit's own).
CURAND_H=""
if [ ! -f "${CUDA_HOME:-/nonexistent}/include/curand_kernel.h" ]; then
    CURAND_H=$(find $(python3 -c 'import nvidia; print(*nvidia.__path__)' 2>/dev/null) /usr/local/cuda* /usr/include \
                    -name curand_kernel.h 2>/dev/null | head -1)
    [ -n "$CURAND_H" ] && export FLASHINFER_EXTRA_CUDAFLAGS="-isystem $(dirname "$CURAND_H") ${FLASHINFER_EXTRA_CUDAFLAGS:-}"
fi
echo "== nvcc $NVCC, CUDA_HOME ${CUDA_HOME:-unset}, libcudart ${CUDART:-not found}, libcuda ${LIBCUDA:-not found}," \
     "curand_kernel.h ${CURAND_H:-in the toolkit or not found}"

step install 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl \
  && step import 60 python3 -c "import flashinfer, tvm_ffi; print('flashinfer', flashinfer.__version__)"
shopt -s nullglob
JIT_IN=(.flashinfer/fijit*.tar.gz)
shopt -u nullglob
# The carried modules, and those an earlier call built on this machine (a reinstall empties the AOT folder).
step install-jit 60 python3 -m splitkv.bench.peers_sweep --install-jit "${JIT_IN[@]}"

TAG=$(python3 -c "import torch; from splitkv.bench.timing import gpu_tag; print(gpu_tag(torch.cuda.get_device_name()))" \
      2>/dev/null || echo gpu)
JSON="$OUT/peers_${TAG}_${PART}.json"

CAP=${PEERS_COMPILE_S:-400}
[ $COMPILE_ONLY = 1 ] && CAP=600
step compile "$CAP" python3 -m splitkv.bench.peers_sweep --peers "$PEERS" "${ROWS[@]}" \
    --compile-only --jit-log "$OUT/ninja_log.txt"
RESERVE=25 step pack-jit 60 python3 -m splitkv.bench.peers_sweep --pack-jit "$OUT/fijit.tar.gz"
[ $COMPILE_ONLY = 1 ] && STATUS+="  time: not run (--compile-only)"$'\n' && JSON=/nonexistent
# FLASHINFER_DISABLE_JIT: a module the compile step did not finish fails its peer at once (recorded) instead of
# starting nvcc inside the timing run; the built ones load from the AOT folder.
[ $COMPILE_ONLY = 0 ] && step time 600 env FLASHINFER_DISABLE_JIT=1 python3 -m splitkv.bench --peers "$PEERS" "${ROWS[@]}" --out "$JSON" \
    --figures "$OUT"
if [ -f "$JSON" ]; then  # also a run cut short: the JSON holds every finished row
    RESERVE=5 step report 60 python3 -m splitkv.bench.peers_sweep --report "$JSON" --figures "$OUT" > "$OUT/report.txt"
    sed -n '/^Measured on/,$p' "$OUT/report.txt"
fi
# ninja's log comes back only where a module failed (the call brings back 8 files at most).
grep -q "FAILED" "$OUT/ninja_log.txt" 2>/dev/null && tail -c 20000 "$OUT/ninja_log.txt" > "$OUT/ninja_tail.txt"
rm -f "$OUT/ninja_log.txt" "$OUT/report.txt"

echo "================ summary ($(( $(date +%s) - T0 )) s of $BUDGET) ================"
printf '%s' "$STATUS"
[ $COMPILE_ONLY = 0 ] && python3 - "$JSON" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as err:
    sys.exit(f"no results: {err}")
n = len(r["rows"])
timed = sum(1 for row in r["rows"] for k, v in row["impls"].items() if v.get("graph"))
bad = [(row["model"], row["case"], k, (v.get("refused") or v.get("error") or "")[:120])
       for row in r["rows"] for k, v in row["impls"].items() if v.get("refused") or v.get("error")]
print(f"{r['device']}: {n} rows, {timed} timed entries, {len(bad)} refused or failed; libraries {r.get('libraries')}")
for b in bad:
    print("  ", *b)
EOF
ls -la "$OUT"
sleep 1  # let tee write the last lines
