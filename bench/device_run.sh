#!/usr/bin/env bash
# One GPU-machine call that validates everything and measures every benchmark, for machines that
# return only a few files: writes to DIR (default $OUT, else ./device_run) at most 7 files --
# suite.txt, bench_log.txt and the benchmarks' JSON (gemm, collectives, AllGather+GEMM in two
# halves).  Rebuild docs/ from them on any machine:
#   python bench/gemm.py --replot DIR/gemm/gemm_bench.json
#   python bench/collectives.py --replot DIR/coll/collectives_bench.json
#   python bench/ag_gemm.py --merge DIR/ag1/ag_gemm_bench.json DIR/ag2/ag_gemm_bench.json
# (The debugging aids in tools/ and the probes in experiments/ are run by hand, not here.)
# Usage: bash bench/device_run.sh [DIR]      (about 5 minutes on 2x H200; benchmarks first: a fresh
# machine's first compiles then land in the GEMM bench's compile-time column)
set -u
cd "$(dirname "$0")/.."
DIR=${1:-${OUT:-device_run}}
mkdir -p "$DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
MPIRUN=(mpirun)
if mpirun --version 2>/dev/null | grep -q "Open MPI"; then MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none); fi
NGPU=$(python -c "from cuda.bindings import driver as cu; cu.cuInit(0); print(cu.cuDeviceGetCount()[1])")
LOG="$DIR/bench_log.txt"
: > "$LOG"
step() { echo "=== $*" | tee -a "$LOG"; "$@" >> "$LOG" 2>&1; echo "=== rc=$?" | tee -a "$LOG"; }
step timeout 300 python bench/gemm.py --out "$DIR/gemm"
if [ "$NGPU" -ge 2 ]; then
  step timeout 300 "${MPIRUN[@]}" -np "$NGPU" python bench/collectives.py --out "$DIR/coll"
  step timeout 300 "${MPIRUN[@]}" -np "$NGPU" python bench/ag_gemm.py --max-m 8192 --out "$DIR/ag1"
  step timeout 300 "${MPIRUN[@]}" -np "$NGPU" python bench/ag_gemm.py --min-m 16384 --out "$DIR/ag2"
fi
rm -f "$DIR"/*/*.png "$DIR"/*/*.md
grep -aE "at or above|large-size" "$LOG"
bash tests/run_gpu.sh --timeout=150 > "$DIR/suite.txt" 2>&1
rc=$?
grep -aE "passed|failed|=== GPU" "$DIR/suite.txt" | tail -8
exit $rc
