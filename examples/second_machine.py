"""Print the exact command that joins another machine to the mesh this machine runs.

    python examples/second_machine.py

Run it on the coordinator's machine. It finds the mesh the usual way ($GPUMESH_URL /
$GPUMESH_TOKEN, else the config ``gpumesh serve`` saved), asks the live coordinator for
its pool, then tries each of this machine's network addresses: an address counts as
reachable when the same coordinator (same workers, same token) answers on it. Every
reachable address gets a ready-to-paste ``gpumesh join`` line with the port, the token
and (for TLS) the certificate pin filled in.

A coordinator bound to 127.0.0.1 (``gpumesh serve``'s default) answers on no other
address; the script then says so and prints how to restart it for the LAN. Reachable
from here does not prove reachable from the other machine: a firewall in between is the
usual reason it is not (docs/troubleshooting.md, "Bound, but the other machine cannot
connect").

Exit code 0 with at least one join line, 1 when the mesh cannot be reached or no
address but loopback reaches it.
"""

from __future__ import annotations

import shlex
import sys
from urllib.parse import urlsplit

from gpumesh import GPUMesh, MeshError
from gpumesh.discovery import is_loopback, local_addresses


def worker_ids(mesh: GPUMesh) -> set[str]:
    """The ids of every worker the coordinator knows (raises MeshError when unreachable)."""
    return {w["id"] for w in mesh.workers()}


def reachable_urls(mesh: GPUMesh, known: set[str]) -> list[str]:
    """The URLs, one per non-loopback address of this machine, on which the coordinator
    of ``mesh`` answers with the same pool (``known``, or the pool as it is right after
    the probe: a worker may join meanwhile) and accepts the same token."""
    parts = urlsplit(mesh.url)
    found = []
    for addr in local_addresses():
        url = f"{parts.scheme}://{addr}:{parts.port}"
        probe = GPUMesh(url, token=mesh.token, fingerprint=mesh.fingerprint, output=False)
        try:
            there = worker_ids(probe)
            if there == known or there == worker_ids(mesh):
                found.append(url)
        except MeshError:
            continue  # nothing listens there (bound elsewhere), or another coordinator
        finally:
            probe.close()
    return found


def join_command(url: str, token: str | None, fingerprint: str | None) -> str:
    line = ["gpumesh", "join", url]
    if fingerprint:
        line.append(f"--fingerprint={fingerprint}")
    line.append(f"--token={token}" if token else "--token=<the coordinator's token>")
    return " ".join(shlex.quote(part) for part in line)


def main() -> int:
    mesh = GPUMesh(output=False)
    try:
        known = worker_ids(mesh)
    except MeshError as e:
        print(f"cannot read the mesh at {mesh.url}: {e}", file=sys.stderr)
        print("start one with `gpumesh serve`, or point $GPUMESH_URL/$GPUMESH_TOKEN at it",
              file=sys.stderr)
        return 1
    parts = urlsplit(mesh.url)
    if parts.scheme not in ("http", "https"):
        print(f"{mesh.url} is a Dask or Ray cluster: machines join it with that engine's own "
              "tools (dask worker / ray start), not gpumesh join.")
        return 1
    print(f"Coordinator: {mesh.url} ({len(known)} worker(s) known)")
    if not is_loopback(parts.hostname or ""):
        urls = [mesh.url]  # already a network address: that is what the other machine uses
    else:
        urls = reachable_urls(mesh, known)
    if not urls:
        print(f"The coordinator is bound to loopback only: no address of this machine but "
              f"{parts.hostname} reaches port {parts.port}, so other machines cannot join.")
        print("To open it to your network, stop it (Ctrl+C) and start it again, with the same")
        print("token, bound to every address (read the warning serve prints):")
        if mesh.token:
            print(f"  export GPUMESH_TOKEN={shlex.quote(mesh.token)}")
        tls = " --tls" if parts.scheme == "https" else ""
        print(f"  gpumesh serve --host 0.0.0.0 --port {parts.port}{tls}")
        print("then run this script again.")
        return 1
    print("On the other machine, with gpumesh installed, run:")
    for url in urls:
        print(f"  {join_command(url, mesh.token, mesh.fingerprint)}")
    print("(If the coordinator was started with --worker-token, give the worker that token "
          "instead: it can join but not submit.)")
    print("If it cannot connect, a firewall on this machine is the usual reason: allow "
          f"TCP port {parts.port} (docs/troubleshooting.md).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
