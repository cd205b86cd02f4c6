"""Unit tests for gpumesh.hardware: memory sizes, GPU names, requirements, slots, filters."""

from __future__ import annotations

import pytest

from gpumesh import hardware as hw
from gpumesh.hardware import Requirements, Slot

GiB = 2**30
MiB = 2**20


# ---------------------------------------------------------------- memory sizes -------

@pytest.mark.parametrize("text, expected", [
    ("16GB", 16 * 10**9),
    ("16 GB", 16 * 10**9),
    ("16gb", 16 * 10**9),
    ("16 GiB", 16 * GiB),
    ("16GiB", 17_179_869_184),
    ("512MB", 512 * 10**6),
    ("512MiB", 512 * MiB),
    ("1.5GB", 1_500_000_000),
    ("0.5 TiB", 2**39),
    ("2KB", 2000),
    ("2 KiB", 2048),
    ("1TB", 10**12),
    ("100B", 100),
    (" 8 gib ", 8 * GiB),
    (4096, 4096),                 # an int is bytes
])
def test_parse_memory(text, expected):
    assert hw.parse_memory(text) == expected


@pytest.mark.parametrize("bad", ["lots", "16", "16G", "16Gb/s", "GB", "", "-1GB", "0GB", "1e3GB",
                                 "16 GB RAM", "0.0000001B", 0, -5, 1.5, True, None, [16], "99999999TB"])
def test_parse_memory_garbage_names_the_argument(bad):
    with pytest.raises(ValueError, match="gpu_memory"):
        hw.parse_memory(bad, "gpu_memory")


def test_format_bytes():
    assert hw.format_bytes(16 * 10**9) == "16 GB"
    assert hw.format_bytes(16 * GiB) == "17.18 GB"
    assert hw.format_bytes(512 * 10**6) == "512 MB"
    assert hw.format_bytes(999) == "999 B"


# ---------------------------------------------------------------- GPU names ----------

@pytest.mark.parametrize("model, name, matches", [
    ("A100", "NVIDIA A100-SXM4-80GB", True),
    ("A100", "NVIDIA A100 80GB PCIe", True),
    ("a100", "NVIDIA A100-SXM4-40GB", True),
    ("A100", "NVIDIA A10", False),
    ("A100", "NVIDIA RTX A1000", False),
    ("A10", "NVIDIA A100-SXM4-80GB", False),
    ("A10", "NVIDIA A10", True),
    ("A1000", "NVIDIA RTX A1000", True),
    ("RTX 4090", "NVIDIA GeForce RTX 4090", True),
    ("rtx4090", "NVIDIA GeForce RTX 4090", True),
    ("RTX-4090", "NVIDIA GeForce RTX 4090", True),
    ("4090", "NVIDIA GeForce RTX 4090", True),
    ("RTX 409", "NVIDIA GeForce RTX 4090", False),
    ("RTX 4080", "NVIDIA GeForce RTX 4090", False),
    ("GeForce RTX", "NVIDIA GeForce RTX 3060", True),
    ("L40", "NVIDIA L40S", False),
    ("L40S", "NVIDIA L40S", True),
    ("L4", "NVIDIA L4", True),
    ("L4", "NVIDIA L40", False),
    ("H100", "NVIDIA H100 80GB HBM3", True),
    ("H100", "NVIDIA GH200 480GB", False),
    ("V100", "Tesla V100-SXM2-16GB", True),
    ("T4", "Tesla T4", True),
    ("A100 80GB", "NVIDIA A100 80GB PCIe", True),
    ("A100 80GB", "NVIDIA A100-SXM4-40GB", False),
    ("nvidia", "NVIDIA H200", True),
    ("", "NVIDIA H200", False),
])
def test_gpu_matches(model, name, matches):
    assert hw.gpu_matches(model, name) is matches


@pytest.mark.parametrize("value, expected", [
    ("cuda", "cuda"), ("CUDA", "cuda"), (" mps ", "mps"), ("cpu", "cpu"), ("GPU", "gpu"),
    ("A100", "A100"), (" RTX 4090 ", "RTX 4090"),
])
def test_normalise_gpu(value, expected):
    assert hw.normalise_gpu(value) == expected


@pytest.mark.parametrize("bad", ["", "   ", "--", "cuda:1", "cuda : 0", 7, None, True, ["A100"]])
def test_normalise_gpu_refuses(bad):
    with pytest.raises(ValueError, match="gpu"):
        hw.normalise_gpu(bad)


