"""The pods `paramserver k8s` renders, checked by checkov and run for real on this machine (plain form, and
TFJob under the TF_CONFIG the operator writes, dense and sparse)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tests.conftest import ROOT
from tests.k8s_objects import by_kind, deployment, env_of, make_certs, named, pod_templates, secured_shapes
from tests.ports import free_port
from tests.tfjob import tfjob_tf_config

from paramserver.launch.kubernetes.manifests import Deployment, manifests
from paramserver.transport.health import check

SMALL = str(ROOT / "tests" / "integration" / "scripts" / "train_small.py")


# ---- checkov over every shape with TLS and tokens ----

CHECKOV_SKIPS = yaml.safe_load((ROOT / "deploy" / "checkov-skips.yaml").read_text())


def checkov_command() -> str:
    """checkov, installed apart from the project's environment (its pins clash with the project's):
    $CHECKOV, else .venv-checkov beside this environment or in the repository (`make setup`), else PATH."""
    places = [os.environ.get("CHECKOV", ""), str(Path(sys.prefix).parent / ".venv-checkov" / "bin" / "checkov"),
              str(ROOT / ".venv-checkov" / "bin" / "checkov"), shutil.which("checkov") or ""]
    found = [place for place in places if place and Path(place).is_file()]
    if not found:
        pytest.fail(f"checkov {CHECKOV_SKIPS['checkov']} is not installed: `make setup` installs it in .venv-checkov")
    return found[0]


@pytest.mark.cluster  # starts checkov
def test_checkov_fails_no_check_but_those_skipped_with_a_reason(tmp_path):
    """One checkov run over every shape with TLS and tokens: a TFJob (a kind checkov does not know) as
    its replicas' pods."""
    directory = tmp_path / "manifests"
    directory.mkdir()
    workloads = set()
    for i, d in enumerate(secured_shapes(tmp_path).values()):
        objects = manifests(d)
        if d.certs is None:  # the plaintext forms differ only in their probes (grpc) and mount no Secret
            continue
        for tfjob in by_kind(objects, "TFJob"):
            objects.remove(tfjob)
            objects += [{"apiVersion": "v1", "kind": "Pod", "metadata": {**d.metadata(f"{d.name}-{kind.lower()}")},
                         "spec": spec["template"]["spec"]} for kind, spec in tfjob["spec"]["tfReplicaSpecs"].items()]
        (directory / f"{i}.yaml").write_text(yaml.safe_dump_all(objects))
        workloads |= {f"{o['kind']}.ml.{o['metadata']['name']}" for o in objects if o["kind"] in ("Job", "Pod")}
    run = subprocess.run([checkov_command(), "-d", str(directory), "--framework", "kubernetes", "-o", "json", "--quiet",
                          "--compact", "--skip-download"], capture_output=True, text=True, timeout=240)
    report = json.loads(run.stdout)
    assert report["summary"]["parsing_errors"] == 0, run.stderr
    assert report["summary"]["checkov_version"] == CHECKOV_SKIPS["checkov"], "deploy/checkov-skips.yaml's version"
    failed: dict[str, set[str]] = {}
    for check_result in report["results"]["failed_checks"]:
        failed.setdefault(check_result["check_id"], set()).add(check_result["resource"])
    assert workloads <= failed["CKV_K8S_11"], "checkov read every Job and Pod (none has a CPU limit)"
    unexplained = {check: sorted(found) for check, found in failed.items() if check not in CHECKOV_SKIPS["skips"]}
    assert not unexplained, "a failed check needs a fix or a reason in deploy/checkov-skips.yaml"
    assert set(failed) == set(CHECKOV_SKIPS["skips"]), "a check that passes needs no skip"
    assert all(len(reason) > 80 for reason in CHECKOV_SKIPS["skips"].values())


