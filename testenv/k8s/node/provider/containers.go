package provider

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/distribution/reference"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/api/types/mount"
	"github.com/docker/docker/client"
	"github.com/virtual-kubelet/virtual-kubelet/log"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// errWaiting means a container could not be created yet; its Waiting state has
// been recorded and the start loop should retry later.
var errWaiting = errors.New("container waiting")

// startPod materialises the volumes, runs the init containers to completion and
// then creates and starts the app containers. Transient failures (missing image,
// missing Secret) are retried with a capped backoff until the pod is deleted.
func (p *Provider) startPod(ctx context.Context, key string, rec *podRecord) {
	for attempt := 0; ; attempt++ {
		err := p.tryStartPod(ctx, key, rec, attempt)
		p.notifyPod(ctx, key)
		if err == nil || ctx.Err() != nil {
			return
		}
		if !errors.Is(err, errWaiting) {
			log.G(ctx).WithError(err).WithField("pod", key).Warn("starting pod")
		}
		delay := time.Duration(1<<min(attempt, 4)) * 2 * time.Second // 2s .. 32s
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
	}
}

func (p *Provider) tryStartPod(ctx context.Context, key string, rec *podRecord, attempt int) error {
	pod := rec.snapshotPod(&p.mu)

	volumes, err := p.prepareVolumes(pod)
	if err != nil {
		p.setWaiting(rec, pod, "CreateContainerConfigError", err.Error())
		return fmt.Errorf("%w: %v", errWaiting, err)
	}
	existing, err := p.listPodContainers(ctx, pod.UID)
	if err != nil {
		return err
	}

	for i := range pod.Spec.InitContainers {
		c := &pod.Spec.InitContainers[i]
		id, err := p.ensureContainer(ctx, rec, pod, c, true, volumes, existing, attempt)
		if err != nil {
			return err
		}
		code, err := p.waitExit(ctx, id)
		if err != nil {
			return err
		}
		if code != 0 {
			// Like restartPolicy Never: a failed init container fails the pod.
			p.mu.Lock()
			rec.initFailed = true
			p.mu.Unlock()
			return nil
		}
	}
	for i := range pod.Spec.Containers {
		if _, err := p.ensureContainer(ctx, rec, pod, &pod.Spec.Containers[i], false, volumes, existing, attempt); err != nil {
			return err
		}
	}
	return nil
}

// ensureContainer adopts an existing container for (pod UID, container name) or
// creates and starts a new one, and records its ID in rec.
func (p *Provider) ensureContainer(ctx context.Context, rec *podRecord, pod *corev1.Pod, c *corev1.Container,
	isInit bool, volumes map[string]volumeDir, existing map[string]container.Summary, attempt int) (string, error) {

	if s, ok := existing[c.Name]; ok {
		if s.State == container.StateCreated {
			if err := p.docker.ContainerStart(ctx, s.ID, container.StartOptions{}); err != nil {
				log.G(ctx).WithError(err).WithField("container", c.Name).Warn("starting adopted container")
			}
		}
		p.recordContainer(rec, c.Name, s.ID)
		return s.ID, nil
	}

	img, err := p.docker.ImageInspect(ctx, c.Image)
	if domain, ok := loopbackRegistry(c.Image); ok && c.ImagePullPolicy != corev1.PullNever &&
		(client.IsErrNotFound(err) || (err == nil && c.ImagePullPolicy == corev1.PullAlways)) {
		// As a kubelet: pull, with the pod's imagePullSecrets.
		if pullErr := p.pull(ctx, pod, c.Image, domain); pullErr != nil {
			reason := "ErrImagePull"
			if attempt > 0 {
				reason = "ImagePullBackOff"
			}
			p.setContainerWaiting(rec, c.Name, reason,
				fmt.Sprintf("Failed to pull image %q: %v", c.Image, pullErr))
			return "", errWaiting
		}
		img, err = p.docker.ImageInspect(ctx, c.Image)
	}
	if err != nil {
		if reason, msg, ok := imageWaiting(c, err, attempt); ok {
			p.setContainerWaiting(rec, c.Name, reason, msg)
			return "", errWaiting
		}
		return "", err
	}

	imageUser := ""
	if img.Config != nil {
		imageUser = img.Config.User
	}
	cfg, hostCfg, err := p.containerConfig(pod, c, isInit, volumes, imageUser)
	if err != nil {
		p.setContainerWaiting(rec, c.Name, "CreateContainerConfigError", err.Error())
		return "", errWaiting
	}
	name := containerName(pod, c.Name)
	created, err := p.docker.ContainerCreate(ctx, cfg, hostCfg, nil, nil, name)
	if err != nil {
		p.setContainerWaiting(rec, c.Name, "CreateContainerError", err.Error())
		return "", errWaiting
	}
	// Record the ID before starting, so a start failure (e.g. executable not found)
	// shows up as a terminated container with reason StartError.
	p.recordContainer(rec, c.Name, created.ID)
	if err := p.docker.ContainerStart(ctx, created.ID, container.StartOptions{}); err != nil {
		log.G(ctx).WithError(err).WithField("container", name).Info("container failed to start")
	}
	return created.ID, nil
}

