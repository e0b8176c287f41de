"""TLS material of a node, read once from its options, and the credentials made from it.

`tls_cert` + `tls_key` turn TLS on for every channel (gRPC and the tensor stream); with `tls_ca`
too, both ends verify each other (mutual TLS): a server asks every client for a certificate
signed by that CA, and a client verifies the server against it. Without `tls_ca`, a client
verifies servers against the system's trusted roots and servers ask for no client certificate.

Host names: a client checks that the server's certificate names the host it dialled (the host part
of the cluster address, e.g. ``127.0.0.1`` or ``ps-0.train.svc``), on gRPC and on the stream alike;
`paramserver certs` puts localhost, 127.0.0.1, the node's name and every `--hosts` entry in each
node's certificate. Servers check only that a client's certificate chains to the CA.

Protocols: TLS 1.2 and 1.3 only; over TLS 1.2 both ports offer only ECDHE key exchange with AEAD
ciphers (AES-GCM, ChaCha20-Poly1305): the stream's contexts are set to TLS12_CIPHERS, and gRPC's
own defaults are the same set. A peer that offers only CBC suites fails the handshake.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError

# TLS 1.2 suites of the tensor stream: forward-secret and AEAD only (no CBC), as gRPC's port offers
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


@dataclass(frozen=True)
class TlsMaterial:
    """A node's certificate chain and key, and the CA bundle it trusts (None: the system's roots),
    as PEM bytes; plus the tensor stream's SSL contexts, made from the same files."""

    cert: bytes
    key: bytes
    ca: bytes | None
    server_context: ssl.SSLContext = field(repr=False, compare=False)
    client_context: ssl.SSLContext = field(repr=False, compare=False)

    @property
    def mutual(self) -> bool:
        """Both ends present a certificate signed by the CA."""
        return self.ca is not None

    @classmethod
    def load(cls, cert_path: str, key_path: str, ca_path: str = "") -> TlsMaterial:
        """Read and check the PEM files; a ConfigError names the file that is missing or wrong."""
        cert, key = _read(cert_path, "tls_cert"), _read(key_path, "tls_key")
        ca = _read(ca_path, "tls_ca") if ca_path else None
        server = _context(ssl.PROTOCOL_TLS_SERVER, cert_path, key_path, ca)
        client = _context(ssl.PROTOCOL_TLS_CLIENT, cert_path, key_path, ca)
        return cls(cert, key, ca, server, client)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.mutual
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        # the client's certificate is offered always; a server without a CA simply does not ask for it
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def open_channel(address: str, tls: TlsMaterial | None, options: list | tuple = ()) -> grpc.Channel:
    """A gRPC channel to `address`: over TLS with `tls`, plaintext without."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


def tls_from_options(options: Options) -> TlsMaterial | None:
    """The node's TlsMaterial, or None when its options leave TLS off (no tls_cert).
    Options made sure tls_cert and tls_key come together, and tls_ca only with them."""
    if not options.tls_cert:
        return None
    return TlsMaterial.load(options.tls_cert, options.tls_key, options.tls_ca)


def _read(path: str, option: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"option {option!r}: cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"option {option!r}: {path} is not a PEM file")
    return data


def _context(protocol: int, cert_path: str, key_path: str, ca: bytes | None) -> ssl.SSLContext:
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(TLS12_CIPHERS)  # TLS 1.3's suites are all AEAD already
    try:
        context.load_cert_chain(cert_path, key_path)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"options 'tls_cert' / 'tls_key': {cert_path} and {key_path} are not a certificate "
            f"and its private key: {exc}"
        ) from None
    if ca is not None:
        try:
            context.load_verify_locations(cadata=ca.decode("ascii", errors="replace"))
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"option 'tls_ca': not a PEM CA bundle: {exc}") from None
    elif protocol == ssl.PROTOCOL_TLS_CLIENT:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if protocol == ssl.PROTOCOL_TLS_SERVER:
        context.verify_mode = ssl.CERT_REQUIRED if ca is not None else ssl.CERT_NONE
    # PROTOCOL_TLS_CLIENT verifies the server's chain and host name (check_hostname) by default
    return context
