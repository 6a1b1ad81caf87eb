// Package provider is a virtual-kubelet provider that runs each pod's containers
// as local Docker containers. It exists only to give tests a real Kubernetes node
// on a single machine without a kubelet or a container registry.
//
// Design notes:
//   - Every container is created with NetworkMode "none", Docker's init process as
//     PID 1 (Init: true) and labels naming the pod (see labels.go) so that the
//     containers of this provider can always be found again.
//   - Images are pulled only from registries on loopback (127.0.0.0/8, ::1,
//     localhost), with the credentials of the pod's imagePullSecrets, so that no test
//     sends traffic off the machine; other images are never pulled. As a kubelet would,
//     a failed pull leaves the container Waiting with ErrImagePull, then
//     ImagePullBackOff, and a reference that does not parse
//     leaves the container Waiting with reason InvalidImageName; a missing image with
//     reason ErrImageNeverPull (pull policy Never) or ErrImagePull (first attempt) and
//     then ImagePullBackOff (retries).
//   - terminationMessagePolicy FallbackToLogsOnError: a container that exited non-zero
//     gets the tail of its logs as its termination message (80 lines, 2048 bytes).
//   - Pod status is derived from `docker inspect` on every evaluation and pushed to
//     virtual-kubelet through NotifyPods, triggered by Docker events and by a
//     periodic resync.
//   - Restart behaviour: containers left by an earlier provider process are ADOPTED
//     when Kubernetes still has the pod (same pod UID and container name), and
//     REMOVED by the garbage collector otherwise (see gc.go).
package provider

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/docker/docker/client"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/log"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	corev1listers "k8s.io/client-go/listers/core/v1"
)

// Config holds what the provider needs from its caller.
type Config struct {
	// NodeName is the Kubernetes node this provider backs; it is also written into
	// the container labels so that several nodes could share one Docker daemon.
	NodeName string
	// StateDir holds per-pod volume directories (StateDir/pods/<uid>/volumes/...).
	StateDir string
	// Listers for the objects that volumes refer to.
	Secrets    corev1listers.SecretLister
	ConfigMaps corev1listers.ConfigMapLister
	// ForceDelete, if set, removes a pod object from the API once its containers are
	// gone (grace period 0, UID precondition), as the kubelet does. Without it,
	// virtual-kubelet only removes the pod after the full deletion grace period.
	ForceDelete func(ctx context.Context, namespace, name string, uid types.UID) error
}

// Provider implements nodeutil.Provider and node.PodNotifier on top of Docker.
type Provider struct {
	cfg    Config
	docker *client.Client

	mu     sync.Mutex
	pods   map[string]*podRecord // keyed by "namespace/name"
	notify func(*corev1.Pod)     // set by NotifyPods
}

// podRecord is what the provider knows about one pod.
type podRecord struct {
	pod *corev1.Pod // the pod as last given by CreatePod/UpdatePod (spec and metadata)

	// containerIDs maps container name to Docker container ID once created.
	containerIDs map[string]string
	// waiting holds the Waiting state of containers that could not be created yet.
	waiting map[string]corev1.ContainerStateWaiting

	startTime        metav1.Time
	deadlineTimer    *time.Timer
	deadlineExceeded bool
	initFailed       bool // an init container exited non-zero
	deleted          bool
	cancelStart      context.CancelFunc // stops the asynchronous start loop

	// logTails caches the FallbackToLogsOnError message of failed containers, by ID.
	logTails map[string]string

	// lastStatus keeps condition transition times stable between evaluations.
	lastStatus *corev1.PodStatus
}

// New connects to the Docker daemon (DOCKER_HOST etc. from the environment) with API
// version negotiation, so that old daemons such as Debian's 20.10 (API 1.41) work.
func New(ctx context.Context, cfg Config) (*Provider, error) {
	if cfg.NodeName == "" || cfg.StateDir == "" {
		return nil, errors.New("provider: NodeName and StateDir are required")
	}
	dc, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		return nil, fmt.Errorf("docker client: %w", err)
	}
	if _, err := dc.Ping(ctx); err != nil {
		return nil, fmt.Errorf("docker daemon not reachable: %w", err)
	}
	if err := os.MkdirAll(filepath.Join(cfg.StateDir, "pods"), 0o755); err != nil {
		return nil, err
	}
	return &Provider{
		cfg:    cfg,
		docker: dc,
		pods:   map[string]*podRecord{},
	}, nil
}

// Run starts the background loops (Docker event watch, periodic resync, garbage
// collection). It returns when ctx is cancelled.
func (p *Provider) Run(ctx context.Context) {
	go p.watchEvents(ctx)
	go p.collectGarbage(ctx)
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			p.notifyAll(ctx)
		}
	}
}

