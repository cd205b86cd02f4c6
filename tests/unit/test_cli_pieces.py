"""Pure pieces behind the CLI: script results, payload files, progress, logging, frames."""

from __future__ import annotations

import io
import json
import logging
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpumesh import logs
from gpumesh.cli import main
from gpumesh.client import progress, scripts
from gpumesh.client.frames import results_to_dataframe
from gpumesh.worker.scripts import result_line


def test_result_is_the_last_line_that_parses_as_json():
    assert result_line(b'{"a": 1}\n{"b": 2}\nplain text\n\n') == b'{"b": 2}'
    assert result_line(b"starting\n  [1, 2]  \ndone\n") == b"[1, 2]"
    assert result_line(b"42\n") == b"42"
    assert result_line(b"no json here\n{broken\n") is None
    assert result_line(b"") is None
    assert result_line(b'\xff\xfe\n"ok"\n') == b'"ok"'


def test_payload_files(tmp_path):
    arr = tmp_path / "a.json"
    arr.write_text('[{"x": 1}, 2, "three"]')
    assert scripts.load_payloads(arr) == [{"x": 1}, 2, "three"]
    lines = tmp_path / "l.jsonl"
    lines.write_text('{"x": 1}\n\n{"x": 2}\n')
    assert scripts.load_payloads(lines) == [{"x": 1}, {"x": 2}]
    # JSON Lines of one line is one task (a program writing one line per payload may
    # write one), an object or any other value; a line holding an array is the array form
    one = tmp_path / "one.jsonl"
    one.write_text('{"x": 1}\n')
    assert scripts.load_payloads(one) == [{"x": 1}]
    one.write_text('  "text"  \n\n')
    assert scripts.load_payloads(one) == ["text"]
    one.write_text('[1, 2]')
    assert scripts.load_payloads(one) == [1, 2]
    obj = tmp_path / "o.json"
    obj.write_text('{\n  "x": 1\n}\n')  # one object over several lines: not JSON Lines
    with pytest.raises(ValueError, match="must hold a JSON array with one payload per task, or one "
                                         "JSON value per line, not a JSON object over 3 lines"):
        scripts.load_payloads(obj)
    empty = tmp_path / "e.json"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is not JSON: Expecting value"):
        scripts.load_payloads(empty)
    with pytest.raises(ValueError, match="cannot read the payloads file"):
        scripts.load_payloads(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="no payloads"):
        scripts.encode_payloads([])
    with pytest.raises(ValueError, match="payload #1 cannot be written as JSON"):
        scripts.encode_payloads([1, {1, 2}])
    assert scripts.encode_payloads([{"é": 1}]) == ['{"é": 1}'.encode()]


def test_bar_text():
    assert progress.bar_text(6, 6, 10.2) == "#################### 100%  6/6 done  (10s)"
    assert progress.bar_text(3, 6, 4) == "##########.......... 50%  3/6 done  (4s)".replace(" 50%", "  50%")
    assert progress.bar_text(0, 0, 0).endswith("0/0 done  (0s)")


def test_progress_only_for_people(monkeypatch):
    monkeypatch.delenv("GPUMESH_PROGRESS", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe / file: never
    assert progress.wanted() is False
    monkeypatch.setenv("GPUMESH_PROGRESS", "1")
    assert progress.wanted() is True
    monkeypatch.setenv("GPUMESH_PROGRESS", "0")
    assert progress.wanted() is False


def test_forced_progress_in_a_log_file_writes_plain_lines(monkeypatch):
    """GPUMESH_PROGRESS=1 with stderr piped to a file: rich's live bar draws nothing
    there, so the bar is plain lines (no escape codes, no carriage returns), one when it
    appears, one per interval when the counts moved, and the last state."""
    import time as _time
    monkeypatch.setenv("GPUMESH_PROGRESS", "1")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.05)
    bar = progress.Progress(4, "square", delay=0)
    assert bar.shown
    bar.update(1)
    deadline = _time.monotonic() + 5
    while "1/4 done" not in err.getvalue() and _time.monotonic() < deadline:
        _time.sleep(0.02)
    _time.sleep(0.2)  # ticks with nothing new: no more lines
    bar.update(4, failed=1)
    bar.close()
    lines = err.getvalue().splitlines()
    assert "\x1b" not in err.getvalue() and "\r" not in err.getvalue()
    assert all(line.startswith("[gpumesh] square ") for line in lines), lines
    assert "0/4 done  (0s)" in lines[0]
    assert [line for line in lines if "1/4 done" in line][:1], lines
    assert len([line for line in lines if "1/4 done" in line]) == 1, lines
    assert "100%  4/4 final: 3 done, 1 failed" in lines[-1]


