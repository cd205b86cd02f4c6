"""LAN discovery: DNS-SD over multicast DNS (RFC 6762/6763) with the ``zeroconf`` package.

Service type ``_gpumesh._tcp.local.``, so ordinary tools (``avahi-browse -r _gpumesh._tcp``,
``dns-sd -B _gpumesh._tcp``) see the mesh too. Each coordinator and worker is one service
instance whose TXT record carries only :data:`TXT_KEYS` (role, version, device,
device_name, score, hostname, and for a worker the coordinator's URL): never a token,
never anything else from the process's settings.

Rules, enforced here so every caller gets them:

* ``GPUMESH_DISCOVERY=0`` turns discovery off everywhere: nothing advertises or browses
  and no zeroconf socket is ever opened (:func:`enabled`);
* a coordinator or worker bound to / joined over loopback never advertises
  (:func:`advertise_addresses` returns nothing for it);
* ``zeroconf`` is imported only when something is really advertised or browsed; if it is
  missing, :class:`DiscoveryUnavailable` says in one line how to install it.

A leaf module: it imports nothing else from gpumesh.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from . import limits

log = logging.getLogger("gpumesh.discovery")

SERVICE_TYPE = "_gpumesh._tcp.local."
ENV = "GPUMESH_DISCOVERY"
#: The only TXT keys ever published. A token has no key here, so it cannot leak.
TXT_KEYS = ("role", "version", "device", "device_name", "score", "hostname", "coordinator", "scheme")
ROLES = ("coordinator", "worker")
INSTALL_HINT = "LAN discovery needs the zeroconf package: pip install zeroconf"


class DiscoveryUnavailable(RuntimeError):
    """Discovery cannot run here (switched off, or zeroconf missing); the message is one line."""


def enabled(env: dict | None = None) -> bool:
    """False when ``GPUMESH_DISCOVERY`` is ``0``/``false``/``no``/``off``."""
    return limits.setting(ENV, env)


def _zeroconf():
    if not enabled():
        raise DiscoveryUnavailable(f"LAN discovery is off ({ENV}=0); unset it to use discovery")
    try:
        import zeroconf
    except ImportError:
        raise DiscoveryUnavailable(INSTALL_HINT) from None
    return zeroconf


def is_loopback(host: str) -> bool:
    host = (host or "").strip("[]").lower()
    if host in ("localhost", "localhost.localdomain", "") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_addresses() -> list[str]:
    """This machine's non-loopback, non-link-local IPv4 addresses (no traffic sent)."""
    out: list[str] = []
    try:
        import ifaddr  # installed with zeroconf
        for adapter in ifaddr.get_adapters():
            for ip in adapter.ips:
                if isinstance(ip.ip, str):
                    addr = ipaddress.ip_address(ip.ip)
                    if not (addr.is_loopback or addr.is_link_local) and ip.ip not in out:
                        out.append(ip.ip)
    except ImportError:
        pass
    return out


def route_address(host: str) -> str | None:
    """The local address this machine would use to reach ``host``. A UDP ``connect`` only
    picks a route; nothing is sent."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_DGRAM)
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        finally:
            s.close()
    except OSError:
        return None


def advertise_addresses(host: str, host_ip: str | None = None) -> list[str]:
    """Where a coordinator bound to ``host`` is advertised: nothing for loopback; the
    address other machines use (``serve --host-ip``) when ``host_ip`` is a non-loopback
    IP address; else the machine's non-loopback IPv4 addresses for ``0.0.0.0``/``::``/``""``,
    else ``host`` itself (a name is resolved). A ``host_ip`` that is a host name changes
    nothing: an mDNS record carries addresses, not names."""
    if is_loopback(host):
        return []
    if host_ip:
        try:
            announced = ipaddress.ip_address(host_ip.strip("[]"))
        except ValueError:
            pass  # a name
        else:
            if not (announced.is_loopback or announced.is_unspecified):
                return [str(announced)]
    if host in ("0.0.0.0", "::", ""):
        return local_addresses()
    try:
        ipaddress.ip_address(host.strip("[]"))
        return [host.strip("[]")]
    except ValueError:
        try:
            addr = socket.gethostbyname(host)
        except OSError:
            return []
        return [] if is_loopback(addr) else [addr]


def worker_address(coordinator_url: str) -> str | None:
    """Where a worker joined to ``coordinator_url`` is advertised: the local address on
    the route to the coordinator; None (do not advertise) if the coordinator is loopback."""
    host = urlsplit(coordinator_url).hostname or ""
    if is_loopback(host):
        return None
    try:
        ipaddress.ip_address(host)
        target = host
    except ValueError:
        try:
            target = socket.gethostbyname(host)
        except OSError:
            return None
    if is_loopback(target):
        return None
    addr = route_address(target)
    return None if addr is None or is_loopback(addr) else addr


def txt_properties(role: str, **fields) -> dict[str, str]:
    """The TXT record: only keys in :data:`TXT_KEYS`, values as short text."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}")
    props = {"role": role}
    for key in TXT_KEYS:
        if key != "role" and fields.get(key) not in (None, ""):
            props[key] = str(fields[key])[:200]
    return props


