#!/usr/bin/env bash
# Start grpoflow's team services on this machine, each in its own process group, logs and pids in one folder:
#   - a Prefect server whose database is PostgreSQL (PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://...)
#   - an MLflow tracking server with a PostgreSQL backend store and proxied artifact storage (clients up- and
#     download artifacts through the server: no shared disk needed for MLflow)
#   - a Prefect process worker on the `grpoflow-process` work pool (created if missing), which runs the
#     deployments of infra/prefect.yaml (`grpoflow deploy`)
#
# Usage: infra/services/up.sh [DIR]      (DIR: logs, pids, artifacts and flow results; default .state/services)
#        infra/services/down.sh [DIR]    stops them
# Then: source DIR/services.env         (PREFECT_API_URL, MLFLOW_TRACKING_URI; no secret is written there)
#
# Settings, from the environment only (secrets never from a file in the repo, never printed):
#   GRPOFLOW_PG_URL          PostgreSQL server, postgresql://user[:password]@host:port (default: postgres@127.0.0.1:5432)
#   GRPOFLOW_PREFECT_DB      Prefect's database (default grpoflow_prefect); GRPOFLOW_MLFLOW_DB (default grpoflow_mlflow);
#                            both created when missing
#   GRPOFLOW_HOST            address the servers listen on (default 127.0.0.1)
#   GRPOFLOW_PREFECT_PORT    (default 4200); GRPOFLOW_MLFLOW_PORT (default 5000); GRPOFLOW_MLFLOW_WORKERS (default 2)
#   GRPOFLOW_WORK_POOL       (default grpoflow-process); GRPOFLOW_WORKER=0 starts no worker
#   GRPOFLOW_RESULTS         where flow and task results live (default DIR/results): every worker must reach it
#                            (a shared mount) for a cache hit on another machine; or set
#                            PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK to a Prefect filesystem block (s3-bucket/...)
#   PREFECT_SERVER_API_AUTH_STRING  "user:password": the Prefect API refuses clients without it (clients set
#                            PREFECT_API_AUTH_STRING to the same value)
#   GRPOFLOW_HEARTBEAT_S     flow runs' heartbeat period (default 60, at least 30); GRPOFLOW_ZOMBIE_AFTER_S: a run
#                            with no heartbeat for this long is marked Crashed (default 3 heartbeats)
#   GRPOFLOW_PYTHON          the Python that has grpoflow installed (default: the repo's .venv)
#   GRPOFLOW_SERVICES_TIMEOUT seconds to wait for each server to answer (default 300)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
DIR="$(mkdir -p "${1:-$REPO/.state/services}" && cd "${1:-$REPO/.state/services}" && pwd)"
PY="${GRPOFLOW_PYTHON:-$REPO/.venv/bin/python}"
BIN="$(dirname "$PY")"
HOST="${GRPOFLOW_HOST:-127.0.0.1}"
PREFECT_PORT="${GRPOFLOW_PREFECT_PORT:-4200}"
MLFLOW_PORT="${GRPOFLOW_MLFLOW_PORT:-5000}"
POOL="${GRPOFLOW_WORK_POOL:-grpoflow-process}"
TIMEOUT="${GRPOFLOW_SERVICES_TIMEOUT:-300}"
export GRPOFLOW_PG_URL="${GRPOFLOW_PG_URL:-postgresql://postgres@127.0.0.1:5432}"
mkdir -p "$DIR/logs" "$DIR/pids"
cd "$REPO"

say() { echo "grpoflow services: $*" >&2; }
# alive PID: running, not a zombie (a killed server whose parent is gone stays one until reaped, and kill -0 passes)
alive() { local st; st="$(ps -o stat= -p "$1" 2>/dev/null)" && [[ -n "$st" && "$st" != Z* ]]; }

# The databases, created when missing; the URLs (password included) stay in this process's environment
urls="$("$PY" "$REPO/infra/services/databases.py" "${GRPOFLOW_PREFECT_DB:-grpoflow_prefect}" \
  "${GRPOFLOW_MLFLOW_DB:-grpoflow_mlflow}")"
read -r PREFECT_DB_URL MLFLOW_DB_URL <<<"$urls"
unset urls

start() {  # name, command...: in its own session (down.sh stops the whole group), log and pid in DIR
  local name="$1"; shift
  if [[ -f "$DIR/pids/$name" ]] && alive "$(cat "$DIR/pids/$name")"; then
    say "$name already running (pid $(cat "$DIR/pids/$name"))"; return
  fi
  setsid "$@" >>"$DIR/logs/$name.log" 2>&1 < /dev/null &
  echo $! >"$DIR/pids/$name"
  say "$name started (pid $!, log $DIR/logs/$name.log)"
}