def test_progress_bar_draws_counts_rate_and_eta():
    from rich.console import Console
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    bar = progress.Progress(4, "square", enabled=True, delay=0, keep=True, console=console)
    assert bar.shown
    bar.update(3)
    bar.close()
    text = out.getvalue()
    assert "square" in text and "3/4" in text and "done" in text and "/s" in text and "ETA" in text


def test_progress_waits_for_its_delay():
    bar = progress.Progress(10, enabled=True, delay=5)
    bar.update(10)
    bar.close()
    assert not bar.shown  # a short batch never drew anything
    assert not progress.Progress(10, enabled=False, delay=0).shown


def test_log_json_formatter_and_levels():
    out = io.StringIO()
    logs.configure(verbose=1, as_json=True, stream=out)
    try:
        logging.getLogger("gpumesh.test").info("hello %s", "world")
        logging.getLogger("gpumesh.test").debug("hidden at -v")
        rec = json.loads(out.getvalue().strip())
        assert rec["message"] == "hello world" and rec["level"] == "info" and rec["logger"] == "gpumesh.test"
        assert logs.level() == logging.INFO and logs.json_enabled()
        logs.configure(verbose=2, as_json=False, stream=out)
        assert logging.getLogger("gpumesh").level == logging.DEBUG
    finally:
        logs.configure(0, False)
    assert logging.getLogger("gpumesh").level == logging.WARNING
    assert logs.formatter() is None


def test_results_to_dataframe(monkeypatch):
    df = results_to_dataframe([{"a": 1, "b": 2}, {"a": 3}])
    assert list(df.columns) == ["a", "b"] and df["a"].tolist() == [1, 3]
    assert results_to_dataframe([1, 2, 3])["result"].tolist() == [1, 2, 3]
    recs = [{"task_id": "t1", "index": 0, "state": "done", "worker": "w", "error": None,
             "result": {"acc": 0.9}}]
    df = results_to_dataframe(recs)
    assert df.loc[0, "acc"] == 0.9 and df.loc[0, "state"] == "done"
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match="pip install pandas"):
        results_to_dataframe([{"a": 1}])


def _frame(columns: dict, dtypes: dict):
    import pandas as pd
    return pd.DataFrame({k: pd.Series(v, dtype=dtypes[k]) for k, v in columns.items()})


def test_a_sweep_where_every_item_returned_a_dict_has_its_keys_as_columns_and_no_error():
    import pandas as pd
    df = results_to_dataframe([{"lr": 0.1, "acc": 0.5}, {"lr": 0.2, "acc": 0.75}])
    pd.testing.assert_frame_equal(df, _frame({"lr": [0.1, 0.2], "acc": [0.5, 0.75]},
                                             {"lr": "float64", "acc": "float64"}))


def test_a_failed_item_among_dicts_leaves_its_row_missing_and_says_why_in_error():
    import pandas as pd
    res = [{"lr": 0.1, "steps": 10}, ValueError("diverged"), {"lr": 0.3, "steps": 30}]
    df = results_to_dataframe(res)
    pd.testing.assert_frame_equal(df, _frame(
        {"lr": [0.1, None, 0.3], "steps": [10.0, None, 30.0],
         "error": [None, "ValueError: diverged", None]},
        {"lr": "float64", "steps": "float64", "error": object}))
    assert df["lr"].isna().tolist() == [False, True, False]


def test_a_failed_item_among_scalars_gets_a_result_and_an_error_column():
    import pandas as pd
    from gpumesh.errors import RemoteError, TaskTimeout
    df = results_to_dataframe([1, KeyError("k"), 3, RemoteError("mod.Boom", "bad"),
                               TaskTimeout("too long"), RuntimeError()])
    pd.testing.assert_frame_equal(df, _frame(
        {"result": [1.0, None, 3.0, None, None, None],
         "error": [None, "KeyError: 'k'", None, "mod.Boom: bad", "TaskTimeout: too long",
                   "RuntimeError"]},
        {"result": "float64", "error": object}))
    every = results_to_dataframe([ValueError("a")])  # nothing succeeded: no dict to spread
    assert every.to_dict("list") == {"result": [None], "error": ["ValueError: a"]}


