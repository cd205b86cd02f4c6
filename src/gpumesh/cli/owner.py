"""The machine owner's side of a worker: ``join``'s sharing flags, the worker config file
``~/.gpumesh/worker.toml``, and ``gpumesh pause`` / ``gpumesh resume``.

The config file holds the same settings as the flags (a flag given wins over the file)::

    gpus = "0,2"                  # or [0, 2], or "none" for CPU only
    cpu_slots = 2
    max_gpu_memory = "8GB"
    hours = ["22:00-08:00", "sat,sun 00:00-24:00"]
    at_window_end = "finish"      # or "requeue"
    yield_gpu = true
    busy_threshold = "10%"        # or a memory size, "500MiB"
    yield_grace = "30s"
    max_temp = 80                 # degrees Celsius
    max_power = 250               # watts

It must belong to the user running the worker and be writable by no one else (its rules
decide what this machine shares). Anything wrong is a usage error (exit 2) naming the
setting.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import click

from .. import userdirs
from .common import fail

#: Settings of the config file, with the flag each one mirrors.
SETTINGS = {"gpus": "--gpus", "cpu_slots": "--cpu-slots", "max_gpu_memory": "--max-gpu-memory",
            "hours": "--hours", "at_window_end": "--at-window-end", "yield_gpu": "--yield-gpu",
            "busy_threshold": "--busy-threshold", "yield_grace": "--yield-grace",
            "max_temp": "--max-temp", "max_power": "--max-power"}


def worker_config_path() -> Path:
    """``~/.gpumesh/worker.toml`` (on macOS/Windows: see gpumesh.userdirs)."""
    return userdirs.config_file("worker.toml")


def load_worker_config(path: Path | None = None) -> dict:
    """The settings of the worker config file (``{}`` when there is none). Raises
    ``ValueError`` naming the file (and the setting) when it is unsafe or malformed."""
    path = path or worker_config_path()
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}
    if st.st_uid != os.getuid():
        raise ValueError(f"{path} belongs to another user (uid {st.st_uid}); not reading it")
    if st.st_mode & 0o022:
        raise ValueError(f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): "
                         f"they could change what this machine shares; run: chmod 600 {path}")
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None
    unknown = sorted(set(data) - set(SETTINGS))
    if unknown:
        raise ValueError(f"{path}: unknown setting {unknown[0]!r} (known: {', '.join(SETTINGS)})")
    return data


def owner_options(fn):
    """``join``'s flags for the owner's rules (each defaults to the config file, then off)."""
    opts = [
        click.option("--gpus", default=None, metavar="LIST",
                     help="Which GPUs to share, by index: 0,2 or none (CPU only) [default: all]."),
        click.option("--max-gpu-memory", default=None, metavar="SIZE",
                     help="GPU memory each shared GPU offers, e.g. 8GB: bigger tasks never come "
                          "here [default: all of it]."),
        click.option("--hours", multiple=True, metavar="WINDOW",
                     help="Take tasks only inside this local-time window, e.g. 22:00-08:00 or "
                          "'mon-fri 19:00-23:30'; repeatable [default: always]."),
        click.option("--at-window-end", type=click.Choice(["finish", "requeue"]), default=None,
                     help="At the end of the hours, let running tasks finish or hand them back "
                          "[default: finish]."),
        click.option("--yield-gpu/--no-yield-gpu", default=None,
                     help="Stop using a GPU while another program (a game, your own training) "
                          "uses it [default: off]."),
        click.option("--busy-threshold", default=None, metavar="N%|SIZE",
                     help="What counts as using a GPU: other programs' utilisation (10%) or "
                          "memory (500MiB) [default: 10%]."),
        click.option("--yield-grace", default=None, metavar="DURATION",
                     help="How long a yielding GPU's running task may go on before it is handed "
                          "back, e.g. 30s [default: 30s]."),
        click.option("--max-temp", default=None, metavar="CELSIUS",
                     help="No new tasks on a GPU at or above this temperature; again 5C below "
                          "[default: no limit]."),
        click.option("--max-power", default=None, metavar="WATTS",
                     help="No new tasks on a GPU drawing this much power; again below 90% "
                          "[default: no limit]."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _number(value, name: str, lo: float, hi: float) -> float:
    try:
        n = float(value)
    except (TypeError, ValueError):
        n = float("nan")
    if isinstance(value, bool) or not lo < n <= hi:
        raise ValueError(f"{name}={value!r} must be a number above {lo:g} and at most {hi:g}")
    return n


def build_policy(flags: dict, file_settings: dict):
    """(:class:`gpumesh.worker.owner.Policy`, cpu slots or None) from ``join``'s flags
    (None: not given) over the file's settings. Raises ``ValueError`` naming the setting."""
    from ..hardware import MiB, parse_memory
    from ..worker.owner import DEFAULT_YIELD_GRACE_S, Policy, Threshold, Window, parse_duration

    merged = {k: v for k, v in file_settings.items()}
    for key, value in flags.items():
        if value is not None and value != ():
            merged[key] = list(value) if key == "hours" else value

    def name(key: str) -> str:
        return SETTINGS[key] if flags.get(key) not in (None, ()) else key

    kw: dict = {}
    if "gpus" in merged:
        raw = merged["gpus"]
        if isinstance(raw, list):
            raw = ",".join(str(x) for x in raw)
        text = str(raw).strip().lower()
        if text == "none":
            kw["gpus"] = ()
        else:
            try:
                kw["gpus"] = tuple(dict.fromkeys(int(x) for x in text.split(",")))
            except ValueError:
                raise ValueError(f"{name('gpus')}={raw!r}: give GPU indices such as 0,2 or none") from None
            if not kw["gpus"] or min(kw["gpus"]) < 0:
                raise ValueError(f"{name('gpus')}={raw!r}: give GPU indices such as 0,2 or none")
    if "max_gpu_memory" in merged:
        size = parse_memory(merged["max_gpu_memory"], name("max_gpu_memory"))
        kw["max_gpu_memory_mb"] = max(1, size // MiB)
    if "hours" in merged:
        hours = merged["hours"]
        if isinstance(hours, str):
            hours = [hours]
        if not isinstance(hours, list) or not hours:
            raise ValueError(f"{name('hours')}: give one or more windows such as \"22:00-08:00\"")
        kw["hours"] = tuple(Window.parse(str(h), name("hours")) for h in hours)
    if "at_window_end" in merged:
        if merged["at_window_end"] not in ("finish", "requeue"):
            raise ValueError(f"{name('at_window_end')}={merged['at_window_end']!r} must be finish or requeue")
        kw["at_window_end"] = merged["at_window_end"]
    if "yield_gpu" in merged:
        if not isinstance(merged["yield_gpu"], bool):
            raise ValueError(f"{name('yield_gpu')} must be true or false")
        kw["yield_gpu"] = merged["yield_gpu"]
    if "busy_threshold" in merged:
        kw["busy_threshold"] = Threshold.parse(merged["busy_threshold"], name("busy_threshold"))
    if "yield_grace" in merged:
        kw["yield_grace_s"] = parse_duration(merged["yield_grace"], name("yield_grace"))
    else:
        kw["yield_grace_s"] = DEFAULT_YIELD_GRACE_S
    if "max_temp" in merged:
        kw["max_temp_c"] = _number(merged["max_temp"], name("max_temp"), 0, 150)
    if "max_power" in merged:
        kw["max_power_w"] = _number(merged["max_power"], name("max_power"), 0, 10000)
    _refuse_idle_flags(flags, merged, kw)
    slots = None
    if "cpu_slots" in merged:
        v = merged["cpu_slots"]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1024:
            raise ValueError(f"{name('cpu_slots')}={v!r} must be a whole number from 0 to 1024")
        slots = v
    return Policy(**kw), slots


#: The rules that act on shared GPUs only.
GPU_RULES = ("max_gpu_memory", "yield_gpu", "busy_threshold", "yield_grace", "max_temp", "max_power")


def _refuse_idle_flags(flags: dict, merged: dict, kw: dict) -> None:
    """A flag that the other settings make do nothing raises ``ValueError`` (a usage
    error, as ``serve --slots N --no-self-worker`` is): it would otherwise be accepted and
    ignored. Only flags: a rule kept in the config file while a flag turns it off for one
    run is how the file is meant to be used."""
    given = [k for k, v in flags.items() if v not in (None, ()) and (k != "yield_gpu" or v)]
    if kw.get("gpus") == ():
        idle = [k for k in given if k in GPU_RULES]
        if idle:
            how = "--gpus none" if flags.get("gpus") not in (None, ()) else "gpus = \"none\" (worker.toml)"
            raise ValueError(f"{how} shares no GPU, so {SETTINGS[idle[0]]} has nothing to apply "
                             f"to: drop {SETTINGS[idle[0]]}")
    if "at_window_end" in given and "hours" not in merged:
        raise ValueError("--at-window-end says what happens when the --hours window ends, and "
                         "no hours are set: give --hours too, or drop --at-window-end")
    for key in ("busy_threshold", "yield_grace"):
        if key in given and not kw.get("yield_gpu"):
            raise ValueError(f"{SETTINGS[key]} tunes --yield-gpu, which is off: add --yield-gpu "
                             f"(or yield_gpu = true in worker.toml), or drop {SETTINGS[key]}")


def gpu_rules_inactive(policy, gpus: list[dict]) -> str | None:
    """The one warning line for a worker whose GPU rules (``--yield-gpu``, ``--max-temp``,
    ``--max-power``) cannot act on this machine: it shares no NVIDIA GPU (``gpus``: those
    it shares), or NVML, which they read, is missing or cannot start. None when no such
    rule is set or they can act."""
    if not policy.watches_gpus:
        return None
    from ..worker.device import nvml_missing
    why = [w for w in ("no NVIDIA GPU was found to share" if not gpus else None, nvml_missing()) if w]
    if not why:
        return None
    rules = [SETTINGS[k] for k, on in (("yield_gpu", policy.yield_gpu),
                                       ("max_temp", policy.max_temp_c is not None),
                                       ("max_power", policy.max_power_w is not None)) if on]
    return (f"warning: the GPU rules ({', '.join(rules)}) are inactive on this machine: "
            f"{' and '.join(why)}; the worker starts without them")


def gpu_memory_inactive(policy, gpus: list[dict]) -> str | None:
    """The warning line for a worker whose ``--max-gpu-memory`` has nothing to cap, for no
    GPU was found to share (``gpus``: those it shares). None when the setting is unset, a
    GPU is shared, or ``gpus = none`` turns GPUs off on purpose (a cap kept in worker.toml
    for the runs that share them: :func:`describe_policy` then leaves it out)."""
    if policy.max_gpu_memory_mb is None or gpus or policy.gpus == ():
        return None
    return (f"warning: {SETTINGS['max_gpu_memory']} is inactive on this machine: no NVIDIA "
            "GPU was found to share; the worker starts without it")


def describe_policy(policy, gpu_rules: bool = True, gpu_memory: bool = True) -> list[str]:
    """The rules in force, one short line each, for join's start-up lines; ``gpu_rules``
    False leaves out those that read the GPUs (:func:`gpu_rules_inactive` says why),
    ``gpu_memory`` False the GPU memory cap (:func:`gpu_memory_inactive` says why), as
    does sharing no GPU (``gpus = none``)."""
    out = []
    if policy.gpus is not None:
        out.append("GPUs shared: " + (", ".join(f"cuda:{i}" for i in policy.gpus) or "none"))
    if policy.max_gpu_memory_mb is not None and gpu_memory and policy.gpus != ():
        out.append(f"GPU memory offered: at most {policy.max_gpu_memory_mb} MiB per GPU")
    if policy.hours:
        out.append(f"hours: {', '.join(w.text for w in policy.hours)} (local time; at the end "
                   f"running tasks {'are handed back' if policy.at_window_end == 'requeue' else 'finish'})")
    if not gpu_rules:
        return out
    if policy.yield_gpu:
        out.append(f"yielding a GPU another program uses above {policy.busy_threshold} "
                   f"(grace {policy.yield_grace_s:g}s)")
    if policy.max_temp_c is not None:
        out.append(f"no new tasks on a GPU at {policy.max_temp_c:g}C or hotter")
    if policy.max_power_w is not None:
        out.append(f"no new tasks on a GPU drawing {policy.max_power_w:g}W or more")
    return out


# ---------------------------------------------------------------- pause / resume -----
def _send(request: dict, worker: str | None) -> list[dict]:
    from ..worker import control
    if worker is not None:
        request["worker"] = worker
    try:
        answers = control.send(request)
    except control.NoWorkerRunning as e:
        fail(str(e))
    except control.ControlError as e:
        fail(str(e))
    for a in answers:
        if not a.get("ok"):
            fail(f"a worker refused: {a.get('error', 'no reason given')}")
    meant = [a for a in answers if not a.get("skipped")]
    if not meant:
        fail(f"no running worker of this user has the id {worker}")
    return meant


def _who(a: dict) -> str:
    return f"worker {a.get('worker') or '?'} ({a.get('hostname') or '?'})"


@click.command()
@click.option("--now", is_flag=True,
              help="Hand running tasks back at once (their processes are killed; they run "
                   "again elsewhere) [default: let them finish].")
@click.option("--for", "for_", default=None, metavar="DURATION",
              help="Resume by itself after this long, e.g. 2h or 30m [default: until `gpumesh resume`].")
@click.option("--worker", default=None, metavar="ID", help="Only this worker [default: every "
              "worker of this user on this machine].")
def pause(now, for_, worker):
    """Stop this machine's workers from taking new tasks (the owner's "not now").

    Talks to the workers of this OS user on this machine through a local, owner-only
    channel (never the network). Exit code 1 if no worker is running."""
    from ..worker.owner import clock_time, parse_duration
    for_s = None
    if for_ is not None:
        try:
            for_s = parse_duration(for_, "--for")
        except ValueError as e:
            fail(str(e), code=2)
    for a in _send({"op": "pause", "now": now, "for_s": for_s}, worker):
        n, queued = a.get("running", 0), a.get("queued", 0)
        what = "no task running" if not n else (
            f"{n} running task(s) handed back" if now else f"{n} running task(s) finish")
        if queued:  # (leased behind a running task, not begun: they go back either way)
            what += f"; {queued} queued task(s) handed back"
        until = ""
        if for_ and a.get("until"):
            until = f" for {for_} (until {clock_time(a['until'])})"
        again = " (it was paused already: this pause replaces that one)" if a.get("was_paused") else ""
        click.echo(f"[OK] paused {_who(a)}{until}: no new tasks; {what}{again}")


@click.command()
@click.option("--worker", default=None, metavar="ID", help="Only this worker [default: every "
              "worker of this user on this machine].")
def resume(worker):
    """Let this machine's paused workers take tasks again. Exit code 1 if no worker is
    running."""
    for a in _send({"op": "resume"}, worker):
        state = a.get("state", "open")
        still = "" if state == "open" else f" (still {state})"
        if a.get("was_paused") is False:  # (a worker of an older gpumesh does not say)
            click.echo(f"[OK] {_who(a)} was not paused: nothing to resume{still}")
        else:
            click.echo(f"[OK] resumed {_who(a)}{still}")
