"""Warm per-function hosts: imports are paid about once, yet every task gets a fresh process."""

from __future__ import annotations

import os

from gpumesh import accelerate


def write_heavy_module(path, counter, value: int) -> None:
    """A module that takes 0.3 s to import and appends an 'x' to ``counter`` each time."""
    path.write_text("import time\n"
                    f"with open({str(counter)!r}, 'a') as fh:\n"
                    "    fh.write('x')\n"
                    "time.sleep(0.3)\n"
                    f"VALUE = {value}\n")


def test_a_heavy_import_is_paid_once_per_host_not_once_per_task(make_mesh, tmp_path):
    m = make_mesh(workers=1)
    moddir = tmp_path / "mods"
    moddir.mkdir()
    counter = tmp_path / "imports"
    write_heavy_module(moddir / "gm_heavy_module.py", counter, 7)

    @accelerate(m.client(output=False))
    def uses_heavy(i):
        import os
        import sys
        ahead = "gm_heavy_module" in sys.modules  # imported before the task began
        sys.path.insert(0, MODDIR)
        import gm_heavy_module
        return gm_heavy_module.VALUE + i, os.getpid(), ahead

    MODDIR = str(moddir)  # noqa: N806 - captured by the closure above
    out = uses_heavy.map(range(12))
    assert [v for v, _, _ in out] == [7 + i for i in range(12)]
    assert len({pid for _, pid, _ in out}) == 12, "every task must run in its own process"
    # after the first task, the import is paid before a task starts (a spare or two
    # started before the first task reported it may still pay it themselves)
    assert sum(ahead for _, _, ahead in out[1:]) >= 8, out
    if os.environ.get("GPUMESH_RUNTIME") == "spawn":
        return  # a fresh interpreter per task imports it once each, ahead of its task
    imports = len(counter.read_text())
    # the first task imports it; its host then preloads it (one more), and a task or two
    # forked before the preload finished may import it too - never once per task
    assert imports <= 4, f"imported {imports} times for 12 tasks"


def test_a_heavy_submodule_of_a_light_package_is_paid_once_too(make_mesh, tmp_path):
    """``from pkg.heavy import x`` (``from sklearn.ensemble import ...``): the host must
    preload ``pkg.heavy`` itself, not only the light ``pkg`` above it."""
    m = make_mesh(workers=1)
    pkg = tmp_path / "mods" / "gm_light_pkg"
    pkg.mkdir(parents=True)
    counter = tmp_path / "imports"
    (pkg / "__init__.py").write_text("")
    write_heavy_module(pkg / "heavy.py", counter, 5)

    @accelerate(m.client(output=False))
    def uses_submodule(i):
        import sys
        ahead = "gm_light_pkg.heavy" in sys.modules
        sys.path.insert(0, MODDIR)
        from gm_light_pkg.heavy import VALUE
        return VALUE + i, ahead

    MODDIR = str(tmp_path / "mods")  # noqa: N806 - captured by the closure above
    out = uses_submodule.map(range(12))
    assert [v for v, _ in out] == [5 + i for i in range(12)]
    assert sum(ahead for _, ahead in out[1:]) >= 8, out
    if os.environ.get("GPUMESH_RUNTIME") == "spawn":
        return  # imported once per process there, ahead of each task
    imports = len(counter.read_text())
    assert imports <= 4, f"imported {imports} times for 12 tasks"