def _label(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9-]+", "-", text).strip("-")[:limit] or "host"


def instance_name(role: str, hostname: str, address: str, port: int) -> str:
    """A service instance name unique per role, host, address, port and process."""
    return f"{_label(hostname.split('.')[0], 20)} {role} {address} {port} {os.getpid()}"[:63]


class Advertiser:
    """Publishes one service instance on ``addresses`` until :meth:`close`.

    Registration (mDNS probing takes about a second) runs in a background thread so the
    caller never waits; :meth:`update` republishes the TXT record (e.g. a new score).
    """

    def __init__(self, role: str, addresses: list[str], port: int, properties: dict[str, str]):
        self.role, self.addresses, self.port = role, list(addresses), port
        self.properties = dict(properties)
        # zeroconf's Zeroconf and ServiceInfo (the module is imported only when used)
        self._zc: Any = None
        self._info: Any = None
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> "Advertiser":
        if not self.addresses or not enabled():
            return self
        self._thread = threading.Thread(target=self._register, name="mdns-advertise", daemon=True)
        self._thread.start()
        return self

    def _make_info(self):
        zeroconf = _zeroconf()
        host = self.properties.get("hostname") or socket.gethostname()
        first = self.addresses[0]
        return zeroconf.ServiceInfo(
            SERVICE_TYPE, f"{instance_name(self.role, host, first, self.port)}.{SERVICE_TYPE}",
            port=self.port, properties=self.properties,
            server=f"{_label(host.split('.')[0], 20)}-{_label(first.replace('.', '-').replace(':', '-'), 40)}.local.",
            parsed_addresses=self.addresses)

    def _register(self) -> None:
        try:
            zeroconf = _zeroconf()
            v6 = any(":" in a for a in self.addresses)
            v4 = any(":" not in a for a in self.addresses)
            version = (zeroconf.IPVersion.All if v6 and v4 else
                       zeroconf.IPVersion.V6Only if v6 else zeroconf.IPVersion.V4Only)
            with self._lock:
                if self._closed:
                    return
                self._zc = zeroconf.Zeroconf(interfaces=self.addresses, ip_version=version)
                info = self._make_info()
                sent = dict(self.properties)
            zc = self._zc
            zc.register_service(info, allow_name_change=True)
            # Only now is there a record to update: an update() during the probing above
            # would have published the name first, and the probe would then have renamed
            # this record ("... -2"), leaving two services for one process.
            with self._lock:
                self._info = info
                changed = self.properties != sent
            log.info("advertising %s on %s port %s", self.role, ", ".join(self.addresses), self.port)
            if changed:
                self.update()
        except DiscoveryUnavailable as e:
            log.info("not advertised: %s", e)
        except Exception as e:  # noqa: BLE001 - discovery must never stop a coordinator/worker
            log.warning("could not advertise on the LAN: %s", e)

    def update(self, **fields) -> None:
        for key, value in fields.items():
            if key in TXT_KEYS and key != "role" and value is not None:
                self.properties[key] = str(value)[:200]
        with self._lock:
            if self._zc is None or self._info is None or self._closed:
                return
            try:
                info = self._make_info()
                info.name = self._info.name  # keep a name changed by conflict resolution
                self._zc.update_service(info)
                self._info = info
            except Exception as e:  # noqa: BLE001
                log.debug("could not update the advertisement: %s", e)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            zc, info = self._zc, self._info
            self._zc = None
        if zc is not None:
            try:
                if info is not None:
                    zc.unregister_service(info)  # a goodbye packet: browsers drop it at once
            except Exception:  # noqa: BLE001
                pass
            zc.close()


