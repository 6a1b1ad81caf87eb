package provider

// Labels put on every Docker container this provider creates. The pod labels use
// the same keys as the kubelet's old dockershim, so familiar tooling finds them.
const (
	// LabelProvider marks containers created by this provider (value ProviderName).
	// `cluster.sh down` removes every container with this label.
	LabelProvider = "sandbox-test.k8s/provider"
	// LabelNode names the virtual node that owns the container.
	LabelNode = "sandbox-test.k8s/node"

	LabelPodNamespace  = "io.kubernetes.pod.namespace"
	LabelPodName       = "io.kubernetes.pod.name"
	LabelPodUID        = "io.kubernetes.pod.uid"
	LabelContainerName = "io.kubernetes.container.name"
	// LabelInitContainer is "true" on containers created for spec.initContainers.
	LabelInitContainer = "sandbox-test.k8s/init-container"

	// ProviderName is the value of LabelProvider.
	ProviderName = "docker-vk"
)
