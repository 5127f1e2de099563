#!/usr/bin/env bash
# Run a command on every MPI rank with its output in $LOGDIR/rank<N>.log (default: current dir).
r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
exec "$@" > "${LOGDIR:-.}/rank$r.log" 2>&1
