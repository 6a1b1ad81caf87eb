// Command sandbox-node runs a virtual-kubelet node whose pods are Docker
// containers on the local daemon (see package provider). It registers one node,
// serves the kubelet API (exec, logs) over HTTPS on loopback and keeps the node
// Ready through status updates and a node Lease.
package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"flag"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/virtual-kubelet/virtual-kubelet/log"
	logruslogger "github.com/virtual-kubelet/virtual-kubelet/log/logrus"
	"github.com/virtual-kubelet/virtual-kubelet/node"
	"github.com/virtual-kubelet/virtual-kubelet/node/nodeutil"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"sandbox.local/testenv/k8s/node/provider"
)

func main() {
	var (
		kubeconfig     = flag.String("kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig of the node's API identity")
		nodeName       = flag.String("node-name", "sandbox-node", "name of the Kubernetes node")
		listenAddr     = flag.String("listen-addr", "127.0.0.1:10250", "address of the kubelet API (HTTPS)")
		stateDir       = flag.String("state-dir", "/tmp/sandbox-node", "directory for pod volumes")
		clientCA       = flag.String("client-ca-file", "", "if set, require client certificates signed by this CA on the kubelet API")
		tlsCert        = flag.String("tls-cert-file", "", "serving certificate (default: self-signed, generated at start)")
		tlsKey         = flag.String("tls-key-file", "", "serving key")
		cpu            = flag.String("cpu", strconv.Itoa(runtime.NumCPU()), "allocatable CPU")
		memory         = flag.String("memory", "8Gi", "allocatable memory")
		maxPods        = flag.String("pods", "110", "maximum number of pods")
		kubeletVersion = flag.String("kubelet-version", "v1.36.3", "version reported in node.status.nodeInfo")
		verbose        = flag.Bool("v", false, "debug logging")
	)
	flag.Parse()

	logger := logrus.StandardLogger()
	if *verbose {
		logger.SetLevel(logrus.DebugLevel)
	}
	log.L = logruslogger.FromLogrus(logrus.NewEntry(logger))

	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer cancel()

	if err := run(ctx, options{
		kubeconfig: *kubeconfig, nodeName: *nodeName, listenAddr: *listenAddr, stateDir: *stateDir,
		clientCA: *clientCA, tlsCert: *tlsCert, tlsKey: *tlsKey,
		cpu: *cpu, memory: *memory, pods: *maxPods, kubeletVersion: *kubeletVersion,
	}); err != nil {
		log.G(ctx).WithError(err).Error("sandbox-node failed")
		os.Exit(1)
	}
}

type options struct {
	kubeconfig, nodeName, listenAddr, stateDir string
	clientCA, tlsCert, tlsKey                  string
	cpu, memory, pods, kubeletVersion          string
}

func run(ctx context.Context, o options) error {
	host, portStr, err := net.SplitHostPort(o.listenAddr)
	if err != nil {
		return fmt.Errorf("--listen-addr: %w", err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return fmt.Errorf("--listen-addr port: %w", err)
	}
	capacity := corev1.ResourceList{}
	for name, val := range map[corev1.ResourceName]string{
		corev1.ResourceCPU: o.cpu, corev1.ResourceMemory: o.memory, corev1.ResourcePods: o.pods,
	} {
		q, err := resource.ParseQuantity(val)
		if err != nil {
			return fmt.Errorf("capacity %s=%q: %w", name, val, err)
		}
		capacity[name] = q
	}

	// nodeutil.NewNode builds a default client from $KUBECONFIG before applying
	// options; point it at our kubeconfig so it does not warn about in-cluster config.
	if o.kubeconfig != "" {
		os.Setenv("KUBECONFIG", o.kubeconfig)
	}
	clientset, err := nodeutil.ClientsetFromEnv(o.kubeconfig)
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}

	var prov *provider.Provider
	mux := http.NewServeMux()
	n, err := nodeutil.NewNode(o.nodeName,
		func(pc nodeutil.ProviderConfig) (nodeutil.Provider, node.NodeProvider, error) {
			configureNode(pc.Node, host, int32(port), capacity, o.kubeletVersion)
			p, err := provider.New(ctx, provider.Config{
				NodeName:   o.nodeName,
				StateDir:   o.stateDir,
				Secrets:    pc.Secrets,
				ConfigMaps: pc.ConfigMaps,
				ForceDelete: func(ctx context.Context, namespace, name string, uid types.UID) error {
					opts := metav1.DeleteOptions{
						GracePeriodSeconds: new(int64),
						Preconditions:      metav1.NewUIDPreconditions(string(uid)),
					}
					err := clientset.CoreV1().Pods(namespace).Delete(ctx, name, opts)
					if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
						return nil // already gone, or a new pod of the same name
					}
					return err
				},
			})
			prov = p
			// A nil NodeProvider makes nodeutil use its naive one, which marks the
			// node Ready once the controllers run and keeps status and Lease fresh.
			return p, nil, err
		},
		nodeutil.WithClient(statusPatching{clientset}),
		func(cfg *nodeutil.NodeConfig) error {
			cfg.HTTPListenAddr = o.listenAddr
			cfg.Handler = mux
			cfg.NumWorkers = 4
			cfg.InformerResyncPeriod = time.Minute
			cfg.StreamIdleTimeout = 4 * time.Hour // long-running interactive execs
			cfg.StreamCreationTimeout = 30 * time.Second
			return nil
		},
		nodeutil.AttachProviderRoutes(mux),
		nodeutil.WithTLSConfig(tlsOptions(o, host)...),
	)
	if err != nil {
		return err
	}

	go prov.Run(ctx)
	go func() {
		if err := n.WaitReady(ctx, 2*time.Minute); err != nil {
			log.G(ctx).WithError(err).Error("node did not become ready")
			return
		}
		log.G(ctx).WithField("node", o.nodeName).Info("node ready")
	}()
	return n.Run(ctx)
}