def advertise(role: str, addresses: list[str], port: int, **fields) -> Advertiser | None:
    """Start advertising (in the background); None when discovery is off, no address
    qualifies, or zeroconf is missing (logged, never raised)."""
    if not enabled() or not addresses:
        return None
    try:
        _zeroconf()
    except DiscoveryUnavailable as e:
        log.info("not advertised: %s", e)
        return None
    return Advertiser(role, addresses, port, txt_properties(role, **fields)).start()


def _decode(props: dict) -> dict[str, str]:
    out = {}
    for k, v in (props or {}).items():
        key = k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k)
        if key in TXT_KEYS:
            out[key] = v.decode("utf-8", "replace") if isinstance(v, bytes) else ("" if v is None else str(v))
    return out


def entry(name: str, addresses: list[str], port: int, props: dict) -> dict:
    """One discovered service as radar shows it."""
    p = _decode(props)
    role = p.get("role", "?")
    addr = addresses[0] if addresses else ""
    hostport = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
    scheme = p.get("scheme", "http") if p.get("scheme") in ("http", "https") else "http"
    return {
        "name": name.removesuffix("." + SERVICE_TYPE),
        "role": role,
        "host": p.get("hostname", ""),
        "version": p.get("version", ""),
        "device": p.get("device", ""),
        "device_name": p.get("device_name", ""),
        "score": p.get("score", ""),
        "addresses": list(addresses),
        "port": port,
        "address": hostport,
        "url": f"{scheme}://{hostport}" if role == "coordinator" and addr else None,
        "coordinator": p.get("coordinator") or None,
        "properties": p,
    }


class Browser:
    """Watches the LAN for gpumesh services; :meth:`snapshot` is what is seen now.
    Raises :class:`DiscoveryUnavailable`, or ``OSError`` when no interface can listen."""

    def __init__(self):
        zeroconf = _zeroconf()
        self._zc_mod = zeroconf
        try:
            self.zc = zeroconf.Zeroconf()
        except RuntimeError as e:  # zeroconf's word for "no interface to listen on"
            raise OSError(str(e)) from None
        self._pending: set[str] = set()
        self._found: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.browser = zeroconf.ServiceBrowser(self.zc, SERVICE_TYPE, handlers=[self._on_change])

    def _on_change(self, zeroconf, service_type, name, state_change) -> None:  # zeroconf thread
        with self._lock:
            if state_change is self._zc_mod.ServiceStateChange.Removed:
                self._found.pop(name, None)
                self._pending.discard(name)
            else:
                self._pending.add(name)
        self._wake.set()

    def poll(self, wait: float) -> None:
        """Resolve newly seen names (blocking up to ``wait`` s for news)."""
        self._wake.wait(wait)
        self._wake.clear()
        with self._lock:
            names, self._pending = self._pending, set()
        for name in names:
            info = self._zc_mod.ServiceInfo(SERVICE_TYPE, name)
            if info.request(self.zc, 1500):
                addrs = info.parsed_addresses()
                with self._lock:
                    self._found[name] = entry(name, addrs, info.port or 0, info.properties)

    def snapshot(self) -> list[dict]:
        with self._lock:
            items = list(self._found.values())
        return sorted(items, key=lambda e: (e["role"] != "coordinator", e["host"], e["address"]))

    def close(self) -> None:
        try:
            self.browser.cancel()
        finally:
            self.zc.close()


def browse(timeout: float = 3.0) -> list[dict]:
    """Everything found within ``timeout`` seconds. Raises :class:`DiscoveryUnavailable`."""
    b = Browser()
    try:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            b.poll(min(left, 0.25))
        return b.snapshot()
    finally:
        b.close()


def coordinators(entries: list[dict]) -> list[dict]:
    """The coordinators among ``entries``, one per URL."""
    seen: dict[str, dict] = {}
    for e in entries:
        if e["role"] == "coordinator" and e["url"] and e["url"] not in seen:
            seen[e["url"]] = e
    return list(seen.values())
