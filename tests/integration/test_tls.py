"""TLS and mutual TLS: a cluster trains over it as it does in plaintext, and a PS refuses every
peer without a certificate from its CA, on gRPC and on the tensor stream, changing nothing.

Certificates are made by the test (`paramserver.security.certs`); nodes are real processes."""

import json
import socket
import ssl
import struct
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from tests.conftest import ROOT, Procs
from tests.tls_pki import material, write_pki

from paramserver.base.config import Options
from paramserver.base.errors import UnavailableError
from paramserver.security.certs import node_tls_files
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.transport.stream import MAGIC, METHODS
from paramserver.transport.stream_client import StreamClient
from paramserver.wire import codec

SMALL = str(ROOT / "tests" / "integration" / "scripts" / "train_small.py")
BOUND_S = 30.0  # how long a refusal may take to arrive; never reached (a refusal is immediate)
PUSH = codec.encode({}, [("b", np.ones(2, np.float32))])


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The cluster's CA and node certificates, and another CA's (an outsider's)."""
    return write_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_ps(pki):
    """A real PS with mutual TLS on, one registered group, and a good client on its tensor stream."""
    procs = Procs()
    options = Options(**node_tls_files(pki / "cluster", "ps-0"), audit_log=str(pki / "ps-audit.jsonl"))
    try:
        _, address = procs.start_ps(PARAMSERVER_OPTIONS=options.to_json())
        good = GrpcChannel(address, 1 << 24, use_stream=True, use_shared_memory=False,
                           tls=material(pki, "cluster", "client"))
        good.wait_ready(BOUND_S)
        call(good, "Register", codec.encode({"group": "g", "optimizer": {"name": "sgd", "hyper": {"lr": 1}}},
                                            [("w", np.arange(6, dtype=np.float32).reshape(3, 2)),
                                             ("b", np.zeros(2, np.float32))]))
        stream_port = call(good, "Hello", codec.encode({})).meta["stream_port"]
        yield address, stream_port, good
        good.close()
    finally:
        procs.cleanup()


def call(channel, method, payload):
    return codec.decode(channel.call(method, payload, BOUND_S).wait(BOUND_S))


def pull(channel):
    frame = call(channel, "PushPull", codec.encode({"pull": ["w", "b"]}))
    return frame.meta["version"], {k: v.copy() for k, v in frame.tensors.items()}


def assert_unchanged(channel, before):
    version, values = pull(channel)
    assert version == before[0]
    for name, value in before[1].items():
        np.testing.assert_array_equal(values[name], value)


@pytest.mark.cluster
def test_a_good_client_trains_over_mutual_tls(tls_ps):
    """The good path works (so the refusals below are the certificates' doing, not a broken server)."""
    _, _, good = tls_ps
    version, values = pull(good)
    reply = call(good, "PushPull", codec.encode({"pull": ["b"]}, [("b", np.ones(2, np.float32))]))
    assert reply.meta["version"] == version + 1
    np.testing.assert_array_equal(reply.tensors["b"], values["b"] - 1)


def _grpc_attackers(pki):
    ca = (pki / "cluster" / "ca.crt").read_bytes()
    other = pki / "other"
    return {
        "plaintext": lambda address: grpc.insecure_channel(address),
        "no certificate": lambda address: grpc.secure_channel(address, grpc.ssl_channel_credentials(ca)),
        "another CA's certificate": lambda address: grpc.secure_channel(address, grpc.ssl_channel_credentials(
            ca, (other / "client.key").read_bytes(), (other / "client.crt").read_bytes())),
    }


@pytest.mark.cluster
@pytest.mark.parametrize("attacker", ["plaintext", "no certificate", "another CA's certificate"])
def test_grpc_refuses_a_client_without_a_certificate_from_its_ca(pki, tls_ps, attacker):
    address, _, good = tls_ps
    before = pull(good)
    channel = _grpc_attackers(pki)[attacker](address)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary("/paramserver.Shard/PushPull")(PUSH, timeout=BOUND_S)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    finally:
        channel.close()
    assert_unchanged(good, before)


def _stream_attackers(pki):
    def plain(port):
        return socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)

    def tls(port, cert_dir=None):
        context = ssl.create_default_context(cafile=str(pki / "cluster" / "ca.crt"))
        if cert_dir is not None:
            context.load_cert_chain(cert_dir / "client.crt", cert_dir / "client.key")
        return context.wrap_socket(plain(port), server_hostname="127.0.0.1")

    return {"plaintext": plain, "no certificate": tls,
            "another CA's certificate": lambda port: tls(port, pki / "other")}


@pytest.mark.cluster
@pytest.mark.parametrize("attacker", ["plaintext", "no certificate", "another CA's certificate"])
def test_the_tensor_stream_refuses_a_client_without_a_certificate_from_its_ca(pki, tls_ps, attacker):
    """A raw push on the stream port: the connection ends without a reply, and nothing changed."""
    _, stream_port, good = tls_ps
    before, audited = pull(good), tls_refusals(pki)
    reply = b""
    try:
        with _stream_attackers(pki)[attacker](stream_port) as sock:
            prefix = struct.pack("<4sBBHQ", MAGIC, 0, 0, METHODS.index("PushPull"), len(PUSH))  # docs/protocol.md
            sock.sendall(prefix + PUSH)
            while chunk := sock.recv(4096):  # until the PS closes the connection
                reply += chunk
    except (ssl.SSLError, ConnectionError):  # the PS's TLS alert, or its reset: refused either way
        pass
    assert reply == b""
    assert_unchanged(good, before)
    # OpenSSL sends its alert before the PS's handler writes the audit line: wait for that line
    assert refusals_reach(pki, audited + 1) == audited + 1


