package deploy

import (
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/api/types"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// overlays are the kustomizations a user applies; base is rendered too (it
// must stand on its own).
var overlays = []string{"k8s/base", "k8s/overlays/dev", "k8s/overlays/gpu", "k8s/overlays/autoscale"}

// objects is one rendered kustomization, decoded into the API types.
type objects struct {
	dir          string
	statefulSets []*appsv1.StatefulSet
	deployments  []*appsv1.Deployment
	services     []*corev1.Service
	pdbs         []*policyv1.PodDisruptionBudget
	namespaces   []*corev1.Namespace
	hpas         []*autoscalingv2.HorizontalPodAutoscaler
}

// decodeStrict decodes one YAML document into the API type of its kind; a
// field the type does not have is an error (a misspelt or misplaced field
// would be dropped by the API server without a word).
func decodeStrict(doc []byte) (any, error) {
	var meta struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := yaml.Unmarshal(doc, &meta); err != nil {
		return nil, err
	}
	var obj any
	switch meta.APIVersion + " " + meta.Kind {
	case "apps/v1 StatefulSet":
		obj = &appsv1.StatefulSet{}
	case "apps/v1 Deployment":
		obj = &appsv1.Deployment{}
	case "v1 Service":
		obj = &corev1.Service{}
	case "v1 Namespace":
		obj = &corev1.Namespace{}
	case "v1 Secret":
		obj = &corev1.Secret{}
	case "v1 ConfigMap":
		obj = &corev1.ConfigMap{}
	case "policy/v1 PodDisruptionBudget":
		obj = &policyv1.PodDisruptionBudget{}
	case "autoscaling/v2 HorizontalPodAutoscaler":
		obj = &autoscalingv2.HorizontalPodAutoscaler{}
	case "kustomize.config.k8s.io/v1beta1 Kustomization":
		obj = &types.Kustomization{}
	default:
		return nil, fmt.Errorf("kind %q of %q: no API type to check it with (add it to decodeStrict)", meta.Kind, meta.APIVersion)
	}
	if err := yaml.UnmarshalStrict(doc, obj); err != nil {
		return nil, fmt.Errorf("%s: %w", meta.Kind, err)
	}
	return obj, nil
}

// splitDocs splits a YAML stream at its "---" lines.
func splitDocs(b []byte) [][]byte {
	var docs [][]byte
	for _, d := range bytes.Split(append([]byte("\n"), b...), []byte("\n---")) {
		if len(bytes.TrimSpace(stripComments(d))) > 0 {
			docs = append(docs, d)
		}
	}
	return docs
}

func stripComments(b []byte) []byte {
	var out [][]byte
	for _, l := range bytes.Split(b, []byte("\n")) {
		if !bytes.HasPrefix(bytes.TrimSpace(l), []byte("#")) {
			out = append(out, l)
		}
	}
	return bytes.Join(out, []byte("\n"))
}

// TestManifestsDecode decodes every YAML document under k8s/ — resources,
// strategic-merge patches (partial objects of the same types) and the
// kustomization files — with the Kubernetes API types, strictly.
func TestManifestsDecode(t *testing.T) {
	n := 0
	err := filepath.WalkDir("k8s", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".yaml") {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for i, doc := range splitDocs(b) {
			if _, err := decodeStrict(doc); err != nil {
				t.Errorf("%s, document %d: %v", path, i+1, err)
			}
			n++
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n < 10 {
		t.Fatalf("decoded only %d documents under k8s/", n)
	}
}

// render runs kustomize (the library kubectl -k embeds) on dir and decodes
// what it produces.
func render(dir string) (*objects, error) {
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	m, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
	}
	out := &objects{dir: dir}
	for _, r := range m.Resources() {
		y, err := r.AsYAML()
		if err != nil {
			return nil, err
		}
		obj, err := decodeStrict(y)
		if err != nil {
			return nil, fmt.Errorf("%s: %s %s: %w", dir, r.GetKind(), r.GetName(), err)
		}
		switch o := obj.(type) {
		case *appsv1.StatefulSet:
			out.statefulSets = append(out.statefulSets, o)
		case *appsv1.Deployment:
			out.deployments = append(out.deployments, o)
		case *corev1.Service:
			out.services = append(out.services, o)
		case *policyv1.PodDisruptionBudget:
			out.pdbs = append(out.pdbs, o)
		case *corev1.Namespace:
			out.namespaces = append(out.namespaces, o)
		case *autoscalingv2.HorizontalPodAutoscaler:
			out.hpas = append(out.hpas, o)
		}
	}
	return out, nil
}

// renderAll renders every overlay once per test binary.
var rendered = map[string]*objects{}

func renderAll(t *testing.T) []*objects {
	t.Helper()
	var all []*objects
	for _, dir := range overlays {
		o := rendered[dir]
		if o == nil {
			var err error
			if o, err = render(filepath.Join("k8s", strings.TrimPrefix(dir, "k8s/"))); err != nil {
				t.Fatal(err)
			}
			rendered[dir] = o
		}
		all = append(all, o)
	}
	return all
}

// workload is a pod template with the object that owns it.
type workload struct {
	kind, name string
	replicas   int
	service    string // a StatefulSet's serviceName
	labels     map[string]string
	pod        *corev1.PodSpec
	sts        *appsv1.StatefulSet
}

func (o *objects) workloads() []workload {
	var ws []workload
	for _, s := range o.statefulSets {
		r := 1
		if s.Spec.Replicas != nil {
			r = int(*s.Spec.Replicas)
		}
		ws = append(ws, workload{"StatefulSet", s.Name, r, s.Spec.ServiceName, s.Spec.Template.Labels, &s.Spec.Template.Spec, s})
	}
	for _, d := range o.deployments {
		r := 1
		if d.Spec.Replicas != nil {
			r = int(*d.Spec.Replicas)
		}
		ws = append(ws, workload{"Deployment", d.Name, r, "", d.Spec.Template.Labels, &d.Spec.Template.Spec, nil})
	}
	return ws
}

// podName is a name the workload's first pod gets.
func (w workload) podName() string {
	if w.kind == "StatefulSet" {
		return w.name + "-0"
	}
	return w.name + "-7d4b9c-x2x5q"
}

func selects(selector, labels map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}
