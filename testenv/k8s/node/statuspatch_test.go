package main

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// A status write from a stale copy of the pod leaves the labels set meanwhile.
func TestStatusWritesKeepNewerLabels(t *testing.T) {
	ctx := context.Background()
	client := statusPatching{fake.NewSimpleClientset()}
	pods := client.CoreV1().Pods("ns")
	stale := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{
		Name: "p", Namespace: "ns", Labels: map[string]string{"state": "warming"},
	}}
	if _, err := pods.Create(ctx, stale, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	current, err := pods.Get(ctx, "p", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	current.Labels["state"] = "ready"
	if _, err := pods.Update(ctx, current, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	stale = stale.DeepCopy()
	stale.Status.Phase = corev1.PodRunning
	if _, err := pods.UpdateStatus(ctx, stale, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err := pods.Get(ctx, "p", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.Labels["state"] != "ready" {
		t.Errorf("the status write reverted the label to %q", got.Labels["state"])
	}
	if got.Status.Phase != corev1.PodRunning {
		t.Errorf("the status was not written: phase %q", got.Status.Phase)
	}
}
