#!/usr/bin/env bash
# The test cluster's node: a REAL Kubernetes node (upstream kubelet + containerd + CNI)
# joined to the control plane that cluster.sh runs (cluster.sh up/down call this; see
# README.md).
#
# Usage: realnode.sh up|down|status
#   up      build the kubelet if needed (same pinned k8s.io/kubernetes as the control
#           plane), start a private containerd (CRI) and the kubelet, import the local
#           images, wait for the node to be Ready; the LAST stdout line is the node name.
#           Needs a running cluster (cluster.sh up).
#   down    delete the node's pods and the Node object, stop kubelet, containerd, shims
#           and containers, remove the bridge, cgroups and runtime state. Keeps the
#           kubelet binary, its generated build module and the node certificates.
#   status  show what runs and whether the node is Ready (exit 0 if up).
#
# The node is labelled runcell.dev/real-node=true and takes every pod (no taint).
#
# Isolation from the rest of the machine: containerd and kubelet share a private
# mount namespace (held by a small holder process) in which
#   - /run/containerd is a fresh tmpfs (containerd 1.6 shims hard-code their sockets
#     under /run/containerd/s, which Docker's containerd uses on the host),
#   - /var/lib/cni (libcni's result cache, not configurable in containerd 1.6) is
#     bind-mounted from our state dir,
#   - the six /proc/sys files the kubelet insists on (vm.overcommit_memory,
#     kernel.panic, kernel.panic_on_oops, ...) are masked with files holding the
#     values it wants, so it does not rewrite the host's sysctls.
# All container mounts, netns mounts and the kubelet's tmpfs volumes therefore live
# in that namespace only and disappear with it.
#
# Environment:
#   RUNCELL_TESTENV_STATE          cluster state dir (default: <repo>/target/k8s);
#                                  this node uses $RUNCELL_TESTENV_STATE/realnode
#   RUNCELL_REALNODE_NAME          node name (default runcell-real-node)
#   RUNCELL_REALNODE_PORT          kubelet API port on the node address (default 10260)
#   RUNCELL_REALNODE_POD_CIDR      pod subnet of the CNI bridge (default 10.244.0.0/24)
#   RUNCELL_REALNODE_IMAGES        images copied from Docker into containerd
#                                  (default: every sandbox-test/* image in Docker)
#   RUNCELL_REALNODE_READY_TIMEOUT seconds to wait for Ready (default 120)
#   RUNCELL_REALNODE_STREAM_IDLE   the kubelet's streamingConnectionIdleTimeout (default
#                                  30s; the suite's idle case waits twice as long)
#   GO                             go binary (default: go in PATH, else /usr/local/go/bin/go)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/../.." && pwd))
state=${RUNCELL_TESTENV_STATE:-$repo/target/k8s}
rn=$state/realnode
node_name=${RUNCELL_REALNODE_NAME:-runcell-real-node}
kubelet_port=${RUNCELL_REALNODE_PORT:-10260}
healthz_port=$((kubelet_port + 8))
pod_cidr=${RUNCELL_REALNODE_POD_CIDR:-10.244.0.0/24}
ready_timeout=${RUNCELL_REALNODE_READY_TIMEOUT:-120}
stream_idle=${RUNCELL_REALNODE_STREAM_IDLE:-30s}
bridge=runcell-cni0
# The kubelet rejects a loopback node IP ("nodeIP can't be loopback address": no
# InternalIP, so the apiserver cannot reach it). The node's address is therefore the
# gateway address of our CNI bridge, a host-local address created by `up`; the
# kubelet listens there only. The apiserver (127.0.0.1) reaches it without leaving
# the host.
node_ip=${pod_cidr%/*}
node_ip=${node_ip%.*}.1
cgroup_root=runcell-realnode
fwd_rule=(FORWARD -i "$bridge" -o "$bridge" -m comment --comment runcell-realnode -j ACCEPT)
node_label=runcell.dev/real-node
pause_image=localhost/runcell/pause:1

GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
export GOTOOLCHAIN=local

cluster_kubeconfig=$state/kubeconfig
pki=$state/pki # the cluster's CA (cluster.sh)
run=$rn/run
logs=$rn/logs
sock=$run/containerd.sock
ctr_cmd=(ctr --address "$sock" --namespace k8s.io)

log() { echo "realnode.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

kubectl() {
  local k
  k=$(ls -t "$state"/bin/controlplane-*/kubectl 2>/dev/null | head -n 1)
  [[ -x $k ]] || k=$(command -v kubectl) || die "no kubectl (run cluster.sh up first)"
  "$k" --kubeconfig "$cluster_kubeconfig" "$@"
}

