package provider

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
)

// Volumes are materialised as plain host directories under
// StateDir/pods/<pod uid>/volumes/<volume name> and bind-mounted into the
// containers. Secret, ConfigMap, downward API and projected volumes are written
// once when the pod starts (later updates of the source objects are not
// propagated) and mounted read-only; emptyDir is a world-writable directory.

// volumeDir is one materialised volume.
type volumeDir struct {
	path     string
	readOnly bool
	emptyDir bool
}

// subPath returns the host path for a volumeMount.subPath, refusing escapes.
func (v volumeDir) subPath(sub string) (string, error) {
	if sub == "" {
		return v.path, nil
	}
	clean := filepath.Clean(sub)
	if filepath.IsAbs(clean) || clean == ".." || strings.HasPrefix(clean, "../") {
		return "", fmt.Errorf("invalid subPath %q", sub)
	}
	full := filepath.Join(v.path, clean)
	if v.emptyDir {
		// The kubelet creates missing subPath directories inside writable volumes.
		if err := os.MkdirAll(full, 0o777); err != nil {
			return "", err
		}
	}
	if _, err := os.Stat(full); err != nil {
		return "", fmt.Errorf("subPath %q: %w", sub, err)
	}
	return full, nil
}

func (p *Provider) podDir(uid types.UID) string {
	return filepath.Join(p.cfg.StateDir, "pods", string(uid))
}

// supportedVolume reports whether the provider can materialise a volume.
func supportedVolume(v corev1.Volume) error {
	switch {
	case v.EmptyDir != nil, v.Secret != nil, v.ConfigMap != nil, v.DownwardAPI != nil:
		return nil
	case v.Projected != nil:
		return nil
	}
	return fmt.Errorf("volume %q: only emptyDir, secret, configMap, downwardAPI and projected volumes are supported by the docker test provider", v.Name)
}

// prepareVolumes (re)creates the pod's volume directories. It is idempotent:
// emptyDir contents survive, generated files are rewritten.
func (p *Provider) prepareVolumes(pod *corev1.Pod) (map[string]volumeDir, error) {
	out := make(map[string]volumeDir, len(pod.Spec.Volumes))
	base := filepath.Join(p.podDir(pod.UID), "volumes")
	for _, v := range pod.Spec.Volumes {
		dir := filepath.Join(base, v.Name)
		var err error
		switch {
		case v.EmptyDir != nil:
			if err = os.MkdirAll(dir, 0o777); err == nil {
				err = os.Chmod(dir, 0o777) // independent of the umask, like the kubelet
			}
			out[v.Name] = volumeDir{path: dir, emptyDir: true}
			if err != nil {
				return nil, err
			}
			continue
		case v.Secret != nil:
			err = p.writeSecret(dir, pod.Namespace, v.Secret.SecretName, v.Secret.Items, v.Secret.DefaultMode, v.Secret.Optional, true)
		case v.ConfigMap != nil:
			err = p.writeConfigMap(dir, pod.Namespace, v.ConfigMap.Name, v.ConfigMap.Items, v.ConfigMap.DefaultMode, v.ConfigMap.Optional, true)
		case v.DownwardAPI != nil:
			err = writeDownwardAPI(dir, pod, v.DownwardAPI.Items, v.DownwardAPI.DefaultMode, true)
		case v.Projected != nil:
			err = p.writeProjected(dir, pod, v.Projected)
		default:
			err = supportedVolume(v)
		}
		if err != nil {
			return nil, fmt.Errorf("volume %q: %w", v.Name, err)
		}
		out[v.Name] = volumeDir{path: dir, readOnly: true}
	}
	if sc := pod.Spec.SecurityContext; sc != nil && sc.FSGroup != nil {
		for _, v := range out {
			if err := applyFSGroup(v, *sc.FSGroup); err != nil {
				return nil, err
			}
		}
	}
	return out, nil
}

// applyFSGroup mimics the kubelet's volume ownership management: the volume's
// files belong to group fsGroup and are group-readable (group-writable for
// writable volumes); directories get the setgid bit so new files inherit the group.
func applyFSGroup(v volumeDir, gid int64) error {
	return filepath.WalkDir(v.path, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := os.Lchown(path, -1, int(gid)); err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil || info.Mode()&os.ModeSymlink != 0 {
			return err
		}
		mode := info.Mode().Perm() | 0o040
		if !v.readOnly {
			mode |= 0o020
		}
		if d.IsDir() {
			mode |= 0o010 | os.ModeSetgid
		}
		return os.Chmod(path, mode)
	})
}

func (p *Provider) writeSecret(dir, ns, name string, items []corev1.KeyToPath, mode *int32, optional *bool, fresh bool) error {
	s, err := p.cfg.Secrets.Secrets(ns).Get(name)
	if err != nil {
		if apierrors.IsNotFound(err) && optional != nil && *optional {
			return resetDir(dir, fresh)
		}
		return fmt.Errorf("secret %q: %w", name, err)
	}
	return writeKeys(dir, s.Data, items, mode, optional, fresh)
}