def refusals_reach(pki, count: int, bound_s: float = 60.0) -> int:
    """The refused handshakes audited, once they reach `count` (the bound only ends a failing wait)."""
    deadline = time.monotonic() + bound_s
    while (seen := tls_refusals(pki)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def tls_refusals(pki) -> int:
    """The stream's refused TLS handshakes in the PS's audit log."""
    path = pki / "ps-audit.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum(1 for r in map(json.loads, lines) if r["what"] == "StreamTLS" and r["outcome"] == "UNAUTHENTICATED")


@pytest.mark.cluster
def test_paramserver_clients_without_tls_or_trusting_another_ca_are_refused(pki, tls_ps):
    """Our own client: plaintext is refused by the PS; a client of another CA refuses the PS."""
    address, stream_port, good = tls_ps
    before = pull(good)
    for tls in (None, material(pki, "other", "client")):
        stream = StreamClient("127.0.0.1", stream_port, 1 << 24, "test", shared_memory=False,
                              tls=None if tls is None else tls.client_context)
        with pytest.raises(UnavailableError, match="tensor stream failed"):
            stream.call("PushPull", PUSH, BOUND_S).wait(BOUND_S)
        stream.close()
        channel = GrpcChannel(address, 1 << 24, use_stream=False, tls=tls)
        with pytest.raises(UnavailableError):
            channel.call("PushPull", PUSH, BOUND_S).wait(BOUND_S)
        channel.close()
    assert_unchanged(good, before)


def paramserver_run(procs, *args):
    proc = procs.start([sys.executable, "-m", "paramserver", "run", "--ps", "1", "--workers", "2", "--mode", "sync",
                        "--progress-every", "0", *args, SMALL, "--", "--steps", "20"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    return out


@pytest.mark.cluster
def test_a_cluster_trains_over_mutual_tls_to_the_same_values_as_in_plaintext(procs, pki):
    """`paramserver run --certs`: every PS, worker and the coordinator on mutual TLS; sync mode makes
    the result exact, so the checksums of the final variables must be equal."""
    secure = paramserver_run(procs, "--certs", str(pki / "cluster"))
    plain = paramserver_run(procs)
    assert "mutual TLS" in secure and "mutual TLS" not in plain

    def checksums(out):
        return sorted(line.split("checksum")[-1] for line in out.splitlines() if "checksum" in line)
    assert len(checksums(secure)) == 2 and checksums(secure) == checksums(plain)
    assert json.loads(secure.strip().splitlines()[-1])["steps"] == 40
    assert procs.leftovers() == []


@pytest.mark.cluster
@pytest.mark.parametrize("port", ["grpc", "stream"])
def test_tls_1_2_offers_only_aead_suites_on_every_port(pki, tls_ps, port):
    """A TLS 1.2 peer offering only CBC suites fails the handshake; one offering AES-GCM passes it."""
    address, stream_port, _ = tls_ps
    target = int(address.rsplit(":", 1)[1]) if port == "grpc" else stream_port
    client = pki / "cluster"

    def handshake(ciphers):
        context = ssl.create_default_context(cafile=str(client / "ca.crt"))
        context.load_cert_chain(client / "client.crt", client / "client.key")
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        context.set_ciphers(ciphers)
        if port == "grpc":
            context.set_alpn_protocols(["h2"])
        with socket.create_connection(("127.0.0.1", target), timeout=BOUND_S) as sock:
            with context.wrap_socket(sock, server_hostname="127.0.0.1") as secure:
                return secure.version(), secure.cipher()[0]

    assert handshake("ECDHE+AESGCM") == ("TLSv1.2", "ECDHE-ECDSA-AES256-GCM-SHA384")
    for cbc in ("ECDHE-ECDSA-AES128-SHA", "ECDHE-ECDSA-AES256-SHA384", "ECDHE-ECDSA-AES128-SHA256"):
        with pytest.raises((ssl.SSLError, ConnectionError)):
            handshake(cbc)


@pytest.mark.cluster
def test_health_and_status_without_tls_flags_say_the_node_needs_tls_not_that_it_is_unreachable(tls_ps):
    from paramserver.launch.status import TLS_REQUIRED, speaks_tls, tls_aware_check
    from paramserver.transport.health import UNREACHABLE

    address, stream_port, _ = tls_ps
    assert tls_aware_check(address, 2.0) == TLS_REQUIRED
    assert speaks_tls(f"127.0.0.1:{stream_port}", 2.0)
    with socket.socket() as closed:  # a port nobody serves
        closed.bind(("127.0.0.1", 0))
        free = closed.getsockname()[1]
    assert tls_aware_check(f"127.0.0.1:{free}", 1.0) == UNREACHABLE