# --- kubelet binary ----------------------------------------------------------

# The kubelet needs modules the control plane's go.mod does not list
# (k8s.io/cri-streaming, otelrestful, hnslib), so it is built in a generated module
# under $rn/src: the control plane's go.mod/go.sum (same pins and replaces) plus an
# import of cmd/kubelet, completed by `go mod tidy` (adds only those requirements).
kubelet_key() {
  local v
  v=$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "$here/controlplane/go.mod")
  echo "kubelet-$v-$( (cd "$here/controlplane" && cat go.mod go.sum && "$GO" version) | sha256sum | cut -c1-12)"
}

build_kubelet() {
  kubelet_bin=$rn/bin/$(kubelet_key)
  [[ -f $kubelet_bin/.complete ]] && return
  command -v "$GO" >/dev/null || die "go not found (set GO=...)"
  mkdir -p "$rn/bin" "$logs"
  log "building kubelet into $kubelet_bin (log: $logs/build-kubelet.log)"
  local t0=$SECONDS src=$rn/src
  rm -rf "$src" "$kubelet_bin"
  mkdir -p "$src" "$kubelet_bin"
  cp "$here/controlplane/go.mod" "$here/controlplane/go.sum" "$src/"
  sed -i 's#^module .*#module sandbox.local/testenv/k8s/realnode#' "$src/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "k8s.io/kubernetes/cmd/kubelet"\n' >"$src/tools.go"
  if ! (
    cd "$src"
    # the etcd requirement goes away (nothing imports it here); the rest stays
    "$GO" mod tidy
    export CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
    v=$("$GO" list -m -f '{{.Version}}' k8s.io/kubernetes)
    minor=${v#v1.}
    minor=${minor%%.*}
    ld="-s -w"
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ld+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
      ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    done
    nice -n 15 "$GO" build -trimpath -tags selinux,notest -ldflags "$ld" -o "$kubelet_bin/kubelet" k8s.io/kubernetes/cmd/kubelet
  ) >"$logs/build-kubelet.log" 2>&1; then
    tail -n 30 "$logs/build-kubelet.log" >&2
    die "kubelet build failed"
  fi
  touch "$kubelet_bin/.complete"
  log "kubelet built in $((SECONDS - t0))s"
  local d
  for d in "$rn/bin/kubelet-"*; do
    [[ -d $d && $d != "$kubelet_bin" ]] && rm -rf "$d"
  done
  return 0
}

# --- certificates and config -------------------------------------------------

# sign NAME SUBJECT SAN EKU: key + cert signed by the cluster CA, in $rn/pki.
sign() {
  local name=$1 subj=$2 san=$3 eku=$4 d=$rn/pki
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [[ -n $san ]] && echo "subjectAltName=$san"
  } >"$d/$name.ext"
  openssl genrsa -out "$d/$name.key" 2048 2>/dev/null
  openssl req -new -key "$d/$name.key" -subj "$subj" -out "$d/$name.csr" 2>/dev/null
  openssl x509 -req -in "$d/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -CAserial "$d/ca.srl" -days 3650 -extfile "$d/$name.ext" -out "$d/$name.crt" 2>/dev/null
  rm -f "$d/$name.csr" "$d/$name.ext"
}

