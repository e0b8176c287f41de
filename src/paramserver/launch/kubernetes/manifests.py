"""`paramserver k8s`: the Kubernetes objects of a cluster, as multi-document YAML (docs/deploy.md).

Plain form: every node (PS, chief, worker, evaluator) is a Job of its own, `<name>-<role>-<i>`,
whose pod has that hostname under its role's headless Service, so every node has a stable DNS name
`<name>-<role>-<i>.<name>-<role>.<ns>.svc`; one pod template per node, so each pod mounts its own
certificate, key and token only. The chief ends the PS when the run completed (`stop_ps_at_end`):
every Job completes, and is deleted `ttl_after_finished` seconds later. The cluster spec and the
shared options are in a ConfigMap (cluster.json); every node runs `paramserver node --cluster ...
--role R --index I`. TFJob form (`tfjob=True`): one kubeflow.org/v1 TFJob; the operator writes
TF_CONFIG, names the nodes `<name>-<role>-<i>.<ns>.svc` and deletes the pods still running when
the job ends; PARAMSERVER_CLUSTER holds the whole cluster for the sparse TF_CONFIG of
`enableDynamicWorker`. Both: Secrets from --certs / --tokens, a PVC for a local checkpoint
directory, probes, resource requests and the restricted security context (k8s_pods.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError
from paramserver.launch.kubernetes import pods

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_TFJOB_TYPES = {"ps": "PS", "chief": "Chief", "worker": "Worker", "evaluator": "Evaluator"}
_TFJOB_CONTAINER, _TFJOB_PORT = "tensorflow", "tfjob-port"  # the names the TFJob operator looks for


@dataclass(frozen=True)
class Deployment:
    """What `paramserver k8s` was asked for. `options`: the options every node shares (flags)."""

    name: str
    image: str
    script: str
    args: tuple[str, ...] = ()
    ps: int = 1
    workers: int = 1
    chief: bool = False
    evaluator: bool = False
    namespace: str = "default"
    port: int = 2222
    tfjob: bool = False
    dynamic_workers: bool = False
    storage_size: str = "10Gi"
    certs: Path | None = None
    tokens: Path | None = None
    cpu: str = "1"
    memory: str = "4Gi"
    uid: int = 10001  # the containers' user; their group and the volumes' (fsGroup) is `gid`
    gid: int = 10001
    ttl_after_finished: int = 86400  # seconds a finished Job (or TFJob) is kept; -1: until deleted
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if not _DNS_LABEL.match(self.name) or len(self.name) > 40:
            problems.append(f"--name {self.name!r} must be a DNS label of at most 40 characters (a-z, 0-9, '-')")
        if not _DNS_LABEL.match(self.namespace):
            problems.append(f"--namespace {self.namespace!r} must be a DNS label")
        if self.ps < 1 or self.workers < 1:
            problems.append(f"--ps and --workers must be at least 1, got {self.ps} and {self.workers}")
        if not 1 <= self.port <= 65534:
            problems.append(f"--port must be from 1 to 65534 (the stream takes the next), got {self.port}")
        if self.uid < 1 or self.gid < 1:
            problems.append(f"--uid and --gid must be at least 1 (not root), got {self.uid} and {self.gid}")
        if self.ttl_after_finished < -1:
            problems.append(f"--ttl-after-finished must be -1 (never) or more, got {self.ttl_after_finished}")
        if self.dynamic_workers and not self.tfjob:
            problems.append("--dynamic-workers is a TFJob's enableDynamicWorker: give --tfjob too")
        if self.checkpoint_volume and not self.checkpoint_volume.startswith("/"):
            problems.append(
                f"--checkpoint-dir {self.checkpoint_volume!r} must be an absolute path (the volume's "
                f"mount point) or a URL such as s3://bucket/run"
            )
        if problems:
            raise ConfigError("; ".join(problems))
        security = pods.node_options("ps", self.certs is not None, self.tokens is not None)
        Options.from_dict({**self.all_options, **security}).validate(self.workers + int(self.chief))

    @property
    def roles(self) -> dict[str, int]:
        """Role -> number of nodes, in the order the objects are written."""
        found = {"ps": self.ps, "chief": int(self.chief), "worker": self.workers, "evaluator": int(self.evaluator)}
        return {role: count for role, count in found.items() if count}

    def host(self, role: str, index: int) -> str:
        """A node's DNS name: the TFJob operator's per-replica Service, else the pod's own name under
        its role's headless Service."""
        if self.tfjob:
            return f"{self.name}-{role}-{index}.{self.namespace}.svc"
        return f"{self.name}-{role}-{index}.{self.name}-{role}.{self.namespace}.svc"

    @property
    def cluster(self) -> dict[str, list[str]]:
        return {role: [f"{self.host(role, i)}:{self.port}" for i in range(count)] for role, count in self.roles.items()}

    @property
    def node_hosts(self) -> dict[str, str]:
        """Node name (as `paramserver certs` and tokens name nodes) -> host, for the serving roles."""
        return {
            f"{role}-{i}": self.host(role, i)
            for role, count in self.roles.items()
            if role in pods.SERVING_ROLES
            for i in range(count)
        }

    @property
    def checkpoint_volume(self) -> str:
        """The checkpoint directory when it is a path (a volume is mounted there), else ""."""
        directory = self.options.get("checkpoint_dir", "")
        return "" if "://" in directory else directory

    @property
    def all_options(self) -> dict:
        return {**self.options, **pods.shared_options(self.port, self.options, self.tfjob)}

    def labels(self, role: str | None = None, index: int | None = None) -> dict[str, str]:
        found = {"app.kubernetes.io/name": "paramserver", "app.kubernetes.io/instance": self.name}
        if role:
            found["paramserver.io/role"] = role
        return found if index is None else {**found, "paramserver.io/index": str(index)}

    def metadata(self, name: str, role: str | None = None, index: int | None = None) -> dict:
        return {"name": name, "namespace": self.namespace, "labels": self.labels(role, index)}


