#!/usr/bin/env bash
# Two expert-parallel "hosts" on one machine, end to end (run as root: it needs `unshare --ipc --mount`):
#
#     bash examples/ep_two_hosts.sh [CHECKPOINT]        # default: checkpoints/tiny (DeepSeek-V3, 8 experts)
#
# Each host is `unshare --ipc --mount` with a fresh tmpfs on /dev/shm (its own shared memory) and its own daemon
# serving EP rank R of 2 (`expert_parallel: {size: 2, ranks: [R]}`) on tcp://127.0.0.1; `torchrun --nnodes 2
# --node_rank R` runs examples/ep_worker.py there. Once both ranks serve, a trainer's push (push_all) gives both
# daemons a new generation and both ranks refresh to it; then a SIGTERM to the ranks stops them, each host stops
# its daemon, and the script checks that neither host's /dev/shm holds anything. Its own folder (/tmp/expertd-ep-*:
# configs, logs, torchrun's files) is removed on exit. Exit 0 when all of that happened.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}

host() {  # inside `unshare --ipc --mount`: this host's /dev/shm, daemon and torchrun node
  local r=$1 dir=$WORK/host$1
  mount -t tmpfs -o size=1g,mode=1777 "expertd-ep-host$r" /dev/shm
  "$PYTHON" -m expertd.server.cli start --config "$dir/expertd.yaml" >"$dir/daemon.log" 2>&1 &
  local daemon=$! torchrun=""
  trap '[ -n "$torchrun" ] && kill $torchrun 2>/dev/null; "$PYTHON" -m expertd.server.cli stop --config "$dir/expertd.yaml" >/dev/null 2>&1 || true; wait $daemon 2>/dev/null' EXIT
  "$PYTHON" -m expertd.server.cli status --config "$dir/expertd.yaml" --wait 600 >/dev/null
  echo "host $r: daemon serving EP rank $r of 2 on $(endpoint "$r")"
  EXPERTD_ENDPOINT=$(endpoint "$r") EXPERTD_TOKEN=$TOKEN TMPDIR=$dir OMP_NUM_THREADS=1 \
    "$PYTHON" -m torch.distributed.run --nnodes 2 --nproc_per_node 1 --node_rank "$r" --master_addr 127.0.0.1 \
    --master_port "$MASTER_PORT" "$REPO/examples/ep_worker.py" --poll 0.5 --ready-file "$dir/ready" \
    >"$dir/torchrun.log" 2>&1 &
  torchrun=$!
  echo $torchrun >"$dir/torchrun.pid"
  local code=0
  wait $torchrun || code=$?
  torchrun=""
  "$PYTHON" -m expertd.server.cli stop --config "$dir/expertd.yaml" >/dev/null
  wait $daemon || code=$?
  trap - EXIT
  ls -A /dev/shm >"$dir/left-in-shm"
  echo "host $r: torchrun exited $code; daemon stopped; /dev/shm holds $(wc -l <"$dir/left-in-shm") file(s)"
  return $code
}

endpoint() { echo "tcp://127.0.0.1:$(eval echo "\$DAEMON_PORT$1")"; }
ranks() { pgrep -P "$(cat "$WORK/host$1/torchrun.pid")" || true; }  # host R's worker processes: its torchrun's children

if [ "${1:-}" = "--host" ]; then host "$2"; exit; fi

if ! unshare --ipc --mount true 2>/dev/null; then
  echo "ep_two_hosts.sh: \`unshare --ipc --mount\` is not permitted here (run as root, or with CAP_SYS_ADMIN)" >&2
  exit 2
fi
CHECKPOINT=$(cd "${1:-$REPO/checkpoints/tiny}" && pwd)
WORK=$(mktemp -d /tmp/expertd-ep-XXXXXX)
read -r DAEMON_PORT0 DAEMON_PORT1 MASTER_PORT < <("$PYTHON" -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
TOKEN=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(16))')
# plain tcp:// on 127.0.0.1 with a token: clients and the CLI send it in clear only when told so (a local user who
# binds a port while its daemon is down would receive it); across real hosts, give the daemons CURVE keys instead
EXPERTD_ALLOW_PLAIN_TCP_TOKENS=1
export WORK DAEMON_PORT0 DAEMON_PORT1 MASTER_PORT PYTHON TOKEN EXPERTD_ALLOW_PLAIN_TCP_TOKENS
HOSTS=()

