package provider

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"

	"github.com/distribution/reference"
	"github.com/docker/docker/api/types/image"
	"github.com/docker/docker/api/types/registry"
	corev1 "k8s.io/api/core/v1"
)

// loopbackRegistry reports whether ref names an image on a registry on this machine
// (127.0.0.0/8, ::1 or localhost): the only images this node pulls, so that no test
// ever sends traffic off the machine.
func loopbackRegistry(ref string) (string, bool) {
	named, err := reference.ParseNormalizedNamed(ref)
	if err != nil {
		return "", false
	}
	domain := reference.Domain(named)
	host := domain
	if h, _, err := net.SplitHostPort(domain); err == nil {
		host = h
	}
	if host == "localhost" {
		return domain, true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return domain, ip != nil && ip.IsLoopback()
}

// dockerConfigJSON is the payload of a kubernetes.io/dockerconfigjson Secret.
type dockerConfigJSON struct {
	Auths map[string]struct {
		Username string `json:"username"`
		Password string `json:"password"`
		Auth     string `json:"auth"`
	} `json:"auths"`
}

// registryAuth finds the credentials for domain in the pod's imagePullSecrets, as a
// kubelet does (the first Secret with an entry for the registry), encoded for the
// Docker API; "" when none has one. A Secret that is missing or malformed is an error.
func (p *Provider) registryAuth(pod *corev1.Pod, domain string) (string, error) {
	for _, ref := range pod.Spec.ImagePullSecrets {
		s, err := p.cfg.Secrets.Secrets(pod.Namespace).Get(ref.Name)
		if err != nil {
			return "", fmt.Errorf("imagePullSecret %q: %w", ref.Name, err)
		}
		var cfg dockerConfigJSON
		if err := json.Unmarshal(s.Data[corev1.DockerConfigJsonKey], &cfg); err != nil {
			return "", fmt.Errorf("imagePullSecret %q: not a %s Secret: %w", ref.Name, corev1.SecretTypeDockerConfigJson, err)
		}
		for server, entry := range cfg.Auths {
			server = strings.TrimPrefix(strings.TrimPrefix(server, "https://"), "http://")
			server = strings.TrimSuffix(strings.SplitN(server, "/", 2)[0], "/")
			if server != domain {
				continue
			}
			user, password := entry.Username, entry.Password
			if entry.Auth != "" {
				raw, err := base64.StdEncoding.DecodeString(entry.Auth)
				if err != nil {
					return "", fmt.Errorf("imagePullSecret %q: auth of %s is not base64", ref.Name, server)
				}
				user, password, _ = strings.Cut(string(raw), ":")
			}
			return registry.EncodeAuthConfig(registry.AuthConfig{
				Username:      user,
				Password:      password,
				ServerAddress: domain,
			})
		}
	}
	return "", nil
}

// pull pulls ref through Docker with the pod's credentials for its registry.
func (p *Provider) pull(ctx context.Context, pod *corev1.Pod, ref, domain string) error {
	auth, err := p.registryAuth(pod, domain)
	if err != nil {
		return err
	}
	body, err := p.docker.ImagePull(ctx, ref, image.PullOptions{RegistryAuth: auth})
	if err != nil {
		return err
	}
	defer body.Close()
	// The stream carries the pull's own error (unauthorized, not found) at its end.
	dec := json.NewDecoder(body)
	for {
		var msg struct {
			Error string `json:"error"`
		}
		if err := dec.Decode(&msg); err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
		if msg.Error != "" {
			return errors.New(msg.Error)
		}
	}
}