def _record(index, state, result=None, error=None, **more):
    return {"task_id": f"t{index}", "index": index, "state": state, "worker": "w1",
            "error": error, "result": result, **more}


def test_wait_records_keep_a_failed_tasks_error_text():
    import pandas as pd
    recs = [_record(0, "done", {"acc": 0.9}),
            _record(1, "failed", error={"kind": "raised", "type": "ValueError",
                                        "message": "diverged", "traceback": "..."}),
            _record(2, "failed", error={"kind": "timeout", "type": "TaskTimeout",
                                        "message": "the task ran longer than its timeout of 5s"}),
            _record(3, "done", None, result_error="cannot unpickle: no module 'x'"),
            _record(4, "cancelled", error={"kind": "cancelled", "type": "Cancelled"})]
    df = results_to_dataframe(recs)
    pd.testing.assert_frame_equal(df, _frame(
        {"index": [0, 1, 2, 3, 4], "state": ["done", "failed", "failed", "done", "cancelled"],
         "worker": ["w1"] * 5, "acc": [0.9, None, None, None, None],
         "error": [None, "ValueError: diverged",
                   "TaskTimeout: the task ran longer than its timeout of 5s",
                   "cannot unpickle: no module 'x'", "Cancelled"]},
        {"index": "int64", "state": df["state"].dtype, "worker": df["worker"].dtype,
         "acc": "float64", "error": object}))
    # all done: the columns of before, no error column
    ok = results_to_dataframe([_record(0, "done", {"acc": 0.5}), _record(1, "done", {"acc": 1.0})])
    assert list(ok.columns) == ["index", "state", "worker", "acc"]
    # a status view's tasks read the same
    view = {"id": "ab12", "tasks": [
        {"id": "t0", "index": 0, "state": "done", "worker_id": "w1", "error": None,
         "result": 7},
        {"id": "t1", "index": 1, "state": "failed", "worker_id": "w2",
         "error": {"kind": "script", "type": "ScriptFailed", "message": "exited with code 1"}}]}
    got = results_to_dataframe(view)
    pd.testing.assert_frame_equal(got, _frame(
        {"index": [0, 1], "state": ["done", "failed"], "worker": ["w1", "w2"],
         "result": [7.0, None], "error": [None, "ScriptFailed: exited with code 1"]},
        {"index": "int64", "state": got["state"].dtype, "worker": got["worker"].dtype,
         "result": "float64", "error": object}))
    # a job still running: its pending and leased tasks have no value yet, and no error
    running = results_to_dataframe([_record(0, "done", {"acc": 0.5}), _record(1, "leased"),
                                    _record(2, "pending"), _record(3, "failed", error={
                                        "kind": "raised", "type": "KeyError", "message": "'x'"})])
    assert running["acc"].tolist()[0] == 0.5 and running["acc"].isna().tolist() == [False, True, True, True]
    assert running["error"].tolist() == [None, None, None, "KeyError: 'x'"]


def test_rerun_line_keeps_every_flag_given_but_address_port_and_secrets(monkeypatch, tmp_path):
    """The loopback banner's "re-run with" line must not drop a protection (TLS, safe mode)
    or a choice (the data directory: the job store and people's tokens) the user made:
    following it to open the coordinator up keeps every flag given, with placeholders
    for secrets. serve's own command line is parsed (click), not a copy of its flags."""
    import click

    from gpumesh.cli.serve import banner, rerun_flags, serve

    def rerun(*args: str) -> str:
        got = {}

        def capture(**kw):
            got["flags"] = rerun_flags(click.get_current_context())
        monkeypatch.setattr(serve, "callback", capture)
        with serve.make_context("serve", list(args)) as ctx:
            ctx.invoke(serve.callback, **ctx.params)
        (line,) = [x for x in banner("127.0.0.1", 8000, "t" * 20, False, rerun=got["flags"])
                   if "re-run with" in x]
        return line.split("re-run with: ", 1)[1]

    assert rerun() == "gpumesh serve --host 0.0.0.0 --port 8000 --token=<your token>"
    assert rerun("--port", "8001", "--tls", "--token", "x" * 20) == \
        "gpumesh serve --host 0.0.0.0 --port 8000 --tls --token=<your token>"
    data = tmp_path / "my data"
    assert rerun("--data-dir", str(data), "--no-self-worker", "--tls-cert", "c.pem", "--tls-key", "k.pem",
                 "--safe-mode", "--metrics-token", "m" * 20, "--trusted-proxy", "10.0.0.0/8",
                 "--trusted-proxy", "fd00::/8") == (
        f"gpumesh serve --host 0.0.0.0 --port 8000 --data-dir '{data}' --no-self-worker "
        "--tls-cert c.pem --tls-key k.pem --safe-mode --metrics-token <your metrics token> "
        "--trusted-proxy 10.0.0.0/8 --trusted-proxy fd00::/8 --token=<your token>")


