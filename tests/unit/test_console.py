"""Task output on the caller's console: prefixed lines, and progress bars that redraw
themselves with carriage returns shown as they go (client/console.py)."""

from __future__ import annotations

from gpumesh.client.console import OutputPrinter, shown


def chunk(stream="stderr", task="t1", index=0):
    return {"task_id": task, "stream": stream, "worker": "vm", "index": index}


def test_what_a_redrawn_line_shows_is_its_last_part():
    assert shown("plain") == "plain"
    assert shown("\rstep 0/4\rstep 1/4") == "step 1/4"
    assert shown("step 0/4\r") == "step 0/4"
    assert shown("\r\r") == ""


def test_lines_are_prefixed_and_held_until_their_newline(capsys):
    p = OutputPrinter(single=False)
    p.write(chunk("stdout"), b"hello\nwor")
    assert capsys.readouterr().out == "(vm #0) hello\n"
    p.write(chunk("stdout"), b"ld\n")
    assert capsys.readouterr().out == "(vm #0) world\n"


def test_a_progress_bar_is_drawn_as_it_goes_and_closed_by_its_newline(capsys):
    # tqdm writes "\r<state>" and a newline at the end; each state shows at once, prefixed.
    p = OutputPrinter(single=True)
    p.write(chunk(), b"\rstep 0/4")
    assert capsys.readouterr().err == "\r(vm) step 0/4"
    p.write(chunk(), b"\rstep 1/4\rstep 2/4")
    assert capsys.readouterr().err == "\r(vm) step 2/4"
    p.write(chunk(), b"\rstep 4/4\n")
    assert capsys.readouterr().err == "\r(vm) step 4/4\n"
    p.write(chunk(), b"done\n")  # the next line is a line of its own
    assert capsys.readouterr().err == "(vm) done\n"


def test_another_tasks_output_starts_below_an_open_progress_line(capsys):
    p = OutputPrinter(single=False)
    p.write(chunk(task="a"), b"\r 50%")
    p.write(chunk(task="b", index=1), b"line of b\n")
    assert capsys.readouterr().err == "\r(vm #0)  50%\n(vm #1) line of b\n"
    p.write(chunk(task="a"), b"\r100%\n")  # a's line was closed: its end starts anew
    assert capsys.readouterr().err == "(vm #0) 100%\n"


def test_flush_shows_what_a_redrawn_line_ended_as(capsys):
    p = OutputPrinter(single=True)
    p.write(chunk("stdout"), b"step 0/4\rstep 1/4\r")
    p.flush()
    assert capsys.readouterr().out == "\r(vm) step 1/4\r(vm) step 1/4\n"
