package provider

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	cerrdefs "github.com/containerd/errdefs"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func testPod(c corev1.Container) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "uid-1"},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{c}},
	}
}

func TestContainerConfigCommandArgs(t *testing.T) {
	p := &Provider{cfg: Config{NodeName: "n"}}
	for _, tc := range []struct {
		name             string
		command, args    []string
		wantEntry, wantC []string
	}{
		{"image defaults", nil, nil, nil, nil},
		{"command only drops image CMD", []string{"sleep"}, nil, []string{"sleep"}, nil},
		{"args only keep image ENTRYPOINT", nil, []string{"x"}, nil, []string{"x"}},
		{"both", []string{"sh", "-c"}, []string{"exit 3"}, []string{"sh", "-c"}, []string{"exit 3"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := corev1.Container{Name: "main", Image: "img", Command: tc.command, Args: tc.args}
			cfg, host, err := p.containerConfig(testPod(c), &c, false, nil, "")
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(cfg.Entrypoint, tc.wantEntry) || !slices.Equal(cfg.Cmd, tc.wantC) {
				t.Errorf("entrypoint %q cmd %q, want %q %q", cfg.Entrypoint, cfg.Cmd, tc.wantEntry, tc.wantC)
			}
			if host.NetworkMode != "none" || host.Init == nil || !*host.Init {
				t.Errorf("network %q init %v: want none and init", host.NetworkMode, host.Init)
			}
			if cfg.Labels[LabelPodUID] != "uid-1" || cfg.Labels[LabelProvider] != ProviderName {
				t.Errorf("labels %v", cfg.Labels)
			}
		})
	}
}

func TestContainerConfigSecurityAndResources(t *testing.T) {
	p := &Provider{cfg: Config{NodeName: "n"}}
	uid, gid, no, yes := int64(1000), int64(2000), false, true
	c := corev1.Container{
		Name: "main", Image: "img",
		SecurityContext: &corev1.SecurityContext{
			RunAsUser: &uid, RunAsGroup: &gid,
			ReadOnlyRootFilesystem:   &yes,
			AllowPrivilegeEscalation: &no,
			Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
		},
		Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{
			corev1.ResourceMemory: resource.MustParse("64Mi"),
			corev1.ResourceCPU:    resource.MustParse("500m"),
		}},
	}
	cfg, host, err := p.containerConfig(testPod(c), &c, false, nil, "")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.User != "1000:2000" {
		t.Errorf("user %q", cfg.User)
	}
	if !host.ReadonlyRootfs || !slices.Contains(host.SecurityOpt, "no-new-privileges") || !slices.Equal(host.CapDrop, []string{"ALL"}) {
		t.Errorf("security: ro=%v opts=%v drop=%v", host.ReadonlyRootfs, host.SecurityOpt, host.CapDrop)
	}
	if host.Memory != 64<<20 || host.NanoCPUs != 500_000_000 {
		t.Errorf("resources: memory=%d nanocpus=%d", host.Memory, host.NanoCPUs)
	}
}

func TestRunAsNonRootRejectsRootImage(t *testing.T) {
	p := &Provider{cfg: Config{NodeName: "n"}}
	yes := true
	c := corev1.Container{Name: "main", Image: "img", SecurityContext: &corev1.SecurityContext{RunAsNonRoot: &yes}}
	if _, _, err := p.containerConfig(testPod(c), &c, false, nil, ""); err == nil {
		t.Error("root image accepted with runAsNonRoot")
	}
	if _, _, err := p.containerConfig(testPod(c), &c, false, nil, "1000"); err != nil {
		t.Errorf("non-root image rejected: %v", err)
	}
}