# ---------------------------------------------------------------- requirements -------

def test_requirements_from_options_and_meta_roundtrip():
    r = Requirements.from_options(gpu="A100", cores=8, memory="16GB", gpu_memory="40 GiB")
    assert r == Requirements("A100", 8, 16 * 10**9, 40 * GiB)
    assert r.to_meta() == {"gpu": "A100", "cores": 8, "memory": 16 * 10**9, "gpu_memory": 40 * GiB}
    assert Requirements.from_meta(r.to_meta()) == r
    assert r.needs_gpu and bool(r)
    assert r.describe() == "gpu='A100', cores=8, memory=16 GB, gpu_memory=42.95 GB"
    empty = Requirements.from_options()
    assert not empty and empty.to_meta() == {} and not empty.needs_gpu
    assert Requirements.from_meta(None) == empty
    assert not Requirements(gpu="cpu").needs_gpu
    assert Requirements(gpu_memory=1).needs_gpu


@pytest.mark.parametrize("kwargs, arg", [
    ({"memory": "lots"}, "memory"),
    ({"gpu_memory": "16G"}, "gpu_memory"),
    ({"cores": 0}, "cores"),
    ({"cores": "8"}, "cores"),
    ({"cores": True}, "cores"),
    ({"gpu": "cuda:0"}, "gpu"),
    ({"gpu": 3}, "gpu"),
])
def test_requirements_from_options_name_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        Requirements.from_options(**kwargs)


