#!/usr/bin/env bash
# Builds the upstream control-plane binaries of this module into $1.
# Usage: build.sh OUT_DIR
set -euo pipefail
out=${1:?usage: build.sh OUT_DIR}
cd "$(dirname "$0")"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
mkdir -p "$out"
# Stamp the release version the way Kubernetes' hack/lib/version.sh does, so that
# /version and `kubectl version` report v1.36.3 rather than v0.0.0-master.
k8s_version=$("$GO" list -m -f '{{.Version}}' k8s.io/kubernetes)
minor=${k8s_version#v1.}; minor=${minor%%.*}
ld="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ld+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
flags=(-trimpath -tags selinux,notest -ldflags "$ld")
for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  echo "building $cmd" >&2
  "$GO" build "${flags[@]}" -o "$out/$cmd" "k8s.io/kubernetes/cmd/$cmd"
done
echo "building etcd" >&2
"$GO" build "${flags[@]}" -o "$out/etcd" ./cmd/etcd
