"""Hardware detection for a worker.

Nothing here imports torch or creates a CUDA context: GPUs are listed
through NVML (the ``pynvml`` module from the ``nvidia-ml-py`` package, the
``gpumesh[gpu]`` extra) or, failing that, the ``nvidia-smi`` command line
tool.  Every probe is best-effort; :func:`detect` never raises because of
missing hardware, missing tools or odd output.

A worker offers the GPUs listed here, restricted to the indices in its own
``CUDA_VISIBLE_DEVICES`` when that is set to a list of indices (NVML
indices, which follow PCI bus order).  Apple's MPS counts as present on an
Apple Silicon Mac where torch is installed (found without importing it).

**Testing hook** (never set it outside tests): ``GPUMESH_FAKE_GPUS`` replaces
NVML with fake GPUs, a JSON list such as ``[{"name": "NVIDIA
A100-SXM4-80GB", "memory_total_mb": 81920, "memory_free_mb": 80000,
"score": 5000}]``, or ``@/path/to.json`` naming a file that is re-read at
every refresh (so a test can change free memory while a worker runs).
``score`` (or ``gflops`` and ``bandwidth_gbps``) stands in for the
benchmark of that GPU. For the owner's rules (:mod:`gpumesh.worker.owner`) an entry
may also give what NVML would report at run time: ``other_util_pct`` (utilisation by
processes that are not gpumesh's, %), ``other_memory_mb`` (their memory, MiB),
``temperature_c`` and ``power_w``; with ``@path`` a test changes them while a worker
runs.
"""

from __future__ import annotations

import getpass
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

from ..limits import MiB

log = logging.getLogger("gpumesh.worker.device")

_NVIDIA_SMI_QUERY = "index,name,memory.total,memory.free,driver_version"
#: Seconds a hardware query tool (``nvidia-smi``, ``sysctl``) may take: a wedged driver must
#: not hang a worker's start. Only this module runs them.
_TOOL_TIMEOUT_S = 5.0
#: Environment variable of the fake-GPU testing hook (see the module docstring).
FAKE_GPUS_ENV = "GPUMESH_FAKE_GPUS"


