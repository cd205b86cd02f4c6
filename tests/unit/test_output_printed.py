"""OutputHub.printed: which tasks of a job printed, without a walk over its tasks."""

from __future__ import annotations

from gpumesh.coordinator.output import OutputHub


def test_printed_knows_the_tasks_it_saw_and_those_on_disk_from_before(tmp_path):
    old = OutputHub(tmp_path)  # a coordinator before a restart
    old.append("j1", "aa01", 4, "w", "stdout", b"four\n")
    old.append("j1", "aa02", 9, "w", "stderr", b"nine\n", attempt=2)
    old.append("j1", "aa03", 2, "w", "stdout", b"")  # (nothing printed: no file, not listed)
    assert old.printed("j1", lambda ids: {}) == {"aa01": 4, "aa02": 9}

    hub = OutputHub(tmp_path)  # after it: the logs on disk, the indexes from the store
    asked = []

    def indexes(ids):
        asked.append(sorted(ids))
        return {"aa01": 4, "aa02": 9}
    hub.append("j1", "aa05", 11, "w", "stdout", b"eleven\n")
    assert hub.printed("j1", indexes) == {"aa01": 4, "aa02": 9, "aa05": 11}
    assert asked == [["aa01", "aa02"]]  # only those it had not seen print
    hub.append("j1", "aa06", 0, "w", "stdout", b"zero\n")
    assert hub.printed("j1", indexes) == {"aa01": 4, "aa02": 9, "aa05": 11, "aa06": 0}
    assert len(asked) == 1  # the directory is read once per job
    assert hub.printed("j2", indexes) == {} and len(asked) == 1  # (no logs: nothing to ask)

    hub.forget("j1")  # released: the logs stay, and so does the record
    assert hub.printed("j1", indexes) == {"aa01": 4, "aa02": 9, "aa05": 11, "aa06": 0}
    hub.forget("j1", files=True)  # purged
    assert hub.printed("j1", indexes) == {} and not (tmp_path / "j1").exists()