// imageWaiting maps a failed image inspect to the Waiting state a kubelet reports:
// InvalidImageName for a reference that does not parse (kubelet's applyDefaultImageTag),
// ErrImageNeverPull for a missing image with pull policy Never, else ErrImagePull and
// then ImagePullBackOff (this node never pulls). ok is false for other errors (daemon
// trouble), which are retried without a reason.
func imageWaiting(c *corev1.Container, inspectErr error, attempt int) (reason, msg string, ok bool) {
	if _, err := reference.ParseNormalizedNamed(c.Image); err != nil {
		return "InvalidImageName", fmt.Sprintf("Failed to apply default image tag %q: couldn't parse image name %q: %v",
			c.Image, c.Image, err), true
	}
	switch {
	case !client.IsErrNotFound(inspectErr):
		return "", "", false
	case c.ImagePullPolicy == corev1.PullNever:
		return "ErrImageNeverPull", fmt.Sprintf("Container image %q is not present with pull policy of Never", c.Image), true
	case attempt > 0:
		return "ImagePullBackOff", fmt.Sprintf("Back-off pulling image %q: image %q is not present in the local Docker daemon and this test node never pulls images",
			c.Image, c.Image), true
	default:
		return "ErrImagePull", fmt.Sprintf("image %q is not present in the local Docker daemon and this test node never pulls images",
			c.Image), true
	}
}

// containerConfig translates a Kubernetes container into Docker create options.
func (p *Provider) containerConfig(pod *corev1.Pod, c *corev1.Container, isInit bool,
	volumes map[string]volumeDir, imageUser string) (*container.Config, *container.HostConfig, error) {

	labels := map[string]string{
		LabelProvider:      ProviderName,
		LabelNode:          p.cfg.NodeName,
		LabelPodNamespace:  pod.Namespace,
		LabelPodName:       pod.Name,
		LabelPodUID:        string(pod.UID),
		LabelContainerName: c.Name,
	}
	if isInit {
		labels[LabelInitContainer] = "true"
	}

	env := make([]string, 0, len(c.Env))
	for _, e := range c.Env {
		// virtual-kubelet has already resolved valueFrom/envFrom into Value.
		env = append(env, e.Name+"="+e.Value)
	}

	hostname := pod.Spec.Hostname
	if hostname == "" {
		hostname = pod.Name
	}
	if len(hostname) > 63 {
		hostname = hostname[:63]
	}

	cfg := &container.Config{
		Image:      c.Image,
		Env:        env,
		WorkingDir: c.WorkingDir,
		Labels:     labels,
		Hostname:   hostname,
		Tty:        c.TTY,
		OpenStdin:  c.Stdin,
		StdinOnce:  c.StdinOnce,
	}
	// Kubernetes semantics: command replaces ENTRYPOINT (and drops the image CMD),
	// args replace CMD.
	if len(c.Command) > 0 {
		cfg.Entrypoint = c.Command
		cfg.Cmd = c.Args
	} else if len(c.Args) > 0 {
		cfg.Cmd = c.Args
	}

	init := true
	host := &container.HostConfig{
		NetworkMode:   "none",
		Init:          &init, // docker-init as PID 1 reaps orphaned zombies
		RestartPolicy: restartPolicy(pod.Spec.RestartPolicy, isInit),
	}

	sc := effectiveSecurity(pod, c)
	if sc.user != "" {
		cfg.User = sc.user
	}
	if sc.runAsNonRoot && sc.uid != nil && *sc.uid == 0 {
		return nil, nil, fmt.Errorf("container's runAsUser breaks non-root policy (pod: %q, container: %s)",
			pod.Namespace+"/"+pod.Name, c.Name)
	}
	if sc.runAsNonRoot && sc.uid == nil {
		u := imageUser
		if u == "" || u == "0" || u == "root" || strings.HasPrefix(u, "0:") || strings.HasPrefix(u, "root:") {
			return nil, nil, fmt.Errorf("container has runAsNonRoot and image will run as root (pod: %q, container: %s)",
				pod.Namespace+"/"+pod.Name, c.Name)
		}
	}
	host.GroupAdd = sc.groups
	host.ReadonlyRootfs = sc.readOnlyRoot
	host.Privileged = sc.privileged
	host.CapAdd = sc.capAdd
	host.CapDrop = sc.capDrop
	if sc.noNewPrivileges {
		host.SecurityOpt = append(host.SecurityOpt, "no-new-privileges")
	}
	if sc.seccompUnconfined {
		host.SecurityOpt = append(host.SecurityOpt, "seccomp=unconfined")
	}

	if q, ok := c.Resources.Limits[corev1.ResourceMemory]; ok {
		host.Memory = q.Value()
		host.MemorySwap = q.Value() // no swap beyond the limit
	}
	if q, ok := c.Resources.Limits[corev1.ResourceCPU]; ok {
		host.NanoCPUs = q.MilliValue() * 1_000_000
	}
	if q, ok := c.Resources.Requests[corev1.ResourceCPU]; ok {
		host.CPUShares = max(2, q.MilliValue()*1024/1000)
	}

	for _, vm := range c.VolumeMounts {
		v, ok := volumes[vm.Name]
		if !ok {
			return nil, nil, fmt.Errorf("volume %q mounted by container %q is not defined in the pod", vm.Name, c.Name)
		}
		src, err := v.subPath(vm.SubPath)
		if err != nil {
			return nil, nil, err
		}
		host.Mounts = append(host.Mounts, mount.Mount{
			Type:     mount.TypeBind,
			Source:   src,
			Target:   vm.MountPath,
			ReadOnly: vm.ReadOnly || v.readOnly,
		})
	}
	return cfg, host, nil
}