def test_exposed_banner_says_reachability_is_not_tested():
    """As the product README shows: a coordinator bound beyond loopback says that the
    self-check (over loopback) proves nothing about other machines reaching it."""
    from gpumesh.cli.serve import banner

    lines = banner("192.0.2.10", 8000, "t" * 20, False)
    assert "   Reachability of http://192.0.2.10:8000 from other machines is not tested here — " \
           "a worker joining confirms it." in lines
    assert not [x for x in banner("127.0.0.1", 8000, "t" * 20, False) if "Reachability" in x]


def test_banner_behind_a_proxy_and_in_a_container(monkeypatch):
    from gpumesh.cli import serve
    lines = serve.banner("127.0.0.1", 8000, "t" * 20, False, proxied=True)
    assert "   Other machines reach it through the proxy in front of it (--trusted-proxy)," in lines
    assert not [x for x in lines if "CANNOT reach" in x or "--host 0.0.0.0" in x]
    monkeypatch.setattr(serve, "_lan_ip", lambda: "10.89.0.2")
    monkeypatch.setattr(serve, "in_container", lambda: True)
    lines = serve.banner("0.0.0.0", 8732, "t" * 20, False)
    assert ("   (in a container: other machines use the host's address and the port it "
            "publishes, not this container's own IP)") in lines
    monkeypatch.setattr(serve, "in_container", lambda: False)
    assert "   (127.0.0.1 always works locally; the LAN IP is for other machines)" in \
        serve.banner("0.0.0.0", 8732, "t" * 20, False)


def test_progress_elapsed_counts_from_the_batch_start(monkeypatch):
    """The bar appears after its delay, but its elapsed time (like its rate) counts from
    when the batch began: a batch 65 s old shows 0:01:05, not the bar's age."""
    from rich.console import Console
    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    bar = progress.Progress(4, "square", enabled=False, keep=True, console=console)
    now[0] += 65.0  # the batch has run 65 s when the bar is first drawn
    bar.enabled = True
    bar._show()
    bar.update(2)
    bar.close()
    text = out.getvalue()
    assert "0:01:05" in text and "2/4 done" in text, text


def test_doctor_summary_counts_the_warnings():
    from gpumesh.cli.doctor import Check, summary

    def checks(*statuses):
        return [Check(f"c{i}", s, "detail") for i, s in enumerate(statuses)]
    assert summary(checks("ok", "skip", "ok")) == "all checks passed"
    assert summary(checks("ok", "warn", "skip")) == "all checks passed, 1 warning"
    assert summary(checks("warn", "ok", "warn")) == "all checks passed, 2 warnings"
    assert summary(checks("ok", "fail")) == "some checks failed"
    assert summary(checks("warn", "fail", "warn", "warn")) == "some checks failed, 3 warnings"


def test_doctor_details_and_fixes_start_in_one_column(monkeypatch):
    """Every check name doctor.py uses fits the name column, so `pool packages` (13
    characters) no longer runs into its detail one column right of the others'."""
    import re as _re

    from gpumesh.cli import doctor
    names = set(_re.findall(r'Check\("([^"]+)"', Path(doctor.__file__).read_text()))
    assert {"runtime", "pool packages", "pool versions", "safe mode"} <= names
    made = [doctor.Check(n, ("ok", "warn")[i % 2], f"detail of {n}", f"fix for {n}")
            for i, n in enumerate(sorted(names))]
    for step in ("_install", "_python", "_cloudpickle", "_torch", "_gpus", "_runtime", "_saved"):
        monkeypatch.setattr(doctor, step, lambda *a: doctor.Check("x", "ok", "detail of x"))
    monkeypatch.setattr(doctor, "_coordinator", lambda *a: made)
    out = CliRunner().invoke(main, ["doctor", "http://127.0.0.1:27401"],
                             env={"GPUMESH_URL": None}).output
    lines = [line for line in out.splitlines() if "detail of" in line or "fix for" in line]
    assert len(lines) == 7 + len(names) + len(names) // 2, out
    # the details in one column, each fix's arrow under them
    columns = {line.index("detail of") if "detail of" in line else line.index("-> fix")
               for line in lines}
    assert len(columns) == 1, out
    # and the longest names are set apart by two spaces, as the tags' column is
    assert "[OK]   pool packages  detail of pool packages" in lines, out
    assert "[OK]   pool versions  detail of pool versions" in lines, out


