#!/usr/bin/env bash
# compose.yaml for real, with podman, on a machine whose container registries are unreachable (the
# development machine): a Debian base image built locally, the ktserve image on it with a CPU-only
# torch, then `podman-compose up` of gpu + expert-0 + expert-1 on the CPU, a chat completion, an
# expert container killed (restart: unless-stopped brings it back) and another chat completion.
# Prometheus and Grafana are left out: their images come from a registry.
#
# Needs (root): apt-get install -y podman podman-compose runc debootstrap, and
# /etc/containers/containers.conf with runtime = "runc" (see MACHINES.md). Debian's mirror is
# taken from this machine's apt sources; torch==2.13.0+cpu from what pip here resolves it to
# (never a CUDA build: a +cpu local version exists in no CUDA index).
# Prints the seconds each step took. KEEP=1 leaves the containers running.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=localhost/ktserve-base:bookworm
PORT=8000
URL="http://127.0.0.1:$PORT"
COMPOSE=(podman-compose -p ktserve -f compose.yaml)
export KTSERVE_DEVICE=cpu KTSERVE_TORCH_SPEC=torch==2.13.0+cpu

step_start=0
step() { step_start=$(date +%s); echo "== $*"; }
took() { echo "   took $(( $(date +%s) - step_start )) s"; }

wait_for() {  # wait_for SECONDS WHAT COMMAND...: poll until COMMAND succeeds
  local deadline=$(( $(date +%s) + $1 )) what=$2; shift 2
  until "$@" >/dev/null 2>&1; do
    if (( $(date +%s) > deadline )); then echo "timed out waiting for $what" >&2; return 1; fi
    sleep 1
  done
}

chat() {
  curl -sf "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d \
    '{"model": "demo_model", "max_tokens": 16, "messages": [{"role": "user", "content": "Tell me about the json module."}]}'
}

cleanup() {
  if [ "${KEEP:-0}" != 1 ]; then
    "${COMPOSE[@]}" down >/dev/null 2>&1 || true
    podman volume rm -f ktserve_ktshm >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

for tool in podman podman-compose debootstrap curl; do
  command -v "$tool" >/dev/null || { echo "$tool is missing (see the header)" >&2; exit 1; }
done

if ! podman image exists "$BASE"; then
  step "base image $BASE: debootstrap Debian bookworm with python3, venv, headers"
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null \
           || true)
  mirror=${mirror:-$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list)}
  rootfs=$(mktemp -d)
  debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
    bookworm "$rootfs" "$mirror" >/dev/null
  tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$rootfs"
  took
fi

step "torch CPU wheel (what pip here resolves $KTSERVE_TORCH_SPEC to) and podman build"
wheels=$(mktemp -d)
python3 -m pip download --quiet --no-deps --dest "$wheels" "$KTSERVE_TORCH_SPEC"
ls "$wheels"
# NOTE: this machine's CA bundle (its HTTPS goes through a proxy) is lent to pip in the build.
ca=/etc/ssl/certs/ca-certificates.crt
podman build --quiet --build-arg "BASE_IMAGE=$BASE" --build-arg "TORCH_SPEC=$KTSERVE_TORCH_SPEC" \
  --volume "$wheels:/wheels:ro" --build-arg "PIP_ARGS=--find-links /wheels" \
  --volume "$ca:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt \
  -t ktserve:latest . >/dev/null
rm -rf "$wheels"
podman run --rm ktserve:latest --help | head -3
took

step "podman-compose up gpu expert-0 expert-1 (KTSERVE_DEVICE=cpu)"
# NOTE: podman-compose 1.0 ignores a volume's driver_opts: create the tmpfs volume itself (podman
# reads o=size as an XFS quota, so the tmpfs keeps its default size limit; without uid/gid the
# mount is root's 0755).
podman volume rm -f ktserve_ktshm >/dev/null 2>&1 || true
podman volume create --opt type=tmpfs --opt device=tmpfs \
  --opt o=mode=1777,uid=1000,gid=1000 ktserve_ktshm >/dev/null
"${COMPOSE[@]}" up -d expert-0 expert-1 gpu >/dev/null
wait_for 600 "$URL/health" curl -sf "$URL/health"
took

step "chat completion"
chat
echo
took

step "kill -9 the worker in expert-1's container; restart: unless-stopped brings it back"
restarts() { podman inspect --format '{{.RestartCount}}' ktserve_expert-1_1; }
before=$(restarts)
init_pid=$(podman inspect --format '{{.State.Pid}}' ktserve_expert-1_1)
kill -KILL "$(cat "/proc/$init_pid/task/$init_pid/children")"
wait_for 30 "/health to notice" bash -c "! curl -sf $URL/health"
chat
echo
wait_for 30 "/health back to 200" curl -sf "$URL/health"
(( $(restarts) == before + 1 )) || { echo "expert-1 was not restarted" >&2; exit 1; }
podman logs ktserve_gpu_1 2>&1 | grep "expert worker expert-1:50061 died; waiting for it"
took

step "metrics"
curl -sf "$URL/metrics" | grep -E '^ktserve_(worker_up|generation_tokens_total)'
