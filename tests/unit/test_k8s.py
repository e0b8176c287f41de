"""`paramserver k8s`: every object valid for Kubernetes (and the TFJob for Kubeflow's models), names
that resolve to the Services, the index and probes each role needs, Secrets and volumes. The pods run
for real, and checkov over them, in tests/integration/test_k8s_pods.py."""

from __future__ import annotations

import base64
import json

import kubernetes_validate
import pytest
import yaml
from kubeflow.training.api_client import ApiClient
from tests.k8s_objects import SHAPES, by_kind, deployment, env_of, make_certs, named, pod_templates, secured_shapes
from tests.pod_security import restricted_violations
from tests.ports import free_port
from tests.tfjob import tfjob_cluster

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError
from paramserver.launch import cli
from paramserver.launch.kubernetes.manifests import manifests, render
from paramserver.launch.threads import PASSIVE_WAIT_ENV
from paramserver.node.ps_process import _exit_code
from paramserver.security.certs import write_certs

K8S_VERSIONS = ("1.25.0", "1.37.0")  # the oldest schema here (the objects need 1.24: gRPC probes) and the newest


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("secured", [False, True], ids=["plaintext", "tls+tokens"])
def test_every_object_is_valid_for_kubernetes_and_the_tfjob_for_kubeflow(shape, secured, tmp_path):
    d = deployment(**SHAPES[shape])
    if secured:
        certs = make_certs(tmp_path, d)
        d = deployment(**SHAPES[shape], certs=certs, tokens=certs)
    objects = manifests(d)
    assert list(yaml.safe_load_all(render(d))) == objects
    for o, version in ((o, version) for o in objects for version in K8S_VERSIONS):
        if o["kind"] != "TFJob":
            kubernetes_validate.validate(o, version, strict=True)
    for tfjob in by_kind(objects, "TFJob"):
        for kind, spec in tfjob["spec"]["tfReplicaSpecs"].items():
            for version in K8S_VERSIONS:
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                              "metadata": {"name": kind.lower()}, "template": spec["template"]},
                                             version, strict=True)
            assert spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        client = ApiClient()
        model = client._ApiClient__deserialize(tfjob, "KubeflowOrgV1TFJob")
        assert client.sanitize_for_serialization(model) == tfjob  # a field Kubeflow does not know would be lost
        assert set(tfjob["spec"]["tfReplicaSpecs"]) <= {"PS", "Worker", "Chief", "Evaluator"}


def test_the_plain_cluster_names_are_the_services_dns_names():
    """Each node is a Job of its own, whose pod takes the node's name as its hostname under its role's
    headless Service (hostname + subdomain): the name the cluster spec dials."""
    d = deployment(chief=True, evaluator=True, ps=2, workers=3)
    objects = manifests(d)
    cluster = json.loads(named(objects, "ConfigMap", "ctr-cluster")["data"]["cluster.json"])["cluster"]
    assert {role: len(addresses) for role, addresses in cluster.items()} == {"ps": 2, "chief": 1, "worker": 3,
                                                                          "evaluator": 1}
    assert {o["metadata"]["name"] for o in by_kind(objects, "Job")} == {
        f"ctr-{role}-{i}" for role, addresses in cluster.items() for i in range(len(addresses))}
    for role, addresses in cluster.items():
        service = named(objects, "Service", f"ctr-{role}")
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
        assert 2300 in [p["port"] for p in service["spec"]["ports"]]
        for i, address in enumerate(addresses):
            job = named(objects, "Job", f"ctr-{role}-{i}")
            assert "completionMode" not in job["spec"] and "completions" not in job["spec"]  # one pod
            template = job["spec"]["template"]
            assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
            pod = template["spec"]
            assert address == f"{pod['hostname']}.{pod['subdomain']}.ml.svc:2300" == f"ctr-{role}-{i}.ctr-{role}.ml.svc:2300"
            [container] = pod["containers"]
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


def test_each_node_knows_its_index_without_a_version_dependent_label():
    """Plain form: each node's template holds its index (no pod-index label, which needs Kubernetes
    1.28); TFJob: the operator's replica-index label, on every version."""
    found = {}
    for tfjob in (False, True):
        d = deployment(tfjob=tfjob, chief=True, evaluator=True, workers=2)
        for (role, index), template in pod_templates(manifests(d)).items():
            [container] = template["spec"]["containers"]
            env = env_of(container)
            found[role, index] = env["PARAMSERVER_TASK_INDEX"]
            assert env["PARAMSERVER_NODE"]["value"] == f"{role}-$(PARAMSERVER_TASK_INDEX)"
            if not tfjob:
                args = container["args"]
                assert args[args.index("--role") + 1] == role
                assert args[args.index("--index") + 1] == "$(PARAMSERVER_TASK_INDEX)"
    for role, count in (("ps", 1), ("chief", 1), ("worker", 2), ("evaluator", 1)):
        assert [found[role, i] for i in range(count)] == [{"name": "PARAMSERVER_TASK_INDEX", "value": str(i)}
                                                          for i in range(count)]
        assert found[role, None]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.labels['training.kubeflow.org/replica-index']"
    assert "pod-index" not in render(deployment(chief=True)) + render(deployment(tfjob=True))


