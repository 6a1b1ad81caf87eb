package provider

import (
	"context"
	"os"
	"path/filepath"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/events"
	"github.com/docker/docker/api/types/filters"
	"github.com/virtual-kubelet/virtual-kubelet/log"
	"k8s.io/apimachinery/pkg/types"
)

// watchEvents turns Docker container events (start, die, oom, ...) of this node's
// containers into immediate pod status notifications. The periodic resync in Run
// covers events missed while reconnecting.
func (p *Provider) watchEvents(ctx context.Context) {
	for ctx.Err() == nil {
		msgs, errs := p.docker.Events(ctx, events.ListOptions{Filters: filters.NewArgs(
			filters.Arg("type", string(events.ContainerEventType)),
			filters.Arg("label", LabelNode+"="+p.cfg.NodeName),
		)})
	loop:
		for {
			select {
			case <-ctx.Done():
				return
			case err := <-errs:
				log.G(ctx).WithError(err).Warn("docker event stream ended; reconnecting")
				break loop
			case m := <-msgs:
				switch m.Action {
				case events.ActionStart, events.ActionDie, events.ActionOOM, events.ActionRestart:
					attrs := m.Actor.Attributes
					p.notifyPod(ctx, podKey(attrs[LabelPodNamespace], attrs[LabelPodName]))
				}
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// collectGarbage removes containers and volume directories of this node that
// belong to no pod the provider tracks. After a provider restart, pods that still
// exist in Kubernetes are re-created through CreatePod, which adopts their
// containers; the grace period gives that re-sync time to happen first.
func (p *Provider) collectGarbage(ctx context.Context) {
	const grace = 60 * time.Second
	select {
	case <-ctx.Done():
		return
	case <-time.After(grace):
	}
	tick := time.NewTicker(30 * time.Second)
	defer tick.Stop()
	for {
		p.gcOnce(ctx)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

func (p *Provider) gcOnce(ctx context.Context) {
	tracked := map[types.UID]bool{}
	p.mu.Lock()
	for _, rec := range p.pods {
		tracked[rec.pod.UID] = true
	}
	p.mu.Unlock()

	list, err := p.docker.ContainerList(ctx, container.ListOptions{All: true, Filters: filters.NewArgs(
		filters.Arg("label", LabelNode+"="+p.cfg.NodeName),
	)})
	if err != nil {
		log.G(ctx).WithError(err).Warn("gc: listing containers")
		return
	}
	// A pod created after the snapshot above is registered before any of its
	// containers or directories exist: check again right before removing.
	trackedNow := func(uid types.UID) bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, rec := range p.pods {
			if rec.pod.UID == uid {
				return true
			}
		}
		return false
	}
	for _, c := range list {
		uid := types.UID(c.Labels[LabelPodUID])
		if tracked[uid] || trackedNow(uid) {
			continue
		}
		log.G(ctx).WithField("container", c.Names).Info("gc: removing container of an unknown pod")
		if err := p.docker.ContainerRemove(ctx, c.ID, container.RemoveOptions{Force: true}); err != nil {
			log.G(ctx).WithError(err).Warn("gc: removing container")
		}
	}

	dirs, _ := os.ReadDir(filepath.Join(p.cfg.StateDir, "pods"))
	for _, d := range dirs {
		uid := types.UID(d.Name())
		if tracked[uid] {
			continue
		}
		// Under the lock, so that no pod registers between the check and the removal.
		p.mu.Lock()
		known := false
		for _, rec := range p.pods {
			if rec.pod.UID == uid {
				known = true
				break
			}
		}
		if !known {
			_ = os.RemoveAll(filepath.Join(p.cfg.StateDir, "pods", d.Name()))
		}
		p.mu.Unlock()
	}
}