func podKey(namespace, name string) string { return namespace + "/" + name }

// CreatePod registers the pod and starts its containers asynchronously; errors in
// the spec that can never succeed are returned immediately.
func (p *Provider) CreatePod(ctx context.Context, pod *corev1.Pod) error {
	if err := validatePod(pod); err != nil {
		return errdefs.AsInvalidInput(err)
	}
	key := podKey(pod.Namespace, pod.Name)

	p.mu.Lock()
	if old, ok := p.pods[key]; ok && old.pod.UID == pod.UID {
		p.mu.Unlock()
		return p.UpdatePod(ctx, pod)
	}
	startCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	rec := &podRecord{
		pod:          pod.DeepCopy(),
		containerIDs: map[string]string{},
		waiting:      map[string]corev1.ContainerStateWaiting{},
		startTime:    metav1.Now(),
		cancelStart:  cancel,
	}
	if pod.Status.StartTime != nil { // keep the original start time across provider restarts
		rec.startTime = *pod.Status.StartTime
	}
	for _, c := range pod.Spec.Containers {
		rec.waiting[c.Name] = corev1.ContainerStateWaiting{Reason: "ContainerCreating"}
	}
	p.pods[key] = rec
	p.armDeadlineLocked(key, rec)
	p.mu.Unlock()

	go p.startPod(startCtx, key, rec)
	p.notifyPod(ctx, key)
	return nil
}

// UpdatePod accepts the mutable parts of a pod (labels, annotations, images,
// activeDeadlineSeconds). Only the deadline has an effect on running containers.
func (p *Provider) UpdatePod(ctx context.Context, pod *corev1.Pod) error {
	key := podKey(pod.Namespace, pod.Name)
	p.mu.Lock()
	rec, ok := p.pods[key]
	if !ok || rec.pod.UID != pod.UID {
		p.mu.Unlock()
		return errdefs.NotFoundf("pod %s not known to the provider", key)
	}
	rec.pod = pod.DeepCopy()
	p.armDeadlineLocked(key, rec)
	p.mu.Unlock()
	p.notifyPod(ctx, key)
	return nil
}

// DeletePod stops and removes the pod's containers (found by pod UID label, so it
// also works for pods this process never saw) and its volume directories, then
// reports a terminal status.
func (p *Provider) DeletePod(ctx context.Context, pod *corev1.Pod) error {
	key := podKey(pod.Namespace, pod.Name)
	grace := int64(2)
	if pod.DeletionGracePeriodSeconds != nil && *pod.DeletionGracePeriodSeconds < grace {
		grace = *pod.DeletionGracePeriodSeconds
	}

	p.mu.Lock()
	rec, known := p.pods[key]
	if known && rec.pod.UID == pod.UID {
		rec.deleted = true
		rec.cancelStart()
		if rec.deadlineTimer != nil {
			rec.deadlineTimer.Stop()
		}
	} else {
		known = false
	}
	p.mu.Unlock()

	// Final status is computed while the containers still exist (stopped).
	if err := p.stopPodContainers(ctx, pod.UID, int(grace)); err != nil {
		return err
	}
	final := pod.DeepCopy()
	if known {
		final.Status = *p.computeStatus(ctx, rec)
	}
	if err := p.removePodContainers(ctx, pod.UID); err != nil {
		return err
	}
	if err := os.RemoveAll(p.podDir(pod.UID)); err != nil {
		return fmt.Errorf("removing volumes of %s: %w", key, err)
	}

	p.mu.Lock()
	if cur, ok := p.pods[key]; ok && cur.pod.UID == pod.UID {
		delete(p.pods, key)
	}
	notify := p.notify
	p.mu.Unlock()

	if notify != nil {
		terminalize(final)
		notify(final)
	}
	log.G(ctx).WithField("pod", key).Info("pod deleted from docker")
	if p.cfg.ForceDelete != nil && pod.DeletionTimestamp != nil {
		if err := p.cfg.ForceDelete(ctx, pod.Namespace, pod.Name, pod.UID); err != nil {
			log.G(ctx).WithError(err).WithField("pod", key).Warn("removing pod object; virtual-kubelet will retry after the grace period")
		}
	}
	return nil
}

// GetPod returns the pod with its current status, or NotFound.
func (p *Provider) GetPod(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	p.mu.Lock()
	rec, ok := p.pods[podKey(namespace, name)]
	p.mu.Unlock()
	if !ok {
		return nil, errdefs.NotFoundf("pod %s/%s not found", namespace, name)
	}
	pod := rec.snapshotPod(&p.mu)
	pod.Status = *p.computeStatus(ctx, rec)
	return pod, nil
}

