#!/usr/bin/env bash
# GPU-machine calls that validate everything and measure every benchmark, for machines that return only
# a few files: writes to DIR (default $OUT, else ./device_run) -- suite.txt, bench_log.txt and the
# benchmarks' JSON.  PART picks what runs, so each part fits one call of the device tool (10 minutes):
#   bench1  one-GPU benchmarks: GEMM, attention forward, attention backward        (~3 min)
#   bench2  multi-GPU benchmarks (needs 2+ GPUs): collectives, AllGather+GEMM in two halves,
#           GEMM+ReduceScatter, GEMM+AllReduce, MoE                                  (~9 min on 2x H200)
#   suite   tests/run_gpu.sh (every GPU test)
#   all     the three in order (default; more than one call's limit)
# Rebuild docs/ from the JSON on any machine:
#   python bench/gemm.py --replot DIR/gemm/gemm_bench.json
#   python bench/collectives.py --replot DIR/coll/collectives_bench.json
#   python bench/ag_gemm.py --merge DIR/ag1/ag_gemm_bench.json DIR/ag2/ag_gemm_bench.json
#   python bench/gemm_rs.py --merge DIR/rs/gemm_rs_bench.json;  python bench/gemm_ar.py --merge DIR/ar/gemm_ar_bench.json
#   python bench/moe.py --replot DIR/moe/moe_bench.json
# (The debugging aids in tools/ and the probes in experiments/ are run by hand, not here.)
# Usage: bash bench/device_run.sh [DIR] [PART]
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
PART=${2:-all}
rc=0
if [ "$PART" = bench1 ] || [ "$PART" = all ]; then
  step timeout 300 python bench/gemm.py --out "$DIR/gemm"
  step timeout 150 python bench/attention.py --out "$DIR/attn"
  step timeout 120 python bench/attention_bwd.py --deterministic --out "$DIR/attn_bwd"
fi
if { [ "$PART" = bench2 ] || [ "$PART" = all ]; } && [ "$NGPU" -ge 2 ]; then
  step timeout 120 "${MPIRUN[@]}" -np "$NGPU" python bench/collectives.py --out "$DIR/coll"
  step timeout 120 "${MPIRUN[@]}" -np "$NGPU" python bench/ag_gemm.py --max-m 8192 --out "$DIR/ag1"
  step timeout 120 "${MPIRUN[@]}" -np "$NGPU" python bench/ag_gemm.py --min-m 16384 --out "$DIR/ag2"
  step timeout 90 "${MPIRUN[@]}" -np "$NGPU" python bench/gemm_rs.py --out "$DIR/rs"
  step timeout 90 "${MPIRUN[@]}" -np "$NGPU" python bench/gemm_ar.py --out "$DIR/ar"
  step timeout 150 "${MPIRUN[@]}" -np "$NGPU" python bench/moe.py --quick --out "$DIR/moe"
fi
if [ "$PART" != suite ]; then
  rm -f "$DIR"/*/*.png "$DIR"/*/*.md
  grep -aE "at or above|large-size|rc=[1-9]" "$LOG"
fi
if [ "$PART" = suite ] || [ "$PART" = all ]; then
  bash tests/run_gpu.sh --timeout=150 > "$DIR/suite.txt" 2>&1
  rc=$?
  grep -aE "passed|failed|=== GPU" "$DIR/suite.txt" | tail -8
fi
exit $rc
