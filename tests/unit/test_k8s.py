"""`paramserver k8s`: every object valid for Kubernetes (and the TFJob for Kubeflow's models), names
that resolve to the Services, the index and probes each role needs, Secrets and volumes; and the
generated pods' command lines run for real on this machine (plain form, and TFJob under the
TF_CONFIG the operator writes, dense and sparse)."""

from __future__ import annotations

import base64
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubeflow.training.api_client import ApiClient

from paramserver.base.errors import ConfigError
from paramserver.launch import cli
from paramserver.launch.certs import write_certs
from paramserver.launch.k8s import Deployment, manifests, render
from paramserver.launch.tokens import write_tokens
from paramserver.transport.health import check
from tests.conftest import ROOT
from tests.tfjob import tfjob_cluster, tfjob_tf_config

K8S_VERSION = "1.29.0"  # the oldest the objects need: a StatefulSet's pod-index label (1.28), gRPC probes (1.24)
SMALL = str(ROOT / "tests" / "integration" / "scripts" / "train_small.py")


def deployment(**given) -> Deployment:
    return Deployment(**{"name": "ctr", "image": "reg/ctr:1", "script": "/app/train.py", "args": ("--steps", "5"),
                         "namespace": "ml", "port": 2300, **given})


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict], kind: str, name: str) -> dict:
    [found] = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    return found


def pod_templates(objects: list[dict]) -> dict[str, dict]:
    """Role -> pod template, whichever object holds it."""
    found = {}
    for o in objects:
        if o["kind"] in ("StatefulSet", "Job"):
            found[o["metadata"]["labels"]["paramserver.io/role"]] = o["spec"]["template"]
        if o["kind"] == "TFJob":
            found.update({kind.lower(): spec["template"] for kind, spec in o["spec"]["tfReplicaSpecs"].items()})
    return found


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def make_certs(tmp_path: Path, d: Deployment, hosts: list[str] | None = None) -> Path:
    directory = tmp_path / "certs"
    write_certs(directory, list(d.node_hosts), hosts if hosts is not None else sorted(d.node_hosts.values()), 30)
    write_tokens(directory, [*d.node_hosts, "admin"])
    return directory


SHAPES = {
    "plain": {},
    "plain, chief, evaluator, local checkpoints": {"chief": True, "evaluator": True, "workers": 3,
                                                   "options": {"checkpoint_dir": "/ckpt", "mode": "sync"}},
    "tfjob": {"tfjob": True, "ps": 2, "workers": 2},
    "tfjob, dynamic workers, chief, evaluator, s3": {"tfjob": True, "dynamic_workers": True, "chief": True,
                                                     "evaluator": True, "options": {"checkpoint_dir": "s3://b/r",
                                                                                    "metrics_port": 9100}},
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("secured", [False, True], ids=["plaintext", "tls+tokens"])
def test_every_object_is_valid_for_kubernetes_and_the_tfjob_for_kubeflow(shape, secured, tmp_path):
    d = deployment(**SHAPES[shape])
    if secured:
        certs = make_certs(tmp_path, d)
        d = deployment(**SHAPES[shape], certs=certs, tokens=certs)
    objects = manifests(d)
    assert list(yaml.safe_load_all(render(d))) == objects
    for o in objects:
        if o["kind"] != "TFJob":
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    for tfjob in by_kind(objects, "TFJob"):
        for kind, spec in tfjob["spec"]["tfReplicaSpecs"].items():
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": kind.lower()},
                                          "template": spec["template"]}, K8S_VERSION, strict=True)
            assert spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        client = ApiClient()
        model = client._ApiClient__deserialize(tfjob, "KubeflowOrgV1TFJob")
        assert client.sanitize_for_serialization(model) == tfjob  # a field Kubeflow does not know would be lost
        assert set(tfjob["spec"]["tfReplicaSpecs"]) <= {"PS", "Worker", "Chief", "Evaluator"}