finish() {  # whatever is still running is stopped (ranks first: they detach), then the folder goes
  local code=$?
  for r in 0 1; do
    [ -f "$WORK/host$r/torchrun.pid" ] && kill -TERM $(ranks "$r") 2>/dev/null || true
  done
  for pid in "${HOSTS[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ $code -ne 0 ]; then
    for log in "$WORK"/host*/*.log; do [ -f "$log" ] && { echo "--- $log" >&2; grep -m 3 -B 2 "Error" "$log" >&2; tail -n 5 "$log" >&2; }; done
  fi
  rm -rf "$WORK"
  exit $code
}
trap finish EXIT
trap 'exit 130' INT TERM

for r in 0 1; do
  mkdir -p "$WORK/host$r"
  cat >"$WORK/host$r/expertd.yaml" <<EOF
checkpoint: $CHECKPOINT
endpoint: $(endpoint $r)
auth_token: $TOKEN
namespace: expertd-ep$r
run_dir: $WORK/host$r/run
progress: false
expert_parallel: {size: 2, ranks: [$r]}
EOF
  unshare --ipc --mount --fork bash "${BASH_SOURCE[0]}" --host "$r" &
  HOSTS+=($!)
done

wait_for() {  # wait_for WHAT TEST...: until the test passes, as long as both hosts run
  local what=$1
  shift
  for _ in $(seq 6000); do
    "$@" && return 0
    for pid in "${HOSTS[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "a host ended while waiting for $what" >&2; return 1; }; done
    sleep 0.1
  done
  echo "timed out waiting for $what" >&2
  return 1
}
wait_for "both ranks to serve" test -e "$WORK/host0/ready"
cat "$WORK/host0/torchrun.log" "$WORK/host1/torchrun.log" | grep "serving generation"

# A trainer's push: one call, both daemons (each takes its share; the bytes travel as ZeroMQ frames over tcp)
"$PYTHON" - "$(endpoint 0)" "$(endpoint 1)" "$TOKEN" "$CHECKPOINT" <<'EOF'
import json
import sys

import torch

from expertd.client import push_all

first, second, token, checkpoint = sys.argv[1:]
with open(f"{checkpoint}/config.json") as f:
    hidden = json.load(f)["hidden_size"]
done = push_all([first, second], {"model.norm.weight": torch.full((hidden,), 0.5, dtype=torch.bfloat16)}, token=token)
print(f"pushed model.norm.weight to both daemons: {', '.join(f'{e} generation {g}' for e, g in done.items())}")
EOF
refreshed() { grep -q "rank $1: refreshed to generation 2" "$WORK/host$1/torchrun.log"; }
wait_for "rank 0 to refresh" refreshed 0
wait_for "rank 1 to refresh" refreshed 1
cat "$WORK/host0/torchrun.log" "$WORK/host1/torchrun.log" | grep "refreshed to generation"

# A clean stop: SIGTERM to the ranks (each detaches and exits 0, so torchrun does); each host then stops its daemon
for r in 0 1; do kill -TERM $(ranks "$r"); done
failed=0
for pid in "${HOSTS[@]}"; do wait "$pid" || failed=1; done
HOSTS=()
rm -f "$WORK"/host*/torchrun.pid  # their torchruns are gone: nothing of theirs to signal on exit
left=$(cat "$WORK/host0/left-in-shm" "$WORK/host1/left-in-shm")
if [ $failed -ne 0 ] || [ -n "$left" ]; then
  echo "ep_two_hosts.sh: a host did not stop cleanly${left:+; left in /dev/shm: $left}" >&2
  exit 1
fi
echo "stopped: both ranks and both daemons exited 0; nothing left in either host's /dev/shm"