def detect() -> dict:
    """Describe this machine's hardware.

    Returns a dict with keys ``hostname``, ``user`` (OS user), ``platform``
    (e.g. ``"Linux"``), ``python`` (e.g. ``"3.11.7"``), ``cpu`` (CPU model),
    ``cores`` (logical cores), ``ram_mb`` (total RAM in MiB, 0 if unknown),
    ``gpus`` (the GPUs this worker offers: see :func:`nvidia_gpus` and
    :func:`visible`), ``mps`` (an Apple GPU usable through torch),
    ``device`` (``"GPU"`` if any GPU was found, else ``"CPU"``) and
    ``device_name`` (the first GPU's name, else the CPU model).
    """
    cpu = cpu_model()
    try:
        gpus = visible(nvidia_gpus())
    except Exception:  # belt and braces: GPU probing must never fail detect()
        log.debug("GPU detection failed", exc_info=True)
        gpus = []
    mps = has_mps()
    return {
        "hostname": platform.node(),
        "user": _user(),
        "platform": platform.system(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cores": os.cpu_count() or 1,
        "ram_mb": ram_mb(),
        "gpus": gpus,
        "mps": mps,
        "device": "GPU" if gpus or mps else "CPU",
        "device_name": gpus[0]["name"] if gpus else cpu,
    }


def visible(gpus: list[dict], env: dict | None = None) -> list[dict]:
    """``gpus`` restricted to this process's ``CUDA_VISIBLE_DEVICES`` when it is a list
    of indices (``""`` or ``"-1"``: none); any other form (UUIDs) leaves all of them."""
    raw = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return gpus
    raw = raw.strip()
    if raw in ("", "-1"):
        return []
    try:
        wanted = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        log.info("CUDA_VISIBLE_DEVICES=%r is not a list of indices; offering every GPU", raw)
        return gpus
    keep: list[dict] = []
    for i in wanted:
        if i < 0:
            break  # CUDA stops at the first invalid index
        keep.extend(g for g in gpus if g["index"] == i)
    return keep


def has_mps() -> bool:
    """An Apple Silicon Mac with torch installed (torch is not imported here)."""
    if sys.platform != "darwin" or platform.machine() != "arm64":
        return False
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def fake_entries() -> list | None:
    """The raw JSON list of the ``GPUMESH_FAKE_GPUS`` testing hook (``@path`` reads a file,
    again at every call), or None when it is unset."""
    raw = os.environ.get(FAKE_GPUS_ENV)
    if not raw:
        return None
    if raw.startswith("@"):
        with open(raw[1:], encoding="utf-8") as fh:
            raw = fh.read()
    return json.loads(raw)


def fake_gpus() -> list[dict] | None:
    """The GPUs of the ``GPUMESH_FAKE_GPUS`` testing hook, or None when it is unset."""
    entries = fake_entries()
    if entries is None:
        return None
    out = []
    for i, g in enumerate(entries):
        out.append({"index": i, "name": str(g.get("name", f"Fake GPU {i}")),
                    "memory_total_mb": int(g.get("memory_total_mb", 0)),
                    "memory_free_mb": int(g.get("memory_free_mb", g.get("memory_total_mb", 0))),
                    "driver": str(g.get("driver", "fake"))})
    return out


class GpuMonitor:
    """Free GPU memory, refreshed on demand for the heartbeat. Keeps NVML initialised
    between calls (no CUDA context: NVML is the driver's management library); falls
    back to ``nvidia-smi``. Thread-safe enough for one caller thread."""

    def __init__(self, indices: list[int]):
        self.indices = list(indices)
        self._nvml: Any = None  # the pynvml module, imported and initialised on first use
        self._util_seen: dict[int, int] = {}  # GPU index -> newest utilisation sample (us)

    def free_mb(self) -> dict[int, int]:
        """``{gpu index: free MiB}`` for the watched GPUs; ``{}`` if none can be read."""
        if not self.indices:
            return {}
        try:
            fake = fake_gpus()
        except (OSError, ValueError):
            log.debug("cannot read %s", FAKE_GPUS_ENV, exc_info=True)
            return {}
        if fake is not None:
            return {g["index"]: g["memory_free_mb"] for g in fake if g["index"] in self.indices}
        try:
            return self._nvml_free()
        except Exception:
            log.debug("NVML free-memory query failed; trying nvidia-smi", exc_info=True)
            self.close()
        try:
            return {g["index"]: g["memory_free_mb"] for g in _nvidia_smi_gpus()
                    if g["index"] in self.indices}
        except Exception:
            log.debug("nvidia-smi free-memory query failed", exc_info=True)
            return {}

    def _nvml_free(self) -> dict[int, int]:
        if self._nvml is None:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
        out = {}
        for i in self.indices:
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._nvml.nvmlDeviceGetHandleByIndex(i))
            out[i] = int(mem.free // MiB)
        return out

    def readings(self, ours=None) -> dict:
        """``{gpu index: owner.GpuReading}`` for the watched GPUs: other processes' use
        (``ours(pid)`` says whether a process is gpumesh's own, excluded), temperature and
        power; ``{}`` if nothing can be read. Never raises."""
        from .owner import GpuReading
        if not self.indices:
            return {}
        try:
            fake = fake_entries()
        except (OSError, ValueError):
            log.debug("cannot read %s", FAKE_GPUS_ENV, exc_info=True)
            return {}
        if fake is not None:
            out = {}
            for i, g in enumerate(fake):
                if i in self.indices and isinstance(g, dict):
                    out[i] = GpuReading(i, _num(g.get("other_util_pct")), _num(g.get("other_memory_mb")),
                                        _num(g.get("temperature_c")), _num(g.get("power_w")))
            return out
        try:
            return self._nvml_readings(ours or (lambda pid: False))
        except Exception:
            log.debug("NVML readings failed", exc_info=True)
            self.close()
            return {}

    def telemetry(self) -> dict[int, dict]:
        """``{gpu index: {"utilization_pct", "temperature_c"}}`` for the watched GPUs (whole
        GPU utilisation in %, degrees Celsius; a value NVML cannot give is left out), for
        the dashboard and ``/metrics``. ``{}`` if nothing can be read. Never raises."""
        if not self.indices:
            return {}
        try:
            fake = fake_entries()
            if fake is not None:
                return {i: {k: float(g[k]) for k in ("utilization_pct", "temperature_c")
                            if isinstance(g.get(k), (int, float)) and not isinstance(g.get(k), bool)}
                        for i, g in enumerate(fake) if i in self.indices and isinstance(g, dict)}
            if self._nvml is None:
                import pynvml
                pynvml.nvmlInit()
                self._nvml = pynvml
            nv, out = self._nvml, {}
            for i in self.indices:
                h, d = nv.nvmlDeviceGetHandleByIndex(i), {}
                try:
                    d["utilization_pct"] = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
                except Exception:  # not supported on this GPU/driver
                    pass
                try:
                    d["temperature_c"] = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
                except Exception:
                    pass
                out[i] = d
            return out
        except Exception:
            log.debug("GPU telemetry unavailable", exc_info=True)
            return {}

    def _nvml_readings(self, ours) -> dict:
        from .owner import GpuReading
        if self._nvml is None:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
        nv = self._nvml
        out = {}
        for i in self.indices:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            procs = []
            for query in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    procs.extend(getattr(nv, query)(h))
                except Exception:  # not supported on this GPU/driver
                    pass
            other_mb = sum((p.usedGpuMemory or 0) for p in procs if not ours(p.pid)) / MiB
            util = self._other_util(h, i, ours)
            try:
                temp = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            except Exception:
                temp = None
            try:
                power = nv.nvmlDeviceGetPowerUsage(h) / 1000.0  # milliwatts
            except Exception:
                power = None
            out[i] = GpuReading(i, util, other_mb, temp, power)
        return out

    def _other_util(self, handle, index: int, ours) -> float | None:
        """SM utilisation (%) of the processes that are not ours, from the samples NVML
        took since the last look (the newest one per process); None if unsupported."""
        since = self._util_seen.get(index, 0)
        try:
            samples = self._nvml.nvmlDeviceGetProcessUtilization(handle, since)
        except Exception as e:
            # NotFound: no process used the GPU since the last look
            return 0.0 if type(e).__name__ == "NVMLError_NotFound" else None
        newest: dict[int, tuple[int, float]] = {}
        for smp in samples:
            stamp = int(getattr(smp, "timeStamp", 0) or 0)
            if smp.pid not in newest or stamp >= newest[smp.pid][0]:
                newest[smp.pid] = (stamp, float(smp.smUtil))
            since = max(since, stamp)
        self._util_seen[index] = since
        return sum(u for pid, (_, u) in newest.items() if not ours(pid))

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                log.debug("nvmlShutdown failed", exc_info=True)
            self._nvml = None


def _num(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or one of its descendants (Linux /proc;
    False where that cannot be read)."""
    for _ in range(64):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                pid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _user() -> str:
    """Name of the OS user running this process ("" if it cannot be found)."""
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry (containers) and no LOGNAME/USER
        log.debug("getpass.getuser() failed", exc_info=True)
    try:
        return str(os.getuid())
    except Exception:
        return ""


def cpu_model() -> str:
    """CPU model string, e.g. ``"AMD EPYC 7763 64-Core Processor"``.

    Linux: ``model name`` from /proc/cpuinfo; macOS: ``sysctl -n
    machdep.cpu.brand_string``; otherwise (or when those give nothing)
    ``platform.processor()``, then ``platform.machine()``, then
    ``"unknown"``.
    """
    name = ""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                for line in f:
                    key, sep, value = line.partition(":")
                    if sep and key.strip() == "model name":
                        name = value.strip()
                        break
        except OSError:
            log.debug("cannot read /proc/cpuinfo", exc_info=True)
    elif sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S,
            )
            if out.returncode == 0:
                name = out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            log.debug("sysctl failed", exc_info=True)
    return name or platform.processor() or platform.machine() or "unknown"


def ram_mb() -> int:
    """Total physical RAM in MiB (1024*1024 bytes); 0 if it cannot be found.

    Uses ``os.sysconf`` page size times physical pages (Linux, macOS), else psutil
    when importable (not first: it would stay loaded, ~2 MiB, in every worker agent).
    """
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if total > 0:
            return int(total // MiB)
    except (AttributeError, ValueError, OSError):
        log.debug("os.sysconf unavailable for RAM size", exc_info=True)
    try:
        import psutil

        return int(psutil.virtual_memory().total // MiB)
    except Exception:
        log.debug("psutil unavailable for RAM size", exc_info=True)
    return 0


def nvidia_gpus() -> list[dict]:
    """List NVIDIA GPUs without creating a CUDA context.

    Each entry is ``{"index": int, "name": str, "memory_total_mb": int,
    "memory_free_mb": int, "driver": str}``, memory in MiB.  Indices are
    NVML/nvidia-smi indices, which ignore ``CUDA_VISIBLE_DEVICES``.

    Tries NVML via ``pynvml`` first; if that is not importable or fails,
    runs ``nvidia-smi``.  Returns ``[]`` when neither works; never raises.
    With the ``GPUMESH_FAKE_GPUS`` testing hook set, returns its fake GPUs.
    """
    try:
        fake = fake_gpus()
    except (OSError, ValueError, TypeError, AttributeError):
        log.warning("%s is set but unreadable; ignoring it", FAKE_GPUS_ENV)
        fake = None
    if fake is not None:
        return fake
    try:
        gpus = _nvml_gpus()
    except ImportError:
        log.debug("pynvml not importable; trying nvidia-smi")
    except Exception:
        log.debug("NVML query failed; trying nvidia-smi", exc_info=True)
    else:
        return gpus
    try:
        return _nvidia_smi_gpus()
    except Exception:
        log.debug("nvidia-smi query failed", exc_info=True)
        return []


def nvml_missing() -> str | None:
    """Why NVML cannot read this machine's GPUs at run time, in a few words, or None when
    it can (or the ``GPUMESH_FAKE_GPUS`` testing hook stands in for it). The owner's GPU
    rules (:class:`gpumesh.worker.owner.Policy` ``watches_gpus``) read only NVML: without
    it they never trigger. Never raises."""
    if os.environ.get(FAKE_GPUS_ENV):
        return None
    try:
        import pynvml
    except ImportError:
        return "NVML is not installed (pip install 'gpumesh[gpu]')"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # no driver, or a driver/library mismatch
        return f"NVML cannot start ({_text(e) or type(e).__name__}); is the NVIDIA driver installed?"
    try:
        pynvml.nvmlShutdown()
    except Exception:
        log.debug("nvmlShutdown failed", exc_info=True)
    return None


def _text(value) -> str:
    """NVML returns bytes in older pynvml releases and str in newer ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _nvml_gpus() -> list[dict]:
    """Every GPU NVML can see (memory in MiB). Raises on any NVML failure."""
    import pynvml

    pynvml.nvmlInit()
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append({
                "index": i,
                "name": _text(pynvml.nvmlDeviceGetName(handle)),
                "memory_total_mb": int(mem.total // MiB),
                "memory_free_mb": int(mem.free // MiB),
                "driver": driver,
            })
        return gpus
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            log.debug("nvmlShutdown failed", exc_info=True)


def _nvidia_smi_gpus() -> list[dict]:
    """GPUs reported by ``nvidia-smi`` (memory in MiB); [] if it is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        log.debug("nvidia-smi not found")
        return []
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={_NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        log.debug("nvidia-smi did not run", exc_info=True)
        return []
    if out.returncode != 0:
        log.debug("nvidia-smi exited %s: %s", out.returncode, out.stderr.strip())
        return []
    return parse_nvidia_smi(out.stdout)


def _int_or_zero(text: str) -> int:
    """Parse an nvidia-smi number; "[N/A]" and other junk give 0."""
    try:
        return int(float(text))
    except ValueError:
        return 0


def parse_nvidia_smi(text: str) -> list[dict]:
    """Parse ``nvidia-smi --query-gpu=index,name,memory.total,memory.free,
    driver_version --format=csv,noheader,nounits`` output.

    Returns one dict per well-formed line: ``{"index": int, "name": str,
    "memory_total_mb": int, "memory_free_mb": int, "driver": str}`` with
    memory in MiB (nvidia-smi's unit for these fields).  Unreadable memory
    values (e.g. ``[N/A]``) become 0; lines without a numeric index or with
    too few fields are skipped.
    """
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        try:
            index = int(parts[0])
        except ValueError:
            continue
        gpus.append({
            "index": index,
            # A name containing commas would be split; the other fields are fixed.
            "name": ", ".join(parts[1:-3]),
            "memory_total_mb": _int_or_zero(parts[-3]),
            "memory_free_mb": _int_or_zero(parts[-2]),
            "driver": parts[-1],
        })
    return gpus
