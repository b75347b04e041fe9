"""Optional TLS on the chain's sockets (``--tls``): the activations travel encrypted.

One certificate is made per pipeline (``new_chain_certificate``: a self-signed
EC P-256 certificate and its key, made in this process, valid for a bounded
time) and reaches each actor only as an argument of Ray's own authenticated
calls, like the handshake's secret. Every connection of the chain is then
wrapped in TLS 1.3 before anything else is said on it: the accepting side
shows the certificate (``server_side``), the connecting side accepts that one
certificate and no other (``client_side``; the hosts are IP addresses, so the
pin is the check, not a host name). The accepting side asks for no client
certificate: the HMAC handshake (orchestrator.transport.handshake), which runs inside
TLS, proves the connector. A TLS handshake that fails or stalls is one
``TLSError`` (which transport.handshake treats as a failed handshake: an
acceptor drops such a stranger and waits for its peer, as for any peer that
does not prove itself; a connector's is a ``HandshakeError``).

Each side's ``ssl.SSLContext`` is built once per certificate (cached), not
per connection. ``orchestrator.transport.wire`` frames messages on a TLS socket as on a
plain one. The per-hop cost is measured by ``python -m benchmarks.probe transport-hop``.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import ssl
import tempfile
from dataclasses import dataclass, field

from orchestrator.config import HANDSHAKE_SECONDS, TLS_CLIENT_HANDSHAKE_SECONDS, TLS_CLOCK_SKEW, TLS_VALID_FOR
from stages.errors import SpecpipeError

COMMON_NAME = "specpipe chain"


class TLSError(SpecpipeError):
    """A TLS handshake on the chain failed or stalled; the message is one line."""


@dataclass(frozen=True)
class ChainCertificate:
    """One pipeline's certificate and private key, both PEM; picklable (a Ray call argument)."""

    certificate_pem: bytes
    key_pem: bytes = field(repr=False)  # never in a log line


def new_chain_certificate(valid_for: datetime.timedelta = TLS_VALID_FOR) -> ChainCertificate:
    """A fresh self-signed EC P-256 certificate and key, valid from now for ``valid_for``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, COMMON_NAME)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - TLS_CLOCK_SKEW)
        .not_valid_after(now + valid_for)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return ChainCertificate(
        certificate_pem=certificate.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
    )


@functools.lru_cache(maxsize=8)
def _server_context(certificate: ChainCertificate) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = context.maximum_version = ssl.TLSVersion.TLSv1_3
    context.num_tickets = 0  # no session resumption: a chain connection is made once
    # ssl loads a certificate chain only from a file: a private one, gone at once
    with tempfile.TemporaryDirectory(prefix="specpipe-tls-") as folder:  # mode 0700
        path = os.path.join(folder, "chain.pem")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as file:
            file.write(certificate.certificate_pem + certificate.key_pem)
        context.load_cert_chain(path)
    return context


@functools.lru_cache(maxsize=8)
def _client_context(certificate: ChainCertificate) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = context.maximum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # peers are IP addresses; the pinned certificate is the check
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=certificate.certificate_pem.decode("ascii"))  # this run's, and only it
    return context


def server_side(sock: socket.socket, certificate: ChainCertificate, timeout: float = HANDSHAKE_SECONDS) -> ssl.SSLSocket:
    """The accepting end of a connection, in TLS, showing the pipeline's certificate.
    timeout: for the TLS handshake (config.HANDSHAKE_SECONDS: one peer's
    turn). On failure ``sock`` is closed and TLSError raised."""
    return _wrap(sock, _server_context(certificate), True, timeout)


def client_side(sock: socket.socket, certificate: ChainCertificate,
                timeout: float = TLS_CLIENT_HANDSHAKE_SECONDS) -> ssl.SSLSocket:
    """The connecting end of a connection, in TLS; the peer must show the
    pipeline's own certificate. On failure ``sock`` is closed and TLSError raised."""
    return _wrap(sock, _client_context(certificate), False, timeout)


def _wrap(sock: socket.socket, context: ssl.SSLContext, server: bool, timeout: float) -> ssl.SSLSocket:
    peer = _peer_name(sock)
    side = "from" if server else "to"
    previous = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        wrapped = context.wrap_socket(sock, server_side=server)  # the handshake; on failure ssl closes sock
    except TimeoutError:
        sock.close()
        raise TLSError(f"TLS handshake {side} {peer}: no answer within {timeout:g} s") from None
    except ssl.SSLCertVerificationError as error:
        sock.close()
        raise TLSError(f"TLS handshake {side} {peer}: the peer's certificate is not this pipeline's "
                       f"({error.verify_message})") from None
    except (ssl.SSLError, OSError) as error:
        sock.close()
        reason = getattr(error, "reason", None) or str(error).splitlines()[0] or type(error).__name__
        raise TLSError(f"TLS handshake {side} {peer} failed: {reason}") from None
    wrapped.settimeout(previous)
    return wrapped


def _peer_name(sock: socket.socket) -> str:
    try:
        address = sock.getpeername()
    except OSError:
        return "a peer that is gone"
    if isinstance(address, tuple):
        return f"{address[0]}:{address[1]}"
    return str(address) or "a local peer"
