module sandbox.local/testenv/k8s/node

go 1.26.0

require (
	github.com/docker/docker v28.5.2+incompatible // indirect
	github.com/virtual-kubelet/virtual-kubelet v1.14.1 // indirect
)
