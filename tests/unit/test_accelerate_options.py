"""@accelerate's hardware options at decoration time, .to(), and the local-fallback check."""

from __future__ import annotations

import pickle

import pytest

from gpumesh import GPUMesh, Unsatisfiable, accelerate
from gpumesh.client import mesh as mesh_mod
from gpumesh.client import pipeline
from gpumesh.hardware import Requirements

M = GPUMesh("http://127.0.0.1:9", token="t")   # never contacted here


def f(x=1):
    return x


@pytest.mark.parametrize("options, arg", [
    ({"memory": "lots"}, "memory"),
    ({"memory": "16"}, "memory"),
    ({"gpu_memory": "8G"}, "gpu_memory"),
    ({"cores": 0}, "cores"),
    ({"gpu": "cuda:1"}, "gpu"),
    ({"gpu": ""}, "gpu"),
])
def test_bad_options_raise_at_decoration(options, arg):
    with pytest.raises(ValueError, match=arg):
        accelerate(M, **options)(f)


def test_options_become_requirements():
    g = accelerate(M, gpu="A100", cores=8, memory="16GB", gpu_memory="40GiB", timeout=300)(f)
    assert g.require == Requirements("A100", 8, 16 * 10**9, 40 * 2**30)
    assert g.options["timeout"] == 300.0
    assert accelerate(M)(f).require == Requirements()
    # shipped inside a task, the options travel and rebuild the same requirements
    assert pickle.loads(pickle.dumps(g)).require == g.require


def test_to_binds_a_device_and_keeps_the_rest():
    g = accelerate(M, memory="16GB")(f)
    on_cuda = g.to("cuda")
    assert on_cuda.require == Requirements(gpu="cuda", memory=16 * 10**9)
    assert on_cuda.to(" RTX 4090 ").require.gpu == "RTX 4090"
    assert g.to("CPU").require.gpu == "cpu"
    assert g.require.gpu is None                      # the original is unchanged
    for bad in ("cuda:0", "", 3):
        with pytest.raises(ValueError):
            g.to(bad)


MACHINE = {"hostname": "me", "cpu": "Intel i7", "cores": 8, "ram_mb": 16000, "mps": False,
           "gpus": [{"index": 0, "name": "NVIDIA GeForce RTX 3060", "memory_total_mb": 12288,
                     "memory_free_mb": 11000}]}


@pytest.fixture
def this_machine(monkeypatch):
    monkeypatch.setattr(pipeline, "_this_machine", MACHINE)


@pytest.mark.parametrize("require, hints", [
    (None, None),
    (Requirements(), [{"gpu_memory_mb": 5000}]),            # the GPU has 11000 MiB free
    (Requirements(gpu="cuda"), None),
    (Requirements(gpu="RTX 3060", memory=16 * 10**9), None),
    (Requirements(gpu="cuda"), [{"gpu_memory_mb": 11000}]),
    (Requirements(gpu="cpu", cores=8), None),
])
def test_check_local_passes(this_machine, require, hints):
    mesh_mod.check_local(f, require, hints, "no worker is alive")


@pytest.mark.parametrize("require, hints, words", [
    (Requirements(gpu="A100"), None, "is a NVIDIA GeForce RTX 3060, not a A100"),
    (Requirements(cores=16), None, "has 8 cores, fewer than 16"),
    (Requirements(memory=32 * 10**9), None, "less than 32 GB"),
    (Requirements(gpu="cuda"), [{"gpu_memory_mb": 12000}], "11000 MiB of GPU memory free"),
    (Requirements(gpu="mps"), None, "has no mps GPU"),
    (Requirements(), [{"gpu_memory_mb": 10**6}],                 # a hint asks for a GPU
     "(gpu_memory_mb=1000000): its cuda:0 has 12288 MiB of GPU memory in all, less than the "
     "1000000 MiB hinted; its cpu has no GPU"),
])
def test_check_local_refuses(this_machine, require, hints, words):
    with pytest.raises(Unsatisfiable) as e:
        mesh_mod.check_local(f, require, hints, "no worker is alive in the mesh at X")
    msg = str(e.value)
    assert msg.startswith("no worker is alive in the mesh at X, and this machine cannot run f (")
    assert words in msg


