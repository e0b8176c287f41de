"""`paramserver k8s`: Kubernetes manifests (a Job per role, or a Kubeflow TFJob) and their pods' commands."""
