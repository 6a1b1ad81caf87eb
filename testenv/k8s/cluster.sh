#!/usr/bin/env bash
# Single-node Kubernetes test cluster on loopback, built from pinned Go modules:
# etcd + kube-apiserver + kube-controller-manager + kube-scheduler (upstream) and one
# real node: the upstream kubelet on a private containerd with CNI (realnode.sh).
#
# Usage: cluster.sh up|down|status
#   up      build binaries if needed, create certs, start everything, wait for the
#           node to be Ready, apply the StorageClass runcell-hostpath (dynamic hostPath
#           volumes); the LAST line of stdout is the kubeconfig path.
#   down    stop the node (its pods, containerd, the kubelet: realnode.sh down), then
#           the control plane, and remove the cluster state (etcd data, pid files,
#           the hostPath volumes of StorageClass runcell-hostpath). Binaries and
#           certificates are kept.
#   status  show which processes run and whether the node is Ready (exit 0 if up).
#
# Environment (prefix RUNCELL_TESTENV_: RUNCELL_K8S_* is the k8s driver's config, and
# the driver rejects every RUNCELL_K8S_* variable that is not one of its keys):
#   RUNCELL_TESTENV_STATE          state dir (default: <repo>/target/k8s)
#   RUNCELL_TESTENV_API_PORT       kube-apiserver port (default 6443)
#   RUNCELL_TESTENV_READY_TIMEOUT  seconds to wait for the node (default 180)
#   GO                             go binary (default: go in PATH, else /usr/local/go/bin/go)
set -euo pipefail

# The names these had before, which the k8s driver still reads (deprecated) as its own
# config, rejecting them as unknown keys.
for old in SANDBOX_K8S_STATE SANDBOX_K8S_API_PORT SANDBOX_K8S_READY_TIMEOUT; do
  new=RUNCELL_TESTENV_${old#SANDBOX_K8S_}
  if [[ -n ${!old:-} && -z ${!new:-} ]]; then
    echo "cluster.sh: error: $old was renamed to $new (the k8s driver takes $old as its config and rejects it)" >&2
    exit 2
  fi
done

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/../.." && pwd))
state=${RUNCELL_TESTENV_STATE:-$repo/target/k8s}
api_port=${RUNCELL_TESTENV_API_PORT:-6443}
etcd_port=32379 # client; peer is etcd_port+1. Not 2379, to stay clear of other etcds.
node_name=${RUNCELL_REALNODE_NAME:-runcell-real-node}
ready_timeout=${RUNCELL_TESTENV_READY_TIMEOUT:-180}

GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
export GOTOOLCHAIN=local

pki=$state/pki
run=$state/run
logs=$state/logs
kubeconfig=$state/kubeconfig
components=(etcd kube-apiserver kube-controller-manager kube-scheduler)
# Where the controller manager's hostPath provisioner (--enable-hostpath-provisioner,
# StorageClass runcell-hostpath) makes its volumes: /tmp/hostpath_pv/<uuid>, fixed in
# k8s.io/kubernetes pkg/volume/hostpath (its deleter removes them when their claim goes;
# `down` removes what is left).
hostpath_pv_dir=/tmp/hostpath_pv

log() { echo "cluster.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

# --- binaries ---------------------------------------------------------------

# Version keys: the pinned Kubernetes version plus a hash of everything that
# determines the binaries, so an unchanged checkout never rebuilds.
hash_files() { (cd "$here" && cat "$@" && "$GO" version) | sha256sum | cut -c1-12; }
cp_key() {
  local v
  v=$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "$here/controlplane/go.mod")
  echo "controlplane-$v-$(hash_files controlplane/go.mod controlplane/go.sum controlplane/build.sh controlplane/cmd/etcd/main.go)"
}

# prune_bins PREFIX KEEP: drop binaries of other versions (running processes from
# them are restarted by `start`, which compares command lines).
prune_bins() {
  local d
  for d in "$state/bin/$1"*; do
    [[ -d $d && $d != "$2" ]] && rm -rf "$d"
  done
  return 0
}

build_binaries() {
  command -v "$GO" >/dev/null || die "go not found (set GO=...)"
  cp_bin=$state/bin/$(cp_key)
  if [[ ! -f $cp_bin/.complete ]]; then
    log "building control plane into $cp_bin (cold: several minutes; log: $logs/build-controlplane.log)"
    local t0=$SECONDS
    rm -rf "$cp_bin"
    if ! "$here/controlplane/build.sh" "$cp_bin" >"$logs/build-controlplane.log" 2>&1; then
      tail -n 30 "$logs/build-controlplane.log" >&2
      die "control-plane build failed"
    fi
    touch "$cp_bin/.complete"
    log "control plane built in $((SECONDS - t0))s"
    prune_bins controlplane- "$cp_bin"
  fi
}

# --- certificates -----------------------------------------------------------

# sign NAME SUBJECT [SAN] [EXT_KEY_USAGE]: key + certificate signed by the CA.
sign() {
  local name=$1 subj=$2 san=${3:-} eku=${4:-clientAuth}
  local ext=$pki/$name.ext
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [[ -n $san ]] && echo "subjectAltName=$san"
  } >"$ext"
  openssl genrsa -out "$pki/$name.key" 2048 2>/dev/null
  openssl req -new -key "$pki/$name.key" -subj "$subj" -out "$pki/$name.csr" 2>/dev/null
  openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3650 -extfile "$ext" -out "$pki/$name.crt" 2>/dev/null
  rm -f "$pki/$name.csr" "$ext"
}

