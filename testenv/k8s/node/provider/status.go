package provider

import (
	"bytes"
	"context"
	"strconv"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/client"
	"github.com/docker/docker/pkg/stdcopy"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// containerView is the Kubernetes status of one container plus what the pod phase
// computation needs to know about it.
type containerView struct {
	status  corev1.ContainerStatus
	running bool // running (or being restarted by Docker)
	done    bool // terminated for good
	failed  bool // terminated with a non-zero exit code (or never started)
}

// computeStatus derives the pod status from Docker's view of the containers.
func (p *Provider) computeStatus(ctx context.Context, rec *podRecord) *corev1.PodStatus {
	p.mu.Lock()
	pod := rec.pod.DeepCopy()
	ids := make(map[string]string, len(rec.containerIDs))
	for k, v := range rec.containerIDs {
		ids[k] = v
	}
	waiting := make(map[string]corev1.ContainerStateWaiting, len(rec.waiting))
	for k, v := range rec.waiting {
		waiting[k] = v
	}
	deadlineExceeded, initFailed := rec.deadlineExceeded, rec.initFailed
	start := rec.startTime
	last := rec.lastStatus
	p.mu.Unlock()

	view := func(c corev1.Container) containerView {
		if id, ok := ids[c.Name]; ok {
			v := p.inspectContainer(ctx, c, id)
			if t := v.status.State.Terminated; t != nil && t.ExitCode != 0 && t.Message == "" &&
				c.TerminationMessagePolicy == corev1.TerminationMessageFallbackToLogsOnError {
				t.Message = p.logTail(ctx, rec, id)
			}
			return v
		}
		w, ok := waiting[c.Name]
		if !ok {
			w = corev1.ContainerStateWaiting{Reason: "PodInitializing"}
		}
		return containerView{status: corev1.ContainerStatus{
			Name: c.Name, Image: c.Image, State: corev1.ContainerState{Waiting: &w},
		}}
	}

	st := &corev1.PodStatus{
		HostIP:    "127.0.0.1",
		HostIPs:   []corev1.HostIP{{IP: "127.0.0.1"}},
		StartTime: &start,
		QOSClass:  pod.Status.QOSClass,
	}

	initDone := true
	for _, c := range pod.Spec.InitContainers {
		v := view(c)
		st.InitContainerStatuses = append(st.InitContainerStatuses, v.status)
		if !v.done || v.failed {
			initDone = false
		}
	}

	var running, done, failed, total int
	anyCreated := len(ids) > 0
	for _, c := range pod.Spec.Containers {
		v := view(c)
		total++
		if v.running {
			running++
		}
		if v.done {
			done++
		}
		if v.failed {
			failed++
		}
		st.ContainerStatuses = append(st.ContainerStatuses, v.status)
	}

	switch {
	case deadlineExceeded:
		st.Phase = corev1.PodFailed
		st.Reason = "DeadlineExceeded"
		st.Message = "Pod was active on the node longer than the specified deadline"
	case initFailed:
		st.Phase = corev1.PodFailed
		st.Reason = "InitContainerFailed"
		st.Message = "an init container exited with a non-zero code"
	case !initDone:
		st.Phase = corev1.PodPending
	case total > 0 && done == total:
		st.Phase = corev1.PodSucceeded
		if failed > 0 {
			st.Phase = corev1.PodFailed
		}
	case running > 0 && running+done == total:
		st.Phase = corev1.PodRunning
	default:
		st.Phase = corev1.PodPending
	}

	ready := st.Phase == corev1.PodRunning && running == total
	for i := range st.ContainerStatuses {
		st.ContainerStatuses[i].Ready = ready && st.ContainerStatuses[i].State.Running != nil
	}
	st.Conditions = []corev1.PodCondition{
		condition(last, corev1.PodReadyToStartContainers, anyCreated || initDone && len(pod.Spec.InitContainers) > 0),
		condition(last, corev1.PodInitialized, initDone),
		condition(last, corev1.ContainersReady, ready),
		condition(last, corev1.PodReady, ready),
		condition(last, corev1.PodScheduled, true),
	}

	p.mu.Lock()
	rec.lastStatus = st.DeepCopy()
	p.mu.Unlock()
	return st
}

// The kubelet's bounds for a termination message taken from the logs
// (kubecontainer.MaxContainerTerminationMessageLogLines / ...LogLength).
const (
	terminationLogLines = 80
	terminationLogBytes = 2048
)

// logTail is what FallbackToLogsOnError puts in the termination message of a container
// that failed: the end of its logs (stdout and stderr), at most 80 lines and 2048
// bytes. Read once per container and kept in the pod record.
func (p *Provider) logTail(ctx context.Context, rec *podRecord, id string) string {
	p.mu.Lock()
	tail, ok := rec.logTails[id]
	p.mu.Unlock()
	if ok {
		return tail
	}
	rc, err := p.docker.ContainerLogs(ctx, id, container.LogsOptions{
		ShowStdout: true, ShowStderr: true, Tail: strconv.Itoa(terminationLogLines),
	})
	if err != nil {
		return ""
	}
	defer rc.Close()
	var buf bytes.Buffer
	if _, err := stdcopy.StdCopy(&buf, &buf, rc); err != nil {
		return ""
	}
	b := buf.Bytes()
	if len(b) > terminationLogBytes {
		b = b[len(b)-terminationLogBytes:]
	}
	tail = string(b)
	p.mu.Lock()
	if rec.logTails == nil {
		rec.logTails = map[string]string{}
	}
	rec.logTails[id] = tail
	p.mu.Unlock()
	return tail
}

// condition builds a pod condition, keeping the previous transition time when the
// status did not change so that repeated evaluations compare equal.
func condition(last *corev1.PodStatus, t corev1.PodConditionType, ok bool) corev1.PodCondition {
	status := corev1.ConditionFalse
	if ok {
		status = corev1.ConditionTrue
	}
	c := corev1.PodCondition{Type: t, Status: status, LastTransitionTime: metav1.Now()}
	if last != nil {
		for _, old := range last.Conditions {
			if old.Type == t && old.Status == status {
				c.LastTransitionTime = old.LastTransitionTime
			}
		}
	}
	return c
}

// inspectContainer maps Docker's container state onto a Kubernetes ContainerStatus.
func (p *Provider) inspectContainer(ctx context.Context, c corev1.Container, id string) containerView {
	cs := corev1.ContainerStatus{Name: c.Name, Image: c.Image, ContainerID: "docker://" + id}
	info, err := p.docker.ContainerInspect(ctx, id)
	if err != nil {
		if client.IsErrNotFound(err) {
			// Removed behind our back: report it the way the kubelet does.
			cs.State.Terminated = &corev1.ContainerStateTerminated{
				ExitCode: 137, Reason: "ContainerStatusUnknown",
				Message: "The container could not be located when the pod was terminated",
			}
			return containerView{status: cs, done: true, failed: true}
		}
		w := corev1.ContainerStateWaiting{Reason: "Unknown", Message: err.Error()}
		cs.State.Waiting = &w
		return containerView{status: cs}
	}
	cs.ImageID = "docker://" + info.Image
	cs.RestartCount = int32(info.RestartCount)
	started := true
	cs.Started = &started

	s := info.State
	startedAt, finishedAt := parseDockerTime(s.StartedAt), parseDockerTime(s.FinishedAt)
	terminated := func() *corev1.ContainerStateTerminated {
		reason := "Completed"
		switch {
		case s.OOMKilled:
			reason = "OOMKilled"
		case s.ExitCode != 0:
			reason = "Error"
		}
		return &corev1.ContainerStateTerminated{
			ExitCode: int32(s.ExitCode), Reason: reason, Message: s.Error,
			StartedAt: startedAt, FinishedAt: finishedAt, ContainerID: cs.ContainerID,
		}
	}

	switch s.Status {
	case container.StateRunning, container.StatePaused:
		cs.State.Running = &corev1.ContainerStateRunning{StartedAt: startedAt}
		return containerView{status: cs, running: true}
	case container.StateRestarting:
		cs.State.Waiting = &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff",
			Message: "Docker is restarting the container (restart policy)"}
		cs.LastTerminationState.Terminated = terminated()
		return containerView{status: cs, running: true}
	case container.StateExited, container.StateDead, container.StateRemoving:
		cs.State.Terminated = terminated()
		return containerView{status: cs, done: true, failed: s.ExitCode != 0}
	default: // created
		if s.Error != "" {
			// The runtime could not start the process (e.g. executable not found).
			code := int32(s.ExitCode)
			if code == 0 {
				code = 128
			}
			cs.State.Terminated = &corev1.ContainerStateTerminated{
				ExitCode: code, Reason: "StartError", Message: s.Error, ContainerID: cs.ContainerID,
			}
			started = false
			return containerView{status: cs, done: true, failed: true}
		}
		started = false
		cs.State.Waiting = &corev1.ContainerStateWaiting{Reason: "ContainerCreating"}
		return containerView{status: cs}
	}
}