func (p *Provider) writeConfigMap(dir, ns, name string, items []corev1.KeyToPath, mode *int32, optional *bool, fresh bool) error {
	cm, err := p.cfg.ConfigMaps.ConfigMaps(ns).Get(name)
	if err != nil {
		if apierrors.IsNotFound(err) && optional != nil && *optional {
			return resetDir(dir, fresh)
		}
		return fmt.Errorf("configmap %q: %w", name, err)
	}
	data := make(map[string][]byte, len(cm.Data)+len(cm.BinaryData))
	for k, v := range cm.Data {
		data[k] = []byte(v)
	}
	for k, v := range cm.BinaryData {
		data[k] = v
	}
	return writeKeys(dir, data, items, mode, optional, fresh)
}

// writeProjected writes all sources into one directory. Service account token
// sources are skipped: the provider has no TokenRequest client, so pods get the
// CA bundle and namespace but no token (tests here do not call the API from pods).
func (p *Provider) writeProjected(dir string, pod *corev1.Pod, v *corev1.ProjectedVolumeSource) error {
	if err := resetDir(dir, true); err != nil {
		return err
	}
	for _, src := range v.Sources {
		var err error
		switch {
		case src.Secret != nil:
			err = p.writeSecret(dir, pod.Namespace, src.Secret.Name, src.Secret.Items, v.DefaultMode, src.Secret.Optional, false)
		case src.ConfigMap != nil:
			err = p.writeConfigMap(dir, pod.Namespace, src.ConfigMap.Name, src.ConfigMap.Items, v.DefaultMode, src.ConfigMap.Optional, false)
		case src.DownwardAPI != nil:
			err = writeDownwardAPI(dir, pod, src.DownwardAPI.Items, v.DefaultMode, false)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// writeDownwardAPI supports the metadata fieldRefs (name, namespace, uid, labels,
// annotations); resourceFieldRefs and other fields are rejected.
func writeDownwardAPI(dir string, pod *corev1.Pod, items []corev1.DownwardAPIVolumeFile, mode *int32, fresh bool) error {
	data := map[string][]byte{}
	var keys []corev1.KeyToPath
	for _, it := range items {
		if it.FieldRef == nil {
			return fmt.Errorf("downwardAPI %q: only fieldRef is supported", it.Path)
		}
		var val string
		switch it.FieldRef.FieldPath {
		case "metadata.name":
			val = pod.Name
		case "metadata.namespace":
			val = pod.Namespace
		case "metadata.uid":
			val = string(pod.UID)
		case "metadata.labels":
			val = formatMap(pod.Labels)
		case "metadata.annotations":
			val = formatMap(pod.Annotations)
		default:
			return fmt.Errorf("downwardAPI %q: fieldPath %q is not supported", it.Path, it.FieldRef.FieldPath)
		}
		data[it.Path] = []byte(val)
		keys = append(keys, corev1.KeyToPath{Key: it.Path, Path: it.Path, Mode: it.Mode})
	}
	return writeKeys(dir, data, keys, mode, nil, fresh)
}

func formatMap(m map[string]string) string {
	var b strings.Builder
	for k, v := range m {
		fmt.Fprintf(&b, "%s=%q\n", k, v)
	}
	return b.String()
}

// writeKeys writes data into dir: every key when items is empty, otherwise the
// listed keys at their paths. Modes follow item.Mode, then defaultMode, then 0644.
func writeKeys(dir string, data map[string][]byte, items []corev1.KeyToPath, defaultMode *int32, optional *bool, fresh bool) error {
	if err := resetDir(dir, fresh); err != nil {
		return err
	}
	mode := os.FileMode(0o644)
	if defaultMode != nil {
		mode = os.FileMode(*defaultMode) & 0o777
	}
	if len(items) == 0 {
		for k := range data {
			items = append(items, corev1.KeyToPath{Key: k, Path: k})
		}
	}
	for _, it := range items {
		val, ok := data[it.Key]
		if !ok {
			if optional != nil && *optional {
				continue
			}
			return fmt.Errorf("key %q not found", it.Key)
		}
		rel := filepath.Clean(it.Path)
		if filepath.IsAbs(rel) || rel == ".." || strings.HasPrefix(rel, "../") {
			return fmt.Errorf("invalid path %q", it.Path)
		}
		m := mode
		if it.Mode != nil {
			m = os.FileMode(*it.Mode) & 0o777
		}
		full := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(full, val, m); err != nil {
			return err
		}
		if err := os.Chmod(full, m); err != nil { // WriteFile is subject to the umask
			return err
		}
	}
	return nil
}

// resetDir empties dir (when fresh) and makes sure it exists.
func resetDir(dir string, fresh bool) error {
	if fresh {
		if err := os.RemoveAll(dir); err != nil {
			return err
		}
	}
	return os.MkdirAll(dir, 0o755)
}
