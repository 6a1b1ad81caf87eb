package main

import (
	"context"
	"encoding/json"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
)

// statusPatching makes the pod controller's status writes patches of the status alone,
// as the kubelet's are. virtual-kubelet writes a pod's status with UpdateStatus on the
// provider's copy of the pod, whose labels and annotations are as they were when the
// provider got it; the pods/status endpoint keeps the metadata it is sent, so such an
// update reverted labels set meanwhile (a warm pool's claim: "ready" went back to
// "warming", and a claim was lost).
type statusPatching struct{ kubernetes.Interface }

func (c statusPatching) CoreV1() corev1client.CoreV1Interface {
	return coreV1{c.Interface.CoreV1()}
}

type coreV1 struct{ corev1client.CoreV1Interface }

func (c coreV1) Pods(namespace string) corev1client.PodInterface {
	return pods{c.CoreV1Interface.Pods(namespace)}
}

type pods struct{ corev1client.PodInterface }

// UpdateStatus replaces the pod's status, and nothing else, with the given one.
func (p pods) UpdateStatus(ctx context.Context, pod *corev1.Pod, _ metav1.UpdateOptions) (*corev1.Pod, error) {
	patch, err := json.Marshal([]map[string]any{{"op": "replace", "path": "/status", "value": pod.Status}})
	if err != nil {
		return nil, err
	}
	return p.Patch(ctx, pod.Name, types.JSONPatchType, patch, metav1.PatchOptions{}, "status")
}
