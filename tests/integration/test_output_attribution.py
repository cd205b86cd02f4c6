"""What a task prints is its own: a slot reuses one pair of output files, and no line of
an earlier task may show up as a later task's output (live or in ``logs``)."""

from __future__ import annotations

import re

from gpumesh import accelerate


def _says(x):
    print(f"value={x}")
    print(f"again={x}")
    return x


def test_every_task_logs_exactly_its_own_lines(shared_mesh, capfd):
    client = shared_mesh.client(output=True)
    f = accelerate(client)(_says)
    singles = [100 + r for r in range(6)]
    for x in singles:
        assert f(x) == x
        assert f.map(range(8)) == list(range(8))
    live = capfd.readouterr().out
    jobs = [j for j in client.jobs(limit=50) if j["name"] == "_says"]
    assert len(jobs) == 12
    seen_singles = []
    for job in jobs:
        for task in client.logs(job["id"]):
            m = re.fullmatch(r"value=(\d+)\nagain=\1\n", task["stdout"])
            assert m, (job["id"], task["index"], task["stdout"])
            if job["n_tasks"] == 1:
                seen_singles.append(int(m.group(1)))
            else:
                assert int(m.group(1)) == task["index"], task
    assert sorted(seen_singles) == singles
    # Live, each value is printed exactly twice (value= and again=), once per call of it.
    for x in singles:
        assert len(re.findall(rf"\b(?:value|again)={x}\n", live)) == 2
    for i in range(8):
        assert len(re.findall(rf"\bvalue={i}\n", live)) == 6
