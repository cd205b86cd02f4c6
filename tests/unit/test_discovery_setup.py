"""Discovery's pure parts (no socket is opened) and the `gpumesh setup` wizard."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from gpumesh import discovery
from gpumesh.cli import main
from gpumesh.cli import setup as wizard


def test_suite_runs_with_discovery_off():
    assert os.environ.get("GPUMESH_DISCOVERY") == "0"
    assert not discovery.enabled()
    assert discovery.enabled({}) and not discovery.enabled({"GPUMESH_DISCOVERY": "off"})


def test_nothing_is_advertised_or_browsed_when_off(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a zeroconf socket was about to be opened")
    import zeroconf
    monkeypatch.setattr(zeroconf, "Zeroconf", boom)
    assert discovery.advertise("coordinator", ["10.0.0.5"], 8000, version="1") is None
    a = discovery.Advertiser("coordinator", ["10.0.0.5"], 8000, {"role": "coordinator"}).start()
    assert a._thread is None
    with pytest.raises(discovery.DiscoveryUnavailable, match="GPUMESH_DISCOVERY=0"):
        discovery.browse(0.1)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.8.8", "::1", "[::1]", "localhost"])
def test_loopback_is_never_advertised(host):
    assert discovery.advertise_addresses(host) == []
    assert discovery.worker_address(f"http://{host}:8000") is None


def test_addresses_for_a_bound_host(monkeypatch):
    assert discovery.advertise_addresses("10.214.8.1") == ["10.214.8.1"]
    monkeypatch.setattr(discovery, "local_addresses", lambda: ["192.168.1.4", "10.0.0.2"])
    assert discovery.advertise_addresses("0.0.0.0") == ["192.168.1.4", "10.0.0.2"]


def test_local_addresses_exclude_loopback():
    for a in discovery.local_addresses():
        assert not a.startswith("127.") and not a.startswith("169.254.")


def test_txt_record_holds_only_known_keys():
    props = discovery.txt_properties("coordinator", version="0.1.0", device="GPU", device_name="H100",
                                     hostname="box", token="secret-token-value", url="x", score=None)
    assert props == {"role": "coordinator", "version": "0.1.0", "device": "GPU",
                     "device_name": "H100", "hostname": "box"}
    with pytest.raises(ValueError):
        discovery.txt_properties("admin")


def test_entry_and_coordinators():
    e = discovery.entry("box coordinator 10.0.0.5 8000 1._gpumesh._tcp.local.", ["10.0.0.5"], 8000,
                        {b"role": b"coordinator", b"hostname": b"box", b"token": b"nope",
                         b"scheme": b"https"})
    assert e["url"] == "https://10.0.0.5:8000" and e["host"] == "box" and "token" not in e["properties"]
    w = discovery.entry("w", ["10.0.0.6"], 8000, {b"role": b"worker", b"coordinator": b"http://x:1"})
    assert w["url"] is None and w["coordinator"] == "http://x:1"
    assert discovery.coordinators([e, w, dict(e)]) == [e]


def test_instance_name_is_short_and_unique_per_role():
    a = discovery.instance_name("coordinator", "my.very.long.host-name.example.com", "10.0.0.1", 8000)
    b = discovery.instance_name("worker", "my.very.long.host-name.example.com", "10.0.0.1", 8000)
    assert a != b and len(a) <= 63 and "." not in a.replace("10.0.0.1", "")


def test_radar_table_renders():
    from rich.console import Console
    from gpumesh.cli.radar import radar_table
    e = discovery.entry("n", ["10.0.0.5"], 8000, {b"role": b"coordinator", b"hostname": b"box",
                                                  b"device": b"GPU", b"device_name": b"H100"})
    console = Console(width=150, record=True, file=open(os.devnull, "w"))
    console.print(radar_table([e]))
    text = console.export_text()
    assert "box" in text and "coordinator" in text and "http://10.0.0.5:8000" in text and "H100" in text


# --------------------------------------------------------------------------- setup ---
def test_serve_plan_lan_keeps_the_token_off_the_command_line():
    plan = wizard.serve_plan("lan", 8001, "t" * 40, generated=True)
    assert plan.argv == ["serve", "--host", "0.0.0.0", "--port", "8001"]
    assert plan.env == {"GPUMESH_TOKEN": "t" * 40}
    assert "t" * 40 not in plan.command()
    assert any("t" * 40 in line for line in plan.lines())  # shown once, like serve does


def test_serve_plan_local_and_entered_token_is_not_echoed():
    plan = wizard.serve_plan("local", 8000, "u" * 30, generated=False)
    assert plan.argv == ["serve", "--port", "8000"]
    assert not any("u" * 30 in line for line in plan.lines())


def test_join_plans():
    assert wizard.join_plan("local", port=9000).argv == ["join", "http://127.0.0.1:9000"]
    assert wizard.join_plan("lan").argv == ["join"]  # found on the LAN
    assert wizard.join_plan("lan", "http://10.0.0.5:8000/").argv == ["join", "http://10.0.0.5:8000"]
    with pytest.raises(ValueError):
        wizard.join_plan("lan", "ftp://x")


def test_setup_coordinator_on_the_lan_through_the_cli_runner():
    r = CliRunner().invoke(main, ["setup"], input="coordinator\nlan\n8002\ngenerate\n")
    assert r.exit_code == 0, r.output
    assert "gpumesh serve --host 0.0.0.0 --port 8002" in r.output
    assert "export GPUMESH_TOKEN=" in r.output
    assert "--token" not in r.output


def test_setup_worker_with_an_entered_token():
    secret = "entered-token-0123456789"
    r = CliRunner().invoke(main, ["setup"], input=f"worker\nlan\n\nenter\nshort\n{secret}\n")
    assert r.exit_code == 0, r.output
    assert "at least 16 characters" in r.output
    assert "  gpumesh join\n" in r.output
    assert secret not in r.output


def test_setup_refuses_a_short_or_blank_token_with_an_error_line():
    # docs/cli.md: a refused answer is one `Error:` line, then the question again (the
    # token's refusal used to be a bare sentence)
    secret = "entered-token-0123456789"
    r = CliRunner().invoke(main, ["setup"], input=f"worker\nlan\n\nenter\nshort\n\n{secret}\n")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines.count("Error: a token needs at least 16 characters") == 2, r.output
    assert r.output.count("Token (hidden): ") == 3
    assert secret not in r.output and "short" not in r.output


def test_setup_from_a_terminal_reads_the_token_hidden_and_refuses_it_the_same_way(monkeypatch):
    monkeypatch.setattr(wizard, "_is_tty", lambda stream: True)  # click's hidden prompt
    secret = "entered-token-0123456789"
    r = CliRunner().invoke(main, ["setup"], input=f"worker\nlan\n\nenter\nshort\n{secret}\n")
    assert r.exit_code == 0, r.output
    assert "Error: a token needs at least 16 characters" in r.output.splitlines()
    assert secret not in r.output


def test_scripted_setup_reads_the_token_without_getpass_warnings(tmp_path):
    # stdin a pipe: getpass cannot turn echo off and warned (GetPassWarning, "Password
    # input may be echoed"); a piped answer is echoed by nothing, so it is read as a line
    import subprocess
    import sys
    secret = "entered-token-0123456789"
    env = dict(os.environ, HOME=str(tmp_path), GPUMESH_CONFIG=str(tmp_path / "config.json"))
    r = subprocess.run([sys.executable, "-m", "gpumesh", "setup"], env=env, capture_output=True,
                       text=True, timeout=60, input=f"coordinator\nlan\n8000\nenter\nshort\n{secret}\n")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == ""
    assert "Error: a token needs at least 16 characters" in r.stdout.splitlines()
    assert r.stdout.rstrip().endswith("gpumesh serve --host 0.0.0.0 --port 8000")
    assert secret not in r.stdout


@pytest.mark.parametrize("answers, question, tty", [
    ("coordinator\nlan\n", "Port", False),
    ("worker\nlan\n\nenter\n", "Token (hidden)", False),
    ("worker\nlan\n\nenter\n", "Token (hidden)", True),
    ("", "Role of this machine", False),
])
def test_setup_input_that_ends_at_a_prompt_is_one_error_line(monkeypatch, answers, question, tty):
    # It used to end "Port [8000]: Aborted!": click's word, on the prompt's line.
    monkeypatch.setattr(wizard, "_is_tty", lambda stream: tty)
    r = CliRunner().invoke(main, ["setup"], input=answers)
    assert r.exit_code == 1, r.output
    assert r.stderr == (f"Error: no answer to {question!r}: the input ended (or was interrupted) "
                        "before the last question; setup stopped\n")
    assert r.stdout.endswith(": \n" if not tty else "\n")  # the prompt's line is ended
    if not tty:  # (the runner's stand-in for a hidden prompt ends its line itself)
        assert not r.stdout.endswith("\n\n")
    assert "Aborted!" not in r.output


def test_setup_run_execs_with_the_token_in_the_environment(monkeypatch):
    seen = {}

    def fake_exec(path, argv, env):
        seen.update(argv=argv, env=env)
    monkeypatch.setattr(os, "execvpe", fake_exec)
    r = CliRunner().invoke(main, ["setup", "--run"], input="worker\nlocal\n8000\nenter\n" + "k" * 20 + "\n")
    assert r.exit_code == 0, r.output
    assert seen["argv"][-2:] == ["join", "http://127.0.0.1:8000"]
    assert all("k" * 20 not in a for a in seen["argv"])
    assert seen["env"]["GPUMESH_TOKEN"] == "k" * 20


def test_setup_bad_choice_is_asked_again():
    r = CliRunner().invoke(main, ["setup"], input="admin\ncoordinator\nlocal\n8000\ngenerate\n")
    assert r.exit_code == 0 and "gpumesh serve --port 8000" in r.output


def test_setup_bad_url_is_asked_again_not_a_failure():
    # A URL that is not http(s)://HOST is refused at its own prompt, which asks again
    # (as the port and choice prompts do); the wizard used to go on to the token question
    # and then end with exit code 1.
    r = CliRunner().invoke(main, ["setup"], input="worker\nlan\nftp://x\nhttp://10.0.0.5:8000/\nsaved\n")
    assert r.exit_code == 0, r.output
    assert "Error: coordinator URL 'ftp://x' must start with http:// or https://" in r.output
    assert r.output.count("Coordinator URL (empty: find it on the LAN):") == 2
    assert r.output.rstrip().endswith("gpumesh join http://10.0.0.5:8000")



def test_setup_local_worker_offers_the_saved_coordinator(tmp_path, monkeypatch):
    # `gpumesh serve --port 8123` saved its URL: the wizard's default port and the join
    # line follow it (they used to say 8000 whatever was saved)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"url": "http://127.0.0.1:8123", "token": "s" * 32}))
    monkeypatch.setenv("GPUMESH_CONFIG", str(cfg))
    r = CliRunner().invoke(main, ["setup"], input="worker\nlocal\n\nsaved\n")
    assert r.exit_code == 0, r.output
    assert "Coordinator port [8123]:" in r.output
    assert r.output.rstrip().endswith("gpumesh join http://127.0.0.1:8123"), r.output
    assert wizard.join_plan("local", port=9000).argv == ["join", "http://127.0.0.1:9000"]


def test_join_takes_the_saved_token_for_its_url_written_another_way(tmp_path):
    # The config names "https://127.0.0.1:9/"; `join https://127.0.0.1:9` is that coordinator
    # (it used to compare the strings and say "no token"). Its saved pin is malformed here,
    # so join stops at it, after the token was found and before any connection.
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"url": "https://127.0.0.1:9/", "token": "s" * 32,
                               "fingerprint": "SHA256:nothex"}))
    env = {"GPUMESH_CONFIG": str(cfg), "GPUMESH_TOKEN": "", "GPUMESH_WORKER_TOKEN": "",
           "GPUMESH_FINGERPRINT": ""}
    r = CliRunner().invoke(main, ["join", "https://127.0.0.1:9"], env=env)
    assert "no token" not in r.output, r.output
    assert r.exit_code == 1 and "'SHA256:nothex' is not SHA256:<64 hex digits>" in r.output, r.output


def test_setup_worker_says_when_no_token_is_at_hand(tmp_path, monkeypatch):
    # "saved" with neither $GPUMESH_TOKEN nor a saved token: the join line alone would stop
    # at once with "no token"; the plan says what to set first (it used to claim the token
    # would be taken from them)
    monkeypatch.setenv("GPUMESH_CONFIG", str(tmp_path / "none.json"))
    monkeypatch.delenv("GPUMESH_TOKEN", raising=False)
    r = CliRunner().invoke(main, ["setup"], input="worker\nlan\nhttp://10.0.0.5:8000\nsaved\n")
    assert r.exit_code == 0, r.output
    assert "Token: none here yet" in r.output and "export GPUMESH_TOKEN=" in r.output
    assert "taken from $GPUMESH_TOKEN" not in r.output
    monkeypatch.setenv("GPUMESH_TOKEN", "t" * 32)
    r = CliRunner().invoke(main, ["setup"], input="worker\nlan\nhttp://10.0.0.5:8000\nsaved\n")
    assert "Token: taken from $GPUMESH_TOKEN or the saved config." in r.output
