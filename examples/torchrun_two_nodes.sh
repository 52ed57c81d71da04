#!/usr/bin/env bash
# Two "nodes" of 2 ranks each on this machine, started the way a real 2-node job is: one torchrun
# per node, meeting at node 0's address (here loopback). On real nodes, run the same command on
# each with its own --node-rank and node 0's address for MASTER_ADDR.
#
#   bash examples/torchrun_two_nodes.sh                        # tawpipe train's defaults
#   bash examples/torchrun_two_nodes.sh --model micro --steps 20
#
# The topology (2 nodes x 2 ranks) comes from torchrun's environment; with no GPU the ranks use
# gloo on the CPU, with GPUs NCCL. Arguments go to `tawpipe train`. A node that never comes ends
# the other's torchrun after $TAWPIPE_TIMEOUT seconds (default 300) through --rdzv-conf timeout=;
# without it, torchrun's rendezvous waited on, silent, for over 400 s.
set -euo pipefail
PYTHON=${PYTHON:-python3}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
node() {
  "$PYTHON" -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank "$1" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --rdzv-conf "timeout=${TAWPIPE_TIMEOUT:-300}" \
    -m tawpipe train "${@:2}"
}
node 1 "$@" > /dev/null &   # the second node: rank 0's summary and results are printed by node 0
second=$!
node 0 "$@"
wait "$second"
