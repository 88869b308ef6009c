#!/usr/bin/env bash
# A spot node: one node agent (persistent scheduler) with N worker processes that joins a run.
#   launch/spot.sh --controller tcp://RESERVED_HOST:5555 --workers 2 [--keys DIR]
set -euo pipefail

usage() {
  cat <<USAGE
usage: launch/spot.sh --controller tcp://HOST:PORT [--workers N] [--keys DIR]
                      [--metadata-url URL] [--node-id ID] [--queue-lost-s S]

  --controller   the address launch/reserved.sh printed
  --workers N    worker processes (one per GPU; default: the GPU count, else 1)
  --keys DIR     CURVE: DIR/node.key_secret and DIR/controller.key
  --metadata-url spot-notice URL to poll, e.g.
                 http://169.254.169.254/latest/meta-data/spot/instance-action        (AWS)
                 http://metadata.google.internal/computeMetadata/v1/instance/preempted (GCP)
  --queue-lost-s S  leave when the reserved side's queue has not answered for S seconds (30)
  --leave-s S ...   a node's own runtime knobs (see: spotlight agent --help; default: the run's [runtime])
SIGTERM (how clouds deliver a spot notice) makes the node commit, release its leases and exit.
USAGE
}

CONTROLLER=""
WORKERS=""
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --controller) CONTROLLER=${2:?--controller needs a value}; shift 2 ;;
    --workers) WORKERS=${2:?--workers needs a value}; shift 2 ;;
    --keys|--metadata-url|--node-id|--metadata-poll-s|--queue-lost-s|--rpc-timeout-s|--log-level|\
    --leave-s|--pull-wait-s|--request-timeout-s|--store-timeout-s|--worker-start-s)
      EXTRA+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "spot.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
if [[ -z "$CONTROLLER" ]]; then
  echo "spot.sh: --controller is required" >&2
  usage >&2
  exit 2
fi
if [[ -z "$WORKERS" ]]; then
  WORKERS=1
  if command -v nvidia-smi >/dev/null 2>&1; then
    WORKERS=$(nvidia-smi -L 2>/dev/null | wc -l)
    [[ "$WORKERS" -ge 1 ]] || WORKERS=1
  fi
fi

SPOTLIGHT=${SPOTLIGHT:-spotlight}
if ! command -v "$SPOTLIGHT" >/dev/null 2>&1; then
  SPOTLIGHT="python -m spotlight.cli"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# shellcheck disable=SC2086  # SPOTLIGHT may be "python -m spotlight.cli"
exec $SPOTLIGHT agent --controller "$CONTROLLER" --workers "$WORKERS" --kind spot ${EXTRA[@]+"${EXTRA[@]}"}
