// Command etcd is the stock etcd server (go.etcd.io/etcd/server/v3/etcdmain),
// built from the version in Kubernetes' module graph.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
