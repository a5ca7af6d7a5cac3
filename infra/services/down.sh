#!/usr/bin/env bash
# Stop what infra/services/up.sh started (worker first, then the servers): SIGINT, then SIGTERM to each process
# group, SIGKILL after GRPOFLOW_STOP_TIMEOUT seconds in all (default 30). Usage: infra/services/down.sh [DIR] (default .state/services)
set -uo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
DIR="${1:-$REPO/.state/services}"
TIMEOUT="${GRPOFLOW_STOP_TIMEOUT:-30}"
alive() { local st; st="$(ps -o stat= -p "$1" 2>/dev/null)" && [[ -n "$st" && "$st" != Z* ]]; }  # not a zombie
for name in worker mlflow-server prefect-server; do
  pidfile="$DIR/pids/$name"
  [[ -f "$pidfile" ]] || continue
  pid="$(cat "$pidfile")"
  if alive "$pid"; then
    # SIGINT first: the Prefect worker shuts down on it (it sat through SIGTERM for 30 s), the servers too
    for sig in INT TERM; do
      kill -"$sig" -- "-$pid" 2>/dev/null || kill -"$sig" "$pid" 2>/dev/null
      deadline=$((SECONDS + TIMEOUT / 2))
      while alive "$pid" && ((SECONDS < deadline)); do sleep 0.5; done
      alive "$pid" || break
    done
    if alive "$pid"; then
      echo "grpoflow services: $name (pid $pid) still running after ${TIMEOUT}s: killing it" >&2
    fi
    kill -KILL -- "-$pid" 2>/dev/null  # the rest of its group (flow-run subprocesses, server workers) too
    echo "grpoflow services: $name stopped" >&2
  fi
  rm -f "$pidfile"
done
