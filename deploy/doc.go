// Package deploy holds what runs lumen outside this repository: the
// Kubernetes manifests (k8s/, a kustomize base and the dev and gpu
// overlays), the Grafana dashboard (grafana/lumen.json) and the Prometheus
// scrape configuration (prometheus/prometheus.yml). It has no code; its
// tests check those files against the real binary:
//
//   - every manifest decodes with the Kubernetes API types, and every
//     overlay renders with kustomize (the library kubectl -k runs);
//   - every container's flags are flags `lumen` accepts (the built binary
//     parses them), its ports are the ports those flags bind, its probes
//     name ports and paths the process serves (asked of running
//     processes), the controllers join each other by the names the
//     headless Service gives them;
//   - every metric the dashboard queries is one the processes export,
//     scraped from a running cluster taken through a worker's failure,
//     its resumed stream and its progressive recovery.
//
// docs/deploy.md explains the choices.
package deploy
