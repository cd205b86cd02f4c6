"""The container's HEALTHCHECK: exit 0 when healthy, 1 when not.

For a coordinator (PID 1 runs ``gpumesh serve``) that is ``GET /v1/health`` answering
200 on the port it serves (``--port``, else gpumesh's default), over HTTPS when it was
started with TLS (the certificate is not checked: this is the container asking itself).
For a worker (``gpumesh join``) it is that the agent process is alive, which it is if
this runs at all: a worker whose coordinator is away keeps retrying, and is not broken.
"""

import ssl
import sys
import urllib.request


def main() -> int:
    try:
        with open("/proc/1/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        argv = []
    if "serve" not in argv:
        return 0
    from gpumesh.limits import DEFAULT_PORT
    port = DEFAULT_PORT
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            port = int(argv[i + 1])
        elif arg.startswith("--port="):
            port = int(arg.split("=", 1)[1])
    tls = any(a in ("--tls", "--tls-cert") or a.startswith("--tls-cert=") for a in argv)
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}/v1/health"
    try:
        with urllib.request.urlopen(url, timeout=4, context=ctx if tls else None) as resp:
            return 0 if resp.status == 200 else 1
    except OSError as e:
        print(f"{url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