def gen(n):
    yield from range(n)


async def co(n):
    return n


async def agen(n):
    yield n


class AsyncCallable:
    async def __call__(self, n):
        return n


NOT_RETURNING = [
    (gen, "gen: it is a generator function", "return list"),
    (co, "co: it is an async def function", "asyncio.run"),
    (agen, "agen: it is an async generator function", "asyncio.run"),
    (AsyncCallable(), "AsyncCallable: it is an async def function", "asyncio.run"),
]


@pytest.mark.parametrize("fn, why, advice", NOT_RETURNING)
def test_generator_and_async_functions_are_refused_at_decoration(fn, why, advice, monkeypatch):
    from gpumesh import mesh
    # Nothing may run: a call would fail on the mesh and here alike (its value, a
    # generator or coroutine, cannot be pickled), so every entry point refuses at once.
    monkeypatch.setattr(pipeline, "run", lambda *a, **k: pytest.fail("the call ran"))
    entries = [
        ("@accelerate/@mesh", lambda: accelerate(M)(fn)),
        ("@accelerate/@mesh", lambda: accelerate(M, gpu="cuda", timeout=5)(fn)),
        ("@accelerate/@mesh", lambda: accelerate(fn)),
        ("@accelerate/@mesh", lambda: mesh(fn)),
        ("@accelerate/@mesh", lambda: mesh(timeout=5)(fn)),
        ("distribute()", lambda: M.distribute(function=fn, params=[1, 2])),
        ("run_calls()/iter_calls()", lambda: M.run_calls(fn, [((1,), {})])),
    ]
    for who, entry in entries:
        with pytest.raises(TypeError) as got:
            entry()
        text = str(got.value)
        assert text.startswith(f"{who} cannot run {why}"), text
        assert advice in text, text
    # .to() rebuilds from the same function: it too would be refused (and never sees one)
    assert pipeline.unsupported_function(fn) is not None


@pytest.mark.parametrize("thing, shown", [(None, "NoneType: None"), (5, "int: 5"),
                                          ("f", "str: 'f'"), ("x" * 100, "str: 'xxx")])
def test_what_is_not_callable_is_refused_before_anything_is_sent(thing, shown, monkeypatch):
    monkeypatch.setattr(pipeline, "run", lambda *a, **k: pytest.fail("the call ran"))
    for who, entry in [("distribute()", lambda: M.distribute(function=thing, params=[{}])),
                       ("run_calls()/iter_calls()", lambda: M.run_calls(thing, [((1,), {})])),
                       ("@accelerate/@mesh", lambda: accelerate(M)(thing))]:
        with pytest.raises(TypeError) as got:
            entry()
        assert str(got.value).startswith(f"{who} needs a function (or another callable), got {shown}")
        assert len(str(got.value)) < 200


def test_plain_functions_and_callables_are_still_accepted():
    import functools

    class Callable:
        def __call__(self, n):
            return n

    for fn in (f, functools.partial(f, 2), Callable(), len, lambda: (yield_ for yield_ in ())):
        assert pipeline.unsupported_function(fn) is None, fn
        assert accelerate(M)(fn).to("cpu").require.gpu == "cpu"
    assert pipeline.unsupported_function(functools.partial(co, 1)) is not None


def test_a_gpumesh_decorates_as_accelerate_does():
    # A notebook that names its GPUMesh `mesh` keeps writing @mesh (a fresh user got
    # "TypeError: 'GPUMesh' object is not callable").
    from gpumesh.client.remote import RemoteFunction
    mesh = M

    @mesh
    def plain(x):
        return x

    @mesh(timeout=5, gpu="cuda")
    def options(x):
        return x

    assert isinstance(plain, RemoteFunction) and isinstance(options, RemoteFunction)
    assert plain.mesh is M and options.mesh is M
    assert options.options["timeout"] == 5 and options.require == Requirements(gpu="cuda")
    assert plain.local(3) == 3
    with pytest.raises(TypeError, match=r"@accelerate/@mesh needs a function \(or another callable\)"):
        mesh(42)
    with pytest.raises(ValueError, match="memory"):
        mesh(memory="lots")(f)
