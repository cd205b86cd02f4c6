"""Auth behind proxies and tunnels, without processes: whose ``X-Forwarded-For`` is believed
(``--trusted-proxy``), and that the loopback exemption is off whenever something fronts the
coordinator (``--public``, ``--tailscale``, a trusted proxy)."""

from __future__ import annotations

import warnings

import pytest

from gpumesh.coordinator.app import create_app
from gpumesh.coordinator.auth import Authenticator, forwarded_client, parse_networks
from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.store import Store
from gpumesh.limits import AUTH_FAIL_MAX, MAX_FORWARDED_HOPS

MAIN = "main-token-0123456789abcdefghij"
WRONG = "wrong-token-0123456789abcdefgh"
PROXY = parse_networks(["10.0.0.0/8", "127.0.0.1/32"])


class Headers(dict):
    """A header map with repeated names, like Starlette's (``getlist``)."""

    def __init__(self, *pairs):
        super().__init__()
        self.pairs = list(pairs)
        for k, v in pairs:
            self.setdefault(k, v)

    def getlist(self, name):
        return [v for k, v in self.pairs if k == name]


def test_parse_networks_takes_cidrs_and_addresses_and_names_a_bad_one():
    nets = parse_networks(["10.0.0.0/8", "192.0.2.7", "fd00::/8", " 127.0.0.1/32 "])
    assert [str(n) for n in nets] == ["10.0.0.0/8", "192.0.2.7/32", "fd00::/8", "127.0.0.1/32"]
    assert str(parse_networks(["10.1.2.3/8"])[0]) == "10.0.0.0/8"  # host bits are tolerated
    for bad in ("nginx", "10.0.0.0/33", "", "300.1.1.1"):
        with pytest.raises(ValueError) as info:
            parse_networks(["10.0.0.0/8", bad])
        assert repr(bad) in str(info.value) and "CIDR" in str(info.value)


def test_the_rightmost_untrusted_hop_is_the_client():
    xff = lambda v: Headers(("x-forwarded-for", v))  # noqa: E731
    # an untrusted peer: its header is never read
    assert forwarded_client("203.0.113.9", xff("198.51.100.1"), PROXY) == "203.0.113.9"
    # a trusted proxy names its client
    assert forwarded_client("10.0.0.2", xff("198.51.100.1"), PROXY) == "198.51.100.1"
    # a client that writes its own X-Forwarded-For cannot hide behind it
    assert forwarded_client("10.0.0.2", xff("192.0.2.1, 198.51.100.1"), PROXY) == "198.51.100.1"
    # two trusted proxies in a row: the walk goes past both
    assert forwarded_client("127.0.0.1", xff("198.51.100.1, 10.9.9.9"), PROXY) == "198.51.100.1"
    # every hop trusted: the leftmost one
    assert forwarded_client("127.0.0.1", xff("10.1.1.1, 10.2.2.2"), PROXY) == "10.1.1.1"
    # no header at all: the proxy itself
    assert forwarded_client("10.0.0.2", Headers(), PROXY) == "10.0.0.2"
    # a malformed hop ends the walk at the last trusted address
    assert forwarded_client("10.0.0.2", xff("198.51.100.1, garbage"), PROXY) == "10.0.0.2"
    assert forwarded_client("10.0.0.2", xff("garbage, 10.3.3.3"), PROXY) == "10.3.3.3"
    # repeated header lines read as one list, in order; IPv4-mapped IPv6 is IPv4
    two = Headers(("x-forwarded-for", "192.0.2.1"), ("x-forwarded-for", "::ffff:198.51.100.2"))
    assert forwarded_client("10.0.0.2", two, PROXY) == "198.51.100.2"
    assert forwarded_client("::ffff:10.0.0.2", xff("2001:db8::5"), PROXY) == "2001:db8::5"
    # hops with a port, as some proxies write them
    assert forwarded_client("10.0.0.2", xff("198.51.100.3:4711"), PROXY) == "198.51.100.3"
    assert forwarded_client("10.0.0.2", xff("[2001:db8::7]:4711"), PROXY) == "2001:db8::7"
    # an endless chain of trusted hops is cut short, not walked
    long = ", ".join(["198.51.100.7"] + ["10.0.0.1"] * (MAX_FORWARDED_HOPS + 5))
    assert forwarded_client("10.0.0.2", xff(long), PROXY) == "10.0.0.1"


def test_any_front_turns_the_loopback_exemption_off():
    assert Authenticator(MAIN, loopback_bound=True, loopback_exempt=True).exempt("127.0.0.1", {})
    fronted = Authenticator(MAIN, loopback_bound=True, loopback_exempt=True, fronted=True)
    assert not fronted.exempt("127.0.0.1", {})
    proxied = Authenticator(MAIN, loopback_bound=True, loopback_exempt=True,
                            trusted_proxies=["127.0.0.1/32"])
    assert proxied.fronted and not proxied.exempt("127.0.0.1", {})


@pytest.fixture
def app_factory(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
    made = []

    def make(client, **kw):
        store = Store(tmp_path / f"data{len(made)}")
        app = create_app(Coordinator(store), MAIN,
                         authenticator=Authenticator(MAIN, loopback_bound=True, **kw))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = TestClient(app, client=client)
        made.append((c, store))
        return c

    yield make
    for c, store in made:
        c.close()
        store.close()


def get(c, token, xff=None):
    headers = {"authorization": f"Bearer {token}"}
    if xff:
        headers["x-forwarded-for"] = xff
    return c.get("/v1/workers", headers=headers)


def test_behind_a_trusted_proxy_each_client_is_locked_out_on_its_own(app_factory):
    c = app_factory(("127.0.0.1", 40000), trusted_proxies=["127.0.0.1/32"])
    codes = [get(c, WRONG, "198.51.100.1").status_code for _ in range(AUTH_FAIL_MAX)]
    assert codes == [401] * (AUTH_FAIL_MAX - 1) + [429]
    r = get(c, MAIN, "198.51.100.1")
    assert r.status_code == 429 and "198.51.100.1" in r.json()["message"]
    # inventing an earlier hop does not make the guesser someone else
    assert get(c, MAIN, "192.0.2.77, 198.51.100.1").status_code == 429
    # another client behind the same proxy is still served
    assert get(c, MAIN, "198.51.100.2").status_code == 200


def test_a_fronted_loopback_coordinator_locks_out_local_guessers(app_factory):
    # --tailscale/--public: the same loopback peer that used to be exempt is now counted
    c = app_factory(("127.0.0.1", 40000), fronted=True)
    codes = [get(c, WRONG).status_code for _ in range(AUTH_FAIL_MAX)]
    assert codes[-1] == 429
    assert get(c, MAIN).status_code == 429


def test_an_untrusted_peer_is_judged_by_its_socket_whatever_it_claims(app_factory):
    c = app_factory(("192.0.2.50", 40000), trusted_proxies=["10.0.0.0/8"])
    for i in range(AUTH_FAIL_MAX):  # a new X-Forwarded-For for every guess
        r = get(c, WRONG, f"198.51.100.{i}")
    assert r.status_code == 429 and "192.0.2.50" in r.json()["message"]
    assert get(c, MAIN, "198.51.100.200").status_code == 429
