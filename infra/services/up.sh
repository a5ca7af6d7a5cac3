#!/usr/bin/env bash
# Start grpoflow's team services on this machine, each in its own process group, logs and pids in one folder:
#   - a Prefect server whose database is PostgreSQL
#     (PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://...)
#   - an MLflow tracking server with a PostgreSQL backend store and proxied artifact storage (clients up- and
#     download artifacts through the server: no shared disk needed for MLflow)
#   - a Prefect process worker on the `grpoflow-process` work pool (created if missing), which runs the
#     deployments of infra/prefect.yaml (`grpoflow deploy`)
#
# Usage: infra/services/up.sh [DIR]   (DIR: logs, pids, artifacts and flow results; default .state/services)
#        infra/services/down.sh [DIR] stops them
# Then: source DIR/services.env      (PREFECT_API_URL, MLFLOW_TRACKING_URI, GRPOFLOW_WORK_POOL; no secret)
#
# Settings, from the environment only (secrets never from a file in the repo, never printed):
#   GRPOFLOW_PG_URL          PostgreSQL server, postgresql://user[:password]@host:port
#                            (default: postgres@127.0.0.1:5432)
#   GRPOFLOW_PREFECT_DB      Prefect's database (default grpoflow_prefect); GRPOFLOW_MLFLOW_DB (default
#                            grpoflow_mlflow); both created when missing
#   GRPOFLOW_HOST            address the servers listen on (default 127.0.0.1)
#   GRPOFLOW_PREFECT_PORT    (default 4200); GRPOFLOW_MLFLOW_PORT (default 5000); GRPOFLOW_MLFLOW_WORKERS
#                            (default 2)
#   GRPOFLOW_WORK_POOL       (default grpoflow-process; `grpoflow deploy` reads it from services.env);
#                            GRPOFLOW_WORKER=0 starts no worker
#   GRPOFLOW_RESULTS         where flow and task results live (default DIR/results): every worker must reach it
#                            (a shared mount) for a cache hit on another machine; or set
#                            PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK to a Prefect filesystem block (s3-bucket/...)
#   PREFECT_SERVER_API_AUTH_STRING  "user:password": the Prefect API refuses clients without it (clients set
#                            PREFECT_API_AUTH_STRING to the same value)
#   GRPOFLOW_HEARTBEAT_S     flow runs' heartbeat period (default 60, at least 30); GRPOFLOW_ZOMBIE_AFTER_S: a
#                            run with no heartbeat for this long is marked Crashed (default 3 heartbeats)
#   GRPOFLOW_PYTHON          the Python that has grpoflow installed (default: the repo's .venv)
#   GRPOFLOW_SERVICES_TIMEOUT seconds to wait for each server to answer (default 300)
#
# A service counts as running only while the PID in DIR/pids is the process this script started (its start
# time and command line are recorded next to it), and a server counts as up only once the process listening on
# its port is its own. When a start fails, what this invocation started is stopped again. The worker, and so
# every flow run, gets no server secret: neither GRPOFLOW_PG_URL nor the servers' settings (PREFECT_SERVER_*,
# the API's auth string among them); with auth on it gets the client's PREFECT_API_AUTH_STRING, without which
# it and its runs could not talk to the API.
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
STOP_TIMEOUT="${GRPOFLOW_STOP_TIMEOUT:-30}"
# what only a server, or databases.py, may see: the admin database URL and the servers' own settings
SERVER_ONLY='^(GRPOFLOW_PG_URL|PREFECT_SERVER_.*|PREFECT_API_DATABASE_.*|MLFLOW_BACKEND_STORE_URI)$'
mkdir -p "$DIR/logs" "$DIR/pids"
cd "$REPO"
source "$REPO/infra/services/pids.sh"

say() { echo "grpoflow services: $*" >&2; }