@pytest.mark.parametrize("meta, field", [
    ([], "require"),
    ({"gpus": "A100"}, "require.gpus"),
    ({"memory": "16GB"}, "require.memory"),     # the wire carries bytes, not strings
    ({"memory": 1.5}, "require.memory"),
    ({"memory": 0}, "memory"),
    ({"cores": -1}, "cores"),
    ({"gpu": ""}, "gpu"),
])
def test_requirements_from_meta_names_the_field(meta, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        Requirements.from_meta(meta)


# ---------------------------------------------------------------- slots --------------

A100 = {"index": 0, "name": "NVIDIA A100-SXM4-80GB", "memory_total_mb": 81920, "memory_free_mb": 80000}
RTX = {"index": 1, "name": "NVIDIA GeForce RTX 4090", "memory_total_mb": 24564, "memory_free_mb": 2000}


def test_slot_list():
    assert hw.slot_list([A100, RTX], 2) == [
        {"id": 0, "kind": "cuda", "gpu": 0}, {"id": 1, "kind": "cuda", "gpu": 1},
        {"id": 2, "kind": "cpu"}, {"id": 3, "kind": "cpu"}]
    assert hw.slot_list([], 1, mps=True) == [{"id": 0, "kind": "mps"}, {"id": 1, "kind": "cpu"}]
    assert hw.slot_list([A100], 0) == [{"id": 0, "kind": "cuda", "gpu": 0}]


def worker_info(**kw):
    info = {"hostname": "box", "cpu": "AMD EPYC 7763", "cores": 64, "ram_mb": 256_000,
            "gpus": [dict(A100), dict(RTX)], "slot_list": hw.slot_list([A100, RTX], 1),
            "scores": {"cpu": 100.0, "cuda:0": 40000.0}}
    info.update(kw)
    return info


def test_slots_of():
    a, r, c = hw.slots_of("w1", worker_info())
    assert a == Slot("w1", 0, "cuda", 0, "NVIDIA A100-SXM4-80GB", 81920, 80000, 64, 256_000, 40000.0, "box")
    assert (r.kind, r.gpu, r.vram_free_mb, r.score) == ("cuda", 1, 2000, 100.0)  # unmeasured: CPU's
    assert (c.kind, c.name, c.score, c.vram_total_mb) == ("cpu", "AMD EPYC 7763", 100.0, 0)
    assert [s.device for s in (a, r, c)] == ["cuda:0", "cuda:1", "cpu"]
    # a worker from before slots: N CPU slots, its one score
    legacy = hw.slots_of("w2", {"slots": 2, "score": 7.5, "cores": 4, "ram_mb": 8000})
    assert [(s.id, s.kind, s.score) for s in legacy] == [(0, "cpu", 7.5), (1, "cpu", 7.5)]


# ---------------------------------------------------------------- hard filters -------

BOX = {s.device: s for s in hw.slots_of("w1", worker_info())}
MAC = hw.slots_of("m", {"cpu": "Apple M2 Max", "cores": 12, "ram_mb": 32768,
                        "slot_list": hw.slot_list([], 1, mps=True)})[0]


@pytest.mark.parametrize("req, device, hint, ok", [
    (Requirements(), "cpu", None, True),
    (Requirements(), "cuda:0", None, True),
    (Requirements(gpu="cpu"), "cpu", None, True),
    (Requirements(gpu="cpu"), "cuda:0", None, False),
    (Requirements(gpu="cuda"), "cuda:1", None, True),
    (Requirements(gpu="cuda"), "cpu", None, False),
    (Requirements(gpu="gpu"), "cuda:0", None, True),
    (Requirements(gpu="gpu"), "cpu", None, False),
    (Requirements(gpu="mps"), "cuda:0", None, False),
    (Requirements(gpu="A100"), "cuda:0", None, True),
    (Requirements(gpu="A100"), "cuda:1", None, False),
    (Requirements(gpu="A100"), "cpu", None, False),
    (Requirements(gpu="RTX 4090"), "cuda:1", None, True),
    (Requirements(cores=64), "cpu", None, True),
    (Requirements(cores=65), "cpu", None, False),
    (Requirements(memory=256_000 * MiB), "cuda:1", None, True),
    (Requirements(memory=256_000 * MiB + 1), "cuda:1", None, False),
    (Requirements(gpu_memory=80 * GiB), "cuda:0", None, True),    # 81920 MiB is exactly 80 GiB
    (Requirements(gpu_memory=80 * GiB + 1), "cuda:0", None, False),
    (Requirements(gpu_memory=20 * 10**9), "cuda:1", None, True),
    (Requirements(gpu_memory=1), "cpu", None, False),
    (Requirements(), "cuda:0", 80000, True),                     # hint vs free VRAM
    (Requirements(), "cuda:0", 80001, False),
    (Requirements(), "cuda:1", 2001, False),
    (Requirements(), "cpu", 10**6, False),                       # a hint asks for a GPU
    (Requirements(gpu="cuda"), "cuda:1", 1000, True),
])
def test_refusal_table(req, device, hint, ok):
    reason = hw.refusal(req, BOX[device], hint)
    assert (reason is None) is ok, reason


def test_refusal_reasons_and_ever():
    assert hw.refusal(Requirements(gpu="A100"), BOX["cuda:1"]) == \
        "is a NVIDIA GeForce RTX 4090, not a A100"
    assert "2000 MiB of GPU memory free" in hw.vram_refusal(BOX["cuda:1"], 3000)
    assert hw.vram_refusal(BOX["cuda:1"], 3000, ever=True) is None  # fits the card in all
    assert "24564 MiB of GPU memory in all" in hw.vram_refusal(BOX["cuda:1"], 30000, ever=True)
    assert hw.refusal(Requirements(gpu="mps"), MAC) is None
    assert hw.refusal(Requirements(gpu="cuda"), MAC) == "has no cuda GPU"


def test_satisfiable():
    slots = list(BOX.values())
    assert hw.satisfiable(Requirements(gpu="A100"), slots)
    assert not hw.satisfiable(Requirements(gpu="H100"), slots)
    assert hw.satisfiable(Requirements(gpu="cuda"), slots, 50000)      # the A100 has it
    assert not hw.satisfiable(Requirements(gpu="cuda"), slots, 90000)  # no card that big
    assert not hw.satisfiable(Requirements(), slots, 90000)            # a CPU slot is no GPU
    assert not hw.satisfiable(Requirements(gpu="cuda"), [])


# ---------------------------------------------------------------- the pool -----------

def test_pool_devices_and_description():
    workers = [
        dict(worker_info(), id="w1", alive=True, busy_slots=[0]),
        {"id": "w2", "alive": True, "hostname": "laptop", "cpu": "Intel i7", "cores": 8, "ram_mb": 16000,
         "slots": 2, "score": 50.0},                                   # from before slots
        dict(worker_info(), id="w3", alive=False),
    ]
    devs = hw.pool_devices(workers)
    assert [(d["worker"], d["device"], d["score"], d["slots"], d["busy"]) for d in devs] == [
        ("w1", "cuda:0", 40000.0, 1, 1), ("w1", "cpu", 100.0, 1, 0), ("w2", "cpu", 50.0, 2, 0),
        ("w1", "cuda:1", None, 1, 0)]
    assert devs[0]["memory_free_mb"] == 80000 and devs[0]["name"] == "NVIDIA A100-SXM4-80GB"
    text = hw.describe_pool(workers)
    assert text.startswith("the pool has 2 alive worker(s): box [NVIDIA A100-SXM4-80GB (81920 MiB, "
                           "80000 MiB free), NVIDIA GeForce RTX 4090 (24564 MiB, 2000 MiB free), "
                           "CPU AMD EPYC 7763; 64 cores, 256000 MiB RAM]")
    assert "laptop [CPU Intel i7; 8 cores, 16000 MiB RAM]" in text
    assert hw.describe_pool([]) == "the pool has no alive worker"


def test_the_pool_described_for_a_call_with_a_python_and_requires():
    # The refusal of a call whose requirements no single worker meets names what each has.
    base = {"alive": True, "cpu": "EPYC", "cores": 2, "ram_mb": 24105, "slots": 1}
    workers = [dict(base, id="a", hostname="old", python="3.10.13", packages={"numpy": "2.2.6"}),
               dict(base, id="b", hostname="same", python="3.12.1", packages={"numpy": "1.26.4"}),
               dict(base, id="c", hostname="builder", python="3.13.0", allow_installs=True)]
    text = hw.describe_pool(workers, python=True, requires=("numpy>=2",))
    assert text == ("the pool has 3 alive worker(s): "
                    "old [CPU EPYC; 2 cores, 24105 MiB RAM; Python 3.10.13; has numpy>=2]; "
                    "same [CPU EPYC; 2 cores, 24105 MiB RAM; Python 3.12.1; lacks numpy>=2]; "
                    "builder [CPU EPYC; 2 cores, 24105 MiB RAM; Python 3.13.0; allows installs]")


# ---------------------------------------------------------------- validation ---------

def test_check_slot_list():
    gpus = [A100, RTX]
    good = hw.slot_list(gpus, 1)
    assert hw.check_slot_list(good, 3, gpus) == good
    assert hw.check_slot_list(None, 2, None) == [{"id": 0, "kind": "cpu"}, {"id": 1, "kind": "cpu"}]
    for bad, slots, msg in [
        ([{"id": 0, "kind": "cuda", "gpu": 5}], 1, r"slot_list\[0\]\.gpu"),
        ([{"id": 1, "kind": "cpu"}], 1, r"slot_list\[0\]"),
        ([{"id": 0, "kind": "tpu"}], 1, r"slot_list\[0\]\.kind"),
        (good, 2, "'slots' is 2"),
        ("cpu", 1, "slot_list"),
        ([], 1, "slot_list"),
    ]:
        with pytest.raises(ValueError, match=msg):
            hw.check_slot_list(bad, slots, gpus)


def test_check_scores_free_hints_and_free_slots():
    assert hw.check_scores({"cpu": 1, "cuda:0": 2.5, "mps": 0}) == {"cpu": 1.0, "cuda:0": 2.5, "mps": 0.0}
    for bad in [{"tpu": 1}, {"cpu": -1}, {"cpu": True}, {"cpu": "1"}, [1]]:
        with pytest.raises(ValueError, match="scores"):
            hw.check_scores(bad)
    assert hw.check_gpu_free({"0": 100, "1": 0}) == {0: 100, 1: 0}
    for bad in [{"x": 1}, {"0": -1}, {"0": 1.5}, [100]]:
        with pytest.raises(ValueError, match="gpu_free_mb"):
            hw.check_gpu_free(bad)
    assert hw.check_vram_hints(None, 3) == {}
    assert hw.check_vram_hints([None, 0, 512, 1.5], 4) == {2: 512.0, 3: 1.5}
    for bad in [[1, 2], [-1], ["1"], [True], "512"]:
        with pytest.raises(ValueError, match="gpu_memory_mb"):
            hw.check_vram_hints(bad, 1 if isinstance(bad, list) and len(bad) == 1 else 3)
    assert hw.check_free_slots(None) is None and hw.check_free_slots([0, 3]) == [0, 3]
    for bad in [[-1], [True], ["0"], 3, [1024]]:
        with pytest.raises(ValueError, match="free"):
            hw.check_free_slots(bad)
