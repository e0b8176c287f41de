"""Certificates the TLS tests make (`paramserver.security.certs`): the cluster's CA and node certificates, and
another CA's (an outsider's)."""

from pathlib import Path

from paramserver.security.certs import node_tls_files, write_certs
from paramserver.security.tls import TlsMaterial


def write_pki(root: Path) -> Path:
    """The cluster's CA and node certificates under root/cluster, and another CA's under root/other."""
    write_certs(root / "cluster", ["ps-0", "worker-0", "worker-1", "client"])
    write_certs(root / "other", ["client"])
    return root


def material(pki, ca_dir: str, node: str) -> TlsMaterial:
    files = node_tls_files(pki / ca_dir, node)
    return TlsMaterial.load(files["tls_cert"], files["tls_key"], files["tls_ca"])
