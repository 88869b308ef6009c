#!/usr/bin/env bash
# The reserved side of a cluster run: request queue, tensor store, controller + trainer, and a
# node agent with the reserved workers, all on this node. Prints the address spot nodes join with.
#   launch/reserved.sh tiny --port 5555                       # then, on each spot node:
#   launch/spot.sh --controller tcp://THIS_HOST:5555 --workers 2
set -euo pipefail

usage() {
  cat <<USAGE
usage: launch/reserved.sh RECIPE [section.field=value ...] [--port PORT] [--host ADDR]
                          [--advertise HOST] [--keys DIR] [--queue-port P] [--store-port P]
                          [--resume] [--no-progress]

  RECIPE         recipe file or built-in name (e.g. tiny); runtime.reserved_workers sets the local workers
  --port PORT    controller port spot nodes connect to (default 5555)
  --host ADDR    interface to bind (default 0.0.0.0)
  --advertise H  host name or IP spot nodes reach this node by (default: this host's address)
  --keys DIR     CURVE: DIR/controller.key_secret and DIR/nodes/*.key (see \`spotlight keys\`)
  --queue-port P, --store-port P   fixed ports for the queue and the store (default: any free;
                 fix them behind a firewall or a Kubernetes Service: launch/k8s/, launch/skypilot/)
Stop with Ctrl-C or SIGTERM: every process it started is stopped.
USAGE
}

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  usage
  exit $(( $# < 1 ? 2 : 0 ))
fi

SPOTLIGHT=${SPOTLIGHT:-spotlight}
if ! command -v "$SPOTLIGHT" >/dev/null 2>&1; then
  SPOTLIGHT="python -m spotlight.cli"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# shellcheck disable=SC2086  # SPOTLIGHT may be "python -m spotlight.cli"
exec $SPOTLIGHT reserved "$@"
