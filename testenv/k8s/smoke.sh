#!/usr/bin/env bash
# Smoke test of the test cluster (run after `cluster.sh up`), using the stock
# kubectl built with the cluster and the local image sandbox-test/busybox:latest.
#
# Usage: smoke.sh [KUBECONFIG]
#   default kubeconfig: $RUNCELL_TESTENV_STATE/kubeconfig (state dir as in cluster.sh)
#   KUBECTL=...   kubectl binary (default: the one cluster.sh built)
# Prints one line per check and "N passed, N failed" at the end; exits 1 on failure.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/../.." && pwd))
state=${RUNCELL_TESTENV_STATE:-$repo/target/k8s}
kubeconfig=${1:-$state/kubeconfig}
image=${RUNCELL_TEST_IMAGE:-sandbox-test/busybox:latest}
kubectl_bin=${KUBECTL:-$(ls -t "$state"/bin/controlplane-*/kubectl 2>/dev/null | head -n 1)}
node=${RUNCELL_REALNODE_NAME:-runcell-real-node}
# The node's containerd (realnode.sh): its containers, by pod label.
ctr_bin=$(command -v ctr || echo ctr)
containers() { # LABEL VALUE: ids of the node's containers whose io.kubernetes.pod.LABEL is VALUE
  "$ctr_bin" -a "$state/realnode/run/containerd.sock" -n k8s.io containers ls -q "labels.\"io.kubernetes.pod.$1\"==$2"
}
# The kubelet stops a deleted pod's containers at once and removes them at its next
# container GC (about a minute): what must be gone at once is every running task.
running_tasks() { # LABEL VALUE
  local ids
  ids=$(containers "$@")
  [[ -z $ids ]] && return 0
  "$ctr_bin" -a "$state/realnode/run/containerd.sock" -n k8s.io tasks ls |
    awk 'NR > 1 && $3 == "RUNNING" { print $1 }' | grep -Fx -f <(echo "$ids")
}
nothing_runs() { [[ -z $(running_tasks "$@") ]]; } # polled: evaluated on every try
ns=smoke-$(date +%s)-$$

[[ -f $kubeconfig ]] || { echo "smoke: no kubeconfig at $kubeconfig (run cluster.sh up)" >&2; exit 1; }
[[ -x $kubectl_bin ]] || { echo "smoke: kubectl not found (set KUBECTL=...)" >&2; exit 1; }
k() { "$kubectl_bin" --kubeconfig "$kubeconfig" "$@"; }
kn() { k -n "$ns" "$@"; }

passed=0
failed=0
ok() { echo "PASS: $*"; passed=$((passed + 1)); }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }

# check NAME COMMAND...: run a check function, report PASS/FAIL.
check() {
  local name=$1 out
  shift
  if out=$("$@" 2>&1); then
    ok "$name"
  else
    fail "$name"
    [[ -n $out ]] && sed 's/^/    /' <<<"$out"
  fi
}

# poll SECONDS COMMAND...: retry COMMAND every 0.5 s until it succeeds.
poll() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 0.5
  done
}

pod_yaml() { # NAME [EXTRA SPEC LINES]
  cat <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $1
  namespace: $ns
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 2
$2
  containers:
  - name: main
    image: $image
    imagePullPolicy: Never
    command: ["sleep", "infinity"]
EOF
}

# --- checks -------------------------------------------------------------------