func TestWriteKeysItemsAndModes(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "v")
	mode, itemMode := int32(0o400), int32(0o600)
	data := map[string][]byte{"a": []byte("A"), "b": []byte("B")}
	items := []corev1.KeyToPath{{Key: "a", Path: "sub/a.txt"}, {Key: "b", Path: "b", Mode: &itemMode}}
	if err := writeKeys(dir, data, items, &mode, nil, true); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]os.FileMode{"sub/a.txt": 0o400, "b": 0o600} {
		st, err := os.Stat(filepath.Join(dir, path))
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != want {
			t.Errorf("%s: mode %v, want %v", path, st.Mode().Perm(), want)
		}
	}
	bad := []corev1.KeyToPath{{Key: "a", Path: "../escape"}}
	if err := writeKeys(dir, data, bad, nil, nil, true); err == nil {
		t.Error("path escaping the volume accepted")
	}
	missing := []corev1.KeyToPath{{Key: "nope", Path: "x"}}
	if err := writeKeys(dir, data, missing, nil, nil, true); err == nil {
		t.Error("missing key accepted")
	}
	if err := writeKeys(dir, data, missing, nil, &[]bool{true}[0], true); err != nil {
		t.Errorf("missing optional key rejected: %v", err)
	}
}

func TestSubPathRefusesEscape(t *testing.T) {
	v := volumeDir{path: t.TempDir(), emptyDir: true}
	if _, err := v.subPath("../x"); err == nil {
		t.Error("subPath ../x accepted")
	}
	got, err := v.subPath("a/b")
	if err != nil || got != filepath.Join(v.path, "a", "b") {
		t.Errorf("subPath a/b = %q, %v", got, err)
	}
}

func TestImageWaitingLikeAKubelet(t *testing.T) {
	notFound := fmt.Errorf("No such image: %w", cerrdefs.ErrNotFound)
	other := errors.New("daemon trouble")
	for _, tc := range []struct {
		image   string
		policy  corev1.PullPolicy
		err     error
		attempt int
		reason  string
	}{
		{"Busybox:latest", corev1.PullIfNotPresent, other, 0, "InvalidImageName"},
		{"garbage:::", corev1.PullNever, notFound, 3, "InvalidImageName"},
		{"sandbox-test/nope:1", corev1.PullNever, notFound, 0, "ErrImageNeverPull"},
		{"sandbox-test/nope:1", corev1.PullNever, notFound, 2, "ErrImageNeverPull"},
		{"sandbox-test/nope:1", corev1.PullIfNotPresent, notFound, 0, "ErrImagePull"},
		{"sandbox-test/nope:1", corev1.PullAlways, notFound, 1, "ImagePullBackOff"},
		{"sandbox-test/nope:1", corev1.PullIfNotPresent, other, 0, ""},
	} {
		c := corev1.Container{Name: "c", Image: tc.image, ImagePullPolicy: tc.policy}
		reason, msg, ok := imageWaiting(&c, tc.err, tc.attempt)
		if reason != tc.reason || ok != (tc.reason != "") {
			t.Errorf("%s %s attempt %d: got %q (%v), want %q", tc.image, tc.policy, tc.attempt, reason, ok, tc.reason)
		}
		if ok && !strings.Contains(msg, tc.image) {
			t.Errorf("%s: message does not name the image: %s", tc.image, msg)
		}
	}
}

// Only registries on this machine are pulled from.
func TestLoopbackRegistry(t *testing.T) {
	for _, tc := range []struct {
		ref, domain string
		ok          bool
	}{
		{"127.0.0.1:5000/t/img:1", "127.0.0.1:5000", true},
		{"localhost:5000/img", "localhost:5000", true},
		{"[::1]:5000/img", "[::1]:5000", true},
		{"127.9.9.9/img", "127.9.9.9", true},
		{"sandbox-test/busybox:latest", "docker.io", false},
		{"10.0.0.1:5000/img", "10.0.0.1:5000", false},
		{"registry.example/img", "registry.example", false},
	} {
		domain, ok := loopbackRegistry(tc.ref)
		if domain != tc.domain || ok != tc.ok {
			t.Errorf("loopbackRegistry(%q) = %q, %v; want %q, %v", tc.ref, domain, ok, tc.domain, tc.ok)
		}
	}
}