def manifests(d: Deployment) -> list[dict]:
    """Every object of the deployment, each a dict as `kubectl apply` takes it."""
    objects = _secrets(d) + _checkpoint_claim(d)
    if d.tfjob:
        return objects + [_tfjob(d)]
    objects.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": d.metadata(f"{d.name}-cluster"),
            "data": {
                "cluster.json": json.dumps({"cluster": d.cluster, "options": d.all_options}, indent=1, sort_keys=True)
            },
        }
    )
    for role, count in d.roles.items():
        objects.append(_headless_service(d, role))
        objects.extend(_node_job(d, role, index) for index in range(count))
    return objects


class _Dumper(yaml.SafeDumper):
    """Plain YAML for people and kubectl: no anchors, a multi-line string (cluster.json) as a block."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def render(d: Deployment) -> str:
    return yaml.dump_all(manifests(d), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def _secrets(d: Deployment) -> list[dict]:
    found = []
    if d.certs is not None:
        found.append(pods.secret(f"{d.name}-tls", d.namespace, d.labels(), pods.cert_files(d.certs, d.node_hosts)))
    if d.tokens is not None:
        found.append(
            pods.secret(f"{d.name}-tokens", d.namespace, d.labels(), pods.token_files(d.tokens, list(d.node_hosts)))
        )
    return found


def _checkpoint_claim(d: Deployment) -> list[dict]:
    """A ReadWriteMany claim every node mounts: each PS writes its shard file, the chief the manifest."""
    if not d.checkpoint_volume:
        return []
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": d.metadata(f"{d.name}-checkpoints"),
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": d.storage_size}}},
        }
    ]


def _headless_service(d: Deployment, role: str) -> dict:
    """DNS for each pod of `role`, published before the pod is ready: a worker must reach every PS and
    the coordinator's host to become ready itself."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": d.metadata(f"{d.name}-{role}", role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": d.labels(role),
            "ports": [
                {"name": p["name"], "port": p["containerPort"], "targetPort": p["containerPort"]}
                for p in _ports(d, role)
            ],
        },
    }


def _node_job(d: Deployment, role: str, index: int) -> dict:
    """One node: a Job whose one pod is `<job>.<role's Service>.<ns>.svc` (hostname and subdomain).
    OnFailure restarts a failed node in its pod; a deleted or evicted pod is replaced under the same
    name. The Job completes when the node exits 0: a worker when its script ended, a PS when the
    chief ended it (`stop_ps_at_end`), an evaluator after the final checkpoint."""
    name = f"{d.name}-{role}-{index}"
    template = _pod_template(d, role, index, "OnFailure")
    template["metadata"]["labels"] = d.labels(role, index)
    template["spec"] = {"hostname": name, "subdomain": f"{d.name}-{role}", **template["spec"]}
    spec: dict = {"backoffLimit": 6, "template": template}
    if d.ttl_after_finished >= 0:
        spec["ttlSecondsAfterFinished"] = d.ttl_after_finished
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": d.metadata(name, role, index), "spec": spec}


