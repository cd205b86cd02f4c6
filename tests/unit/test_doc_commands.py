"""Every ``gpumesh ...`` command line the user-facing guides tell people to run names a real
command and only flags that command (or the ``gpumesh`` group) has.

Command lines are taken where a reader copies them from: lines of ```bash blocks
(``$ `` prompts and ``VAR=value`` prefixes stripped) and inline code spans that start with
``gpumesh``. Example output (```text blocks) is not a command and is not checked.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from gpumesh.cli import main

ROOT = Path(__file__).resolve().parents[2]
GUIDES = ["docs/troubleshooting.md", "docs/why-not-ray-or-dask.md", "CONTRIBUTING.md"]

FENCE = re.compile(r"^```(\w*)\s*$")
INLINE = re.compile(r"`([^`\n]+)`")
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def command_lines(markdown: str) -> list[str]:
    """The ``gpumesh ...`` lines a reader would run, in order of appearance."""
    out: list[str] = []
    lang = None  # inside a fence: its language ("" for none)
    for line in markdown.splitlines():
        m = FENCE.match(line.strip())
        if m:
            lang = m.group(1) if lang is None else None
            continue
        if lang is not None:
            if lang in ("bash", "sh", "console"):
                text = line.strip().removeprefix("$ ")
                out += [text] if _gpumesh_argv(text) is not None else []
            continue
        for span in INLINE.findall(line):
            if _gpumesh_argv(span) is not None:
                out.append(span)
    return out


def _gpumesh_argv(text: str) -> list[str] | None:
    """The arguments after ``gpumesh`` when ``text`` runs it (after env assignments)."""
    text = text.split(" #", 1)[0].split("&&", 1)[0].split("|", 1)[0]
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()
    while words and ASSIGNMENT.match(words[0]):
        words.pop(0)
    if words[:1] in (["export"], ["sudo"], ["python"]) or not words or words[0] != "gpumesh":
        return None
    return words[1:]


def _options(command: click.Command) -> set[str]:
    names = {"-h", "--help"}
    for param in command.params:
        if isinstance(param, click.Option):
            names.update(param.opts)
            names.update(param.secondary_opts)
    return names


def problems(line: str) -> list[str]:
    """What is wrong with one command line (an empty list when it is right)."""
    argv = _gpumesh_argv(line)
    assert argv is not None
    group_opts = _options(main) | {"-V", "--version"}
    while argv and argv[0].startswith("-"):
        if argv[0].split("=", 1)[0] not in group_opts:
            return [f"{line!r}: gpumesh has no option {argv[0]}"]
        argv.pop(0)
    if not argv:
        return []
    name, rest = argv[0], argv[1:]
    command = main.commands.get(name)
    if command is None:
        return [f"{line!r}: there is no command `gpumesh {name}`"]
    # a group's subcommand (`gpumesh token add NAME --role view`): its own options
    while isinstance(command, click.Group) and rest and rest[0] in command.commands:
        name = f"{name} {rest[0]}"
        command, rest = command.commands[rest[0]], rest[1:]
    allowed = _options(command)
    return [f"{line!r}: `gpumesh {name}` has no option {word.split('=', 1)[0]}"
            for word in rest if word.startswith("--") and word.split("=", 1)[0] not in allowed]


def test_the_checker_finds_a_wrong_command_and_a_wrong_flag():
    doc = """
Run `gpumesh serve --host 0.0.0.0 --port 8000`, then `gpumesh joinn URL`.

```bash
$ GPUMESH_TOKEN=abc gpumesh doctor --url http://h:8000 --jsn   # comment --ignored
export GPUMESH_TOKEN=x
```

```text
error: the text of `gpumesh serve` output is not a command --nope
```
"""
    lines = command_lines(doc)
    assert lines == ["gpumesh serve --host 0.0.0.0 --port 8000", "gpumesh joinn URL",
                     "GPUMESH_TOKEN=abc gpumesh doctor --url http://h:8000 --jsn   # comment --ignored"]
    assert problems(lines[0]) == []
    assert problems(lines[1]) == ["'gpumesh joinn URL': there is no command `gpumesh joinn`"]
    assert problems(lines[2]) == [f"{lines[2]!r}: `gpumesh doctor` has no option --jsn"]
    # a subcommand's options are its own
    assert problems("gpumesh token add NAME --role view --max-running 2") == []
    assert problems("gpumesh token list --role view") == [
        "'gpumesh token list --role view': `gpumesh token list` has no option --role"]


@pytest.mark.parametrize("guide", GUIDES)
def test_every_command_in_the_guide_exists(guide):
    path = ROOT / guide
    lines = command_lines(path.read_text(encoding="utf-8"))
    assert lines, f"{guide} shows no gpumesh command at all"
    found = [p for line in lines for p in problems(line)]
    assert not found, "\n".join(found)


def test_readme_links_to_the_guides():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for guide in GUIDES:
        assert f"]({guide})" in readme, f"README.md does not link to {guide}"
        assert (ROOT / guide).is_file()
