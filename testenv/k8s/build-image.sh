#!/usr/bin/env bash
# Builds the local smoke-test image sandbox-test/busybox:latest (no registry needed):
# FROM scratch plus Debian's static busybox, with applet symlinks in /bin.
# Usage: build-image.sh [--force]
set -euo pipefail
image=${RUNCELL_TEST_IMAGE:-sandbox-test/busybox:latest}
if [[ ${1:-} != --force ]] && docker image inspect "$image" >/dev/null 2>&1; then
  echo "$image already present"
  exit 0
fi
busybox=${BUSYBOX:-/bin/busybox}
if ! file -L "$busybox" 2>/dev/null | grep -q 'statically linked' && ! ldd "$busybox" 2>&1 | grep -q 'not a dynamic'; then
  echo "error: $busybox is not a static binary (apt-get install busybox-static)" >&2
  exit 1
fi
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
cp "$busybox" "$ctx/busybox"
cat > "$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY busybox /bin/busybox
RUN ["/bin/busybox", "mkdir", "-p", "/tmp", "/usr/bin", "/sbin", "/usr/sbin", "/root", "/etc"]
RUN ["/bin/busybox", "chmod", "1777", "/tmp"]
RUN ["/bin/busybox", "--install", "-s", "/bin"]
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
CMD ["/bin/sh"]
DOCKERFILE
if ! DOCKER_BUILDKIT=0 docker build -q -t "$image" "$ctx" >"$ctx/build.log" 2>&1; then
  cat "$ctx/build.log" >&2
  exit 1
fi
echo "built $image"