// terminalize turns the final status of a deleted pod into a terminal one: every
// container terminated, phase Succeeded or Failed.
func terminalize(pod *corev1.Pod) {
	now := metav1.Now()
	failed := false
	fix := func(list []corev1.ContainerStatus) {
		for i := range list {
			cs := &list[i]
			if cs.State.Terminated == nil {
				cs.State = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
					ExitCode: 137, Reason: "ContainerStatusUnknown", FinishedAt: now,
					Message: "The container was removed with its pod",
				}}
			}
			cs.Ready = false
			if cs.State.Terminated.ExitCode != 0 {
				failed = true
			}
		}
	}
	fix(pod.Status.InitContainerStatuses)
	fix(pod.Status.ContainerStatuses)
	if pod.Status.Phase != corev1.PodSucceeded && pod.Status.Phase != corev1.PodFailed {
		pod.Status.Phase = corev1.PodSucceeded
		if failed {
			pod.Status.Phase = corev1.PodFailed
		}
	}
	for i := range pod.Status.Conditions {
		if t := pod.Status.Conditions[i].Type; t == corev1.PodReady || t == corev1.ContainersReady {
			pod.Status.Conditions[i].Status = corev1.ConditionFalse
		}
	}
}

func parseDockerTime(s string) metav1.Time {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil || t.Year() < 2000 { // Docker uses 0001-01-01 for "never"
		return metav1.Time{}
	}
	return metav1.NewTime(t)
}
