"""`paramserver certs` (security/certs.py) and reading TLS material (security/tls.py)."""

import ipaddress
import json
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError
from paramserver.launch import cli
from paramserver.security.certs import node_tls_files, write_certs
from paramserver.security.tls import TlsMaterial, tls_from_options


def cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def verify(ca_dir, node_dir, node, host="localhost"):
    """Verify `node`'s certificate against ca_dir's CA, as a TLS server for `host` and as a TLS client."""
    store = Store([cert(ca_dir / "ca.crt")])
    leaf = cert(node_dir / f"{node}.crt")
    PolicyBuilder().store(store).build_server_verifier(x509.DNSName(host)).verify(leaf, [])
    PolicyBuilder().store(store).build_client_verifier().verify(leaf, [])


def test_certs_writes_a_ca_and_a_certificate_per_node(tmp_path):
    directory = tmp_path / "certs"
    written = write_certs(directory, ["ps-0", "chief-0", "worker-0"], hosts=["ps-0.train.svc", "10.1.2.3"], days=30)
    names = {"ca.crt", "ca.key", *(f"{n}.{ext}" for n in ("ps-0", "chief-0", "worker-0") for ext in ("crt", "key"))}
    assert {p.name for p in written} == names == {p.name for p in directory.iterdir()}
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in directory.glob("*.key"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    ps0 = cert(directory / "ps-0.crt")
    assert ps0.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "ps-0"
    sans = ps0.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(sans.get_values_for_type(x509.DNSName)) == {"localhost", "ps-0", "ps-0.train.svc"}
    assert set(sans.get_values_for_type(x509.IPAddress)) == {ipaddress.ip_address("127.0.0.1"),
                                                             ipaddress.ip_address("10.1.2.3")}
    usages = ps0.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert (ps0.not_valid_after_utc - ps0.not_valid_before_utc).days == 30
    for node in ("ps-0", "chief-0", "worker-0"):
        verify(directory, directory, node)
    verify(directory, directory, "ps-0", host="ps-0.train.svc")
    with pytest.raises(VerificationError):  # a host the certificate does not name
        verify(directory, directory, "ps-0", host="elsewhere.example")


def test_a_certificate_of_another_ca_does_not_verify(tmp_path):
    write_certs(tmp_path / "a", ["ps-0"])
    write_certs(tmp_path / "b", ["ps-0"])
    with pytest.raises(VerificationError):
        verify(tmp_path / "a", tmp_path / "b", "ps-0")


def test_a_directory_with_a_ca_keeps_it_and_adds_nodes(tmp_path):
    write_certs(tmp_path, ["ps-0"])
    ca_before = (tmp_path / "ca.crt").read_bytes()
    written = write_certs(tmp_path, ["worker-7"])
    assert {p.name for p in written} == {"worker-7.crt", "worker-7.key"}
    assert (tmp_path / "ca.crt").read_bytes() == ca_before
    verify(tmp_path, tmp_path, "worker-7")
    verify(tmp_path, tmp_path, "ps-0")


@pytest.mark.parametrize("nodes, hosts, days, fragment", [
    ([], [], 365, "names no node"),
    (["ps 0"], [], 365, "not valid"),
    (["../evil"], [], 365, "not valid"),
    (["ca"], [], 365, "not valid"),
    (["ps-0", "ps-0"], [], 365, "given twice"),
    (["ps-0"], ["bad..host"], 365, "'bad..host' is not valid"),
    (["ps-0"], [], 0, "--days"),
])
def test_bad_arguments_are_refused_before_anything_is_written(tmp_path, nodes, hosts, days, fragment):
    directory = tmp_path / "certs"
    with pytest.raises(ConfigError, match=fragment):
        write_certs(directory, nodes, hosts, days)
    assert not directory.exists()


def test_the_certs_command(tmp_path, capsys):
    assert cli.main(["certs", str(tmp_path / "c"), "--nodes", "ps-0,worker-0", "--hosts", "h1", "--days", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["files"]) == {"ca.crt", "ca.key", "ps-0.crt", "ps-0.key", "worker-0.crt", "worker-0.key"}
    assert cli.main(["certs", str(tmp_path / "d"), "--nodes", "ps-0,ps-0"]) == 2
    assert "given twice" in capsys.readouterr().err


def test_run_with_certs_needs_every_nodes_files_and_no_other_tls_flag(tmp_path, capsys):
    write_certs(tmp_path, ["ps-0", "worker-0"])
    assert cli.main(["run", "--ps", "1", "--workers", "2", "--certs", str(tmp_path), "script.py"]) == 2
    err = capsys.readouterr().err
    assert "worker-1.crt" in err and "worker-1.key" in err and "paramserver certs" in err
    assert cli.main(["run", "--certs", str(tmp_path), "--tls-cert", "a", "--tls-key", "b", "script.py"]) == 2
    assert "one or the other" in capsys.readouterr().err


def test_tls_material_is_read_once_and_checked(tmp_path):
    write_certs(tmp_path, ["ps-0", "worker-0"])
    files = node_tls_files(tmp_path, "ps-0")
    material = tls_from_options(Options(**files))
    assert material.mutual and material.cert == (tmp_path / "ps-0.crt").read_bytes()
    assert tls_from_options(Options()) is None
    assert not TlsMaterial.load(files["tls_cert"], files["tls_key"]).mutual


@pytest.mark.parametrize("change, fragment", [
    (dict(tls_cert="missing.crt"), "'tls_cert': cannot read"),
    (dict(tls_ca="missing.crt"), "'tls_ca': cannot read"),
    (dict(tls_key="worker-0.key"), "not a certificate and its private key"),  # another node's key
    (dict(tls_cert="notpem.txt"), "not a PEM file"),
    (dict(tls_ca="worker-0.key"), "'tls_ca': not a PEM CA bundle"),
])
def test_bad_tls_files_are_a_config_error_naming_the_option(tmp_path, change, fragment):
    write_certs(tmp_path, ["ps-0", "worker-0"])
    (tmp_path / "notpem.txt").write_text("hello")
    files = {**node_tls_files(tmp_path, "ps-0"), **{k: str(tmp_path / v) for k, v in change.items()}}
    with pytest.raises(ConfigError, match=fragment):
        TlsMaterial.load(files["tls_cert"], files["tls_key"], files["tls_ca"])


def test_the_certs_command_writes_tokens_that_the_store_knows_by_role(tmp_path, capsys):
    from paramserver.security.auth import TokenStore, read_token

    directory = tmp_path / "c"
    assert cli.main(["certs", str(directory), "--nodes", "ps-0,worker-0,worker-1,admin", "--tokens"]) == 0
    printed = set(json.loads(capsys.readouterr().out)["files"])
    assert {"tokens.json", "worker-1.token", "admin.token"} <= printed
    store = TokenStore.load(directory / "tokens.json")
    roles = {node: store.find(read_token(directory / f"{node}.token")).role
             for node in ("ps-0", "worker-0", "worker-1", "admin")}
    assert roles == {"ps-0": "ps", "worker-0": "chief", "worker-1": "worker", "admin": "admin"}
    assert store.find("not-a-token") is None
