"""The pod side of `paramserver k8s`: one container per node, its probes, volumes, Secrets and
security context.

In the plain form every node has a pod template of its own (k8s.py), so it mounts its own
certificate, key and token only; a TFJob has one template per replica type, whose pods share it.
Kubernetes expands `$(VAR)` in later env values and in args (docs/deploy.md). Every pod passes the
`restricted` Pod Security Standard: a numeric non-root user, no privilege escalation, no
capabilities, the runtime's seccomp profile, a read-only root filesystem (scratch on emptyDir
volumes) and no service account token. k8s.py builds the Kubernetes objects around these pieces.
"""

from __future__ import annotations

import base64
import json
import posixpath
from pathlib import Path

from paramserver.base.errors import ConfigError
from paramserver.launch.threads import PASSIVE_WAIT_ENV
from paramserver.security.certs import CA_CERT, check_cert_dir, check_cert_hosts
from paramserver.security.tokens import STORE_FILE

CONFIG_DIR = "/etc/paramserver"  # the ConfigMap: cluster.json (plain form)
CLUSTER_FILE = f"{CONFIG_DIR}/cluster.json"
TLS_DIR = "/var/run/paramserver/tls"  # the Secret made from --certs
TOKENS_DIR = "/var/run/paramserver/tokens"  # the Secret made from --tokens
INDEX_ENV = "PARAMSERVER_TASK_INDEX"
NODE_ENV = "PARAMSERVER_NODE"  # ps-<i>, chief-0, worker-<i>: the names `paramserver certs` and tokens use
TFJOB_INDEX_FIELD = "metadata.labels['training.kubeflow.org/replica-index']"  # the operator's label on a pod
SERVING_ROLES = ("ps", "chief", "worker")  # the roles that serve health on their cluster port
SCRATCH_DIR = "/tmp"  # an emptyDir in every pod: the root filesystem is read-only