# Kubelet identity system:node:<name> in system:nodes (the apiserver runs the Node
# authorizer), and a serving cert for 127.0.0.1. Re-issued when the CA changed.
make_pki() {
  local d=$rn/pki
  mkdir -p "$d"
  chmod 700 "$d"
  [[ -f $pki/ca.crt && -f $pki/ca.key ]] || die "no cluster CA in $pki (run cluster.sh up first)"
  if [[ -f $d/kubelet-client.crt ]] && ! openssl verify -CAfile "$pki/ca.crt" "$d/kubelet-client.crt" >/dev/null 2>&1; then
    rm -f "$d"/*.crt "$d"/*.key
  fi
  if [[ ! -f $d/kubelet-client.crt ]] || ! openssl x509 -in "$d/kubelet-client.crt" -noout -subject | grep -q "system:node:$node_name\$"; then
    sign kubelet-client "/O=system:nodes/CN=system:node:$node_name" "" clientAuth
  fi
  [[ -f $d/kubelet-serving.crt ]] || sign kubelet-serving "/CN=$node_name" "IP:$node_ip,IP:127.0.0.1,DNS:$node_name,DNS:localhost" serverAuth
}

write_configs() {
  mkdir -p "$rn/etc" "$rn/cni/net.d" "$rn/cni/ipam" "$rn/cni/cache" "$rn/sysctl" \
    "$rn/containerd/root" "$rn/containerd/state" "$rn/containerd/opt" "$rn/kubelet" "$rn/pod-logs" "$run/runc"

  cat >"$rn/etc/containerd.toml" <<EOF
# Private containerd for the real test node (realnode.sh); not Docker's.
version = 2
root = "$rn/containerd/root"
state = "$rn/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
[debug]
  address = ""
  level = "info"
[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "$rn/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$pause_image"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  disable_apparmor = true
  enable_selinux = false
  # This machine withholds CAP_SYS_RESOURCE even from root: runc cannot lower
  # oom_score_adj (the pause container asks for -998: "failed to update
  # /proc/self/oom_score_adj: Permission denied"). Clamp to containerd's own score.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  max_container_log_line_size = 16384
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "$(command -v runc)"
        Root = "$run/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$rn/cni/net.d"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$rn/etc/certs.d"
EOF

  # Bridge without masquerading and without a default route: pods reach each other
  # and the host's bridge address only. containerd adds loopback itself.
  local gw=$node_ip
  cat >"$rn/cni/net.d/10-runcell.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "runcell-realnode",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$bridge",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$pod_cidr", "gateway": "$gw"}]],
        "dataDir": "$rn/cni/ipam"
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF

  # Pods get no cluster DNS (none runs); an empty search/ns list would make the
  # kubelet fall back to the host's resolv.conf, so name the loopback resolver.
  printf 'nameserver 127.0.0.1\noptions ndots:1\n' >"$rn/etc/resolv.conf"

  # The values the kubelet wants (pkg/kubelet/cm setupKernelTunables); masked over
  # /proc/sys inside the private mount namespace only.
  echo 1 >"$rn/sysctl/vm.overcommit_memory"
  echo 0 >"$rn/sysctl/vm.panic_on_oom"
  echo 10 >"$rn/sysctl/kernel.panic"
  echo 1 >"$rn/sysctl/kernel.panic_on_oops"
  echo 1000000 >"$rn/sysctl/kernel.keys.root_maxkeys"
  echo 25000000 >"$rn/sysctl/kernel.keys.root_maxbytes"

  local b64
  b64() { base64 -w0 <"$1"; }
  cat >"$rn/etc/kubelet.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: sandbox
  cluster:
    server: $(awk '$1 == "server:" { print $2; exit }' "$cluster_kubeconfig")
    certificate-authority-data: $(b64 "$pki/ca.crt")
users:
- name: node
  user:
    client-certificate-data: $(b64 "$rn/pki/kubelet-client.crt")
    client-key-data: $(b64 "$rn/pki/kubelet-client.key")
contexts:
- name: node
  context: {cluster: sandbox, user: node}
current-context: node
EOF
  chmod 600 "$rn/etc/kubelet.kubeconfig"

  cat >"$rn/etc/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $node_ip
port: $kubelet_port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $healthz_port
tlsCertFile: $rn/pki/kubelet-serving.crt
tlsPrivateKeyFile: $rn/pki/kubelet-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $pki/ca.crt}
authorization:
  mode: Webhook
containerRuntimeEndpoint: unix://$sock
imageServiceEndpoint: unix://$sock
# cgroup v1, no systemd on this machine
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /$cgroup_root
failSwapOn: false
makeIPTablesUtilChains: false
protectKernelDefaults: false
resolvConf: $rn/etc/resolv.conf
clusterDomain: cluster.local
podLogsDir: $rn/pod-logs
volumePluginDir: $rn/kubelet/volume-plugins
maxPods: 110
serializeImagePulls: false
# Idle exec/attach streams are cut after this (default 4 h, hardened clusters 5 min):
# short here so that the suite shows a held helper stream outlives it.
streamingConnectionIdleTimeout: $stream_idle
# Images are imported, never pulled: keep image GC from deleting them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  nodefs.inodesFree: 1%
  imagefs.available: 1%
EOF
}

# Our own cgroup subtree in every v1 hierarchy (the kubelet requires cgroupRoot to
# exist). cpuset children start empty: copy the parent's cpus/mems.
make_cgroups() {
  local h
  for h in /sys/fs/cgroup/*/; do
    h=${h%/}
    [[ $h == */unified ]] && continue
    [[ -f $h/cgroup.procs ]] || continue
    mkdir -p "$h/$cgroup_root"
    if [[ $h == */cpuset ]]; then
      [[ -s $h/$cgroup_root/cpuset.cpus ]] || cat "$h/cpuset.cpus" >"$h/$cgroup_root/cpuset.cpus"
      [[ -s $h/$cgroup_root/cpuset.mems ]] || cat "$h/cpuset.mems" >"$h/$cgroup_root/cpuset.mems"
    fi
  done
}