def _worker(wid, host, lacks=()):
    return {"id": wid, "hostname": host, "alive": True, **({"lacks": list(lacks)} if lacks else {})}


def test_doctor_module_advice_when_some_workers_lack_a_module():
    from gpumesh.cli.doctor import pool_checks
    checks = {c.name: c for c in pool_checks(
        [_worker("aaaaaaaa11", "laptop-a", ["gmmod"]), _worker("bbbbbbbb22", "laptop-b")],
        "http://192.0.2.10:8000")}
    mods = checks["pool modules"]
    assert mods.status == "warn"
    assert mods.detail == "recent jobs imported modules some workers lack: gmmod (not on laptop-a (aaaaaaaa))"
    assert mods.fix == ("their tasks ran on the other workers; install the package that provides "
                        "each module on these workers to use them too")


def test_doctor_module_advice_when_every_alive_worker_lacks_a_module():
    # nobody ran those tasks: the advice must not say they ran on other workers
    from gpumesh.cli.doctor import pool_checks
    checks = {c.name: c for c in pool_checks(
        [_worker("aaaaaaaa11", "laptop-a", ["gmmod"]), _worker("bbbbbbbb22", "laptop-b", ["gmmod"])],
        "http://192.0.2.10:8000")}
    mods = checks["pool modules"]
    assert mods.status == "warn"
    assert mods.detail == ("recent jobs imported modules no alive worker has: gmmod (not on "
                           "laptop-a (aaaaaaaa), laptop-b (bbbbbbbb))")
    assert mods.fix == ("no alive worker can run a task that imports them: it fails with "
                        "ModuleNotFoundError; install the package that provides each module on "
                        "the workers")
    assert "ran on the other workers" not in mods.fix


def test_doctor_module_advice_for_both_kinds_at_once():
    from gpumesh.cli.doctor import pool_checks
    checks = {c.name: c for c in pool_checks(
        [_worker("aaaaaaaa11", "a", ["gmall", "gmsome"]), _worker("bbbbbbbb22", "b", ["gmall"])],
        "http://x:1")}
    mods = checks["pool modules"]
    assert mods.detail == ("recent jobs imported modules no alive worker has: gmall (not on "
                           "a (aaaaaaaa), b (bbbbbbbb)). Modules some workers lack: gmsome (not on "
                           "a (aaaaaaaa))")
    assert mods.fix.startswith("no alive worker can run a task that imports them")
    assert mods.fix.endswith("; for those some workers lack, their tasks ran on the other "
                             "workers; install the package that provides each module on these "
                             "workers to use them too")
    # no module lacked: no check at all
    assert "pool modules" not in {c.name for c in pool_checks([_worker("a1", "a")], "http://x:1")}


RADAR = [
    {"name": "a", "host": "gpu-box-in-the-lab.local", "role": "coordinator", "device": "GPU",
     "device_name": "NVIDIA GeForce RTX 4090", "score": "123.4", "url": "http://192.0.2.10:18743",
     "address": "192.0.2.10:18743", "addresses": ["192.0.2.10"], "coordinator": None,
     "version": "0.1.0"},
    {"name": "b", "host": "laptop-b.local", "role": "worker", "device": "CPU",
     "device_name": "AMD Ryzen 9 7950X 16-Core Processor", "score": "55.0", "url": None,
     "address": "192.0.2.11:0", "addresses": ["192.0.2.11"],
     "coordinator": "http://192.0.2.10:18743", "version": "0.1.0"},
]


@pytest.mark.parametrize("width", [80, 60])
def test_radar_table_never_cuts_the_address_on_a_narrow_console(width):
    # A pipe is drawn 80 columns wide: the URL a user copies into `gpumesh join` was cut
    # to "http://192.0…" there.
    from rich.console import Console

    from gpumesh.cli.radar import radar_table
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False)
    assert not console.is_terminal
    console.print(radar_table(RADAR))
    text = out.getvalue()
    assert "http://192.0.2.10:18743 " in text
    assert "192.0.2.11 -> http://192.0.2.10:18743 " in text
    assert max(len(line) for line in text.splitlines()) <= width


