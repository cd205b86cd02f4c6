"""TLS: the coordinator's self-signed certificate (made once) and certificate fingerprints.

``gpumesh serve --tls`` keeps ``tls/cert.pem`` and ``tls/key.pem`` (mode 0600) in the data
directory and reuses them until they near expiry, so the fingerprint that workers and
callers pinned stays valid across restarts, also when the machine's address or name
changes (a new Wi-Fi, a container's new IP): a pin identifies the server, not the names
the certificate lists, which are only for a browser's information. A new pair is made
when there is none or when it expires within ``RENEW_BEFORE_DAYS``. ``--tls-cert/--tls-key``
use your own pair instead (refused once expired).

The fingerprint is ``SHA256:`` + the lowercase hex SHA-256 of the certificate's DER
bytes; :func:`normalise_fingerprint` also accepts colons, upper case and no prefix.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import re
import socket
import ssl
from pathlib import Path

#: Days a generated certificate is valid. Clients pin it, so its lifetime is about how
#: long a pin stays useful, not about revocation.
CERT_DAYS = 3650
#: A generated certificate this close to expiry is replaced at the next start.
RENEW_BEFORE_DAYS = 30


class TLSSetupError(Exception):
    """The certificate or key cannot be made, read or used; the message says which."""


def fingerprint_der(der: bytes) -> str:
    """``SHA256:<hex>`` of a DER certificate."""
    return "SHA256:" + hashlib.sha256(der).hexdigest()


def fingerprint_pem(pem: str | bytes) -> str:
    """``SHA256:<hex>`` of the first certificate in a PEM text."""
    text = pem.decode() if isinstance(pem, bytes) else pem
    return fingerprint_der(ssl.PEM_cert_to_DER_cert(_first_pem(text)))


def _first_pem(text: str) -> str:
    m = re.search(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", text, re.S)
    if not m:
        raise TLSSetupError("no PEM certificate found")
    return m.group(0) + "\n"


def normalise_fingerprint(value: str) -> str:
    """``SHA256:<64 lowercase hex>`` from what a user typed; ValueError if it is not one."""
    v = value.strip()
    if v.lower().startswith("sha256:"):
        v = v[7:]
    v = v.replace(":", "").lower()
    if not re.fullmatch(r"[0-9a-f]{64}", v):
        raise ValueError(f"fingerprint {value[:100]!r} is not SHA256:<64 hex digits> "
                         "(gpumesh serve --tls prints it)")
    return "SHA256:" + v


def local_addresses(host: str) -> tuple[list[str], list[str]]:
    """``(ip addresses, dns names)`` a certificate for ``host`` should name: the bound
    address (for a wildcard bind, this machine's addresses), loopback and the hostname."""
    ips = {"127.0.0.1", "::1"}
    names = {"localhost"}
    hostname = socket.gethostname()
    if hostname:
        names.add(hostname)
    if host in ("0.0.0.0", "::", ""):
        try:
            for info in socket.getaddrinfo(hostname, None):
                ips.add(str(info[4][0]).split("%")[0])
        except OSError:
            pass
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.connect(("192.0.2.1", 9))  # picks the default route; sends nothing
            ips.add(s.getsockname()[0])
        except OSError:
            pass
        finally:
            s.close()
    else:
        try:
            ipaddress.ip_address(host)
            ips.add(host)
        except ValueError:
            names.add(host)
    return sorted(ips), sorted(names)


def _needs_renewal(cert_path: Path) -> bool:
    """Whether the generated certificate must be replaced: unreadable, or expiring within
    ``RENEW_BEFORE_DAYS``. Not for naming other addresses than those bound now: that
    would change every pinned fingerprint with the machine's address."""
    from cryptography import x509
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except Exception:  # noqa: BLE001 - unreadable or odd: make a new one
        return True
    left = cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)
    return left < datetime.timedelta(days=RENEW_BEFORE_DAYS)


def self_signed(data_dir: Path, host: str) -> tuple[Path, Path, bool]:
    """The self-signed pair for serving on ``host``: ``(cert, key, created)``.

    Reuses the pair in ``data_dir/tls`` until it nears expiry; otherwise writes a new one
    (ECDSA P-256) naming this machine's addresses and names for ``host``. Raises :class:`TLSSetupError` if ``cryptography`` is missing or
    the files cannot be written.
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise TLSSetupError("--tls needs the 'cryptography' package: pip install cryptography") from None
    tls_dir = data_dir / "tls"
    cert_path, key_path = tls_dir / "cert.pem", tls_dir / "key.pem"
    if cert_path.exists() and key_path.exists() and not _needs_renewal(cert_path):
        return cert_path, key_path, False
    ips, names = local_addresses(host)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"gpumesh coordinator {names[-1]}"[:64])])
    san = [x509.DNSName(n) for n in names] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    cert = (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(key, hashes.SHA256()))
    try:
        tls_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(tls_dir, 0o700)
        tmp = key_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
        os.replace(tmp, key_path)
        tmp = cert_path.with_suffix(".tmp")
        tmp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        os.replace(tmp, cert_path)
    except OSError as e:
        raise TLSSetupError(f"cannot write the TLS certificate to {tls_dir}: {e.strerror or e}") from None
    return cert_path, key_path, True


def _check_dates(cert_path: Path) -> None:
    """Raise :class:`TLSSetupError` for a certificate outside its validity dates: every
    worker and caller would refuse it."""
    try:
        from cryptography import x509
        cert = x509.load_pem_x509_certificate(_first_pem(cert_path.read_text()).encode())
    except Exception:  # noqa: BLE001 - no cryptography, or odd PEM: OpenSSL loaded it
        return
    now = datetime.datetime.now(datetime.timezone.utc)
    if cert.not_valid_after_utc < now:
        raise TLSSetupError(f"{cert_path} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: "
                            "workers and callers would refuse it; give a new one")
    if cert.not_valid_before_utc > now:
        start = f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M}"
        raise TLSSetupError(f"{cert_path} is valid only from {start} UTC: check this machine's clock")


def check_pair(cert_path: Path, key_path: Path) -> str:
    """Load a certificate and key as the server will; returns the fingerprint.
    Raises :class:`TLSSetupError` naming what is wrong."""
    for path in (cert_path, key_path):  # (ssl's own error names no file)
        if not Path(path).is_file():
            raise TLSSetupError(f"TLS file not found: {path}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(str(cert_path), str(key_path))
        _check_dates(Path(cert_path))
        return fingerprint_pem(Path(cert_path).read_text())
    except FileNotFoundError as e:  # (gone since the look above)
        raise TLSSetupError(f"TLS file not found: {e.filename or cert_path}") from None
    except (ssl.SSLError, OSError, ValueError) as e:
        raise TLSSetupError(f"cannot use {cert_path} / {key_path} as a TLS certificate and key: {e}") from None