# The CNI bridge with the node's address, created before the kubelet starts (the
# bridge plugin reuses it and finds its gateway address already there).
make_bridge() {
  ip link show "$bridge" >/dev/null 2>&1 || ip link add "$bridge" type bridge
  ip -4 addr show dev "$bridge" | grep -qF " $node_ip/" ||
    ip addr add "$node_ip/${pod_cidr#*/}" dev "$bridge"
  ip link set "$bridge" up
  # br_netfilter is loaded with bridge-nf-call-iptables=1 and Docker sets the FORWARD
  # policy to DROP, so bridged pod-to-pod traffic is dropped unless accepted (Docker
  # has the same rule for docker0). One rule, removed by `down`.
  iptables -C "${fwd_rule[@]}" 2>/dev/null || iptables -I "${fwd_rule[0]}" 1 "${fwd_rule[@]:1}"
}

# --- processes ---------------------------------------------------------------

pid_of() { cat "$run/$1.pid" 2>/dev/null || true; }

# running NAME PATTERN: the recorded pid is alive and its argv0 is PATTERN.
running() {
  local pid
  pid=$(pid_of "$1")
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null &&
    [[ $(tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | head -n 1) == "$2" ]]
}

ns_running() { running ns runcell-realnode-ns; }
containerd_running() { running containerd "$(command -v containerd)"; }
kubelet_running() { running kubelet "$kubelet_bin/kubelet"; }

# The namespace holder: a private mount namespace with the mounts described at the
# top, kept alive by `sleep infinity` (argv0 runcell-realnode-ns).
start_ns() {
  ns_running && return
  # the mount points must exist on the host (empty directories)
  [[ -d /run/containerd ]] || { mkdir -p /run/containerd && touch "$rn/created-run-containerd"; }
  [[ -d /var/lib/cni ]] || { mkdir -p /var/lib/cni && touch "$rn/created-var-lib-cni"; }
  # shellcheck disable=SC2016
  (cd / || exit; setsid nohup unshare --mount --propagation private -- bash -c '
    set -e
    rn=$1
    mount -t tmpfs -o mode=0711,size=64m runcell-realnode /run/containerd
    mount --bind "$rn/cni/cache" /var/lib/cni
    for f in "$rn"/sysctl/*; do
      p=${f##*/}
      mount --bind "$f" "/proc/sys/${p//.//}"
    done
    exec -a runcell-realnode-ns sleep infinity
  ' ns "$rn" >"$logs/ns.log" 2>&1 </dev/null 9>&- &
    echo $! >"$run/ns.pid")
  local deadline=$((SECONDS + 10)) pid
  pid=$(pid_of ns)
  until ns_running; do
    kill -0 "$pid" 2>/dev/null || { cat "$logs/ns.log" >&2; die "mount namespace holder exited"; }
    ((SECONDS < deadline)) || die "mount namespace holder did not come up"
    sleep 0.1
  done
  log "started mount namespace holder (pid $pid)"
}

