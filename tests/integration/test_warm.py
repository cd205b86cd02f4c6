"""Warm per-function hosts: imports are paid about once, yet every task gets a fresh process."""

from __future__ import annotations

from gpumesh import accelerate


def test_a_heavy_import_is_paid_once_per_host_not_once_per_task(make_mesh, tmp_path):
    m = make_mesh(workers=1)
    moddir = tmp_path / "mods"
    moddir.mkdir()
    counter = tmp_path / "imports"
    (moddir / "gm_heavy_module.py").write_text(
        "import time\n"
        f"with open({str(counter)!r}, 'a') as fh:\n"
        "    fh.write('x')\n"
        "time.sleep(0.3)\n"
        "VALUE = 7\n")

    @accelerate(m.client(output=False))
    def uses_heavy(i):
        import os
        import sys
        sys.path.insert(0, MODDIR)
        import gm_heavy_module
        return gm_heavy_module.VALUE + i, os.getpid()

    MODDIR = str(moddir)  # noqa: N806 - captured by the closure above
    out = uses_heavy.map(range(12))
    assert [v for v, _ in out] == [7 + i for i in range(12)]
    assert len({pid for _, pid in out}) == 12, "every task must run in its own process"
    imports = len(counter.read_text())
    # the first task imports it; its host then preloads it (one more), and a task or two
    # forked before the preload finished may import it too - never once per task
    assert imports <= 4, f"imported {imports} times for 12 tasks"
