#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) over a small representative subset of the GPU tests of
# every kernel family, then a summary table: family x tool -> the sanitizer's error / hazard count and the
# tests' exit status.  docs/reliability.md, "Pending a GPU run".
#
# Usage: bash tools/sanitize.sh [TOOL ...]            (default: memcheck racecheck synccheck)
#   env: SANITIZER=path/to/compute-sanitizer  (default: $PATH, /usr/local/cuda/bin, the nvidia pip wheels)
#        NP=2                 ranks of the multi-rank families (they may share one GPU)
#        FAMILIES="gemm ..."  a subset of: gemm collectives ag_gemm gemm_rs gemm_ar internode proxy attention
#                             attention_bwd moe ring_attention
#        RUN_TIMEOUT=300      seconds per (family, tool) run
#        LOGDIR=dir           where the per-run logs go (default: a fresh temporary directory)
# Every run passes --report-api-errors no (the ops probe the driver on purpose: cuPointerGetAttribute on
# foreign pointers, cooperative-launch occupancy queries) and MKERNEL_TIMEOUT=120: the sanitizers slow
# kernels 10-100x, and a peer's kernel must still arrive before the device-side waits give up.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 MKERNEL_TIMEOUT=120
TOOLS=("$@")
[ ${#TOOLS[@]} -gt 0 ] || TOOLS=(memcheck racecheck synccheck)
NP=${NP:-2}
RUN_TIMEOUT=${RUN_TIMEOUT:-300}
FAMILIES=(${FAMILIES:-gemm collectives ag_gemm gemm_rs gemm_ar internode proxy attention attention_bwd moe ring_attention})
LOGDIR=${LOGDIR:-$(mktemp -d /tmp/mk-sanitize.XXXXXX)}
mkdir -p "$LOGDIR"

find_sanitizer() {
  [ -n "${SANITIZER:-}" ] && { echo "$SANITIZER"; return; }
  command -v compute-sanitizer && return
  [ -x /usr/local/cuda/bin/compute-sanitizer ] && { echo /usr/local/cuda/bin/compute-sanitizer; return; }
  python - <<'EOF'
import glob, os, site
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for p in glob.glob(os.path.join(d, "nvidia", "**", "compute-sanitizer"), recursive=True):
        if os.path.isfile(p) and os.access(p, os.X_OK):
            print(p)
            raise SystemExit
EOF
}
SAN=$(find_sanitizer | head -1)
if [ -z "$SAN" ]; then
  echo "sanitize.sh: no compute-sanitizer (CUDA toolkit, or pip install nvidia-cuda-sanitizer-api); set SANITIZER=" >&2
  exit 2
fi
echo "sanitize.sh: $SAN ($("$SAN" --version | tail -1)); logs in $LOGDIR"

MPIRUN=(mpirun)
if mpirun --version 2>/dev/null | grep -q "Open MPI"; then MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none); fi
PYT=(python -m pytest -q -p no:cacheprovider -x)

# family -> "ranks|env|pytest selection" (ranks 0: one process, no mpirun)
declare -A CASES=(
  [gemm]="0||tests/gpu/test_gemm.py -k test_k_zero_and_empty or test_repeat_uses_plan or test_grouped_moe_like or test_gemv_views_and_repeats"
  [collectives]="$NP||tests/gpu/test_collectives.py -k test_all_reduce_two_phase or test_all_gather_int_and_rows or (test_copy_engine_path and float32)"
  [ag_gemm]="$NP||tests/gpu/test_ag_gemm.py -k test_unaligned_shard or test_m_sizes_argument"
  [gemm_rs]="$NP||tests/gpu/test_gemm_rs.py -k test_uneven_rows"
  [gemm_ar]="$NP||tests/gpu/test_gemm_ar.py -k test_repeated_calls_repoint"
  [internode]="$NP|MKERNEL_RANKS_PER_NODE=1|tests/gpu/test_internode.py -k test_internode_all_gather and float32 or test_internode_reduce_scatter and float32"
  [proxy]="0||tests/gpu/test_proxy_gpu.py"
  [attention]="0||tests/gpu/test_attention.py -k test_no_keys or test_strided_views"
  [attention_bwd]="0||tests/gpu/test_attention_bwd.py -k test_strided_views or (test_gradients and (bflo-d64-b2-q77-k77 or bflo-d128-b1-q1000-k77))"
  [moe]="$NP||tests/gpu/test_moe.py -k test_smoke_each_kernel_finishes or test_combine_fp32_rows_not_a_multiple_of_8 or test_dispatch_gemm_back_to_back"
  [ring_attention]="$NP||tests/gpu/test_ring_attention.py -k test_float16 or test_backward_back_to_back_and_deterministic"
)

declare -A RESULT
for fam in "${FAMILIES[@]}"; do
  spec=${CASES[$fam]:-}
  [ -n "$spec" ] || { echo "sanitize.sh: unknown family $fam" >&2; exit 2; }
  IFS='|' read -r ranks envs sel <<<"$spec"
  file=${sel%% -k *}
  kexpr=""; [[ "$sel" == *" -k "* ]] && kexpr=${sel#* -k }
  for tool in "${TOOLS[@]}"; do
    log="$LOGDIR/$fam.$tool"
    san=("$SAN" --tool "$tool" --report-api-errors no --log-file "$log.%p.san")
    [ "$tool" = racecheck ] && san+=(--racecheck-report hazard)
    args=("${PYT[@]}" -m gpu "$file"); [ -n "$kexpr" ] && args+=(-k "$kexpr")
    echo "=== $fam / $tool: $file ${kexpr:+-k \"$kexpr\"} (ranks: ${ranks/#0/1, no mpirun})"
    rm -f "$log".*.san
    if [ "$ranks" = 0 ]; then
      env $envs timeout "$RUN_TIMEOUT" "${san[@]}" "${args[@]}" >"$log.out" 2>&1
    else
      env $envs timeout "$RUN_TIMEOUT" "${MPIRUN[@]}" -np "$ranks" "${san[@]}" "${args[@]}" >"$log.out" 2>&1
    fi
    rc=$?
    # per process: "ERROR SUMMARY: N errors" (memcheck, synccheck) / "RACECHECK SUMMARY: N hazards"
    n=$(cat "$log".*.san 2>/dev/null | grep -Eo "(ERROR|RACECHECK) SUMMARY: [0-9]+" | awk '{s += $3} END {print s + 0}')
    procs=$(ls "$log".*.san 2>/dev/null | wc -l)
    tests=$(grep -Eo "[0-9]+ passed|[0-9]+ failed|[0-9]+ skipped|[0-9]+ error" "$log.out" | sort | uniq -c | awk '{printf "%s %s; ", $2, $3}')
    status=$([ $rc = 0 ] && echo ok || ([ $rc = 124 ] && echo "TIMEOUT" || echo "rc=$rc"))
    [ "$procs" -gt 0 ] || status="$status, NO SANITIZER LOG"
    RESULT[$fam.$tool]="$n findings in $procs processes, tests $status (${tests%; })"
    echo "    ${RESULT[$fam.$tool]}"
    [ "$n" = 0 ] || grep -h -m 5 -E "^=========  (Invalid|Race|Barrier|Error|Program hit)" "$log".*.san | sed 's/^/    /'
  done
done

echo
echo "=== compute-sanitizer summary (logs: $LOGDIR)"
bad=0
for fam in "${FAMILIES[@]}"; do
  for tool in "${TOOLS[@]}"; do
    r=${RESULT[$fam.$tool]}
    printf "%-12s %-10s %s\n" "$fam" "$tool" "$r"
    [[ "$r" == "0 findings"*"tests ok"* ]] || bad=1
  done
done
echo "=== sanitize: $([ $bad = 0 ] && echo CLEAN || echo "FINDINGS or failures: see the logs")"
exit $bad
