#!/usr/bin/env bash
# Stop what infra/services/up.sh started (worker first, then the servers): SIGINT, then SIGTERM to each process
# group, SIGKILL after GRPOFLOW_STOP_TIMEOUT seconds in all (default 30). Usage: infra/services/down.sh [DIR]
# (default .state/services). A PID is signalled only while its start time and command line are those up.sh
# recorded: a stale pid file (the service exited, the machine rebooted) names someone else's process by then.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
DIR="${1:-$REPO/.state/services}"
STOP_TIMEOUT="${GRPOFLOW_STOP_TIMEOUT:-30}"
source "$REPO/infra/services/pids.sh"
for name in worker mlflow-server prefect-server; do
  stop "$name"
done
