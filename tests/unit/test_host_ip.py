"""``serve --host-ip``: the address other machines use, apart from the one bound (--host)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gpumesh import discovery
from gpumesh.cli import main, serve

TOKEN = "t" * 20


def _other_lines(lines: list[str]) -> list[str]:
    return [x for x in lines if "ANOTHER machine" in x or "Reachability" in x or "always works" in x]


def test_banner_uses_the_detected_address_without_host_ip(monkeypatch):
    monkeypatch.setattr(serve, "_lan_ip", lambda: "10.1.2.3")
    monkeypatch.setattr(serve, "in_container", lambda: False)
    install, join, local, reach = _other_lines(serve.banner("0.0.0.0", 8123, TOKEN, False))
    assert install.startswith("   Install on ANOTHER machine: pip install http://10.1.2.3:8123/")
    assert join == "   Join from ANOTHER machine: gpumesh join http://10.1.2.3:8123 --token=<your token>"
    assert local == "   (127.0.0.1 always works locally; the LAN IP is for other machines)"
    assert reach.startswith("   Reachability of http://10.1.2.3:8123 from other machines")


def test_banner_uses_host_ip_for_other_machines(monkeypatch):
    monkeypatch.setattr(serve, "_lan_ip", lambda: "10.1.2.3")
    monkeypatch.setattr(serve, "in_container", lambda: False)
    pin = "SHA256:" + "a" * 64
    lines = serve.banner("0.0.0.0", 8123, TOKEN, False, fingerprint=pin, host_ip="198.51.100.7")
    install, join, local, reach = _other_lines(lines)
    assert install.startswith("   Install on ANOTHER machine: pip install --trusted-host 198.51.100.7 "
                              "https://198.51.100.7:8123/")
    assert join == (f"   Join from ANOTHER machine: gpumesh join https://198.51.100.7:8123 "
                    f"--fingerprint {pin} --token=<your token>")
    assert local == "   (127.0.0.1 always works locally; 198.51.100.7, from --host-ip, is for other machines)"
    assert reach.startswith("   Reachability of https://198.51.100.7:8123 from other machines")
    assert not [x for x in lines if "10.1.2.3" in x]
    # this machine's own join line keeps loopback; a bound address gives way to host_ip too
    (this,) = [x for x in lines if "THIS machine" in x]
    assert this.startswith("   Join from THIS machine:   gpumesh join https://127.0.0.1:8123 ")
    join = _other_lines(serve.banner("192.0.2.10", 8123, TOKEN, False, host_ip="mesh.example.org"))[1]
    assert join == "   Join from ANOTHER machine: gpumesh join http://mesh.example.org:8123 --token=<your token>"
    join = _other_lines(serve.banner("::", 8123, TOKEN, False, host_ip="2001:db8::5"))[1]
    assert join == "   Join from ANOTHER machine: gpumesh join http://[2001:db8::5]:8123 --token=<your token>"


def test_banner_behind_a_proxy_names_host_ip():
    lines = serve.banner("127.0.0.1", 8000, TOKEN, False, proxied=True, host_ip="203.0.113.9")
    assert "   at 203.0.113.9 (--host-ip); binding it to 0.0.0.0 would go around the proxy." in lines


@pytest.mark.parametrize("given, want", [
    ("192.0.2.10", "192.0.2.10"), (" 192.0.2.10 ", "192.0.2.10"), ("2001:DB8::5", "2001:db8::5"),
    ("[2001:db8::5]", "2001:db8::5"), ("mesh.example.org", "mesh.example.org"),
    ("mesh.example.org.", "mesh.example.org"), ("gpu-box-1", "gpu-box-1"),
])
def test_host_ip_accepts_an_address_or_a_host_name(given, want):
    assert serve.check_host_ip(given) == want


def _serve(args: list[str], **env: str):
    base = {"GPUMESH_HOST": "", "GPUMESH_HOST_IP": "", "GPUMESH_TRUSTED_PROXIES": "",
            "GPUMESH_TOKEN": "x" * 32, "GPUMESH_DISCOVERY": "0"}
    return CliRunner().invoke(main, ["serve", "--no-save-config", "--port", "18499", *args],
                              env={**base, **env})


@pytest.mark.parametrize("value", [
    "http://192.0.2.10", "192.0.2.10:8000", "mesh.example.org/gpumesh", "mesh example.org",
    "", "-bad.example.org", "192.0.2.999", "a..b", "x" * 64 + ".org",
])
def test_a_host_ip_that_is_not_an_address_is_a_usage_error(value):
    r = _serve(["--host", "0.0.0.0", "--host-ip", value])
    assert r.exit_code == 2, r.output
    (line,) = r.output.strip().splitlines()
    assert line == (f"Error: --host-ip: {value!r} is not an IP address or host name; give the "
                    "bare address other machines reach this coordinator at, e.g. --host-ip "
                    "192.0.2.10 or --host-ip mesh.example.org (no scheme, port or path)")


@pytest.mark.parametrize("value", ["127.0.0.1", "::1", "0.0.0.0", "localhost"])
def test_a_loopback_host_ip_is_a_usage_error(value):
    r = _serve(["--host", "0.0.0.0", "--host-ip", value])
    assert r.exit_code == 2, r.output
    (line,) = r.output.strip().splitlines()
    assert line.startswith("Error: --host-ip: ") and "LAN or public address" in line


def test_the_variable_is_checked_as_the_flag_is():
    r = _serve(["--host", "0.0.0.0"], GPUMESH_HOST_IP="https://x.example.org")
    assert r.exit_code == 2, r.output
    assert r.output.startswith("Error: GPUMESH_HOST_IP: 'https://x.example.org' is not an IP address")


@pytest.mark.parametrize("args, env", [
    (["--host-ip", "192.0.2.10"], {}),
    ([], {"GPUMESH_HOST_IP": "192.0.2.10"}),
    (["--host", "::1", "--host-ip", "192.0.2.10"], {}),
])
def test_host_ip_with_a_loopback_bind_is_refused(args, env):
    r = _serve(args, **env)
    assert r.exit_code == 2, r.output
    (line,) = r.output.strip().splitlines()
    assert "no other machine can reach" in line and "--host 0.0.0.0" in line
    assert "--trusted-proxy" in line


def test_host_ip_with_a_loopback_bind_behind_a_proxy_passes_the_check(monkeypatch):
    monkeypatch.setattr(serve.limits, "setting", lambda env, environ=None: None)
    assert serve._host_ip("192.0.2.10", "127.0.0.1", proxied=True) == "192.0.2.10"
    assert serve._host_ip(None, "0.0.0.0", proxied=False) is None


def test_advertised_address_is_host_ip_when_it_is_an_ip(monkeypatch):
    monkeypatch.setattr(discovery, "local_addresses", lambda: ["192.168.1.4", "10.0.0.2"])
    assert discovery.advertise_addresses("0.0.0.0", "198.51.100.7") == ["198.51.100.7"]
    assert discovery.advertise_addresses("10.0.0.2", "2001:db8::5") == ["2001:db8::5"]
    # a host name: the detected addresses, as without it
    assert discovery.advertise_addresses("0.0.0.0", "mesh.example.org") == ["192.168.1.4", "10.0.0.2"]
    assert discovery.advertise_addresses("0.0.0.0", None) == ["192.168.1.4", "10.0.0.2"]
    # bound to loopback: never announced, whatever host_ip says
    assert discovery.advertise_addresses("127.0.0.1", "198.51.100.7") == []


def test_serve_announces_host_ip_and_says_why_a_name_is_not(monkeypatch, capsys):
    announced = []
    monkeypatch.setattr(discovery, "enabled", lambda env=None: True)
    monkeypatch.setattr(discovery, "local_addresses", lambda: ["192.168.1.4"])
    monkeypatch.setattr(discovery, "advertise",
                        lambda role, addresses, port, **kw: announced.append(addresses) or object())
    assert serve._advertise("0.0.0.0", 8000, False, "198.51.100.7") is not None
    out = capsys.readouterr().out
    assert "(198.51.100.7; no token)" in out and "host name" not in out
    serve._advertise("0.0.0.0", 8000, False, "mesh.example.org")
    (note, _ok) = capsys.readouterr().out.strip().splitlines()
    assert note == ("[gpumesh] --host-ip mesh.example.org is a host name; the LAN announcement "
                    "(mDNS) carries IP addresses only, so it names the detected ones (192.168.1.4)")
    assert announced == [["198.51.100.7"], ["192.168.1.4"]]