def test_radar_once_piped_prints_every_value_whole(monkeypatch):
    from gpumesh import discovery
    monkeypatch.setattr(discovery, "browse", lambda timeout: RADAR)
    r = CliRunner().invoke(main, ["radar", "--once"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    rows = [line for line in r.output.splitlines() if "0.1.0" in line]
    assert len(rows) == 2
    for row, values in zip(rows, (["gpu-box-in-the-lab.local", "coordinator",
                                   "GPU NVIDIA GeForce RTX 4090", "123.4", "http://192.0.2.10:18743"],
                                  ["laptop-b.local", "worker", "CPU AMD Ryzen 9 7950X 16-Core Processor",
                                   "55.0", "192.0.2.11 -> http://192.0.2.10:18743"])):
        assert [cell.strip() for cell in row.split("│")[1:6]] == values


def test_every_error_line_has_one_form(capsys):
    # one function prints them all (click's own usage errors say "Error:" too)
    from gpumesh.cli.common import fail
    from gpumesh.cli.failure import fail as the_one
    assert fail is the_one
    with pytest.raises(SystemExit) as e:
        fail("the data directory is in use", code=2)
    assert e.value.code == 2
    assert capsys.readouterr().err == "Error: the data directory is in use\n"


def test_doctor_config_is_fine_with_the_connection_in_the_environment(tmp_path, monkeypatch):
    # No saved config: a warning, unless GPUMESH_URL and GPUMESH_TOKEN give the connection.
    from gpumesh import config
    from gpumesh.cli.doctor import _saved
    monkeypatch.setattr(config, "config_path", lambda: tmp_path / "config.json")
    monkeypatch.delenv("GPUMESH_URL", raising=False)
    monkeypatch.delenv("GPUMESH_TOKEN", raising=False)
    assert _saved().status == "warn"
    monkeypatch.setenv("GPUMESH_URL", "http://127.0.0.1:8000")
    assert _saved().status == "warn"  # the token is still missing
    monkeypatch.setenv("GPUMESH_TOKEN", "a" * 32)
    check = _saved()
    assert check.status == "ok" and "GPUMESH_URL" in check.detail
    monkeypatch.delenv("GPUMESH_URL")
    monkeypatch.delenv("GPUMESH_TOKEN")
    assert _saved("http://127.0.0.1:8000", "a" * 32).status == "ok"  # given as flags
    assert _saved("http://127.0.0.1:8000", None).status == "warn"


def test_status_names_what_the_function_raised():
    from gpumesh.cli.views import task_lines

    def task(i, error):
        return {"id": f"t{i}", "state": "failed", "cost": 1.0, "worker_id": "w1", "error": error}
    view = {"tasks": [
        task(0, {"kind": "raised", "type": "KeyError", "message": "'missing 2'"}),
        task(1, {"kind": "timeout", "type": "TaskTimeout",
                 "message": "the task ran longer than its timeout of 1s"}),
    ]}
    errors = [line.strip() for line in task_lines(view) if line.strip().startswith("error:")]
    assert errors == ["error: KeyError: 'missing 2'",
                      "error: the task ran longer than its timeout of 1s"]
    # an error line is a message's end: the last line says where the rest is
    view["id"] = "0123456789ab"
    assert task_lines(dict(view, kind="function"))[-2:] == [
        "", "  each failure's remote traceback: gpumesh status 0123456789ab --json"]
    assert task_lines(dict(view, kind="script"))[-1] == (
        "  whole output of each task, tracebacks included: gpumesh logs 0123456789ab")
    done = {"id": "t2", "state": "done", "cost": 1.0, "worker_id": "w1", "result": 1}
    assert "gpumesh" not in task_lines({"id": "0123456789ab", "tasks": [done]})[-1]


def test_status_of_someone_elses_job_says_its_error_texts_are_withheld():
    """The coordinator outlines the errors of another person's job (kind and type, its
    earlier attempts' too: people.task_outline); status says so instead of an empty text."""
    from gpumesh.cli.views import task_lines
    from gpumesh.coordinator.people import task_outline

    secret = {"kind": "raised", "type": "ValueError", "message": "password hunter2", "traceback": "..."}
    task = {"id": "t0", "state": "failed", "cost": 1.0, "worker_id": "w1", "attempts": 2, "error": secret,
            "history": [{"attempt": 1, "worker": "w1", "hostname": "vm", "retried": True,
                         "ended": "raised ValueError, which the job retries (retry 1 of 1)",
                         "error": {"type": "ValueError", "message": "password hunter2"}},
                        {"attempt": 0, "worker": "w2", "ended": "lost"}]}
    outlined = task_outline(task)
    assert outlined["error"] == {"kind": "raised", "type": "ValueError"}
    assert outlined["history"][0]["error"] == {"type": "ValueError"}
    assert outlined["history"][1] == task["history"][1]
    assert task["error"] is secret and "message" in task["history"][0]["error"]  # (a copy)
    lines = [line.strip() for line in task_lines({"tasks": [outlined]})]
    assert "hunter2" not in "\n".join(lines)
    assert lines[1:] == ["attempt 1 on vm (w1): ValueError; raised ValueError, which the job retries (retry 1 of 1)",
                         "attempt 0 on w2: lost",
                         "error: ValueError (its message is shown to the job's owner only)"]


def test_workers_table_shows_each_workers_slots():
    from gpumesh.cli.pool import format_workers
    gpu_box = {"id": "a" * 12, "hostname": "gpu-box", "device": "GPU", "alive": True, "score": 3000.0,
               "slot_list": [{"id": 0, "kind": "cuda", "gpu": 0}, {"id": 1, "kind": "cuda", "gpu": 1},
                             {"id": 2, "kind": "cpu"}, {"id": 3, "kind": "cpu"}],
               "busy_slots": [0, 2]}
    mac = {"id": "b" * 12, "hostname": "mac", "device": "GPU", "alive": True, "score": 40.0,
           "slot_list": [{"id": 0, "kind": "mps"}]}
    laptop = {"id": "c" * 12, "hostname": "laptop", "device": "CPU", "alive": False, "score": 2.0,
              "slots": 2, "busy_slots": [1]}
    rows = format_workers([laptop, mac, gpu_box]).splitlines()[3:]
    assert rows == [
        "  GPU  aaaaaaaa    gpu-box           score=3000.000  [alive]  slots: 2 GPU, 2 CPU (2 busy)",
        "  GPU  bbbbbbbb    mac               score=40.000    [alive]  slots: 1 GPU",
        "  CPU  cccccccc    laptop            score=2.000     [dead]  slots: 2 CPU",
    ]


def test_workers_table_names_pythons_only_in_a_pool_of_several():
    from gpumesh.cli.pool import format_workers
    a = {"id": "a" * 12, "hostname": "a", "alive": True, "score": 2.0, "slots": 1, "python": "3.10.13"}
    b = {"id": "b" * 12, "hostname": "b", "alive": True, "score": 1.0, "slots": 1, "python": "3.12.1"}
    gone = {"id": "c" * 12, "hostname": "c", "alive": False, "score": 0.5, "slots": 1, "python": "3.9.0"}
    rows = format_workers([a, b, gone]).splitlines()[3:]
    assert [r.rsplit("  ", 1)[1] for r in rows] == ["python 3.10", "python 3.12", "python 3.9"]
    # one Python among the alive ones (a dead worker of another does not count): no column
    rows = format_workers([a, dict(b, python="3.10.2"), gone]).splitlines()[3:]
    assert not any("python" in r for r in rows)


@pytest.mark.parametrize("args, error", [
    (["serve", "--port", "70000"], "Error: Invalid value for '--port': 70000 is not in the range 1<=x<=65535."),
    (["token", "add", "bad", "--role", "superuser"], "Error: Invalid value for '--role': 'superuser' "
     "is not one of 'admin', 'submit', 'worker', 'view'."),
    (["workers", "--nosuch"], "Error: No such option '--nosuch'."),
    (["nosuch"], "Error: No such command 'nosuch'."),
])
def test_a_usage_error_is_one_line_on_stderr(args, error):
    # (README: bad input is one line on stderr; click's own put the usage and a hint above it)
    r = CliRunner().invoke(main, args, env={"GPUMESH_URL": "http://127.0.0.1:9"})
    assert r.exit_code == 2
    assert r.stderr == error + "\n" and r.stdout == ""


def test_no_command_still_shows_the_help():
    r = CliRunner().invoke(main, [])
    assert r.exit_code == 2 and "Commands:" in r.output and "Error" not in r.output


def test_submit_with_a_missing_payloads_file_is_a_usage_error_like_a_missing_script(tmp_path):
    # Both are arguments naming a file that is not there: exit 2 before anything is sent
    # (the payloads file was read later, an error with exit code 1).
    script = tmp_path / "job.py"
    script.write_text("print(1)\n")
    env = {"GPUMESH_URL": "http://127.0.0.1:9", "GPUMESH_TOKEN": "t" * 32}
    r = CliRunner().invoke(main, ["submit", str(script), "--payloads", str(tmp_path / "absent.json")], env=env)
    assert r.exit_code == 2, r.output
    assert "Invalid value for '--payloads'" in r.output and "absent.json' does not exist" in r.output
    r = CliRunner().invoke(main, ["submit", str(tmp_path / "absent.py"), "--payloads", str(script)], env=env)
    assert r.exit_code == 2 and "Invalid value for 'SCRIPT'" in r.output


@pytest.mark.parametrize("args, names", [
    # a malformed pin, before the "no token" check and anything else
    (["join", "http://127.0.0.1:9", "--fingerprint", "SHA256:abc"],
     "--fingerprint: fingerprint 'SHA256:abc' is not SHA256:<64 hex digits>"),
    (["serve", "--token", "short", "--port", "9", "--no-save-config"],
     "the token is 5 characters; at least 16 are needed"),
    # a --task that cannot be a task id, checked as a bad JOB_ID is: no request is made
    (["logs", "abcd", "--task", "zz"], "Invalid value for '--task': 'zz' is not a task id"),
    # the URL quoted as typed (it used to say 'http:')
    (["jobs", "--url", "http://"], "--url: coordinator URL 'http://' must start with http://"),
])
def test_a_bad_flag_value_is_a_usage_error(args, names, tmp_path):
    env = {"GPUMESH_URL": "http://127.0.0.1:9", "GPUMESH_TOKEN": "",
           "GPUMESH_CONFIG": str(tmp_path / "config.json")}
    r = CliRunner().invoke(main, args, env=env)
    assert r.exit_code == 2, r.output
    assert names in r.output
    assert "HTTP" not in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("command", [
    ["workers"], ["devices"], ["jobs"], ["status", "abcd"], ["cancel", "abcd"], ["retry", "abcd"],
    ["logs", "abcd"], ["token", "list"], ["token", "revoke", "someone"], ["doctor"], ["join"],
])
def test_every_command_that_talks_to_a_coordinator_takes_a_checked_pin(command, tmp_path):
    # one --fingerprint option, shared (cli/common.py): the same check everywhere
    env = {"GPUMESH_URL": "http://127.0.0.1:9", "GPUMESH_TOKEN": "", "GPUMESH_FINGERPRINT": "",
           "GPUMESH_CONFIG": str(tmp_path / "config.json")}
    r = CliRunner().invoke(main, [*command, "--fingerprint", "SHA256:abc"], env=env)
    assert r.exit_code == 2, r.output
    assert r.output.strip() == ("Error: --fingerprint: fingerprint 'SHA256:abc' is not "
                                "SHA256:<64 hex digits> (gpumesh serve --tls prints it)")
    if command[0] not in ("doctor", "join"):  # (doctor reports it as a check; join: test_cli)
        r = CliRunner().invoke(main, [*command, "--fingerprint", "SHA256:" + "a" * 64], env=env)
        assert r.exit_code == 2, r.output
        assert r.output.strip() == ("Error: --fingerprint pins a TLS certificate, but "
                                    "http://127.0.0.1:9 is not an https:// URL")


def test_a_cancelled_jobs_notice_counts_what_it_stopped():
    # one wording for Ctrl+C, SIGTERM and SIGHUP: the coordinator's count of tasks it
    # cancelled, not the job's size (those already ended did not stop)
    from gpumesh.client.stopsignals import answer_count, cancelled_text
    from gpumesh.transport import Response
    assert (cancelled_text("47d76918ea0a", 1820, 2000) == "job 47d76918ea0a cancelled on the mesh; "
            "its 1820 unfinished task(s) stop there (180 of 2000 had already ended)")
    assert (cancelled_text("j", 4, 4) == "job j cancelled on the mesh; its 4 unfinished task(s) "
            "stop there")
    assert cancelled_text("j", None, 4) == "job j cancelled on the mesh; its unfinished tasks stop there"
    assert cancelled_text("j", 0, 4) == ("job j: every task had already ended on the mesh; nothing "
                                         "was left to cancel")
    assert answer_count(Response(200, {}, b'{"cancelled": 7, "state": "cancelled"}')) == 7
    assert answer_count(Response(200, {}, b'{"state": "finished"}')) is None
    assert answer_count(Response(200, {}, b"not json")) is None