def _tfjob(d: Deployment) -> dict:
    """One TFJob. restartPolicy OnFailure, not ExitCode: ExitCode restarts only exit codes 128 and up,
    while a node asking to be restarted (a cluster roll-back) exits RESTART_EXIT_CODE (75)."""
    replicas = {}
    extra_env = {"PARAMSERVER_CLUSTER": json.dumps(d.cluster, sort_keys=True)}
    for role, count in d.roles.items():
        template = _pod_template(d, role, pods.TFJOB_INDEX_FIELD, None, extra_env, count)
        replicas[_TFJOB_TYPES[role]] = {"replicas": count, "restartPolicy": "OnFailure", "template": template}
    run_policy: dict = {"cleanPodPolicy": "Running", "backoffLimit": 6 * d.workers}
    if d.ttl_after_finished >= 0:
        run_policy["ttlSecondsAfterFinished"] = d.ttl_after_finished
    spec: dict = {"tfReplicaSpecs": replicas, "runPolicy": run_policy}
    if d.dynamic_workers:
        spec["enableDynamicWorker"] = True
    return {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": d.metadata(d.name), "spec": spec}


def _pod_template(
    d: Deployment,
    role: str,
    index: int | str,
    restart: str | None,
    extra_env: dict[str, str] | None = None,
    count: int = 1,
) -> dict:
    """The pod of node `index` of `role` (plain form), or of every node of `role` (TFJob: `index` is
    the pod field holding it, `count` the number of such nodes)."""
    certs, tokens = d.certs is not None, d.tokens is not None
    options = pods.node_options(role, certs, tokens)
    if d.tfjob:  # no ConfigMap: the shared options travel with each node's own
        options = {**d.all_options, **options}
    env = pods.node_env(role, index, options, extra_env)
    nodes = [f"{role}-{i}" for i in ([index] if isinstance(index, int) else range(count))]
    mounts, volumes = _volumes(d, role, nodes)
    name = _TFJOB_CONTAINER if d.tfjob else "paramserver"
    node = pods.container(
        name,
        d.image,
        _args(d, role),
        env,
        _ports(d, role),
        mounts,
        pods.resources(d.cpu, d.memory),
        pods.probes(role, d.port, certs),
    )
    spec: dict = {
        "automountServiceAccountToken": False,  # a node never calls the Kubernetes API
        "securityContext": pods.pod_security(d.uid, d.gid),
        "containers": [node],
        "terminationGracePeriodSeconds": _grace(d),
        "volumes": volumes,
    }
    if restart:
        spec["restartPolicy"] = restart
    return {"metadata": {"labels": d.labels(role)}, "spec": spec}


def _args(d: Deployment, role: str) -> list[str]:
    """`paramserver` ARGS: the plain form names the cluster file, role and index; a TFJob's TF_CONFIG does."""
    args = ["node"]
    if not d.tfjob:
        args += ["--cluster", pods.CLUSTER_FILE, "--role", role, "--index", f"$({pods.INDEX_ENV})"]
    return args if role == "ps" else [*args, d.script, *d.args]


def _ports(d: Deployment, role: str) -> list[dict]:
    ports = [{"name": _TFJOB_PORT if d.tfjob else "grpc", "containerPort": d.port}]
    if role == "ps":
        ports.append({"name": "stream", "containerPort": d.port + 1})
    if d.options.get("metrics_port", -1) > 0:
        ports.append({"name": "metrics", "containerPort": d.options["metrics_port"]})
    return ports


def _volumes(d: Deployment, role: str, nodes: list[str]) -> tuple[list[dict], list[dict]]:
    """(volumeMounts, volumes) of the pods of `nodes` (each `<role>-<i>`): of the Secrets, their files only."""
    mounts, volumes = [], []
    if not d.tfjob:
        mounts.append({"name": "cluster", "mountPath": pods.CONFIG_DIR, "readOnly": True})
        volumes.append({"name": "cluster", "configMap": {"name": f"{d.name}-cluster"}})
    if role in pods.SERVING_ROLES:
        for wanted, volume, path, keys in (
            (d.certs, "tls", pods.TLS_DIR, pods.tls_keys(nodes)),
            (d.tokens, "tokens", pods.TOKENS_DIR, pods.token_keys(nodes)),
        ):
            if wanted is not None:
                mounts.append({"name": volume, "mountPath": path, "readOnly": True})
                volumes.append(pods.secret_volume(volume, f"{d.name}-{volume}", keys))
    written = []
    if d.checkpoint_volume:
        written.append(d.checkpoint_volume)
        mounts.append({"name": "checkpoints", "mountPath": d.checkpoint_volume})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": f"{d.name}-checkpoints"}})
    for i, directory in enumerate(pods.scratch_dirs(d.options, written)):
        mounts.append({"name": f"scratch-{i}", "mountPath": directory})
        volumes.append({"name": f"scratch-{i}", "emptyDir": {}})
    return mounts, volumes


def _grace(d: Deployment) -> int:
    """More than a PS's preemption grace plus its drain (node/ps_stop.py), which also covers a worker's
    preemption checkpoint (SIGTERM, then a checkpoint at the next step), so SIGKILL cuts neither short."""
    drain = d.options.get("drain_grace_s", Options.drain_grace_s)
    preempt = d.options.get("preempt_grace_s", Options.preempt_grace_s)
    return int(drain + preempt) + 20  # a PS serves the preemption grace, then drains
