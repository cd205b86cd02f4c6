"""What Windows needs that Linux and macOS get for free: an owner-only config file, the
firewall rule for ``serve``, and a console that cannot print every character.

Everything that touches Windows goes through three narrow functions, :func:`is_admin`,
:func:`run_icacls` and :func:`run_netsh`, so the decisions around them can be tested
anywhere. Nothing here is imported on a worker's task path, and nothing here imports a
POSIX-only module.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

#: How long icacls/netsh may take before we give up on them (seconds).
TOOL_TIMEOUT_S = 30


def is_windows() -> bool:
    return sys.platform == "win32"


# --- the config file: readable by its owner only ---------------------------------------

def run_icacls(args: list[str]) -> subprocess.CompletedProcess:
    """Run ``icacls ARGS`` and return what it did (stdout and stderr as text).

    icacls rather than ctypes' advapi32: it ships with every Windows since Vista, takes the
    whole change (drop inherited entries, grant one account) in one call whose effect can
    be read in its documentation, and needs none of the SID/ACL structures that
    SetNamedSecurityInfoW would have us build by hand. Raises ``OSError`` if it cannot be
    started and ``subprocess.TimeoutExpired`` if it hangs."""
    return subprocess.run(["icacls", *args], capture_output=True, text=True,
                          errors="replace", timeout=TOOL_TIMEOUT_S, stdin=subprocess.DEVNULL)


def windows_account() -> str:
    """This user as Windows names them: ``DOMAIN\\user`` (or ``user`` without a domain)."""
    user = os.environ.get("USERNAME") or ""
    if not user:
        import getpass
        user = getpass.getuser()
    domain = os.environ.get("USERDOMAIN")
    return f"{domain}\\{user}" if domain else user


def owner_only_args(path: Path | str, account: str) -> list[str]:
    """The icacls arguments that leave ``account`` as the only one with access to ``path``:
    inherited entries removed (``/inheritance:r``), full control granted, replacing any
    grant it had (``/grant:r``). A new file has no entries of its own besides those."""
    return [str(path), "/inheritance:r", "/grant:r", f"{account}:F"]


def restrict_to_owner(path: Path | str) -> bool:
    """Make ``path`` readable and writable by its owner only; True if that is so.

    POSIX: mode 0600 (the mode bits are the whole story there). Windows: an ACL that
    grants only this user (:func:`owner_only_args`); if icacls fails, a warning states the
    limit - the file is then only as private as the folder it is in - and False returns.
    """
    if not is_windows():
        os.chmod(path, 0o600)
        return True
    account = windows_account()
    try:
        done = run_icacls(owner_only_args(path, account))
        problem = None if done.returncode == 0 else (
            (done.stderr or done.stdout or "").strip() or f"exit code {done.returncode}")
    except (OSError, subprocess.SubprocessError) as e:
        problem = str(e)
    if problem is None:
        return True
    log.warning("could not make %s readable by %s only (icacls: %s); it is only as private "
                "as the permissions of %s", path, account, problem, Path(path).parent)
    return False


# --- serve: the firewall rule ----------------------------------------------------------

def is_admin() -> bool:
    """True if this process runs elevated (as Administrator) on Windows; else False."""
    if not is_windows():
        return False
    try:
        import ctypes
        return bool(ctypes.windll.shell32.IsUserAnAdmin())  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return False


def run_netsh(args: list[str]) -> subprocess.CompletedProcess:
    """Run ``netsh ARGS`` and return what it did (its messages are in the console's code
    page, which need not be ours: undecodable bytes become U+FFFD). Raises ``OSError`` if
    netsh cannot be started and ``subprocess.TimeoutExpired`` if it hangs."""
    return subprocess.run(["netsh", *args], capture_output=True, text=True,
                          errors="replace", timeout=TOOL_TIMEOUT_S, stdin=subprocess.DEVNULL)


def rule_name(port: int) -> str:
    """One rule per port, with no space in its name (nothing to quote on any shell)."""
    return f"gpumesh-{port}"


def add_rule_args(port: int) -> list[str]:
    """netsh arguments adding an inbound rule that allows TCP ``port``."""
    return ["advfirewall", "firewall", "add", "rule", f"name={rule_name(port)}", "dir=in",
            "action=allow", "protocol=TCP", f"localport={port}"]


def firewall_command(port: int) -> str:
    """The command a user runs in an Administrator prompt to add the rule themselves."""
    return (f'netsh advfirewall firewall add rule name="{rule_name(port)}" dir=in '
            f"action=allow protocol=TCP localport={port}")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def firewall_lines(host: str, port: int) -> list[str]:
    """What ``serve`` says (and does) about Windows Firewall once it listens on ``host``.

    Nothing unless this is Windows and the address is one other machines can reach (a
    loopback coordinator, and ``--public``'s tunnel to it, need no rule). As Administrator
    the inbound rule for ``port`` is added (once: an existing rule of that name is kept);
    otherwise the lines say how to add it."""
    if not is_windows() or _loopback(host):
        return []
    name = rule_name(port)
    if not is_admin():
        return ["[!!] Windows Firewall may block workers on other machines. Run gpumesh serve "
                "as Administrator to have the rule added, or run once in an Administrator prompt:",
                f"   {firewall_command(port)}"]
    try:
        if run_netsh(["advfirewall", "firewall", "show", "rule", f"name={name}"]).returncode == 0:
            return [f'[OK] Windows Firewall: rule "{name}" already allows inbound TCP {port}']
        done = run_netsh(add_rule_args(port))
        problem = None if done.returncode == 0 else (
            (done.stdout or done.stderr or "").strip() or f"exit code {done.returncode}")
    except (OSError, subprocess.SubprocessError) as e:
        problem = str(e)
    if problem is None:
        return [f'[OK] Windows Firewall: added rule "{name}" (inbound TCP {port} allowed)']
    return [f"[!!] Windows Firewall: could not add the rule ({problem}); workers on other "
            "machines may be blocked. Add it yourself in an Administrator prompt:",
            f"   {firewall_command(port)}"]


# --- consoles ----------------------------------------------------------------------------

def safe_streams() -> None:
    """Let stdout/stderr print any text: a character the console's encoding lacks (a
    Windows console in cp1252 has no ✓ or →, nor most hostnames' scripts) becomes ``?``
    instead of a ``UnicodeEncodeError``. Streams already in a UTF encoding are untouched."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "")
        if encoding.startswith("utf") or not hasattr(stream, "reconfigure"):
            continue
        try:
            stream.reconfigure(errors="replace")
        except (ValueError, OSError):  # closed, or not a real text stream
            pass