// restartPolicy maps the pod's restart policy onto Docker's, which then restarts
// exited containers itself. Init containers are never restarted.
func restartPolicy(p corev1.RestartPolicy, isInit bool) container.RestartPolicy {
	if isInit {
		return container.RestartPolicy{Name: container.RestartPolicyDisabled}
	}
	switch p {
	case corev1.RestartPolicyAlways:
		return container.RestartPolicy{Name: container.RestartPolicyAlways}
	case corev1.RestartPolicyOnFailure:
		return container.RestartPolicy{Name: container.RestartPolicyOnFailure}
	default:
		return container.RestartPolicy{Name: container.RestartPolicyDisabled}
	}
}

// security is the effective security context of a container (container fields
// override pod fields, as in the kubelet).
type security struct {
	uid, gid          *int64
	user              string
	groups            []string
	runAsNonRoot      bool
	readOnlyRoot      bool
	privileged        bool
	noNewPrivileges   bool
	seccompUnconfined bool
	capAdd, capDrop   []string
}

func effectiveSecurity(pod *corev1.Pod, c *corev1.Container) security {
	var s security
	if psc := pod.Spec.SecurityContext; psc != nil {
		s.uid, s.gid = psc.RunAsUser, psc.RunAsGroup
		s.runAsNonRoot = psc.RunAsNonRoot != nil && *psc.RunAsNonRoot
		if psc.FSGroup != nil {
			s.groups = append(s.groups, strconv.FormatInt(*psc.FSGroup, 10))
		}
		for _, g := range psc.SupplementalGroups {
			s.groups = append(s.groups, strconv.FormatInt(g, 10))
		}
		if psc.SeccompProfile != nil && psc.SeccompProfile.Type == corev1.SeccompProfileTypeUnconfined {
			s.seccompUnconfined = true
		}
	}
	if csc := c.SecurityContext; csc != nil {
		if csc.RunAsUser != nil {
			s.uid = csc.RunAsUser
		}
		if csc.RunAsGroup != nil {
			s.gid = csc.RunAsGroup
		}
		if csc.RunAsNonRoot != nil {
			s.runAsNonRoot = *csc.RunAsNonRoot
		}
		s.readOnlyRoot = csc.ReadOnlyRootFilesystem != nil && *csc.ReadOnlyRootFilesystem
		s.privileged = csc.Privileged != nil && *csc.Privileged
		s.noNewPrivileges = csc.AllowPrivilegeEscalation != nil && !*csc.AllowPrivilegeEscalation
		if csc.Capabilities != nil {
			for _, cp := range csc.Capabilities.Add {
				s.capAdd = append(s.capAdd, string(cp))
			}
			for _, cp := range csc.Capabilities.Drop {
				s.capDrop = append(s.capDrop, string(cp))
			}
		}
		if csc.SeccompProfile != nil {
			s.seccompUnconfined = csc.SeccompProfile.Type == corev1.SeccompProfileTypeUnconfined
		}
	}
	switch {
	case s.uid != nil && s.gid != nil:
		s.user = fmt.Sprintf("%d:%d", *s.uid, *s.gid)
	case s.uid != nil:
		s.user = strconv.FormatInt(*s.uid, 10)
	case s.gid != nil:
		// Docker cannot set only the group; keep the image's user and add the group.
		s.groups = append(s.groups, strconv.FormatInt(*s.gid, 10))
	}
	return s
}

