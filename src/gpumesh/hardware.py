"""What a task needs and what a slot offers: requirements, memory sizes, GPU names, slots.

Pure functions and data, no I/O: the caller (``@accelerate`` options, the local
fallback), the coordinator (validation at the boundary, hard filters) and the CLI
(``gpumesh devices``) all use the same rules.

**Memory sizes** (``memory=``, ``gpu_memory=``) are a number and a unit:

=========  =====================================  ==================
unit       meaning                                "16<unit>" is
=========  =====================================  ==================
``B``      bytes                                  16 bytes
``KB``     10^3 bytes (SI)                        16 000 bytes
``MB``     10^6 bytes                             16 000 000 bytes
``GB``     10^9 bytes                             16 000 000 000 bytes
``TB``     10^12 bytes
``KiB``    2^10 bytes (binary)                    16 384 bytes
``MiB``    2^20 bytes
``GiB``    2^30 bytes                             17 179 869 184 bytes
``TiB``    2^40 bytes
=========  =====================================  ==================

Units are case-insensitive (``"16gb"`` is ``"16GB"``), a space may stand between number
and unit, and the number may have a fraction (``"1.5GB"``; bytes are rounded down). A
plain ``int`` is a number of bytes. A bare number in a string (``"16"``), a unit that is
not in the table (``"16G"``: GB or GiB?), zero, a negative size or anything else raises
``ValueError`` naming the argument.

**GPU selection** (``gpu=``): ``"cuda"`` (any NVIDIA GPU), ``"mps"`` (Apple GPU),
``"gpu"`` (any GPU) and ``"cpu"`` (a CPU slot, no GPU) are *kinds*; anything else is a
*model*. A model matches a GPU's name when its words appear, in order and next to each
other, among the name's words; case and separators do not matter and the words may be
written together. So ``"A100"`` matches ``"NVIDIA A100-SXM4-80GB"`` but neither an
``"NVIDIA A10"`` nor an ``"NVIDIA RTX A1000"``; ``"RTX 4090"`` and ``"rtx4090"`` match
``"NVIDIA GeForce RTX 4090"``; ``"L40"`` does not match ``"NVIDIA L40S"``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from . import availability
from .limits import MiB

#: ``gpu=`` values that name a kind of slot rather than a GPU model.
KINDS = ("cuda", "mps", "gpu", "cpu")

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]+)\s*$")
_WORD = re.compile(r"[a-z0-9]+")
_PYTHON = re.compile(r"[0-9]{1,2}\.[0-9]{1,3}\Z")
#: Largest size anyone could mean (1 EiB); beyond it is a typo.
_MAX_BYTES = 2**60


# ---------------------------------------------------------------- memory sizes -------
def parse_memory(value, arg: str = "memory") -> int:
    """``"16GB"`` -> ``16_000_000_000`` (see the module docstring for the units).

    ``arg`` names the argument in the ``ValueError`` raised for anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"{arg}={value!r} is not a memory size; write e.g. {arg}=\"16GB\"")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE.match(value)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _UNITS:
            raise ValueError(
                f"{arg}={value!r} is not a memory size: use a number and a unit, e.g. "
                f"\"16GB\" (GB = 10^9 bytes), \"16GiB\" (GiB = 2^30 bytes) or \"512MB\"")
        n = math.floor(float(m.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"{arg} must be a size such as \"16GB\" or a number of bytes, "
                         f"got {type(value).__name__}")
    if n <= 0 or n > _MAX_BYTES:
        raise ValueError(f"{arg}={value!r} must be more than 0 bytes and at most 1 EiB")
    return n


def format_bytes(n: float) -> str:
    """``16_000_000_000`` -> ``"16 GB"`` (SI, up to 3 significant decimals)."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= size:
            return f"{n / size:.3f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{int(n)} B"


def format_mib(mib: float) -> str:
    """A number of MiB as written in messages: ``1000000.0`` -> ``"1000000"``, ``0.5`` -> ``"0.5"``."""
    return str(int(mib)) if float(mib).is_integer() else f"{mib:g}"


# ---------------------------------------------------------------- GPU names ----------
def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def normalise_gpu(value, arg: str = "gpu") -> str:
    """Validate a ``gpu=`` value: a kind (lower-cased) or a model (stripped).

    Raises ``ValueError`` naming ``arg`` for a non-string, an empty string, or a device
    index such as ``"cuda:1"`` (a task gets its own GPU; it cannot pick one by index).
    """
    if not isinstance(value, str):
        raise ValueError(f"{arg} must be a string such as \"cuda\", \"cpu\" or \"A100\", "
                         f"got {type(value).__name__}")
    text = value.strip()
    low = text.lower()
    if low in KINDS:
        return low
    if re.match(r"^(cuda|mps|gpu)\s*:\s*\d+$", low):
        raise ValueError(f"{arg}={value!r}: a task cannot choose a GPU by index; use "
                         f"{arg}=\"{low.split(':')[0]}\" (each task is given a GPU of its own)")
    if not _words(text):
        raise ValueError(f"{arg}={value!r} names no GPU; use a kind (\"cuda\", \"mps\", \"gpu\", "
                         f"\"cpu\") or a model such as \"A100\"")
    if len(text) > 200:
        raise ValueError(f"{arg} is too long ({len(text)} characters, at most 200)")
    return text


def gpu_matches(model: str, name: str) -> bool:
    """Whether the GPU called ``name`` is a ``model`` (see the module docstring)."""
    want = _words(model)
    have = _words(name)
    if not want or not have:
        return False
    n = len(want)
    for i in range(len(have) - n + 1):
        if have[i:i + n] == want:
            return True
    # The same words written together ("rtx4090" for "RTX 4090"): compare concatenations
    # of consecutive whole words, so a word is never matched by a piece of it.
    joined = "".join(want)
    for i in range(len(have)):
        acc = ""
        for word in have[i:]:
            acc += word
            if acc == joined:
                return True
            if len(acc) >= len(joined) or not joined.startswith(acc):
                break
    return False


# ---------------------------------------------------------------- requirements -------
@dataclass(frozen=True)
class Requirements:
    """Hardware a task needs. ``None`` fields ask for nothing.

    ``gpu``: a kind or a model (see :func:`normalise_gpu`); ``cores``: logical CPU cores
    of the machine; ``memory``: the machine's total RAM in bytes; ``gpu_memory``: the
    GPU's total memory in bytes (implies a GPU); ``python``: the ``major.minor`` Python
    version of the worker (set by the caller, not the user, for code shipped by value:
    its bytecode only loads on the Python that made it; see :mod:`gpumesh.versions`).
    """

    gpu: str | None = None
    cores: int | None = None
    memory: int | None = None
    gpu_memory: int | None = None
    python: str | None = None
    #: ``requires=``: distributions the task needs (canonical PEP 508 strings, sorted); a
    #: worker that lacks one must allow installs (``gpumesh join --allow-installs``).
    requires: tuple[str, ...] = ()

    @classmethod
    def from_options(cls, gpu=None, cores=None, memory=None, gpu_memory=None,
                     requires=None) -> Requirements:
        """From ``@accelerate`` options; ``ValueError`` names the argument that is wrong."""
        if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
            raise ValueError(f"cores must be a whole number >= 1, got {cores!r}")
        from .packages import parse_requirements
        return cls(gpu=None if gpu is None else normalise_gpu(gpu, "gpu"),
                   cores=cores,
                   memory=None if memory is None else parse_memory(memory, "memory"),
                   gpu_memory=None if gpu_memory is None else parse_memory(gpu_memory, "gpu_memory"),
                   requires=() if requires is None else parse_requirements(requires))

    @classmethod
    def from_meta(cls, meta: Mapping | None, field: str = "require") -> Requirements:
        """From the JSON a job carries (:meth:`to_meta`); ``ValueError`` names the field."""
        if meta is None:
            return cls()
        if not isinstance(meta, Mapping):
            raise ValueError(f"field {field!r} must be an object")
        unknown = set(meta) - {"gpu", "cores", "memory", "gpu_memory", "python", "requires"}
        if unknown:
            raise ValueError(f"field {field}.{sorted(unknown)[0]} is not a known requirement")
        python = meta.get("python")
        if python is not None and (not isinstance(python, str) or not _PYTHON.match(python)):
            raise ValueError(f"field {field}.python must be a Python version like '3.11'")
        for key in ("cores", "memory", "gpu_memory"):
            v = meta.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"field {field}.{key} must be an integer, got {type(v).__name__}")
        try:
            req = cls.from_options(**{k: v for k, v in meta.items() if v is not None and k != "python"
                                      and not (k == "requires" and not v)})
        except ValueError as e:
            raise ValueError(f"field {field}: {e}") from None
        return replace(req, python=python) if python else req

    def to_meta(self) -> dict:
        out: dict[str, object] = {k: v for k, v in (("gpu", self.gpu), ("cores", self.cores), ("memory", self.memory),
                                 ("gpu_memory", self.gpu_memory), ("python", self.python))
               if v is not None}
        if self.requires:
            out["requires"] = list(self.requires)
        return out

    def __bool__(self) -> bool:
        return bool(self.to_meta())

    @property
    def needs_gpu(self) -> bool:
        return (self.gpu is not None and self.gpu != "cpu") or self.gpu_memory is not None

    def describe(self) -> str:
        """``gpu='A100', memory=16 GB``: the requirements as the user wrote them."""
        parts = []
        if self.gpu is not None:
            parts.append(f"gpu={self.gpu!r}")
        if self.cores is not None:
            parts.append(f"cores={self.cores}")
        if self.memory is not None:
            parts.append(f"memory={format_bytes(self.memory)}")
        if self.gpu_memory is not None:
            parts.append(f"gpu_memory={format_bytes(self.gpu_memory)}")
        if self.requires:
            parts.append(f"requires={list(self.requires)}")
        if self.python is not None:
            parts.append(f"Python {self.python} (code shipped by value)")
        return ", ".join(parts) or "no requirements"


# ---------------------------------------------------------------- slots --------------
@dataclass(frozen=True)
class Slot:
    """One place a task can run: a GPU of a worker, or one of its CPU slots.

    ``kind`` is ``"cuda"``, ``"mps"`` or ``"cpu"``; ``gpu`` the NVML index of a CUDA
    slot's GPU; ``name`` the GPU model (the CPU model for a CPU slot); memory in MiB
    (``vram_free_mb`` is the last reported free VRAM, None when unknown); ``score`` the
    benchmark score of the slot's device (0 until measured).
    """

    worker: str
    id: int
    kind: str
    gpu: int | None = None
    name: str = ""
    vram_total_mb: int = 0
    vram_free_mb: int | None = None
    cores: int = 0
    ram_mb: int = 0
    score: float = 0.0
    hostname: str = ""
    python: str = ""  # the worker's Python, "major.minor" ("" if it did not say)
    #: The worker builds environments for ``requires=`` (``join --allow-installs``).
    allow_installs: bool = False
    #: Its installed distributions (gpumesh.packages), for ``requires=``.
    packages: Mapping = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def key(self) -> tuple[str, int]:
        return (self.worker, self.id)

    @property
    def device(self) -> str:
        """The device key this slot runs on: ``"cpu"``, ``"cuda:N"`` or ``"mps"``."""
        return f"cuda:{self.gpu}" if self.kind == "cuda" else self.kind


def slot_list(gpus: Iterable[Mapping], cpu_slots: int, mps: bool = False) -> list[dict]:
    """The slots a worker offers: one per GPU (then MPS), then ``cpu_slots`` CPU slots."""
    out: list[dict] = []
    for g in gpus:
        out.append({"id": len(out), "kind": "cuda", "gpu": int(g["index"])})
    if mps:
        out.append({"id": len(out), "kind": "mps"})
    for _ in range(cpu_slots):
        out.append({"id": len(out), "kind": "cpu"})
    return out


def _score(scores: Mapping, key: str, cpu_score: float) -> float:
    # A GPU that could not be measured (no torch nor CuPy on the worker) ranks as its
    # machine's CPU: that is the speed a task that does not use it gets there.
    value = scores.get(key)
    return cpu_score if value is None else float(value)


def device_score(worker: Mapping, device: str) -> float | None:
    """A device's measured score as a worker reports it; None until measured."""
    scores = worker.get("scores")
    if isinstance(scores, Mapping):
        value = scores.get(device)
        return None if value is None else float(value)
    if device == "cpu" and worker.get("score"):  # a worker from before per-device scores
        return float(worker["score"])
    return None


def device_key(slot: Mapping) -> str:
    return f"cuda:{slot['gpu']}" if slot.get("kind") == "cuda" else str(slot.get("kind", "cpu"))


def slots_of(worker_id: str, info: Mapping, slots: Sequence[Mapping] | None = None) -> list[Slot]:
    """The :class:`Slot` views of a worker description (``info`` as registered/listed)."""
    if slots is None:
        slots = info.get("slot_list") or [{"id": i, "kind": "cpu"} for i in range(int(info.get("slots") or 1))]
    gpus = {int(g.get("index", -1)): g for g in info.get("gpus") or () if isinstance(g, Mapping)}
    scores = info.get("scores") or {}
    cpu_score = float(scores.get("cpu", info.get("score") or 0.0) or 0.0)
    cores, ram = int(info.get("cores") or 0), int(info.get("ram_mb") or 0)
    host = str(info.get("hostname") or "")
    py = python_minor(info.get("python"))
    installs = info.get("allow_installs") is True
    pkgs = info.get("packages")
    if not isinstance(pkgs, Mapping):
        pkgs = {}
    out = []
    for s in slots:
        kind = s.get("kind", "cpu")
        if kind == "cuda":
            g = gpus.get(int(s.get("gpu", -1)), {})
            free = g.get("memory_free_mb")
            out.append(Slot(worker_id, int(s["id"]), "cuda", int(s.get("gpu", -1)),
                            str(g.get("name", "NVIDIA GPU")), int(g.get("memory_total_mb") or 0),
                            None if free is None else int(free), cores, ram,
                            _score(scores, device_key(s), cpu_score), host, py, installs, pkgs))
        elif kind == "mps":
            # Apple GPUs share the machine's memory: their "VRAM" is its RAM.
            out.append(Slot(worker_id, int(s["id"]), "mps", None, str(info.get("cpu") or "Apple GPU"),
                            ram, None, cores, ram, _score(scores, "mps", cpu_score), host, py, installs, pkgs))
        else:
            out.append(Slot(worker_id, int(s["id"]), "cpu", None, str(info.get("cpu") or "CPU"),
                            0, None, cores, ram, cpu_score, host, py, installs, pkgs))
    return out


# ---------------------------------------------------------------- hard filters -------
def refusal(req: Requirements, slot: Slot, vram_hint_mb: float | None = None, *,
            ever: bool = False) -> str | None:
    """Why ``slot`` cannot run a task needing ``req`` (and, for a GPU slot, at least
    ``vram_hint_mb`` MiB of free GPU memory); ``None`` if it can.

    ``ever=True`` asks whether it could at all: the hint is compared with the GPU's total
    memory instead of its last reported free memory.
    """
    if req.python and slot.python and slot.python != req.python:
        return f"runs Python {slot.python}, not {req.python}"
    if req.requires and not slot.allow_installs:
        from .packages import unmet
        missing = unmet(req.requires, slot.packages)
        if missing:
            return (f"lacks {', '.join(missing)} and does not allow installs "
                    "(gpumesh join --allow-installs)")
    gpu = req.gpu
    if gpu == "cpu" and slot.kind != "cpu":
        return f"is a {slot.kind} slot, not a CPU slot"
    if gpu in ("cuda", "mps") and slot.kind != gpu:
        return f"has no {gpu} GPU"
    if (gpu == "gpu" or req.gpu_memory is not None) and slot.kind == "cpu":
        return "has no GPU"
    if gpu is not None and gpu not in KINDS:
        if slot.kind == "cpu":
            return "has no GPU"
        if not gpu_matches(gpu, slot.name):
            return f"is a {slot.name}, not a {gpu}"
    if req.gpu_memory is not None and slot.vram_total_mb * MiB < req.gpu_memory:
        return f"has {slot.vram_total_mb} MiB of GPU memory, less than {format_bytes(req.gpu_memory)}"
    if req.cores is not None and slot.cores < req.cores:
        return f"has {slot.cores} cores, fewer than {req.cores}"
    if req.memory is not None and slot.ram_mb * MiB < req.memory:
        return f"has {slot.ram_mb} MiB of RAM, less than {format_bytes(req.memory)}"
    if vram_hint_mb:
        return vram_refusal(slot, vram_hint_mb, ever=ever)
    return None


def vram_refusal(slot: Slot, vram_hint_mb: float, *, ever: bool = False) -> str | None:
    """Why ``slot`` cannot take a task hinting ``vram_hint_mb`` MiB (None: it can).

    The hint says the task needs that much GPU memory, so a CPU slot always refuses it
    (the task would run without a GPU); a GPU slot refuses it when its GPU is smaller
    (``ever``) or, unless ``ever``, when its last reported free memory is less."""
    if not vram_hint_mb:
        return None
    if slot.kind == "cpu":
        return "has no GPU"
    if slot.vram_total_mb and slot.vram_total_mb < vram_hint_mb:
        return f"has {slot.vram_total_mb} MiB of GPU memory in all, less than the {format_mib(vram_hint_mb)} MiB hinted"
    if not ever and slot.vram_free_mb is not None and slot.vram_free_mb < vram_hint_mb:
        return f"has {slot.vram_free_mb} MiB of GPU memory free, less than the {format_mib(vram_hint_mb)} MiB hinted"
    return None


def satisfiable(req: Requirements, slots: Iterable[Slot], vram_hint_mb: float | None = None) -> bool:
    """Whether any of ``slots`` could ever run a task needing ``req`` and the hint."""
    return any(refusal(req, s, vram_hint_mb, ever=True) is None for s in slots)


def python_minor(version) -> str:
    """``"3.11"`` from a worker's ``"3.11.7"``; ``""`` for anything else."""
    if not isinstance(version, str):
        return ""
    parts = version.split(".")
    return f"{parts[0]}.{parts[1]}" if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit() else ""


# ---------------------------------------------------------------- the pool -----------
def pool_devices(workers: Iterable[Mapping]) -> list[dict]:
    """One dict per device of every alive worker (``GPUMesh.devices()``), strongest first.

    Keys: ``worker``, ``hostname``, ``kind`` (``"cuda"``, ``"mps"``, ``"cpu"``),
    ``device`` (``"cuda:0"``...), ``index`` (NVML index or None), ``name``,
    ``memory_total_mb``/``memory_free_mb`` (GPU memory; RAM for a CPU), ``cores``,
    ``score``, ``slots`` (slots on this device), ``busy`` (of those, running a task) and
    ``state`` (``{"state", "label"}`` while the owner's rules close it, else None; see
    :mod:`gpumesh.availability`).
    """
    out: list[dict] = []
    for w in workers:
        if not w.get("alive", True):
            continue
        busy = set(w.get("busy_slots") or ())
        by_device: dict[str, dict] = {}
        for s in slots_of(str(w.get("id", "")), w):
            d = by_device.get(s.device)
            if d is None:
                d = by_device[s.device] = {
                    "worker": s.worker, "hostname": s.hostname, "kind": s.kind, "device": s.device,
                    "index": s.gpu, "name": s.name,
                    "memory_total_mb": s.vram_total_mb if s.kind != "cpu" else s.ram_mb,
                    "memory_free_mb": s.vram_free_mb, "cores": s.cores,
                    "score": device_score(w, s.device), "slots": 0, "busy": 0,
                    "state": availability.device_state(w, s.device)}
            d["slots"] += 1
            d["busy"] += s.id in busy
        out.extend(by_device.values())
    out.sort(key=lambda d: (-float(d["score"] or 0), d["kind"] == "cpu"))
    return out


def describe_pool(workers: Iterable[Mapping], python: bool = False,
                  requires: tuple[str, ...] = ()) -> str:
    """What the alive workers offer, one clause per worker, for error messages; with
    ``python``, each one's Python version, and with ``requires`` (PEP 508 strings),
    whether it has them (or lacks which), or builds them (``allows installs``)."""
    from .packages import unmet
    parts = []
    for w in workers:
        if not w.get("alive", True):
            continue
        seen: dict[str, Slot] = {}
        for s in slots_of(str(w.get("id", "")), w):
            seen.setdefault(s.device, s)
        items = []
        for s in seen.values():
            if s.kind == "cuda":
                free = "?" if s.vram_free_mb is None else s.vram_free_mb
                items.append(f"{s.name} ({s.vram_total_mb} MiB, {free} MiB free)")
            elif s.kind == "mps":
                items.append("Apple GPU (mps)")
            else:
                items.append(f"CPU {s.name}")
        software = f"; Python {w.get('python') or '?'}" if python else ""
        if requires:
            missing = unmet(requires, w.get("packages") or {})
            software += ("; allows installs" if w.get("allow_installs") else
                         f"; lacks {', '.join(missing)}" if missing else f"; has {', '.join(requires)}")
        parts.append(f"{w.get('hostname') or w.get('id', '?')} [{', '.join(items) or 'no slots'}; "
                     f"{w.get('cores', '?')} cores, {w.get('ram_mb', '?')} MiB RAM{software}]")
    if not parts:
        return "the pool has no alive worker"
    return f"the pool has {len(parts)} alive worker(s): " + "; ".join(parts)


# ---------------------------------------------------------------- validation ---------
# What workers and callers send, checked at the coordinator's boundary. Each raises
# ValueError with a message naming the field.

def check_slot_list(value, n_slots: int, gpus: list | None, field: str = "slot_list") -> list[dict]:
    """A worker's slots: ``[{"id": 0, "kind": "cuda", "gpu": 0}, {"id": 1, "kind": "cpu"}]``,
    ids 0..n-1 in order, each CUDA slot naming a GPU of ``gpus``. ``None``: ``n_slots``
    CPU slots (what a worker that predates slots offers)."""
    if value is None:
        return [{"id": i, "kind": "cpu"} for i in range(n_slots)]
    if not isinstance(value, list) or not 1 <= len(value) <= 1024:
        raise ValueError(f"field {field!r} must be a list of 1 to 1024 slots")
    if len(value) != n_slots:
        raise ValueError(f"field {field!r} lists {len(value)} slots but 'slots' is {n_slots}")
    indices = {g.get("index") for g in gpus or () if isinstance(g, dict)}
    out = []
    for i, s in enumerate(value):
        if not isinstance(s, dict) or s.get("id") != i or isinstance(s.get("id"), bool):
            raise ValueError(f"field {field}[{i}] must be an object with \"id\": {i}")
        kind = s.get("kind")
        if kind not in ("cpu", "cuda", "mps"):
            raise ValueError(f"field {field}[{i}].kind must be \"cpu\", \"cuda\" or \"mps\", got {kind!r}")
        slot = {"id": i, "kind": kind}
        if kind == "cuda":
            g = s.get("gpu")
            if isinstance(g, bool) or not isinstance(g, int) or g not in indices:
                raise ValueError(f"field {field}[{i}].gpu must be the index of one of the worker's 'gpus'")
            slot["gpu"] = g
        out.append(slot)
    return out


def check_scores(value, field: str = "scores") -> dict[str, float]:
    """``{"cpu": 132.6, "cuda:0": 41000.0, "mps": ...}``: a score per device key."""
    if not isinstance(value, dict) or len(value) > 257:
        raise ValueError(f"field {field!r} must be an object of at most 257 device scores")
    out = {}
    for k, v in value.items():
        if not (k in ("cpu", "mps") or re.fullmatch(r"cuda:[0-9]{1,3}", str(k))):
            raise ValueError(f"field {field}: {str(k)[:40]!r} is not a device (cpu, mps, cuda:N)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e12:
            raise ValueError(f"field {field}.{k} must be a number between 0 and 1e12")
        out[k] = float(v)
    return out


def check_gpu_free(value, field: str = "gpu_free_mb") -> dict[int, int]:
    """``{"0": 80000, "1": 1200}``: free GPU memory in MiB per GPU index."""
    if not isinstance(value, dict) or len(value) > 256:
        raise ValueError(f"field {field!r} must be an object mapping GPU index to free MiB")
    out = {}
    for k, v in value.items():
        try:
            idx = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"field {field}: {str(k)[:20]!r} is not a GPU index") from None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**40:
            raise ValueError(f"field {field}.{k} must be a whole number of MiB >= 0")
        out[idx] = v
    return out


def check_vram_hints(value, n_tasks: int, field: str = "gpu_memory_mb") -> dict[int, float]:
    """One ``gpu_memory_mb`` hint (MiB, or null) per task -> ``{task index: MiB}`` for
    the tasks that have one."""
    if value is None:
        return {}
    if not isinstance(value, list) or len(value) != n_tasks:
        raise ValueError(f"field {field!r} must hold one number (or null) per task")
    out = {}
    for i, v in enumerate(value):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 2**40:
            raise ValueError(f"field {field}[{i}] must be a number of MiB >= 0")
        if v:
            out[i] = float(v)
    return out


def check_free_slots(value, field: str = "free") -> list[int] | None:
    """The slot ids a lease request offers (None: any free slot)."""
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) > 1024
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1024 for v in value)):
        raise ValueError(f"field {field!r} must be a list of slot ids (0 to 1023)")
    return value