// GetPodStatus returns the current status of a pod, or NotFound.
func (p *Provider) GetPodStatus(ctx context.Context, namespace, name string) (*corev1.PodStatus, error) {
	pod, err := p.GetPod(ctx, namespace, name)
	if err != nil {
		return nil, err
	}
	return &pod.Status, nil
}

// GetPods returns every pod the provider currently tracks.
func (p *Provider) GetPods(ctx context.Context) ([]*corev1.Pod, error) {
	p.mu.Lock()
	keys := make([]string, 0, len(p.pods))
	for k := range p.pods {
		keys = append(keys, k)
	}
	p.mu.Unlock()
	out := make([]*corev1.Pod, 0, len(keys))
	for _, k := range keys {
		ns, name := splitKey(k)
		if pod, err := p.GetPod(ctx, ns, name); err == nil {
			out = append(out, pod)
		}
	}
	return out, nil
}

// NotifyPods registers virtual-kubelet's status callback (node.PodNotifier).
func (p *Provider) NotifyPods(_ context.Context, f func(*corev1.Pod)) {
	p.mu.Lock()
	p.notify = f
	p.mu.Unlock()
}

// notifyPod pushes the current status of one pod to virtual-kubelet.
func (p *Provider) notifyPod(ctx context.Context, key string) {
	p.mu.Lock()
	notify := p.notify
	rec, ok := p.pods[key]
	p.mu.Unlock()
	if notify == nil || !ok {
		return
	}
	pod := rec.snapshotPod(&p.mu)
	pod.Status = *p.computeStatus(ctx, rec)
	notify(pod)
}

func (p *Provider) notifyAll(ctx context.Context) {
	p.mu.Lock()
	keys := make([]string, 0, len(p.pods))
	for k, rec := range p.pods {
		if !rec.deleted {
			keys = append(keys, k)
		}
	}
	p.mu.Unlock()
	for _, k := range keys {
		p.notifyPod(ctx, k)
	}
}

// armDeadlineLocked (re)starts the activeDeadlineSeconds timer. Caller holds p.mu.
func (p *Provider) armDeadlineLocked(key string, rec *podRecord) {
	if rec.deadlineTimer != nil {
		rec.deadlineTimer.Stop()
		rec.deadlineTimer = nil
	}
	ads := rec.pod.Spec.ActiveDeadlineSeconds
	if ads == nil || rec.deadlineExceeded || rec.deleted {
		return
	}
	remaining := time.Until(rec.startTime.Add(time.Duration(*ads) * time.Second))
	if remaining < 0 {
		remaining = 0
	}
	rec.deadlineTimer = time.AfterFunc(remaining, func() { p.enforceDeadline(key, rec) })
}

// enforceDeadline does what the kubelet does when activeDeadlineSeconds passes:
// kill the containers and mark the pod Failed with reason DeadlineExceeded.
func (p *Provider) enforceDeadline(key string, rec *podRecord) {
	ctx := context.Background()
	p.mu.Lock()
	if rec.deleted || rec.deadlineExceeded {
		p.mu.Unlock()
		return
	}
	rec.deadlineExceeded = true
	rec.cancelStart()
	uid := rec.pod.UID
	p.mu.Unlock()

	log.G(ctx).WithField("pod", key).Info("activeDeadlineSeconds exceeded, killing containers")
	if err := p.stopPodContainers(ctx, uid, 0); err != nil {
		log.G(ctx).WithError(err).WithField("pod", key).Warn("stopping containers after deadline")
	}
	p.notifyPod(ctx, key)
}

// snapshotPod returns a deep copy of the record's pod under the lock.
func (r *podRecord) snapshotPod(mu *sync.Mutex) *corev1.Pod {
	mu.Lock()
	defer mu.Unlock()
	return r.pod.DeepCopy()
}

func splitKey(key string) (namespace, name string) {
	namespace, name, _ = strings.Cut(key, "/")
	return namespace, name
}

// validatePod rejects pod features this provider cannot honour at all, so that the
// pod fails visibly instead of running with a silently different meaning.
func validatePod(pod *corev1.Pod) error {
	if pod.Spec.HostNetwork || pod.Spec.HostPID || pod.Spec.HostIPC {
		return errors.New("hostNetwork/hostPID/hostIPC are not supported by the docker test provider")
	}
	if len(pod.Spec.EphemeralContainers) > 0 {
		return errors.New("ephemeral containers are not supported by the docker test provider")
	}
	for _, v := range pod.Spec.Volumes {
		if err := supportedVolume(v); err != nil {
			return err
		}
	}
	return nil
}
