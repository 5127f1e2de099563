#!/usr/bin/env bash
# Every GPU test on this machine, in one command:
#   single-process GPU tests; MPI tests with 1 rank and with one rank per GPU (2+);
#   emulated multi-node tests (one rank per "node", proxy path across).
# Usage: bash tests/run_gpu.sh [extra pytest args]
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NGPU=$(python -c "from cuda.bindings import driver as cu; cu.cuInit(0); print(cu.cuDeviceGetCount()[1])")
MPIRUN=(mpirun)
if mpirun --version 2>/dev/null | grep -q "Open MPI"; then MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none); fi
# With --timeout (pytest-timeout), a test stuck in a CUDA call (a hung kernel: the signal method cannot
# interrupt a blocked synchronize) is ended by the thread method: all stacks dumped, the process exits.
case " $* " in *" --timeout"*) set -- -o timeout_method=thread "$@" ;; esac
status=0
run() { echo "=== $*"; "$@"; rc=$?; [ $rc = 0 ] || [ $rc = 5 ] || status=1; }  # 5: nothing collected
run python -m pytest -q -p no:cacheprovider -m "gpu and not mpi" tests/gpu "$@"
run "${MPIRUN[@]}" -np 1 python -m pytest -q -p no:cacheprovider -m "gpu and mpi" tests/gpu "$@"
if [ "$NGPU" -ge 2 ]; then
  run "${MPIRUN[@]}" -np "$NGPU" python -m pytest -q -p no:cacheprovider -m "gpu and mpi" tests/gpu "$@"
  run "${MPIRUN[@]}" -np "$NGPU" -x MKERNEL_RANKS_PER_NODE=1 python -m pytest -q -p no:cacheprovider \
      -m "gpu and mpi and internode" tests/gpu "$@"
fi
# the HPC-style example: CuPy arrays (DeviceArrays without CuPy), numpy checks, no torch in the process
run "${MPIRUN[@]}" -np "$([ "$NGPU" -ge 2 ] && echo "$NGPU" || echo 1)" python examples/hpc_cupy.py
echo "=== GPU tests: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status
