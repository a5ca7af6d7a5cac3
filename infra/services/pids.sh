# Sourced by up.sh and down.sh: the record of a service they started, and the test that a PID is still it.
#
# DIR/pids/NAME holds the PID; NAME.start the process's start time (field 22 of /proc/PID/stat, clock ticks
# since boot) and the boot's id; NAME.cmd the command line it was started with. A number alone proves nothing:
# after a reboot, or once the service has exited, the same PID names someone else's process, which must be
# neither signalled nor taken for the service.

alive() {  # PID: running, not a zombie (a killed server whose parent is gone stays one until reaped)
  local st; st="$(ps -o stat= -p "$1" 2>/dev/null)" && [[ -n "$st" && "$st" != Z* ]]
}

proc_start() {  # PID: "start-ticks boot-id", or nothing when there is no such process
  local stat fields
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  read -r -a fields <<<"${stat##*) }"  # the name (field 2) may hold spaces and parentheses: cut after it
  echo "${fields[19]} $(cat /proc/sys/kernel/random/boot_id)"
}

record() {  # NAME PID COMMAND...: the pid file last, so that a pid file always has its proof next to it
  local name="$1" pid="$2"; shift 2
  proc_start "$pid" >"$DIR/pids/$name.start" || : >"$DIR/pids/$name.start"
  echo "$*" >"$DIR/pids/$name.cmd"
  echo "$pid" >"$DIR/pids/$name"
}

recorded_pid() { [[ -f "$DIR/pids/$1" ]] && cat "$DIR/pids/$1"; }

same_process() {  # NAME: its recorded PID is alive and started when the record says
  local pid start
  pid="$(recorded_pid "$1")" && [[ "$pid" =~ ^[0-9]+$ ]] && alive "$pid" || return 1
  start="$(proc_start "$pid")" && [[ -n "$start" && "$start" == "$(cat "$DIR/pids/$1.start" 2>/dev/null)" ]]
}

owned() {  # NAME: same_process, and still running the recorded command (checked once it has exec'd)
  same_process "$1" || return 1
  local cmd expected
  cmd="$(tr '\0' ' ' <"/proc/$(recorded_pid "$1")/cmdline" 2>/dev/null)"
  expected="$(cat "$DIR/pids/$1.cmd" 2>/dev/null)"
  [[ -n "$expected" && "$cmd" == *"$expected"* ]]  # the interpreter of a script comes first: a substring
}

forget() { rm -f "$DIR/pids/$1" "$DIR/pids/$1.start" "$DIR/pids/$1.cmd"; }

stop() {  # NAME [started]: SIGINT, SIGTERM, then SIGKILL to its process group, if its record proves it ours
  local name="$1" check=owned pid sig deadline
  [[ "${2:-}" == started ]] && check=same_process  # this up.sh forked it: it may not have exec'd yet
  pid="$(recorded_pid "$name")" || return 0
  if ! "$check" "$name"; then
    if [[ "$pid" =~ ^[0-9]+$ ]] && alive "$pid"; then
      echo "grpoflow services: $name: pid $pid is another process now (its start time or command line" \
        "differs from what was recorded): left alone; stale pid file removed" >&2
    fi
    forget "$name"; return 0
  fi
  # SIGINT first: the Prefect worker shuts down on it (it sat through SIGTERM for 30 s), the servers too
  for sig in INT TERM; do
    kill -"$sig" -- "-$pid" 2>/dev/null || kill -"$sig" "$pid" 2>/dev/null
    deadline=$((SECONDS + STOP_TIMEOUT / 2))
    while alive "$pid" && ((SECONDS < deadline)); do sleep 0.5; done
    alive "$pid" || break
  done
  if alive "$pid"; then
    echo "grpoflow services: $name (pid $pid) still running after ${STOP_TIMEOUT}s: killing it" >&2
  fi
  # the rest of its group (flow-run subprocesses, server workers) too; none left is no failure (up.sh: set -e)
  kill -KILL -- "-$pid" 2>/dev/null || true
  echo "grpoflow services: $name stopped" >&2
  forget "$name"
}
