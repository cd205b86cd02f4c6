"""Shared by the tests that build their own Linux network namespaces."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def netns_unavailable(tag: str) -> str | None:
    """Why this machine cannot host test namespaces (None if it can): needs Linux, root
    and iproute2, and checks by creating and deleting a probe namespace named ``tag``."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    try:
        for verb in ("add", "del"):
            subprocess.run(["ip", "netns", verb, tag], check=True, capture_output=True, timeout=10)
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as e:
        return f"this machine does not allow network namespaces: {e}"
    return None