# start_in_ns NAME BINARY ARGS...: detached, in the holder's mount namespace.
start_in_ns() {
  local name=$1 bin=$2
  shift 2
  (cd / || exit; setsid nohup nsenter --mount="/proc/$(pid_of ns)/ns/mnt" -- "$bin" "$@" \
    >"$logs/$name.log" 2>&1 </dev/null 9>&- &
    echo $! >"$run/$name.pid")
  log "started $name (pid $(pid_of "$name"))"
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

# wait_for NAME CHECK SECONDS DESCRIPTION COMMAND...
wait_for() {
  local name=$1 check=$2 secs=$3 what=$4
  shift 4
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    "$check" || fail_with_log "$name" "$name exited while waiting for $what"
    ((SECONDS < deadline)) || fail_with_log "$name" "timed out after ${secs}s waiting for $what"
    sleep 0.5
  done
}

node_ready() {
  [[ $(kubectl get node "$node_name" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]]
}

pause_archive() {
  # OCI layout of a FROM-scratch image with Debian's static catatonit in pause mode.
  local d=$rn/images/pause
  [[ -f $rn/images/pause.tar ]] && return
  command -v catatonit >/dev/null || die "catatonit not found (apt-get install catatonit)"
  rm -rf "$d"
  mkdir -p "$d/rootfs" "$d/oci/blobs/sha256"
  cp "$(command -v catatonit)" "$d/rootfs/pause"
  tar -C "$d/rootfs" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$d/layer.tar" pause
  local layer cfg man
  layer=$(sha256sum <"$d/layer.tar" | cut -d' ' -f1)
  mv "$d/layer.tar" "$d/oci/blobs/sha256/$layer"
  printf '{"architecture":"amd64","os":"linux","config":{"Entrypoint":["/pause","-P"],"User":"65535:65535"},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$layer" >"$d/config.json"
  cfg=$(sha256sum <"$d/config.json" | cut -d' ' -f1)
  mv "$d/config.json" "$d/oci/blobs/sha256/$cfg"
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%d},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:%s","size":%d}]}' \
    "$cfg" "$(stat -c %s "$d/oci/blobs/sha256/$cfg")" "$layer" "$(stat -c %s "$d/oci/blobs/sha256/$layer")" >"$d/manifest.json"
  man=$(sha256sum <"$d/manifest.json" | cut -d' ' -f1)
  printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%d,"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"1"}}]}' \
    "$man" "$(stat -c %s "$d/manifest.json")" "$pause_image" >"$d/oci/index.json"
  mv "$d/manifest.json" "$d/oci/blobs/sha256/$man"
  echo '{"imageLayoutVersion":"1.0.0"}' >"$d/oci/oci-layout"
  tar -C "$d/oci" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$rn/images/pause.tar" .
  rm -rf "$d"
}

import_images() {
  mkdir -p "$rn/images"
  pause_archive
  "${ctr_cmd[@]}" images import "$rn/images/pause.tar" >/dev/null
  local images
  if [[ -n ${RUNCELL_REALNODE_IMAGES:-} ]]; then
    read -ra images <<<"$RUNCELL_REALNODE_IMAGES"
  else
    mapfile -t images < <(docker images --format '{{.Repository}}:{{.Tag}}' | grep '^sandbox-test/' | grep -v ':<none>$' || true)
  fi
  if ((${#images[@]})); then
    local t0=$SECONDS
    docker save "${images[@]}" | "${ctr_cmd[@]}" images import - >/dev/null
    log "imported ${#images[@]} image(s) from Docker in $((SECONDS - t0))s: ${images[*]}"
  fi
}

cmd_up() {
  mkdir -p "$rn" "$run" "$logs"
  [[ -f $cluster_kubeconfig ]] || die "no cluster kubeconfig at $cluster_kubeconfig (run cluster.sh up first)"
  kubectl get --raw /readyz >/dev/null 2>&1 || die "apiserver not ready (run cluster.sh up first)"
  command -v containerd >/dev/null || die "containerd not found"
  [[ $(stat -fc %T /sys/fs/cgroup) == tmpfs ]] || log "warning: not cgroup v1; this script was only tried on cgroup v1"
  build_kubelet
  make_pki
  write_configs
  make_cgroups
  make_bridge

  if ! ns_running; then
    # a new namespace: whatever ran in the old one must go (its mounts go with it)
    stop_processes
    start_ns
  fi
  if ! containerd_running; then
    stop_pid containerd
    start_in_ns containerd "$(command -v containerd)" --config "$rn/etc/containerd.toml"
    wait_for containerd containerd_running 30 "containerd socket" "${ctr_cmd[@]}" version
  fi
  import_images
  if ! kubelet_running; then
    stop_pid kubelet # e.g. an older binary
    start_in_ns kubelet "$kubelet_bin/kubelet" \
      --config "$rn/etc/kubelet.yaml" --kubeconfig "$rn/etc/kubelet.kubeconfig" \
      --root-dir "$rn/kubelet" --cert-dir "$rn/pki" \
      --hostname-override "$node_name" --node-ip "$node_ip" \
      --node-labels "$node_label=true" --v 2
  fi
  local t0=$SECONDS
  wait_for kubelet kubelet_running "$ready_timeout" "node $node_name Ready" node_ready
  log "node $node_name Ready after $((SECONDS - t0))s (kubelet $node_ip:$kubelet_port, containerd $sock)"
  echo "$node_name"
}

# stop_pid NAME: SIGTERM, SIGKILL after 15 s; only if the recorded pid still runs one
# of ours (its command line names our state dir, or it is the namespace holder).
stop_pid() {
  local name=$1 pid cmd deadline=$((SECONDS + 15))
  pid=$(pid_of "$name")
  rm -f "$run/$name.pid"
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
  cmd=$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline")
  [[ $cmd == *"$rn"* || $cmd == runcell-realnode-ns* ]] || return 0
  log "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

# Processes of ours that are not tracked by pid files: containerd shims (started by
# our containerd, found by its socket on their command line) and container processes
# (found in our cgroup subtree).
leftover_pids() {
  local p
  for p in /proc/[0-9]*; do
    tr '\0' ' ' 2>/dev/null <"$p/cmdline" | grep -qF -- "-address $sock " && echo "${p#/proc/}"
  done
  find /sys/fs/cgroup/pids/$cgroup_root -name cgroup.procs -exec cat {} + 2>/dev/null || true
}

# Everything of ours that runs: kubelet, containerd, shims and containers, the holder.
stop_processes() {
  stop_pid kubelet
  stop_pid containerd
  local pids i
  for i in 1 2 3 4 5; do
    pids=$(leftover_pids | sort -u)
    [[ -z $pids ]] && break
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    sleep 0.3
  done
  [[ -n $pids ]] && log "warning: processes still alive: $pids"
  stop_pid ns
}

cmd_down() {
  kubelet_bin=$rn/bin/$(kubelet_key)
  # 1. While the kubelet runs, let it tear the pods down (CNI DEL, volumes).
  if [[ -f $cluster_kubeconfig ]] && kubectl get node "$node_name" >/dev/null 2>&1; then
    local pods
    pods=$(kubectl get pods -A --field-selector "spec.nodeName=$node_name" -o name 2>/dev/null | wc -l)
    if ((pods)); then
      log "deleting $pods pod(s) on $node_name"
      kubectl get pods -A --field-selector "spec.nodeName=$node_name" \
        -o go-template='{{range .items}}{{.metadata.namespace}} {{.metadata.name}}{{"\n"}}{{end}}' |
        while read -r ns name; do
          kubectl -n "$ns" delete pod "$name" --grace-period=2 --wait=false >/dev/null 2>&1 || true
        done
      local deadline=$((SECONDS + 30))
      while kubelet_running && ((SECONDS < deadline)) &&
        [[ -n $(kubectl get pods -A --field-selector "spec.nodeName=$node_name" -o name 2>/dev/null) ]]; do
        sleep 0.5
      done
      # whatever is left (kubelet gone or too slow): remove the objects
      kubectl get pods -A --field-selector "spec.nodeName=$node_name" \
        -o go-template='{{range .items}}{{.metadata.namespace}} {{.metadata.name}}{{"\n"}}{{end}}' |
        while read -r ns name; do
          kubectl -n "$ns" delete pod "$name" --grace-period=0 --force >/dev/null 2>&1 || true
        done
    fi
  fi
  # 2. Processes: kubelet, containerd, shims and containers, then the namespace.
  stop_processes
  # 3. The Node object.
  if [[ -f $cluster_kubeconfig ]] && kubectl get node "$node_name" >/dev/null 2>&1; then
    kubectl delete node "$node_name" --wait=false >/dev/null && log "deleted node $node_name"
  fi
  # 4. Host leftovers: the bridge, the cgroup subtree, host-namespace mounts under
  #    our dir (there should be none), the mount points we created.
  while iptables -D "${fwd_rule[@]}" 2>/dev/null; do log "removed iptables rule: ${fwd_rule[*]}"; done
  if ip link show "$bridge" >/dev/null 2>&1; then
    ip link del "$bridge" && log "removed bridge $bridge"
  fi
  local h
  for h in /sys/fs/cgroup/*/"$cgroup_root"; do
    [[ -d $h ]] || continue
    find "$h" -depth -type d -exec rmdir {} + 2>/dev/null || log "warning: could not remove cgroup $h"
  done
  local m
  while read -r m; do
    [[ -n $m ]] && umount -l "$m" && log "unmounted $m"
  done < <(findmnt -rn -o TARGET | grep -F "$rn/" | sort -r)
  if [[ -f $rn/created-var-lib-cni ]]; then rmdir /var/lib/cni 2>/dev/null || true; rm -f "$rn/created-var-lib-cni"; fi
  if [[ -f $rn/created-run-containerd ]]; then rmdir /run/containerd 2>/dev/null || true; rm -f "$rn/created-run-containerd"; fi
  # 5. Runtime state (containerd's root is re-created and re-imported by `up`).
  rm -rf "$rn/containerd" "$rn/kubelet" "$rn/pod-logs" "$rn/cni" "$rn/sysctl" "$run" "$rn/images" "$rn/etc"
  log "real node down (kept $rn/bin, $rn/src, $rn/pki, $rn/logs)"
}

cmd_status() {
  kubelet_bin=$rn/bin/$(kubelet_key)
  local up=0
  ns_running && echo "namespace holder: running (pid $(pid_of ns))" || { echo "namespace holder: stopped"; up=1; }
  containerd_running && echo "containerd: running (pid $(pid_of containerd))" || { echo "containerd: stopped"; up=1; }
  kubelet_running && echo "kubelet: running (pid $(pid_of kubelet))" || { echo "kubelet: stopped"; up=1; }
  if [[ -f $cluster_kubeconfig ]] && node_ready; then
    echo "node $node_name: Ready"
  else
    echo "node $node_name: not Ready"
    up=1
  fi
  return $up
}

lock() {
  mkdir -p "$rn"
  exec 9>"$rn/.lock"
  flock 9
}

case ${1:-} in
up) lock && cmd_up ;;
down) lock && cmd_down ;;
status) cmd_status ;;
*)
  echo "usage: $0 up|down|status" >&2
  exit 2
  ;;
esac