// containerName is unique per pod UID, so a re-created pod of the same name never
// collides with the containers of its predecessor.
func containerName(pod *corev1.Pod, name string) string {
	return fmt.Sprintf("k8s_%s_%s_%s_%s", name, pod.Name, pod.Namespace, pod.UID)
}

func (p *Provider) recordContainer(rec *podRecord, name, id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	rec.containerIDs[name] = id
	delete(rec.waiting, name)
}

func (p *Provider) setContainerWaiting(rec *podRecord, name, reason, msg string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	rec.waiting[name] = corev1.ContainerStateWaiting{Reason: reason, Message: msg}
}

// setWaiting marks every container not created yet as waiting.
func (p *Provider) setWaiting(rec *podRecord, pod *corev1.Pod, reason, msg string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, cs := range [][]corev1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for _, c := range cs {
			if _, ok := rec.containerIDs[c.Name]; !ok {
				rec.waiting[c.Name] = corev1.ContainerStateWaiting{Reason: reason, Message: msg}
			}
		}
	}
}

// waitExit blocks until the container is no longer running and returns its exit code.
func (p *Provider) waitExit(ctx context.Context, id string) (int, error) {
	okCh, errCh := p.docker.ContainerWait(ctx, id, container.WaitConditionNotRunning)
	select {
	case r := <-okCh:
		return int(r.StatusCode), nil
	case err := <-errCh:
		return 0, err
	}
}

// listPodContainers returns this node's containers of one pod, by container name.
func (p *Provider) listPodContainers(ctx context.Context, uid types.UID) (map[string]container.Summary, error) {
	list, err := p.docker.ContainerList(ctx, container.ListOptions{
		All: true,
		Filters: filters.NewArgs(
			filters.Arg("label", LabelNode+"="+p.cfg.NodeName),
			filters.Arg("label", LabelPodUID+"="+string(uid)),
		),
	})
	if err != nil {
		return nil, fmt.Errorf("listing containers of pod %s: %w", uid, err)
	}
	out := make(map[string]container.Summary, len(list))
	for _, s := range list {
		out[s.Labels[LabelContainerName]] = s
	}
	return out, nil
}

// stopPodContainers stops every container of the pod, giving it graceSeconds
// after SIGTERM before SIGKILL. Stopping also disables Docker's restart policy.
func (p *Provider) stopPodContainers(ctx context.Context, uid types.UID, graceSeconds int) error {
	cs, err := p.listPodContainers(ctx, uid)
	if err != nil {
		return err
	}
	var errs []error
	for _, s := range cs {
		if s.State != container.StateRunning && s.State != container.StateRestarting && s.State != container.StatePaused {
			continue
		}
		t := graceSeconds
		if err := p.docker.ContainerStop(ctx, s.ID, container.StopOptions{Timeout: &t}); err != nil && !client.IsErrNotFound(err) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// removePodContainers force-removes every container of the pod.
func (p *Provider) removePodContainers(ctx context.Context, uid types.UID) error {
	cs, err := p.listPodContainers(ctx, uid)
	if err != nil {
		return err
	}
	var errs []error
	for _, s := range cs {
		err := p.docker.ContainerRemove(ctx, s.ID, container.RemoveOptions{Force: true, RemoveVolumes: true})
		if err != nil && !client.IsErrNotFound(err) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
