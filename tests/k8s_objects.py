"""Deployments of `paramserver k8s` and ways to read the objects it renders, for the tests of both tiers."""

from __future__ import annotations

from pathlib import Path

from paramserver.launch.kubernetes.manifests import Deployment
from paramserver.security.certs import write_certs
from paramserver.security.tokens import write_tokens


def deployment(**given) -> Deployment:
    return Deployment(**{"name": "ctr", "image": "reg/ctr:1", "script": "/app/train.py", "args": ("--steps", "5"),
                         "namespace": "ml", "port": 2300, **given})


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict], kind: str, name: str) -> dict:
    [found] = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    return found


def pod_templates(objects: list[dict]) -> dict[tuple[str, int | None], dict]:
    """(role, node index) -> pod template, whichever object holds it; a TFJob's replica type has one
    template for all its nodes: index None."""
    found = {}
    for o in objects:
        if o["kind"] == "Job":
            labels = o["metadata"]["labels"]
            found[labels["paramserver.io/role"], int(labels["paramserver.io/index"])] = o["spec"]["template"]
        if o["kind"] == "TFJob":
            found.update({(kind.lower(), None): spec["template"] for kind, spec in o["spec"]["tfReplicaSpecs"].items()})
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


def secured_shapes(tmp_path: Path) -> dict[str, Deployment]:
    """Every shape, plaintext and with TLS and tokens; each under its own name."""
    found = {}
    for i, (shape, given) in enumerate(SHAPES.items()):
        found[shape] = deployment(**given, name=f"p{i}")
        certs = make_certs(tmp_path / f"s{i}", deployment(**given, name=f"s{i}"))
        found[f"{shape}, tls+tokens"] = deployment(**given, name=f"s{i}", certs=certs, tokens=certs)
    return found