def test_the_plain_cluster_names_are_the_services_dns_names():
    d = deployment(chief=True, evaluator=True, ps=2, workers=3)
    objects = manifests(d)
    cluster = json.loads(named(objects, "ConfigMap", "ctr-cluster")["data"]["cluster.json"])["cluster"]
    assert {role: len(addresses) for role, addresses in cluster.items()} == {"ps": 2, "chief": 1, "worker": 3,
                                                                          "evaluator": 1}
    for role, addresses in cluster.items():
        owner = [o for o in objects if o["kind"] in ("StatefulSet", "Job") and o["metadata"]["name"] == f"ctr-{role}"]
        [owner] = owner
        template = owner["spec"]["template"]
        service_name = owner["spec"]["serviceName"] if owner["kind"] == "StatefulSet" else template["spec"]["subdomain"]
        service = named(objects, "Service", service_name)
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
        labels = template["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        if owner["kind"] == "Job":
            assert owner["spec"]["completionMode"] == "Indexed" and owner["spec"]["completions"] == len(addresses)
        else:
            assert owner["spec"]["replicas"] == len(addresses)
        for i, address in enumerate(addresses):
            # a StatefulSet's pod i and an indexed Job's pod i are both named <owner>-<i>
            assert address == f"{owner['metadata']['name']}-{i}.{service_name}.ml.svc:2300"
        [container] = template["spec"]["containers"]
        assert 2300 in [p["port"] for p in service["spec"]["ports"]]
        assert 2300 in [p["containerPort"] for p in container["ports"]]


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_tfjob_cluster_is_the_one_the_operator_names(dynamic):
    d = deployment(tfjob=True, dynamic_workers=dynamic, chief=True, evaluator=True, ps=2, workers=3)
    [tfjob] = manifests(d)
    replicas = {kind: spec["replicas"] for kind, spec in tfjob["spec"]["tfReplicaSpecs"].items()}
    assert replicas == {"PS": 2, "Chief": 1, "Worker": 3, "Evaluator": 1}
    assert tfjob["spec"].get("enableDynamicWorker", False) is dynamic
    for kind, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        [container] = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow"
        [port] = [p["containerPort"] for p in container["ports"] if p["name"] == "tfjob-port"]
        operator = tfjob_cluster(replicas, job="ctr", namespace="ml", port=port)
        assert json.loads(env_of(container)["PARAMSERVER_CLUSTER"]["value"]) == operator
        assert container["args"][:1] == ["node"] and "--role" not in container["args"]  # the task is TF_CONFIG's


def test_each_role_reads_its_index_from_its_own_pods_field():
    fields = {}
    for tfjob in (False, True):
        d = deployment(tfjob=tfjob, chief=True, evaluator=True)
        for role, template in pod_templates(manifests(d)).items():
            [container] = template["spec"]["containers"]
            env = env_of(container)
            fields[tfjob, role] = env["PARAMSERVER_TASK_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert env["PARAMSERVER_NODE"]["value"] == f"{role}-$(PARAMSERVER_TASK_INDEX)"
            if not tfjob:
                args = container["args"]
                assert args[args.index("--role") + 1] == role
                assert args[args.index("--index") + 1] == "$(PARAMSERVER_TASK_INDEX)"
    assert fields[False, "ps"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    for role in ("chief", "worker", "evaluator"):
        assert fields[False, role] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    for role in ("ps", "chief", "worker", "evaluator"):
        assert fields[True, role] == "metadata.labels['training.kubeflow.org/replica-index']"


@pytest.mark.parametrize("tfjob", [False, True])
def test_probes_ask_each_nodes_own_port(tfjob, tmp_path):
    plain = deployment(tfjob=tfjob, chief=True, evaluator=True, port=2400)
    certs = make_certs(tmp_path, plain)
    for d, tls in ((plain, False), (deployment(tfjob=tfjob, chief=True, evaluator=True, port=2400, certs=certs), True)):
        for role, template in pod_templates(manifests(d)).items():
            [container] = template["spec"]["containers"]
            probes = {key: value for key, value in container.items() if key.endswith("Probe")}
            expected = {"ps": {"startupProbe", "readinessProbe", "livenessProbe"}, "chief": {"readinessProbe"},
                        "worker": {"readinessProbe"}, "evaluator": set()}[role]
            assert set(probes) == expected, role
            for probe in probes.values():
                if tls:
                    assert probe["exec"]["command"] == ["paramserver", "health", "localhost:2400"]
                else:
                    assert probe["grpc"] == {"port": 2400}
            assert container["ports"][0]["containerPort"] == 2400


def test_certs_and_tokens_are_secrets_each_node_mounts_and_names_its_own(tmp_path):
    d = deployment(chief=True, evaluator=True, workers=2)
    certs = make_certs(tmp_path, d)
    objects = manifests(deployment(chief=True, evaluator=True, workers=2, certs=certs, tokens=certs))
    tls = {k: base64.b64decode(v) for k, v in named(objects, "Secret", "ctr-tls")["data"].items()}
    tokens = {k: base64.b64decode(v) for k, v in named(objects, "Secret", "ctr-tokens")["data"].items()}
    nodes = ["ps-0", "chief-0", "worker-0", "worker-1"]
    assert set(tls) == {"ca.crt", *(f"{n}{ext}" for n in nodes for ext in (".crt", ".key"))}  # never ca.key
    assert all(tls[name] == (certs / name).read_bytes() for name in tls)
    assert set(tokens) == {"tokens.json", *(f"{n}.token" for n in nodes)}  # never the admin's token
    for role, template in pod_templates(objects).items():
        [container] = template["spec"]["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
        secrets = {v["name"]: v["secret"]["secretName"] for v in template["spec"]["volumes"] if "secret" in v}
        if role == "evaluator":
            assert not secrets and "PARAMSERVER_OPTIONS" not in env_of(container)
            continue
        assert secrets == {"tls": "ctr-tls", "tokens": "ctr-tokens"}
        options = json.loads(env_of(container)["PARAMSERVER_OPTIONS"]["value"])
        for index in range(len(d.cluster[role])):
            own = {k: v.replace("$(PARAMSERVER_NODE)", f"{role}-{index}") for k, v in options.items()}
            for option, secret, mount in (("tls_cert", tls, "tls"), ("tls_key", tls, "tls"), ("tls_ca", tls, "tls"),
                                          ("token_file", tokens, "tokens"), ("auth_tokens", tokens, "tokens")):
                directory, name = own[option].rsplit("/", 1)
                assert directory == mounts[mount] and name in secret, (role, option)


def test_certs_not_naming_the_nodes_hosts_are_refused(tmp_path):
    d = deployment(workers=2)
    certs = make_certs(tmp_path, d, hosts=["ctr-ps-0.ctr-ps.ml.svc"])
    with pytest.raises(ConfigError, match=r"worker-0 \(ctr-worker-0.ctr-worker.ml.svc\).*--hosts"):
        manifests(deployment(workers=2, certs=certs))
    wildcard = tmp_path / "wild"
    write_certs(wildcard, list(d.node_hosts), ["*.ctr-ps.ml.svc", "*.ctr-worker.ml.svc"], 30)
    assert named(manifests(deployment(workers=2, certs=wildcard)), "Secret", "ctr-tls")


def test_a_local_checkpoint_dir_is_a_shared_volume_and_a_url_is_none():
    objects = manifests(deployment(chief=True, storage_size="50Gi", options={"checkpoint_dir": "/ckpt/run"}))
    [claim] = by_kind(objects, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    for template in pod_templates(objects).values():
        [container] = template["spec"]["containers"]
        assert {"name": "checkpoints", "mountPath": "/ckpt/run"} in container["volumeMounts"]
    s3 = manifests(deployment(options={"checkpoint_dir": "s3://bucket/run"}))
    assert not by_kind(s3, "PersistentVolumeClaim")
    assert all("checkpoints" not in json.dumps(t) for t in pod_templates(s3).values())
    with pytest.raises(ConfigError, match="absolute path"):
        deployment(options={"checkpoint_dir": "ckpt"})


@pytest.mark.parametrize("argv, fragment", [
    (["--mode", "sync", "--backup-workers", "3"], "backup_workers"),
    (["--dynamic-workers"], "--tfjob"),
    (["--name", "Bad_Name"], "--name"),
])
def test_bad_requests_are_refused_before_any_yaml(argv, fragment, capsys):
    assert cli.main(["k8s", "--image", "i", "--workers", "2", *argv, "train.py"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and fragment in err


def test_the_command_writes_the_yaml_file(tmp_path, capsys):
    path = tmp_path / "ctr.yaml"
    assert cli.main(["k8s", "--image", "reg/ctr:1", "--name", "ctr", "--namespace", "ml", "--port", "2300",
                     "--tfjob", "-o", str(path), "/app/train.py", "--", "--steps", "5"]) == 0
    assert capsys.readouterr().out == ""
    assert list(yaml.safe_load_all(path.read_text())) == manifests(deployment(tfjob=True))


# ---- the generated command lines, run for real on this machine ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """`$(VAR)` as Kubernetes expands it in env values and args: defined names only, `$$` escapes."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def container_env(container: dict, index: int, extra: dict[str, str]) -> dict[str, str]:
    """The env a pod's process sees: the downward API gives the index, later values are expanded."""
    env = dict(extra)
    for entry in container["env"]:
        env[entry["name"]] = str(index) if "valueFrom" in entry else kubelet_expand(entry["value"], env)
    return env


class Pods:
    """Runs a deployment's containers as local processes: each DNS host becomes 127.0.0.1 on a free
    port, each mounted path a local directory."""

    def __init__(self, procs, d: Deployment, tmp_path: Path) -> None:
        self.procs, self.d, self.tmp = procs, d, tmp_path
        self.local = {address: f"127.0.0.1:{free_port()}" for addresses in d.cluster.values() for address in addresses}
        self.paths = {"/app/train.py": SMALL}

    def localize(self, text: str) -> str:
        for remote, local in [*self.local.items(), *self.paths.items()]:
            text = text.replace(remote, local)
        return text

    def mount(self, objects: list[dict], mount_path: str, files: dict[str, str | bytes]) -> None:
        directory = self.tmp / mount_path.strip("/").replace("/", "_")
        directory.mkdir(exist_ok=True)
        for name, data in files.items():
            (directory / name).write_bytes(data if isinstance(data, bytes) else data.encode())
        self.paths[mount_path] = str(directory)

    def start(self, container: dict, index: int, extra_env: dict[str, str] | None = None):
        env = {k: self.localize(v) for k, v in container_env(container, index, self.procs.env()).items()}
        env.update({k: self.localize(v) for k, v in (extra_env or {}).items()})
        args = [self.localize(kubelet_expand(a, env)) for a in container["args"]]
        assert container["command"] == ["paramserver"]
        return self.procs.start([sys.executable, "-m", "paramserver", "--log-level", "WARNING", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env), env


def applied_pushes(address: str) -> int:
    from tests.integration.test_node import applied_pushes as pushes
    return pushes(address)


@pytest.mark.cluster
def test_the_plain_pods_train_with_mutual_tls_and_tokens(procs, tmp_path):
    plain = deployment(workers=2)
    certs = make_certs(tmp_path, plain)
    d = deployment(workers=2, certs=certs, tokens=certs)
    objects = manifests(d)
    pods = Pods(procs, d, tmp_path)
    config = json.loads(pods.localize(named(objects, "ConfigMap", "ctr-cluster")["data"]["cluster.json"]))
    config["options"]["stream_port"] = free_port()  # one PS on this host: a fixed port as in its pod
    pods.mount(objects, "/etc/paramserver", {"cluster.json": json.dumps(config)})
    for secret in by_kind(objects, "Secret"):
        files = {k: base64.b64decode(v) for k, v in secret["data"].items()}
        pods.mount(objects, "/var/run/paramserver/" + secret["metadata"]["name"].split("-")[-1], files)
    templates = pod_templates(objects)
    [ps_container] = templates["ps"]["spec"]["containers"]
    [worker_container] = templates["worker"]["spec"]["containers"]
    ps, ps_env = pods.start(ps_container, 0)
    workers = [pods.start(worker_container, i)[0] for i in range(2)]
    outputs = [w.communicate(timeout=180)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    assert "worker 0/2 done" in outputs[0] and "worker 1/2 done" in outputs[1]
    assert ps.poll() is None, ps.stdout.read()
    # the exec probe, in the PS's env, dialling its pod's own port (here: the PS's local port)
    own_port = pods.local[d.cluster["ps"][0]].rsplit(":", 1)[1]
    argv = [a.replace(f"localhost:{d.port}", f"localhost:{own_port}")
            for a in ps_container["readinessProbe"]["exec"]["command"][1:]]
    probe = procs.start([sys.executable, "-m", "paramserver", *argv], stdout=subprocess.PIPE, text=True, env=ps_env)
    assert probe.communicate(timeout=60)[0].strip() == "SERVING" and probe.returncode == 0
    ps.terminate()
    assert ps.wait(30) == 0


@pytest.mark.cluster
@pytest.mark.parametrize("dynamic", [False, True], ids=["dense", "sparse"])
def test_the_tfjob_pods_train_under_the_operators_tf_config(dynamic, procs, tmp_path):
    d = deployment(tfjob=True, dynamic_workers=dynamic, chief=True, workers=1)
    [tfjob] = manifests(d)
    pods = Pods(procs, d, tmp_path)
    replicas = {kind: spec["replicas"] for kind, spec in tfjob["spec"]["tfReplicaSpecs"].items()}
    started = {}
    for kind, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        [container] = spec["template"]["spec"]["containers"]
        options = json.loads(env_of(container)["PARAMSERVER_OPTIONS"]["value"])
        options["stream_port"] = free_port()
        container = {**container, "env": [e if e["name"] != "PARAMSERVER_OPTIONS" else
                                          {**e, "value": json.dumps(options)} for e in container["env"]]}
        tf_config = tfjob_tf_config(replicas, kind, 0, sparse=dynamic, job="ctr", namespace="ml", port=2300)
        started[kind] = pods.start(container, 0, {"TF_CONFIG": tf_config})[0]
    chief, worker = started["Chief"], started["Worker"]
    outputs = [p.communicate(timeout=180)[0] for p in (chief, worker)]
    assert [chief.returncode, worker.returncode] == [0, 0], outputs
    assert "worker 0/2 done" in outputs[0] and "worker 1/2 done" in outputs[1]
    ps_address = pods.local[d.cluster["ps"][0]]
    assert check(ps_address, 10) == "SERVING"  # what the gRPC readiness probe asks
    assert applied_pushes(ps_address) == 10  # 5 steps of each worker
    started["PS"].terminate()
    assert started["PS"].wait(30) == 0


def test_health_of_a_node_that_does_not_answer_is_a_failing_probe(capsys):
    assert cli.main(["health", f"127.0.0.1:{free_port()}", "--timeout", "0.5"]) == 1
    assert capsys.readouterr().out.strip() == "UNREACHABLE"


@pytest.mark.parametrize("given, bind", [({"metrics_port": 9100}, "0.0.0.0"), ({}, None),
                                         ({"metrics_port": 9100, "metrics_bind": "10.1.2.3"}, "10.1.2.3")])
def test_a_metrics_port_listens_on_the_pods_interfaces(given, bind):
    """Outside Kubernetes the endpoint listens on 127.0.0.1; Prometheus scrapes a pod's IP, so the
    manifests open it on every interface (unless the flags name a host)."""
    options = json.loads(named(manifests(deployment(options=given)), "ConfigMap", "ctr-cluster")["data"]["cluster.json"])
    assert options["options"].get("metrics_bind") == bind