STARTED=()
undo() {  # on a failure, stop what this invocation started: a rerun then starts from a clean slate
  local rc=$? i
  ((rc == 0)) && return
  for ((i = ${#STARTED[@]} - 1; i >= 0; i--)); do stop "${STARTED[i]}" started; done
  exit "$rc"
}
trap undo EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The databases, created when missing; the URLs (password included) stay in this shell's unexported variables
urls="$("$PY" "$REPO/infra/services/databases.py" "${GRPOFLOW_PREFECT_DB:-grpoflow_prefect}" \
  "${GRPOFLOW_MLFLOW_DB:-grpoflow_mlflow}")"
read -r PREFECT_DB_URL MLFLOW_DB_URL <<<"$urls"
unset urls

start() {  # NAME HIDE COMMAND...: in its own session (down.sh stops the whole group), log and pid in DIR,
           # without the exported variables whose names match the regex HIDE
  local name="$1" hide="$2" pid var; shift 2
  if owned "$name"; then
    say "$name already running (pid $(recorded_pid "$name"))"; return
  fi
  if pid="$(recorded_pid "$name")" && [[ "$pid" =~ ^[0-9]+$ ]] && alive "$pid"; then
    say "$name: its pid file names pid $pid, another process now (start time or command line differ):" \
      "left alone"
  fi
  forget "$name"
  local hidden=()
  for var in $(compgen -e | grep -E "$hide" || true); do hidden+=(-u "$var"); done
  # a script's background job starts with SIGINT ignored, and Python then never sees it: restore it, so that
  # down.sh's SIGINT stops the worker (and the servers) at once
  (trap - INT QUIT; exec setsid env "${hidden[@]}" "$@") >>"$DIR/logs/$name.log" 2>&1 </dev/null &
  record "$name" $! "$@"
  STARTED+=("$name")
  say "$name started (pid $!, log $DIR/logs/$name.log)"
}

listens() {  # PID PORT: a process of PID's session (the server and the workers it forked) listens on PORT
  "$PY" - "$@" <<'PY'
import os
import sys

session, port = sys.argv[1], int(sys.argv[2])
inodes = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        rows = [line.split() for line in open(table).read().splitlines()[1:]]
    except OSError:
        continue
    inodes |= {r[9] for r in rows if r[3] == "0A" and int(r[1].rsplit(":", 1)[1], 16) == port}  # 0A: LISTEN
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[3] != session:
            continue
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] in inodes:  # socket:[INODE]
                sys.exit(0)
    except OSError:  # a process that ended meanwhile, or another user's
        continue
sys.exit(1)
PY
}

wait_for() {  # NAME URL PORT: until its own process answers 200 at URL, it exits, or TIMEOUT
  local name="$1" url="$2" port="$3" deadline=$((SECONDS + TIMEOUT)) other=""
  while true; do
    if ! same_process "$name"; then
      say "$name exited while starting${other:+ ($other)}; the end of $DIR/logs/$name.log:"
      tail -20 "$DIR/logs/$name.log" >&2; exit 1
    fi
    if "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$url" \
      2>/dev/null; then
      listens "$(recorded_pid "$name")" "$port" && break
      other="something else answers at $url: port $port is another service's"
    fi
    if ((SECONDS > deadline)); then
      say "$name did not answer at $url within ${TIMEOUT}s${other:+ ($other)} (log: $DIR/logs/$name.log)"
      exit 1
    fi
    sleep 1
  done
  say "$name up at $url"
}

PREFECT_API_URL="http://$HOST:$PREFECT_PORT/api"
PREFECT_API_DATABASE_CONNECTION_URL="$PREFECT_DB_URL" PREFECT_HOME="$DIR/prefect-server" \
  PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_UI_API_URL="$PREFECT_API_URL" \
  start prefect-server '^GRPOFLOW_PG_URL$' "$BIN/prefect" server start --host "$HOST" --port "$PREFECT_PORT"

# the backend store through the environment: a password in a command line is visible to every user (ps)
MLFLOW_BACKEND_STORE_URI="$MLFLOW_DB_URL" \
  start mlflow-server '^(GRPOFLOW_PG_URL|PREFECT_SERVER_.*|PREFECT_API_DATABASE_.*)$' \
  "$BIN/mlflow" server --host "$HOST" --port "$MLFLOW_PORT" \
  --artifacts-destination "$DIR/mlartifacts" --workers "${GRPOFLOW_MLFLOW_WORKERS:-2}"

wait_for prefect-server "$PREFECT_API_URL/health" "$PREFECT_PORT"
wait_for mlflow-server "http://$HOST:$MLFLOW_PORT/health" "$MLFLOW_PORT"

# clients of the server: the auth string, when set, is the server's own
export PREFECT_API_URL PREFECT_HOME="$DIR/prefect-client"
if [[ -n "${PREFECT_SERVER_API_AUTH_STRING:-}" ]]; then
  export PREFECT_API_AUTH_STRING="$PREFECT_SERVER_API_AUTH_STRING"
fi
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
found=0
"$PY" - "$AUTOMATION" <<'PY' || found=$?
import sys

from prefect.client.orchestration import get_client

with get_client(sync_client=True) as client:  # the name matched exactly, not searched in a printed table
    sys.exit(0 if client.read_automations_by_name(sys.argv[1]) else 3)
PY
if ((found != 0 && found != 3)); then
  say "cannot list the Prefect server's automations (see above)"; exit 1
fi
if ((found == 3)); then
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
  # flow runs inherit this environment: the team's MLflow, one state folder, results where a cache hit finds
  # them; no server secret (SERVER_ONLY): else a flow run's code, and whatever it logs, is the database admin
  GRPOFLOW_STATE="${GRPOFLOW_STATE:-$DIR/state}" PREFECT_LOCAL_STORAGE_PATH="${GRPOFLOW_RESULTS:-$DIR/results}" \
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY="$HEARTBEAT" \
    start worker "$SERVER_ONLY" "$BIN/prefect" worker start --pool "$POOL" --type process
fi

cat >"$DIR/services.env.tmp" <<EOF
# written by infra/services/up.sh: source it to talk to these services (secrets are not in here)
export PREFECT_API_URL=$PREFECT_API_URL
export MLFLOW_TRACKING_URI=$MLFLOW_TRACKING_URI
export GRPOFLOW_WORK_POOL=$POOL
EOF
mv "$DIR/services.env.tmp" "$DIR/services.env"
say "ready: source $DIR/services.env  (Prefect UI http://$HOST:$PREFECT_PORT, MLflow UI $MLFLOW_TRACKING_URI)"
