#!/usr/bin/env bash
# Two emulated nodes of 2 ranks each on this machine, joined by rate-limited links: each node is a
# network namespace (tawpipe cluster; needs root and iproute2). Every rank gets torchrun's
# environment, so `tawpipe train` runs as it would under torchrun on 2 real nodes, and the traffic
# between nodes crosses a real (emulated) link; the launcher ends by printing the bytes that did.
#
#   sudo bash examples/emulated_cluster.sh --model micro --steps 20
#   RATE=1gbit sudo -E bash examples/emulated_cluster.sh
#
# Arguments go to `tawpipe train`. Without root, examples/torchrun_two_nodes.sh runs the same job
# over loopback.
set -euo pipefail
PYTHON=${PYTHON:-python3}
exec "$PYTHON" -m tawpipe cluster run --nodes 2 --per-node 2 --rate "${RATE:-200mbit}" -- \
  "$PYTHON" -m tawpipe train "$@"