# ---- the generated command lines, run for real on this machine ----

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

    def mount_volumes(self, objects: list[dict], template: dict, pod: str) -> dict[str, str]:
        """The pod's Secret volumes as local directories holding their items only: mount path -> directory."""
        secrets = {o["metadata"]["name"]: o["data"] for o in by_kind(objects, "Secret")}
        volumes = {v["name"]: v["secret"] for v in template["spec"]["volumes"] if "secret" in v}
        [container] = template["spec"]["containers"]
        found = {}
        for mount in container["volumeMounts"]:
            if mount["name"] in volumes:
                secret = volumes[mount["name"]]
                directory = self.tmp / pod / mount["name"]
                directory.mkdir(parents=True)
                for item in secret["items"]:
                    (directory / item["path"]).write_bytes(base64.b64decode(secrets[secret["secretName"]][item["key"]]))
                found[mount["mountPath"]] = str(directory)
        return found

    def start(self, container: dict, index: int, extra_env: dict[str, str] | None = None,
              mounts: dict[str, str] | None = None):
        def local(text: str) -> str:
            for remote, there in (mounts or {}).items():  # this pod's own volumes first
                text = text.replace(remote, there)
            return self.localize(text)

        env = {k: local(v) for k, v in container_env(container, index, self.procs.env()).items()}
        env.update({k: local(v) for k, v in (extra_env or {}).items()})
        args = [local(kubelet_expand(a, env)) for a in container["args"]]
        assert container["command"] == ["paramserver"]
        return self.procs.start([sys.executable, "-m", "paramserver", "--log-level", "WARNING", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env), env


def applied_pushes(address: str) -> int:
    from tests.integration.test_node import applied_pushes as pushes
    return pushes(address)


@pytest.mark.cluster
def test_the_plain_pods_train_with_mutual_tls_and_tokens_and_the_chief_ends_the_ps(procs, tmp_path):
    """Each pod with its own Secret items only; the PS's exec probe answers SERVING; once the run
    completed the chief ends the PS (with its chief token), which exits 0: its Job completes."""
    plain = deployment(workers=2)
    certs = make_certs(tmp_path, plain)
    d = deployment(workers=2, certs=certs, tokens=certs)
    objects = manifests(d)
    pods = Pods(procs, d, tmp_path)
    config = json.loads(pods.localize(named(objects, "ConfigMap", "ctr-cluster")["data"]["cluster.json"]))
    config["options"]["stream_port"] = free_port()  # one PS on this host: a fixed port as in its pod
    assert config["options"]["stop_ps_at_end"] is True
    pods.mount(objects, "/etc/paramserver", {"cluster.json": json.dumps(config)})
    templates = pod_templates(objects)
    started = {}
    for role, index in (("ps", 0), ("worker", 0), ("worker", 1)):
        [container] = templates[role, index]["spec"]["containers"]
        mounts = pods.mount_volumes(objects, templates[role, index], f"{role}-{index}")
        started[role, index] = (container, *pods.start(container, index, mounts=mounts))
        if role == "ps":  # the exec probe, in the PS's env, dialling its pod's own port (here: the PS's local port)
            ps_container, ps, ps_env = started[role, index]
            assert ps.stdout.readline().startswith("PARAMSERVER_READY")
            own_port = pods.local[d.cluster["ps"][0]].rsplit(":", 1)[1]
            argv = [a.replace(f"localhost:{d.port}", f"localhost:{own_port}")
                    for a in ps_container["readinessProbe"]["exec"]["command"][1:]]
            probe = procs.start([sys.executable, "-m", "paramserver", *argv], stdout=subprocess.PIPE, text=True,
                                env=ps_env)
            assert probe.communicate(timeout=60)[0].strip() == "SERVING" and probe.returncode == 0
    workers = [started["worker", i][1] for i in range(2)]
    outputs = [w.communicate(timeout=180)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    assert "worker 0/2 done" in outputs[0] and "worker 1/2 done" in outputs[1]
    assert ps.wait(30) == 0, ps.stdout.read()


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