wait_for() {  # name, url: until it answers 200, the process dies, or TIMEOUT
  local name="$1" url="$2" deadline=$((SECONDS + TIMEOUT))
  until "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$url" 2>/dev/null; do
    if ! alive "$(cat "$DIR/pids/$name")"; then
      say "$name exited while starting; the end of $DIR/logs/$name.log:"; tail -20 "$DIR/logs/$name.log" >&2; exit 1
    fi
    if ((SECONDS > deadline)); then say "$name did not answer at $url within ${TIMEOUT}s (log: $DIR/logs/$name.log)"; exit 1; fi
    sleep 1
  done
  say "$name up at $url"
}

PREFECT_API_URL="http://$HOST:$PREFECT_PORT/api"
PREFECT_API_DATABASE_CONNECTION_URL="$PREFECT_DB_URL" PREFECT_HOME="$DIR/prefect-server" \
  PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_UI_API_URL="$PREFECT_API_URL" \
  start prefect-server "$BIN/prefect" server start --host "$HOST" --port "$PREFECT_PORT"

# the backend store through the environment: a password in a command line is visible to every user (ps)
MLFLOW_BACKEND_STORE_URI="$MLFLOW_DB_URL" \
  start mlflow-server "$BIN/mlflow" server --host "$HOST" --port "$MLFLOW_PORT" \
  --artifacts-destination "$DIR/mlartifacts" --workers "${GRPOFLOW_MLFLOW_WORKERS:-2}"

wait_for prefect-server "$PREFECT_API_URL/health"
wait_for mlflow-server "http://$HOST:$MLFLOW_PORT/health"

# clients of the server: the auth string, when set, is the server's own
export PREFECT_API_URL PREFECT_HOME="$DIR/prefect-client"
[[ -n "${PREFECT_SERVER_API_AUTH_STRING:-}" ]] && export PREFECT_API_AUTH_STRING="$PREFECT_SERVER_API_AUTH_STRING"
export MLFLOW_TRACKING_URI="http://$HOST:$MLFLOW_PORT"

if ! "$BIN/prefect" work-pool inspect "$POOL" >/dev/null 2>&1; then
  "$BIN/prefect" work-pool create "$POOL" --type process >/dev/null
  say "work pool $POOL created (process)"
fi

# A flow run whose process died with its machine (or with a SIGKILLed worker and its children) reports nothing:
# Prefect's server marks no run Crashed by itself. Runs send a heartbeat every HEARTBEAT s; this automation marks
# a run Crashed when ZOMBIE s pass with no heartbeat and no final state, so that a rerun can take over.
HEARTBEAT="${GRPOFLOW_HEARTBEAT_S:-60}"
ZOMBIE="${GRPOFLOW_ZOMBIE_AFTER_S:-$((HEARTBEAT * 3))}"
AUTOMATION="grpoflow: a run whose heartbeat stopped is Crashed"
if ! "$BIN/prefect" automation ls 2>/dev/null | grep -qF "$AUTOMATION"; then
  cat >"$DIR/crashed-runs-automation.yaml" <<END
name: "$AUTOMATION"
trigger:
  type: event
  posture: Proactive
  match: {prefect.resource.id: "prefect.flow-run.*"}
  after: [prefect.flow-run.heartbeat]
  expect: [prefect.flow-run.heartbeat, prefect.flow-run.Completed, prefect.flow-run.Failed, prefect.flow-run.Crashed,
           prefect.flow-run.Cancelled, prefect.flow-run.Cancelling, prefect.flow-run.Regression]
  for_each: [prefect.resource.id]
  threshold: 1
  within: $ZOMBIE
actions:
  - type: change-flow-run-state
    state: CRASHED
    message: "no heartbeat for $ZOMBIE s: its process is gone (machine lost, or worker and run killed)"
END
  "$BIN/prefect" automation create --from-file "$DIR/crashed-runs-automation.yaml" >/dev/null
  say "automation created: $AUTOMATION"
fi

if [[ "${GRPOFLOW_WORKER:-1}" != 0 ]]; then
  # flow runs inherit this environment: the team's MLflow, one state folder, results where a cache hit finds them
  GRPOFLOW_STATE="${GRPOFLOW_STATE:-$DIR/state}" PREFECT_LOCAL_STORAGE_PATH="${GRPOFLOW_RESULTS:-$DIR/results}" \
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY="$HEARTBEAT" \
    start worker "$BIN/prefect" worker start --pool "$POOL" --type process
fi

cat >"$DIR/services.env" <<EOF
# written by infra/services/up.sh: source it to talk to these services (secrets are not in here)
export PREFECT_API_URL=$PREFECT_API_URL
export MLFLOW_TRACKING_URI=$MLFLOW_TRACKING_URI
export GRPOFLOW_WORK_POOL=$POOL
EOF
say "ready: source $DIR/services.env  (Prefect UI http://$HOST:$PREFECT_PORT, MLflow UI $MLFLOW_TRACKING_URI)"
