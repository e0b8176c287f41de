"""TF_CONFIG and the cluster exactly as Kubeflow's training-operator builds them for a TFJob
(genClusterSpec and genTFConfigJSONStr in pkg/controller.v1/tensorflow/tensorflow.go)."""

from __future__ import annotations

import json


def tfjob_cluster(replicas: dict[str, int], job: str = "job", namespace: str = "ns", port: int = 2222) -> dict:
    """The cluster Kubeflow's TFJob controller builds (genClusterSpec): every replica type, evaluator
    and master included, lower-cased, one `<job>-<type>-<i>.<namespace>.svc:<port>` per replica."""
    return {kind.lower(): [f"{job}-{kind.lower()}-{i}.{namespace}.svc:{port}" for i in range(count)]
            for kind, count in replicas.items()}


def tfjob_tf_config(replicas: dict[str, int], task_type: str, index: int, sparse: bool = False, **where) -> str:
    """TF_CONFIG as the TFJob controller writes it (genTFConfigJSONStr): the dense form with
    "environment": "cloud", or with `sparse` (enableDynamicWorker) the sparse form: a worker names
    itself and every PS, a PS only itself, any other task (chief, master, evaluator) nothing."""
    cluster, task_type = tfjob_cluster(replicas, **where), task_type.lower()
    task = {"type": task_type, "index": index}
    if not sparse:
        return json.dumps({"cluster": cluster, "task": task, "environment": "cloud"})
    sparse_cluster = {"worker": {}, "ps": []}
    if task_type == "ps":
        sparse_cluster["ps"] = [cluster["ps"][index]]
    elif task_type == "worker":
        sparse_cluster = {"worker": {str(index): cluster["worker"][index]}, "ps": cluster.get("ps", [])}
    return json.dumps({"sparseCluster": sparse_cluster, "task": task})
