"""`paramserver certs DIR --nodes ...`: a cluster CA and one certificate per node (docs/security.md).

Writes DIR/ca.crt, DIR/ca.key and DIR/<node>.crt, DIR/<node>.key for every node (keys 0600, a new
DIR 0700). A DIR that already holds ca.crt and ca.key keeps its CA: the nodes named are (re)issued
by it, so a node can be added to a running cluster. Keys are ECDSA P-256 (fast handshakes).

A node's certificate: CN = the node's name; SANs = DNS localhost, DNS <node>, every `--hosts`
entry (an IP address or a DNS name), IP 127.0.0.1; usable as a TLS server and as a TLS client.
`paramserver run --certs DIR` gives node ps-<i> the files ps-<i>.*, worker <i> worker-<i>.*.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import re
from dataclasses import replace
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError

log = logging.getLogger(__name__)
CA_CERT, CA_KEY = "ca.crt", "ca.key"
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")  # a file name and a DNS label alike
_CLOCK_SKEW = datetime.timedelta(minutes=5)  # certificates are valid a little before they are made


def ps_node_name(index: int) -> str:
    return f"ps-{index}"


def worker_node_name(index: int) -> str:
    return f"worker-{index}"


def write_certs(directory: Path, nodes: list[str], hosts: list[str] | None = None, days: int = 365) -> list[Path]:
    """Write the CA (unless DIR has one) and every node's certificate and key; returns the files written.
    Every argument is checked before anything is written."""
    directory, hosts = Path(directory), list(hosts or [])
    sans = _check(directory, nodes, hosts, days)
    written = []
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_key, ca_cert = _existing_ca(directory)
    if ca_key is None:
        ca_key, ca_cert = _new_ca(directory.resolve().name, days)
        written += _write_pair(directory, "ca", ca_cert, ca_key)
    else:
        log.info("issuing with the CA already in %s", directory)
    for node in nodes:
        key = ec.generate_private_key(ec.SECP256R1())
        written += _write_pair(directory, node, _node_cert(node, key, sans, ca_cert, ca_key, days), key)
    return written


def _check(directory: Path, nodes: list[str], hosts: list[str], days: int) -> list[x509.GeneralName]:
    """The SANs every node certificate shares, once every argument is known good."""
    problems = []
    if not nodes:
        problems.append("--nodes names no node")
    bad = [n for n in nodes if not _NODE_NAME.match(n) or n == "ca"]
    if bad:
        problems.append(f"node names {bad} are not valid (letters, digits, '.', '_', '-'; not 'ca')")
    doubled = sorted({n for n in nodes if nodes.count(n) > 1})
    if doubled:
        problems.append(f"node names {doubled} are given twice")
    if not 1 <= days <= 100 * 366:
        problems.append(f"--days must be from 1 to 36600, got {days}")
    sans: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for host in hosts:
        try:
            sans.append(_san(host))
        except ValueError as exc:
            problems.append(f"--hosts entry {host!r} is not valid: {exc}")
    if directory.exists() and not directory.is_dir():
        problems.append(f"{directory} exists and is not a directory")
    if (directory / CA_CERT).exists() != (directory / CA_KEY).exists():
        problems.append(f"{directory} holds one of {CA_CERT} and {CA_KEY} without the other")
    if problems:
        raise ConfigError("; ".join(problems))
    return sans


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if not host or not all(re.match(r"^(\*|[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)$", label) for label in labels):
        raise ValueError("neither an IP address nor a DNS name")
    return x509.DNSName(host)


def _existing_ca(directory: Path):
    """(CA key, CA certificate) already in `directory`, or (None, None)."""
    if not (directory / CA_KEY).exists():
        return None, None
    try:
        key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot use the CA in {directory}: {exc}") from None
    return key, cert


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - _CLOCK_SKEW, now + datetime.timedelta(days=days)


def _new_ca(label: str, days: int):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"paramserver CA {label}")])
    start, end = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _node_cert(node: str, key, sans: list[x509.GeneralName], ca_cert: x509.Certificate, ca_key, days: int):
    start, end = _validity(days)
    names = [sans[0], x509.DNSName(node), *sans[1:]]
    names = [n for i, n in enumerate(names) if n not in names[:i]]  # a --hosts entry may repeat one
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(min(end, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def _write_pair(directory: Path, stem: str, cert: x509.Certificate, key) -> list[Path]:
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    paths = [directory / f"{stem}.key", directory / f"{stem}.crt"]
    _write_atomic(paths[0], key_pem, 0o600)
    _write_atomic(paths[1], cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return paths


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Written whole or not at all; a key file is never readable by others, not even for a moment."""
    temp = path.with_name(f".{path.name}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as file:
        os.fchmod(fd, mode)  # the umask narrowed the mode given to open
        file.write(data)
        file.flush()
        os.fsync(fd)
    os.replace(temp, path)


def node_tls_files(directory: Path, node: str) -> dict[str, str]:
    """The tls_* options of `node` from a directory `write_certs` made."""
    directory = Path(directory).resolve()
    return {
        "tls_cert": str(directory / f"{node}.crt"),
        "tls_key": str(directory / f"{node}.key"),
        "tls_ca": str(directory / CA_CERT),
    }


def check_cert_dir(directory: Path, nodes: list[str]) -> None:
    """A ConfigError naming every file `nodes` need that `directory` lacks."""
    missing = [path for node in nodes for path in node_tls_files(directory, node).values() if not Path(path).is_file()]
    if missing:
        raise ConfigError(
            f"--certs {directory}: missing {sorted(set(missing))}; make them with "
            f"`paramserver certs {directory} --nodes {','.join(nodes)}`"
        )


def with_node_tls(options: Options, directory: Path | None, node: str) -> Options:
    """`options` with `node`'s files from `directory` (unchanged without a directory)."""
    if directory is None:
        return options
    files = node_tls_files(directory, node)
    return replace(options, tls_cert=files["tls_cert"], tls_key=files["tls_key"], tls_ca=files["tls_ca"])


def check_cert_hosts(directory: Path, hosts: dict[str, str]) -> None:
    """A ConfigError naming every node (of `hosts`: node -> host it is dialled at) whose certificate
    in `directory` does not name its host, as a client dialling it checks (an exact DNS name, or
    a wildcard `*.rest` for the host's first label)."""
    wrong = []
    for node, host in hosts.items():
        cert = x509.load_pem_x509_certificate((Path(directory) / f"{node}.crt").read_bytes())
        try:
            names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            names = x509.SubjectAlternativeName([])
        if not any(_covers(name, host) for name in names.get_values_for_type(x509.DNSName)):
            wrong.append(f"{node} ({host})")
    if wrong:
        needed = ",".join(sorted(set(hosts.values())))
        raise ConfigError(
            f"certificates in {directory} do not name the hosts their nodes are dialled at: "
            f"{', '.join(wrong)}; issue them with `paramserver certs {directory} --nodes "
            f"{','.join(hosts)} --hosts {needed}`"
        )


def _covers(name: str, host: str) -> bool:
    name, host = name.lower().rstrip("."), host.lower().rstrip(".")
    if name.startswith("*."):
        return "." in host and host.split(".", 1)[1] == name[2:]
    return name == host
