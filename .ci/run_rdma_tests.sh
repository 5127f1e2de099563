#!/bin/bash
# run_rdma_tests.sh: run tests/rdma (the pyverbs transport over real RC queue pairs) inside a
# throwaway QEMU VM with soft-RoCE (rdma_rxe on a dummy netdev), via .ci/softroce_vm.sh.
# Exit status: pytest's (0 = all passed); 125 = VM timeout/crash.  First call installs qemu,
# python3-pyverbs, ... and caches a kernel under $RXE_CACHE (/var/tmp/rxe-vm), ~25 s.
# Env: PYTHON (default /work/venv/bin/python, must see numpy + pytest), PYTEST_ARGS, VM_TIMEOUT.
set -u
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/.." && pwd)
PY=${PYTHON:-/work/venv/bin/python}
C=${RXE_CACHE:-/var/tmp/rxe-vm}
export VM_TIMEOUT=${VM_TIMEOUT:-420}
# make sure the cache exists (first call installs packages), then a pyverbs-only path dir for the
# venv (Debian's python3-pyverbs is built for the system python3; same 3.11 ABI here)
[ -s "$C/kver" ] || "$HERE/softroce_vm.sh" true >/dev/null || exit $?
mkdir -p "$C/pypath" && ln -sfn /usr/lib/python3/dist-packages/pyverbs "$C/pypath/pyverbs"
OUT=${OUTDIR:-$(mktemp -d /tmp/rxe-out.XXXXXX)}
export OUTDIR=$OUT
"$HERE/softroce_vm.sh" "ip link set lo up && modprobe rdma_rxe && ip link add d0 type dummy && ip addr add 10.0.0.1/24 dev d0 && \
ip link set d0 up && rdma link add rxe0 type rxe netdev d0 && cd '$REPO' && \
PYTHONPATH='$C/pypath' PYTHONDONTWRITEBYTECODE=1 MKERNEL_CACHE_DIR=/tmp/mkcache \
'$PY' -m pytest -q -s -p no:cacheprovider --color=no -rs --junitxml=\$RXE_OUT/junit.xml ${PYTEST_ARGS:-tests/rdma}"
rc=$?
echo "run_rdma_tests.sh: exit $rc (junit: $OUT/junit.xml)"
exit $rc