// configureNode fills in what the scheduler and the apiserver need: capacity,
// addresses (InternalIP for the apiserver's exec/logs proxy), the daemon port,
// node info and conditions other than Ready (set by nodeutil).
func configureNode(n *corev1.Node, ip string, port int32, capacity corev1.ResourceList, version string) {
	n.Labels["kubernetes.io/os"] = "linux"
	n.Labels["kubernetes.io/arch"] = runtime.GOARCH
	n.Labels["node.kubernetes.io/instance-type"] = "sandbox-docker"
	n.Spec.Taints = nil
	n.Status.Capacity = capacity
	n.Status.Allocatable = capacity.DeepCopy()
	n.Status.Addresses = []corev1.NodeAddress{
		{Type: corev1.NodeInternalIP, Address: ip},
		{Type: corev1.NodeHostName, Address: n.Name},
	}
	n.Status.DaemonEndpoints.KubeletEndpoint.Port = port
	n.Status.NodeInfo = corev1.NodeSystemInfo{
		OperatingSystem:         "linux",
		Architecture:            runtime.GOARCH,
		KubeletVersion:          version,
		ContainerRuntimeVersion: "docker://local",
		KernelVersion:           kernelVersion(),
	}
	now := metav1.Now()
	for i := range n.Status.Conditions {
		c := &n.Status.Conditions[i]
		if c.Type == corev1.NodeReady {
			continue
		}
		c.Status = corev1.ConditionFalse
		c.Reason = "Sandbox" + string(c.Type) + "False"
		c.LastHeartbeatTime, c.LastTransitionTime = now, now
	}
}

func kernelVersion() string {
	b, err := os.ReadFile("/proc/sys/kernel/osrelease")
	if err != nil {
		return ""
	}
	return string(b[:len(b)-1])
}

// tlsOptions returns the serving certificate (given or self-signed) and, if a
// client CA is configured, client-certificate verification.
func tlsOptions(o options, host string) []func(*tls.Config) error {
	var opts []func(*tls.Config) error
	if o.tlsCert != "" {
		opts = append(opts, nodeutil.WithKeyPairFromPath(o.tlsCert, o.tlsKey))
	} else {
		opts = append(opts, func(c *tls.Config) error {
			cert, err := selfSigned(host)
			if err != nil {
				return err
			}
			c.Certificates = append(c.Certificates, cert)
			return nil
		})
	}
	if o.clientCA != "" {
		opts = append(opts, nodeutil.WithCAFromPath(o.clientCA))
	}
	return opts
}

// selfSigned makes an in-memory ECDSA certificate for the listen address. The
// apiserver does not verify kubelet serving certificates unless it is started
// with --kubelet-certificate-authority.
func selfSigned(host string) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: "sandbox-node"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     []string{"localhost"},
	}
	if ip := net.ParseIP(host); ip != nil {
		tmpl.IPAddresses = []net.IP{ip}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}