t_node_ready() {
  local s
  s=$(k get node "$node" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')
  [[ $s == True ]] || { echo "node $node Ready=$s"; return 1; }
}

t_image_present() {
  docker image inspect "$image" >/dev/null 2>&1 || "$here/build-image.sh" || return 1
  docker image inspect "$image" >/dev/null
}

t_pod_running() {
  pod_yaml sleeper "  shareProcessNamespace: true" | kn apply -f - >/dev/null || return 1
  if ! kn wait --for=condition=Ready pod/sleeper --timeout=60s >/dev/null; then
    kn get pod sleeper -o wide
    kn get pod sleeper -o 'jsonpath={.status.containerStatuses}'
    return 1
  fi
  [[ $(kn get pod sleeper -o 'jsonpath={.status.phase}') == Running ]]
}

t_exec_stdin_echo() {
  local out
  out=$(echo hello | timeout 30 "$kubectl_bin" --kubeconfig "$kubeconfig" -n "$ns" exec -i sleeper -- cat) || return 1
  [[ $out == hello ]] || { echo "got: $out"; return 1; }
}

t_exec_stdin_eof() {
  # wc only prints after EOF on stdin: proves the client's stdin close reaches it.
  local out
  out=$(printf 'a\nb\nc\n' | timeout 30 "$kubectl_bin" --kubeconfig "$kubeconfig" -n "$ns" exec -i sleeper -- wc -l) ||
    { echo "exec failed or hung (rc=$?)"; return 1; }
  [[ $(tr -d ' ' <<<"$out") == 3 ]] || { echo "got: $out"; return 1; }
}

t_exec_exit_code() {
  timeout 30 "$kubectl_bin" --kubeconfig "$kubeconfig" -n "$ns" exec sleeper -- sh -c 'exit 3' >/dev/null 2>&1
  local rc=$?
  [[ $rc == 3 ]] || { echo "exit code $rc, want 3"; return 1; }
}

t_exec_streams_apart() {
  local out err
  out=$(kn exec sleeper -- sh -c 'echo out; echo err >&2' 2>/dev/null) || return 1
  err=$(kn exec sleeper -- sh -c 'echo out; echo err >&2' 2>&1 1>/dev/null) || return 1
  [[ $out == out ]] || { echo "stdout: $out"; return 1; }
  [[ $err == err ]] || { echo "stderr: $err"; return 1; }
}

t_pid1_reaps() {
  # An orphaned child must be reaped by PID 1 (pause, in a shared PID namespace as
  # runcell's pods have), not left a zombie.
  kn exec sleeper -- sh -c '(sleep 0.1 &) ; sleep 0.5' || return 1
  local z
  z=$(kn exec sleeper -- sh -c "ps -o stat | grep -c '^Z' || true")
  [[ $z == 0 ]] || { echo "$z zombie(s)"; return 1; }
}

t_delete_removes_container() {
  local uid
  uid=$(kn get pod sleeper -o 'jsonpath={.metadata.uid}') || return 1
  [[ -n $(containers uid "$uid") ]] || { echo "no container for pod uid $uid"; return 1; }
  kn delete pod sleeper --timeout=60s >/dev/null || return 1
  poll 30 nothing_runs uid "$uid" ||
    { echo "a container of pod uid $uid still runs"; return 1; }
}

t_deadline_exceeded() {
  pod_yaml deadline "  activeDeadlineSeconds: 5" | kn apply -f - >/dev/null || return 1
  deadline_failed() {
    [[ $(kn get pod deadline -o 'jsonpath={.status.phase}/{.status.reason}') == Failed/DeadlineExceeded ]]
  }
  poll 45 deadline_failed || { kn get pod deadline -o 'jsonpath={.status}'; return 1; }
}

t_missing_image() {
  pod_yaml noimage "" | sed "s|image: $image|image: sandbox-test/no-such-image:0|" | kn apply -f - >/dev/null || return 1
  waiting_reason() {
    local r
    r=$(kn get pod noimage -o 'jsonpath={.status.containerStatuses[0].state.waiting.reason}')
    [[ $r == ErrImagePull || $r == ImagePullBackOff || $r == ErrImageNeverPull ]] &&
      kn get pod noimage -o 'jsonpath={.status.containerStatuses[0].state.waiting.message}' | grep -q no-such-image
  }
  poll 30 waiting_reason || { kn get pod noimage -o 'jsonpath={.status}'; return 1; }
}

t_namespace_delete() {
  pod_yaml last "" | kn apply -f - >/dev/null || return 1
  kn wait --for=condition=Ready pod/last --timeout=60s >/dev/null || return 1
  k delete namespace "$ns" --wait=false >/dev/null || return 1
  ns_gone() { ! k get namespace "$ns" >/dev/null 2>&1; }
  poll 120 ns_gone || { k get namespace "$ns" -o 'jsonpath={.status}'; return 1; }
  poll 30 nothing_runs namespace "$ns" ||
    { echo "containers of namespace $ns still run"; return 1; }
}

cleanup() { k delete namespace "$ns" --wait=false >/dev/null 2>&1 || true; }
trap cleanup EXIT

echo "smoke: kubeconfig $kubeconfig, namespace $ns, image $image"
check "node $node is Ready" t_node_ready
check "image $image exists locally (built if missing)" t_image_present
k create namespace "$ns" >/dev/null || fail "create namespace $ns"
poll 30 kn get serviceaccount default || fail "default ServiceAccount in $ns"
check "pod 'sleep infinity' reaches Running" t_pod_running
check "exec -i echoes stdin (echo hello | exec -i cat)" t_exec_stdin_echo
check "exec stdin EOF reaches the process (wc -l)" t_exec_stdin_eof
check "exec exit code 3 is returned" t_exec_exit_code
check "exec keeps stdout and stderr apart" t_exec_streams_apart
check "PID 1 reaps orphaned children" t_pid1_reaps
check "deleting the pod stops its containers" t_delete_removes_container
check "activeDeadlineSeconds: 5 ends Failed/DeadlineExceeded" t_deadline_exceeded
check "missing image reports ErrImageNeverPull (pull policy Never) or ErrImagePull/ImagePullBackOff" t_missing_image
check "namespace deletion completes and stops its containers" t_namespace_delete

echo "$passed passed, $failed failed"
((failed == 0))