def test_every_node_waits_passively_in_openmp():
    """A pod shares its node's cores: idle OpenMP threads must sleep, not spin (launch/threads.py)."""
    for tfjob in (False, True):
        for template in pod_templates(manifests(deployment(tfjob=tfjob, chief=True, evaluator=True))).values():
            [container] = template["spec"]["containers"]
            env = env_of(container)
            assert {name: env[name]["value"] for name in PASSIVE_WAIT_ENV} == PASSIVE_WAIT_ENV


@pytest.mark.parametrize("tfjob", [False, True])
def test_probes_ask_each_nodes_own_port(tfjob, tmp_path):
    plain = deployment(tfjob=tfjob, chief=True, evaluator=True, port=2400)
    certs = make_certs(tmp_path, plain)
    for d, tls in ((plain, False), (deployment(tfjob=tfjob, chief=True, evaluator=True, port=2400, certs=certs), True)):
        for (role, _), template in pod_templates(manifests(d)).items():
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


@pytest.mark.parametrize("tfjob", [False, True])
def test_certs_and_tokens_are_secrets_each_node_mounts_and_names_its_own(tfjob, tmp_path):
    """A plain pod mounts its own certificate, key and token only (and the CA, the store of hashes);
    a TFJob's pods share their replica type's template: those of its type."""
    d = deployment(tfjob=tfjob, chief=True, evaluator=True, workers=2)
    certs = make_certs(tmp_path, d)
    objects = manifests(deployment(tfjob=tfjob, chief=True, evaluator=True, workers=2, certs=certs, tokens=certs))
    tls = {k: base64.b64decode(v) for k, v in named(objects, "Secret", "ctr-tls")["data"].items()}
    tokens = {k: base64.b64decode(v) for k, v in named(objects, "Secret", "ctr-tokens")["data"].items()}
    nodes = ["ps-0", "chief-0", "worker-0", "worker-1"]
    assert set(tls) == {"ca.crt", *(f"{n}{ext}" for n in nodes for ext in (".crt", ".key"))}  # never ca.key
    assert all(tls[name] == (certs / name).read_bytes() for name in tls)
    assert set(tokens) == {"tokens.json", *(f"{n}.token" for n in nodes)}  # never the admin's token
    for (role, index), template in pod_templates(objects).items():
        [container] = template["spec"]["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
        secrets = {v["name"]: v["secret"] for v in template["spec"]["volumes"] if "secret" in v}
        if role == "evaluator":
            options = json.loads(env_of(container).get("PARAMSERVER_OPTIONS", {}).get("value", "{}"))
            assert not secrets and not any(key.startswith(("tls", "token", "auth")) for key in options)
            continue
        assert {name: secret["secretName"] for name, secret in secrets.items()} == {"tls": "ctr-tls",
                                                                                   "tokens": "ctr-tokens"}
        mine = [f"{role}-{i}" for i in ([index] if index is not None else range(len(d.cluster[role])))]
        files = {name: {item["path"] for item in secret["items"]} for name, secret in secrets.items()}
        assert files == {"tls": {"ca.crt", *(f"{n}{ext}" for n in mine for ext in (".crt", ".key"))},
                         "tokens": {"tokens.json", *(f"{n}.token" for n in mine)}}, (role, index)
        assert all(item["key"] == item["path"] for secret in secrets.values() for item in secret["items"])
        options = json.loads(env_of(container)["PARAMSERVER_OPTIONS"]["value"])
        for node in mine:
            own = {k: v.replace("$(PARAMSERVER_NODE)", node) for k, v in options.items() if isinstance(v, str)}
            for option, mount in (("tls_cert", "tls"), ("tls_key", "tls"), ("tls_ca", "tls"),
                                  ("token_file", "tokens"), ("auth_tokens", "tokens")):
                directory, name = own[option].rsplit("/", 1)
                assert directory == mounts[mount] and name in files[mount], (node, option)


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
        assert {"name": "scratch-0", "mountPath": "/tmp"} in container["volumeMounts"]
    s3 = manifests(deployment(options={"checkpoint_dir": "s3://bucket/run"}))
    assert not by_kind(s3, "PersistentVolumeClaim")
    assert all("checkpoints" not in json.dumps(t) for t in pod_templates(s3).values())
    with pytest.raises(ConfigError, match="absolute path"):
        deployment(options={"checkpoint_dir": "ckpt"})


@pytest.mark.parametrize("argv, fragment", [
    (["--mode", "sync", "--backup-workers", "3"], "backup_workers"),
    (["--dynamic-workers"], "--tfjob"),
    (["--name", "Bad_Name"], "--name"),
    (["--uid", "0"], "--uid"),
    (["--ttl-after-finished", "-2"], "--ttl-after-finished"),
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


# ---- security: the restricted Pod Security Standard and how each object ends ----

def test_every_pod_passes_the_restricted_pod_security_standard(tmp_path):
    """What a namespace labelled `pod-security.kubernetes.io/enforce: restricted` admits, and more: a
    numeric user, a read-only root filesystem with /tmp writable, no service account token."""
    for shape, d in secured_shapes(tmp_path).items():
        for (role, index), template in pod_templates(manifests(d)).items():
            spec = template["spec"]
            assert restricted_violations(spec) == [], (shape, role, index)
            assert spec["automountServiceAccountToken"] is False
            assert {key: spec["securityContext"][key] for key in ("runAsUser", "runAsGroup", "fsGroup")} == \
                {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001}
            [container] = spec["containers"]
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            scratch = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
            assert {"name": "scratch-0", "mountPath": "/tmp"} in container["volumeMounts"] and "scratch-0" in scratch
            secrets = [v["secret"] for v in spec["volumes"] if "secret" in v]
            assert all(secret["defaultMode"] == 0o440 for secret in secrets)  # group-readable: fsGroup


def test_the_pod_security_checker_finds_what_restricted_refuses():
    spec = {"hostNetwork": True, "securityContext": {"runAsUser": 0},
            "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
            "containers": [{"name": "c", "ports": [{"containerPort": 1, "hostPort": 1}],
                            "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]},
                                                "seccompProfile": {"type": "Unconfined"}}}]}
    found = " | ".join(restricted_violations(spec))
    for fragment in ("hostNetwork", "hostPath", "privileged", "SYS_ADMIN", "hostPort", "Unconfined", "runAsUser 0",
                     "allowPrivilegeEscalation", "runAsNonRoot", "drop ALL"):
        assert fragment in found


def test_scratch_directories_are_emptydirs_unless_on_a_volume_already():
    d = deployment(options={"checkpoint_dir": "/ckpt", "table_memory_budget": 1 << 20, "spill_dir": "/spill",
                            "logdir": "/ckpt/tb", "audit_log": "/var/log/ps/audit.jsonl"})
    mounts = {m["mountPath"]: m["name"] for m in pod_templates(manifests(d))["ps", 0]["spec"]["containers"][0]
              ["volumeMounts"]}
    assert {path: name for path, name in mounts.items() if name.startswith("scratch")} == {
        "/tmp": "scratch-0", "/spill": "scratch-1", "/var/log/ps": "scratch-2"}  # /ckpt/tb: on the checkpoint volume
    assert mounts["/ckpt"] == "checkpoints"


def test_the_plain_form_ends_with_the_run_and_the_tfjob_through_its_operator():
    """Plain: the chief ends the PS (stop_ps_at_end), every node's Job completes, and is deleted
    ttlSecondsAfterFinished later. TFJob: the operator deletes the pods still running (the PS) when
    the job ends (cleanPodPolicy Running), and the TFJob after the TTL."""
    objects = manifests(deployment(chief=True, evaluator=True, ttl_after_finished=600))
    cluster = json.loads(named(objects, "ConfigMap", "ctr-cluster")["data"]["cluster.json"])
    assert cluster["options"]["stop_ps_at_end"] is True
    jobs = by_kind(objects, "Job")
    assert {o["kind"] for o in objects} == {"ConfigMap", "Service", "Job"}  # nothing that outlives the run but these
    assert all(job["spec"]["ttlSecondsAfterFinished"] == 600 for job in jobs)
    assert all(job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure" for job in jobs)
    assert all("ttlSecondsAfterFinished" not in job["spec"]
               for job in by_kind(manifests(deployment(ttl_after_finished=-1)), "Job"))
    [tfjob] = manifests(deployment(tfjob=True, ttl_after_finished=600))
    assert tfjob["spec"]["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 6, "ttlSecondsAfterFinished": 600}
    options = json.loads(env_of(tfjob["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0])
                         ["PARAMSERVER_OPTIONS"]["value"])
    assert "stop_ps_at_end" not in options
    with pytest.raises(ConfigError, match="--uid"):
        deployment(uid=0)


@pytest.mark.parametrize("stop_at_end, causes, code", [
    (False, [15], 0), (True, [15], 143), (True, [2], 130), (True, ["end", 15], 0), (True, ["restart"], 75),
    (True, [15, "restart"], 75), (False, ["end"], 0)])
def test_a_ps_the_run_ends_exits_0_and_one_a_signal_stopped_first_fails(stop_at_end, causes, code):
    """A Job counts a pod that exited 0 as done: a PS evicted (SIGTERM) before the run ended it must not."""
    assert _exit_code(Options(stop_ps_at_end=stop_at_end), causes, 0) == code


# ---- probes and ports ----

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