# make_pki creates whatever is missing (so certificates added later appear without
# invalidating the CA of an existing cluster).
make_pki() {
  mkdir -p "$pki"
  chmod 700 "$pki"
  if [[ ! -f $pki/ca.crt ]]; then
    log "generating certificates in $pki"
    rm -f "$pki"/*.crt "$pki"/*.key
    openssl req -x509 -newkey rsa:2048 -nodes -keyout "$pki/ca.key" -out "$pki/ca.crt" -days 3650 \
      -subj "/CN=sandbox-k8s-ca" -addext "basicConstraints=critical,CA:TRUE" \
      -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" 2>/dev/null
  fi
  [[ -f $pki/apiserver.crt ]] || sign apiserver "/CN=kube-apiserver" \
    "IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local" \
    serverAuth
  [[ -f $pki/admin.crt ]] || sign admin "/O=system:masters/CN=kubernetes-admin"
  [[ -f $pki/apiserver-kubelet-client.crt ]] || sign apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
  # Aggregation-layer (front proxy) identity; also gives the controller manager and
  # the scheduler the request-header CA their delegated authentication looks for.
  [[ -f $pki/front-proxy-client.crt ]] || sign front-proxy-client "/CN=front-proxy-client"
  if [[ ! -f $pki/sa.pub ]]; then
    openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  fi
}

make_kubeconfig() {
  local b64
  b64() { base64 -w0 <"$1"; }
  cat >"$kubeconfig.tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: sandbox
  cluster:
    server: https://127.0.0.1:$api_port
    certificate-authority-data: $(b64 "$pki/ca.crt")
users:
- name: admin
  user:
    client-certificate-data: $(b64 "$pki/admin.crt")
    client-key-data: $(b64 "$pki/admin.key")
contexts:
- name: sandbox
  context: {cluster: sandbox, user: admin, namespace: default}
current-context: sandbox
EOF
  chmod 600 "$kubeconfig.tmp"
  mv "$kubeconfig.tmp" "$kubeconfig"
}

# --- processes --------------------------------------------------------------

pid_of() { cat "$run/$1.pid" 2>/dev/null || true; }

# running NAME: the recorded pid is alive and still runs our binary.
running() {
  local pid
  pid=$(pid_of "$1")
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "/$1 "
}

# start NAME BINARY ARGS...: detached (own session), output to logs/NAME.log.
start() {
  local name=$1 bin=$2
  shift 2
  if running "$name"; then
    # Keep it only if it runs exactly this binary with exactly these arguments.
    local current wanted
    current=$(sha256sum <"/proc/$(pid_of "$name")/cmdline")
    wanted=$(printf '%s\0' "$bin" "$@" | sha256sum)
    [[ $current == "$wanted" ]] && return
    log "restarting $name: binary or flags changed"
    stop_component "$name"
  fi
  [[ -x $bin ]] || die "missing binary $bin"
  setsid nohup "$bin" "$@" >"$logs/$name.log" 2>&1 </dev/null 9>&- &
  echo $! >"$run/$name.pid"
  log "started $name (pid $!)"
}

fail_with_log() {
  local name=$1
  shift
  log "error: $*"
  if [[ -f $logs/$name.log ]]; then
    log "last lines of $logs/$name.log:"
    tail -n 40 "$logs/$name.log" >&2
  fi
  exit 1
}

# wait_for NAME SECONDS DESCRIPTION COMMAND...: poll until COMMAND succeeds.
wait_for() {
  local name=$1 secs=$2 what=$3
  shift 3
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    running "$name" || fail_with_log "$name" "$name exited while waiting for $what"
    ((SECONDS < deadline)) || fail_with_log "$name" "timed out after ${secs}s waiting for $what"
    sleep 0.5
  done
}

kubectl() { "$cp_bin/kubectl" --kubeconfig "$kubeconfig" "$@"; }

node_ready() {
  [[ $(kubectl get node "$node_name" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]]
}
node_untainted() {
  [[ -z $(kubectl get node "$node_name" -o 'jsonpath={.spec.taints}' 2>/dev/null) ]]
}
default_sa() { kubectl -n default get serviceaccount default; }

cmd_up() {
  mkdir -p "$state" "$run" "$logs" "$state/bin"
  command -v docker >/dev/null || die "docker CLI not found"
  docker info >/dev/null 2>&1 || die "docker daemon not reachable (docker info failed)"
  build_binaries
  make_pki
  make_kubeconfig

  start etcd "$cp_bin/etcd" \
    --name sandbox --data-dir "$state/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$((etcd_port + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((etcd_port + 1))" \
    --initial-cluster "sandbox=http://127.0.0.1:$((etcd_port + 1))" \
    --listen-metrics-urls "" --unsafe-no-fsync=true --log-level warn
  wait_for etcd 60 "etcd health" curl -fsS "http://127.0.0.1:$etcd_port/health"

  start kube-apiserver "$cp_bin/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --service-cluster-ip-range 10.96.0.0/24 \
    --authorization-mode Node,RBAC \
    --endpoint-reconciler-type none \
    --kubelet-client-certificate "$pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$pki/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types InternalIP \
    --requestheader-client-ca-file "$pki/ca.crt" --requestheader-allowed-names front-proxy-client \
    --requestheader-username-headers X-Remote-User --requestheader-group-headers X-Remote-Group \
    --requestheader-extra-headers-prefix X-Remote-Extra- \
    --proxy-client-cert-file "$pki/front-proxy-client.crt" --proxy-client-key-file "$pki/front-proxy-client.key" \
    --allow-privileged=true --profiling=false \
    --cert-dir "$run/apiserver-certs"
  wait_for kube-apiserver 120 "apiserver /readyz" kubectl get --raw /readyz

  start kube-controller-manager "$cp_bin/kube-controller-manager" \
    --kubeconfig "$kubeconfig" \
    --authentication-kubeconfig "$kubeconfig" --authorization-kubeconfig "$kubeconfig" \
    --bind-address 127.0.0.1 --secure-port 10257 --leader-elect=false \
    --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
    --cluster-signing-cert-file "$pki/ca.crt" --cluster-signing-key-file "$pki/ca.key" \
    --use-service-account-credentials=false --profiling=false \
    --enable-hostpath-provisioner \
    --cert-dir "$run/kcm-certs"
  start kube-scheduler "$cp_bin/kube-scheduler" \
    --kubeconfig "$kubeconfig" \
    --authentication-kubeconfig "$kubeconfig" --authorization-kubeconfig "$kubeconfig" \
    --bind-address 127.0.0.1 --secure-port 10259 --leader-elect=false --profiling=false
  # The node: kubelet + containerd + CNI, joined with the cluster's CA. Its last stdout
  # line is its name; ours must stay the kubeconfig.
  RUNCELL_TESTENV_STATE=$state RUNCELL_REALNODE_NAME=$node_name \
    RUNCELL_REALNODE_READY_TIMEOUT=$ready_timeout "$here/realnode.sh" up >/dev/null
  wait_for kube-controller-manager "$ready_timeout" "node $node_name to lose its not-ready taint" node_untainted
  wait_for kube-controller-manager 60 "the default ServiceAccount" default_sa
  # Dynamic hostPath volumes (single node, tests only) for workspace claims.
  kubectl apply -f - >/dev/null <<'EOF' || die "cannot create the StorageClass runcell-hostpath"
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: runcell-hostpath
provisioner: kubernetes.io/host-path
reclaimPolicy: Delete
volumeBindingMode: Immediate
EOF
  for c in "${components[@]}"; do
    running "$c" || fail_with_log "$c" "$c is not running"
  done
  log "cluster up: node $node_name Ready, apiserver https://127.0.0.1:$api_port"
  echo "$kubeconfig"
}

# stop_components NAME...: SIGTERM them together, SIGKILL what is left after 10 s.
stop_components() {
  local name pids=() deadline=$((SECONDS + 10))
  for name in "$@"; do
    if running "$name"; then
      pids+=("$(pid_of "$name")")
      kill -TERM "${pids[-1]}" 2>/dev/null || true
      log "stopping $name (pid ${pids[-1]})"
    fi
    rm -f "$run/$name.pid"
  done
  local pid
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
  done
}

stop_component() { stop_components "$1"; }

cmd_down() {
  # The node first (it deletes its pods through the apiserver), etcd last.
  RUNCELL_TESTENV_STATE=$state RUNCELL_REALNODE_NAME=$node_name "$here/realnode.sh" down
  stop_components kube-scheduler kube-controller-manager kube-apiserver
  stop_components etcd
  rm -rf "$state/etcd" "$state/node" "$run" "$kubeconfig" "$hostpath_pv_dir"
  log "cluster down (kept $state/bin and $state/pki)"
}

cmd_status() {
  local up=0 c
  for c in "${components[@]}"; do
    if running "$c"; then
      echo "$c: running (pid $(pid_of "$c"))"
    else
      echo "$c: stopped"
      up=1
    fi
  done
  cp_bin=$(dirname "$(ls -t "$state"/bin/controlplane-*/kubectl 2>/dev/null | head -n 1)")
  if [[ -x $cp_bin/kubectl && -f $kubeconfig ]] && node_ready; then
    echo "node $node_name: Ready"
  else
    echo "node $node_name: not Ready"
    up=1
  fi
  RUNCELL_TESTENV_STATE=$state RUNCELL_REALNODE_NAME=$node_name "$here/realnode.sh" status || up=1
  [[ -f $kubeconfig ]] && echo "kubeconfig: $kubeconfig"
  return $up
}

# One `up`/`down` at a time per state dir (fd 9 is not inherited by the daemons).
lock() {
  mkdir -p "$state"
  exec 9>"$state/.lock"
  flock 9
}

# restart-apiserver: stops the apiserver (SIGTERM: it ends every stream it proxies, exec
# streams too) and brings the cluster up again; for the test that a command outlives it.
cmd_restart_apiserver() {
  stop_component kube-apiserver
  cmd_up >/dev/null
  log "kube-apiserver restarted"
}

case ${1:-} in
up) lock && cmd_up ;;
restart-apiserver) lock && cmd_restart_apiserver ;;
down) lock && cmd_down ;;
status) cmd_status ;;
*)
  echo "usage: $0 up|down|status|restart-apiserver" >&2
  exit 2
  ;;
esac
