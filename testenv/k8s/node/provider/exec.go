package provider

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/pkg/stdcopy"
	dto "github.com/prometheus/client_model/go"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	statsv1alpha1 "k8s.io/kubelet/pkg/apis/stats/v1alpha1"
	utilexec "k8s.io/utils/exec"
)

// RunInContainer implements `kubectl exec` with a Docker exec:
//
//  1. exec create + attach (hijacked connection);
//  2. stdin is copied into the connection and then half-closed (CloseWrite), so the
//     process sees EOF when the client closes stdin (v5.channel.k8s.io);
//  3. without a TTY, Docker multiplexes stdout and stderr on the connection;
//     stdcopy splits them back apart;
//  4. after the output ends, exec inspect gives the exit code, returned as an
//     unwrapped utilexec.CodeExitError so virtual-kubelet's remotecommand server
//     reports it to the client in the status channel.
func (p *Provider) RunInContainer(ctx context.Context, namespace, podName, containerName string, cmd []string, attach api.AttachIO) error {
	id, err := p.runningContainer(ctx, namespace, podName, containerName)
	if err != nil {
		return err
	}
	stdin, stdout, stderr := attach.Stdin(), attach.Stdout(), attach.Stderr()
	tty := attach.TTY()

	created, err := p.docker.ContainerExecCreate(ctx, id, container.ExecOptions{
		Cmd:          cmd,
		Tty:          tty,
		AttachStdin:  stdin != nil,
		AttachStdout: stdout != nil,
		AttachStderr: stderr != nil,
	})
	if err != nil {
		return fmt.Errorf("exec create in %s/%s/%s: %w", namespace, podName, containerName, err)
	}
	hijacked, err := p.docker.ContainerExecAttach(ctx, created.ID, container.ExecAttachOptions{Tty: tty})
	if err != nil {
		return fmt.Errorf("exec attach: %w", err)
	}
	defer hijacked.Close()

	// Closing the connection when the client goes away unblocks the copies below.
	// (It does not kill the process: Docker has no API to kill an exec.)
	stop := context.AfterFunc(ctx, hijacked.Close)
	defer stop()

	if tty && attach.Resize() != nil {
		go func() {
			for size := range attach.Resize() {
				_ = p.docker.ContainerExecResize(ctx, created.ID, container.ResizeOptions{
					Height: uint(size.Height), Width: uint(size.Width),
				})
			}
		}()
	}

	if stdin != nil {
		go func() {
			_, _ = io.Copy(hijacked.Conn, stdin)
			_ = hijacked.CloseWrite() // EOF for the process
		}()
	}

	outW, errW := writerOrDiscard(stdout), writerOrDiscard(stderr)
	if tty {
		_, err = io.Copy(outW, hijacked.Reader)
	} else {
		_, err = stdcopy.StdCopy(outW, errW, hijacked.Reader)
	}
	if err != nil && ctx.Err() == nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("exec stream: %w", err)
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}

	code, err := p.execExitCode(ctx, created.ID)
	if err != nil {
		return err
	}
	if code != 0 {
		return utilexec.CodeExitError{Err: fmt.Errorf("command terminated with exit code %d", code), Code: code}
	}
	return nil
}

// execExitCode inspects the exec until Docker has recorded its exit code (the
// stream can end a moment before the exec is marked as finished).
func (p *Provider) execExitCode(ctx context.Context, execID string) (int, error) {
	deadline := time.Now().Add(5 * time.Second)
	for {
		info, err := p.docker.ContainerExecInspect(ctx, execID)
		if err != nil {
			return 0, fmt.Errorf("exec inspect: %w", err)
		}
		if !info.Running {
			return info.ExitCode, nil
		}
		if time.Now().After(deadline) {
			return 0, errors.New("exec output ended but the process is still running")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// runningContainer finds the Docker container of a pod's container.
func (p *Provider) runningContainer(ctx context.Context, namespace, podName, containerName string) (string, error) {
	p.mu.Lock()
	rec, ok := p.pods[podKey(namespace, podName)]
	var id string
	if ok {
		if containerName == "" && len(rec.pod.Spec.Containers) > 0 {
			containerName = rec.pod.Spec.Containers[0].Name
		}
		id = rec.containerIDs[containerName]
	}
	p.mu.Unlock()
	if !ok {
		return "", errdefs.NotFoundf("pod %s/%s not found on this node", namespace, podName)
	}
	if id == "" {
		return "", errdefs.NotFoundf("container %q of pod %s/%s has not been created", containerName, namespace, podName)
	}
	return id, nil
}

func writerOrDiscard(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}

// GetContainerLogs streams `docker logs`, with stdout and stderr merged as the
// kubelet does.
func (p *Provider) GetContainerLogs(ctx context.Context, namespace, podName, containerName string, opts api.ContainerLogOpts) (io.ReadCloser, error) {
	id, err := p.runningContainer(ctx, namespace, podName, containerName)
	if err != nil {
		return nil, err
	}
	lo := container.LogsOptions{ShowStdout: true, ShowStderr: true, Follow: opts.Follow, Timestamps: opts.Timestamps}
	if opts.Tail > 0 {
		lo.Tail = strconv.Itoa(opts.Tail)
	}
	if opts.SinceSeconds > 0 {
		lo.Since = strconv.FormatInt(time.Now().Add(-time.Duration(opts.SinceSeconds)*time.Second).Unix(), 10)
	} else if !opts.SinceTime.IsZero() {
		lo.Since = strconv.FormatInt(opts.SinceTime.Unix(), 10)
	}
	rc, err := p.docker.ContainerLogs(ctx, id, lo)
	if err != nil {
		return nil, err
	}
	info, err := p.docker.ContainerInspect(ctx, id)
	if err == nil && info.Config != nil && info.Config.Tty {
		return rc, nil // TTY logs are not multiplexed
	}
	pr, pw := io.Pipe()
	var mu sync.Mutex // stdout and stderr frames go to one pipe
	w := &lockedWriter{mu: &mu, w: pw}
	go func() {
		_, err := stdcopy.StdCopy(w, w, rc)
		rc.Close()
		pw.CloseWithError(err)
	}()
	return pr, nil
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

// AttachToContainer is not supported (tests use exec).
func (p *Provider) AttachToContainer(context.Context, string, string, string, api.AttachIO) error {
	return errdefs.InvalidInput("attach is not supported by the docker test provider")
}

// PortForward is not supported: containers have no network.
func (p *Provider) PortForward(context.Context, string, string, int32, io.ReadWriteCloser) error {
	return errdefs.InvalidInput("port-forward is not supported: pod containers run with network none")
}

// GetStatsSummary returns an empty summary (no metrics in the test cluster).
func (p *Provider) GetStatsSummary(context.Context) (*statsv1alpha1.Summary, error) {
	return &statsv1alpha1.Summary{Node: statsv1alpha1.NodeStats{NodeName: p.cfg.NodeName}}, nil
}

// GetMetricsResource returns no metrics.
func (p *Provider) GetMetricsResource(context.Context) ([]*dto.MetricFamily, error) {
	return nil, nil
}