def node_env(role: str, index: int | str, options: dict, extra: dict[str, str] | None = None) -> list[dict]:
    """The env of a node's container: its index (a number, or the pod field holding it, through the
    downward API), its node name and its options (PARAMSERVER_OPTIONS, where `$(PARAMSERVER_NODE)`
    names its own files), OpenMP's passive wait (a pod shares its node's cores: docs/performance.md,
    "Torch threads of a worker"), then `extra`."""
    own = {"value": str(index)} if isinstance(index, int) else {"valueFrom": {"fieldRef": {"fieldPath": index}}}
    env: list[dict] = [
        {"name": INDEX_ENV, **own},
        {"name": NODE_ENV, "value": f"{role}-$({INDEX_ENV})"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *({"name": name, "value": value} for name, value in PASSIVE_WAIT_ENV.items()),
    ]
    if options:
        env.append({"name": "PARAMSERVER_OPTIONS", "value": json.dumps(options, sort_keys=True)})
    return env + [{"name": name, "value": value} for name, value in (extra or {}).items()]


def node_options(role: str, certs: bool, tokens: bool) -> dict:
    """The security options of one node: its own certificate, key and token, the CA and the token
    store (none for an evaluator, which serves nothing and joins nothing: a CA alone would be refused)."""
    if role not in SERVING_ROLES:
        return {}
    options: dict[str, str] = {}
    if certs:
        options.update(
            tls_cert=f"{TLS_DIR}/$({NODE_ENV}).crt",
            tls_key=f"{TLS_DIR}/$({NODE_ENV}).key",
            tls_ca=f"{TLS_DIR}/{CA_CERT}",
        )
    if tokens:
        options.update(token_file=f"{TOKENS_DIR}/$({NODE_ENV}).token", auth_tokens=f"{TOKENS_DIR}/{STORE_FILE}")
    return options


def shared_options(port: int, given: dict, tfjob: bool) -> dict:
    """Options every node of the deployment shares: a fixed stream port next to the gRPC port, so a
    Service and a NetworkPolicy can name it (0, a free port, could not be declared); in the plain
    form `stop_ps_at_end` (the chief ends the PS: their Jobs complete with the run; a TFJob's
    operator deletes its PS pods itself); and with a metrics port, the metrics endpoint on every
    interface (Prometheus scrapes the pod's IP) unless `given` (the options asked for) names a
    metrics_bind."""
    shared: dict = {"stream_port": port + 1}
    if not tfjob:
        shared["stop_ps_at_end"] = True
    if given.get("metrics_port", -1) >= 0 and "metrics_bind" not in given:
        shared["metrics_bind"] = "0.0.0.0"
    return shared


def probes(role: str, port: int, tls: bool) -> dict:
    """The probes of a node's container.

    Without TLS Kubernetes' own gRPC probe asks grpc.health.v1 on the node's port. With TLS it cannot
    (it shows no client certificate), so an exec probe runs `paramserver health`, which reads the
    node's own TLS files from PARAMSERVER_OPTIONS in the container's env. A PS gets a startup probe
    (restoring a large checkpoint keeps it NOT_SERVING for a while), readiness and liveness; a worker
    readiness only: it is NOT_SERVING once its script ended while the chief's coordinator still
    serves the others, so a liveness probe would kill a chief waiting for its workers (a hung
    worker is the coordinator's heartbeat timeout's to find). An evaluator serves nothing."""
    if role not in SERVING_ROLES:
        return {}
    check = (
        {"exec": {"command": ["paramserver", "health", f"localhost:{port}"]}, "timeoutSeconds": 10}
        if tls
        else {"grpc": {"port": port}, "timeoutSeconds": 5}
    )
    found = {"readinessProbe": {**check, "periodSeconds": 10 if tls else 5}}
    if role == "ps":
        found["startupProbe"] = {**check, "periodSeconds": 10, "failureThreshold": 60}
        found["livenessProbe"] = {**check, "periodSeconds": 20, "failureThreshold": 6}
    return found


def container(
    name: str,
    image: str,
    args: list[str],
    env: list[dict],
    ports: list[dict],
    mounts: list[dict],
    resources: dict,
    probe_spec: dict,
) -> dict:
    """One node's container: `paramserver` ARGS, under container_security()."""
    found = {
        "name": name,
        "image": image,
        "command": ["paramserver"],
        "args": args,
        "env": env,
        "ports": ports,
        "resources": resources,
        "securityContext": container_security(),
        **probe_spec,
    }
    if mounts:
        found["volumeMounts"] = mounts
    return found


def resources(cpu: str, memory: str) -> dict:
    """Requests of `cpu` and `memory`; memory is the limit too (a node over it is killed, not the host)."""
    return {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}


def secret(name: str, namespace: str, labels: dict, files: dict[str, bytes]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "data": {key: base64.b64encode(data).decode() for key, data in sorted(files.items())},
    }


def cert_files(directory: Path, hosts: dict[str, str]) -> dict[str, bytes]:
    """The CA certificate and each node's certificate and key (never the CA's key), once every node's
    files are there and its certificate names the host the cluster spec dials it at."""
    check_cert_dir(directory, list(hosts))
    check_cert_hosts(directory, hosts)
    return {name: (directory / name).read_bytes() for name in tls_keys(list(hosts))}


def token_files(directory: Path, nodes: list[str]) -> dict[str, bytes]:
    """Each node's token and the store (never an admin's token: operators keep theirs)."""
    names = token_keys(nodes)
    missing = [name for name in names if not (directory / name).is_file()]
    if missing:
        raise ConfigError(
            f"--tokens {directory}: missing {missing}; make them with `paramserver certs DIR --nodes "
            f"{','.join(nodes)},admin --tokens` (or write_tokens, docs/security.md)"
        )
    return {name: (directory / name).read_bytes() for name in names}


def secret_volume(name: str, secret_name: str, keys: list[str]) -> dict:
    """The `keys` of a Secret (no other), as files readable by the container's user and group only
    (the group is the pod's fsGroup)."""
    items = [{"key": key, "path": key} for key in keys]
    return {"name": name, "secret": {"secretName": secret_name, "defaultMode": 0o440, "items": items}}


def tls_keys(nodes: list[str]) -> list[str]:
    """The files of the TLS Secret that `nodes` need: the CA certificate and their own certificates and keys."""
    return [CA_CERT] + [f"{node}{ext}" for node in nodes for ext in (".crt", ".key")]


def token_keys(nodes: list[str]) -> list[str]:
    """The files of the tokens Secret that `nodes` need: the store (hashes only) and their own tokens."""
    return [STORE_FILE] + [f"{node}.token" for node in nodes]


def pod_security(uid: int, gid: int) -> dict:
    """A pod's securityContext: a numeric non-root user and group, `gid` owning the mounted volumes
    (the Secrets' files are mode 0440), the runtime's default seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": gid,
        "fsGroup": gid,
        "fsGroupChangePolicy": "OnRootMismatch",  # a checkpoint volume's files are not walked at every start
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> dict:
    """A container's securityContext: no privilege escalation, no capability, a read-only root filesystem."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def scratch_dirs(options: dict, written: list[str]) -> list[str]:
    """Local directories a node writes, each an emptyDir volume: /tmp, and the directories the options
    name (spill_dir, logdir, the audit log's) unless under /tmp or one of the `written` volumes (the
    checkpoint volume)."""
    found = [SCRATCH_DIR]
    wanted = [options.get("spill_dir", ""), options.get("logdir", "")]
    if options.get("audit_log"):
        wanted.append(posixpath.dirname(options["audit_log"]))
    for directory in wanted:
        directory = posixpath.normpath(directory) if directory.startswith("/") else ""
        if directory and not any(_under(directory, parent) for parent in found + written):
            found.append(directory)
    return found


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")
