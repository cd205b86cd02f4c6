"""``gpumesh setup``: a short interactive wizard that ends with the exact command to run.

The questions go through :class:`Prompts` (click's prompts: they read stdin, so the CLI
runner can answer them in tests); the decisions are pure functions
(:func:`serve_plan`, :func:`join_plan`) that turn answers into a :class:`Plan`. A token
never goes on a command line: the plan passes it in the environment
(``GPUMESH_TOKEN``), where gpumesh hides it from ``ps`` once read.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import click

from .. import config
from ..limits import DEFAULT_PORT, MIN_TOKEN_CHARS
from .common import fail

ROLES = ("coordinator", "worker")
NETWORKS = ("local", "lan")  # this machine only / other machines on the LAN


@dataclass
class Plan:
    """What the wizard decided: ``argv`` (after ``gpumesh``), the environment it needs,
    and the lines to show. ``env`` may hold the token; ``argv`` never does."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    show_token: bool = False  # a generated token is shown once (workers need it)

    def command(self) -> str:
        return "gpumesh " + " ".join(shlex.quote(a) for a in self.argv)

    def lines(self) -> list[str]:
        out = list(self.notes)
        token = self.env.get("GPUMESH_TOKEN")
        if token is not None:
            if self.show_token:
                out += [f"Token (keep it secret; workers need it): {token}", "",
                        "Run:", f"  export GPUMESH_TOKEN={shlex.quote(token)}"]
            else:
                out += ["", "Run:", "  export GPUMESH_TOKEN='<the token you entered>'"]
        else:
            out += ["", "Run:"]
        out.append(f"  {self.command()}")
        return out


def serve_plan(network: str, port: int = DEFAULT_PORT, token: str | None = None,
               generated: bool = False) -> Plan:
    """The ``gpumesh serve`` command for a coordinator."""
    if network not in NETWORKS:
        raise ValueError(f"network must be one of {NETWORKS}")
    argv = ["serve", "--port", str(port)]
    notes = []
    if network == "lan":
        argv[1:1] = ["--host", "0.0.0.0"]
        notes.append("Other machines on your LAN can join (`gpumesh join` finds it with no URL; "
                     "`gpumesh radar` shows it). Anyone with the token can run code here.")
    else:
        notes.append("Only this machine can use the coordinator (bound to 127.0.0.1).")
    env = {"GPUMESH_TOKEN": token} if token else {}
    return Plan(argv, env, notes, show_token=generated)


def join_plan(network: str, url: str | None = None, port: int = DEFAULT_PORT,
              token: str | None = None) -> Plan:
    """The ``gpumesh join`` command for a worker."""
    if network not in NETWORKS:
        raise ValueError(f"network must be one of {NETWORKS}")
    argv = ["join"]
    notes = []
    if network == "local":
        saved = saved_local_url()
        # the coordinator `gpumesh serve` saved, with its scheme, when it is on this port
        url = url or (saved if saved and _port(saved) == port else f"http://127.0.0.1:{port}")
    if url:
        argv.append(config.normalise_url(url))
    else:
        notes.append("No URL: `gpumesh join` looks for the coordinator on the LAN and joins it "
                     "if exactly one is found.")
    env = {"GPUMESH_TOKEN": token} if token else {}
    if not token and (os.environ.get("GPUMESH_TOKEN") or config.load_saved().get("token")):
        notes.append("Token: taken from $GPUMESH_TOKEN or the saved config.")
    elif not token:  # join would stop at once: "no token"
        notes.append(f"Token: none here yet ($GPUMESH_TOKEN is unset and {config.config_path()} "
                     f"holds none): export GPUMESH_TOKEN=<the coordinator's token> first.")
    return Plan(argv, env, notes)


def saved_local_url() -> str | None:
    """The saved config's coordinator URL when it is on this machine (loopback), else None."""
    from urllib.parse import urlsplit
    saved = config.load_saved().get("url")
    try:
        url = config.normalise_url(saved) if isinstance(saved, str) else ""
    except ValueError:
        return None
    host = urlsplit(url).hostname
    return url if host in ("127.0.0.1", "localhost", "::1") else None


def _port(url: str) -> int:
    from urllib.parse import urlsplit
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def _url_or_none(text: str) -> str | None:
    if not text.strip():
        return None  # find it on the LAN
    try:
        return config.normalise_url(text)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None  # click says so and prompts again


def _token(text: str) -> str:
    """An entered token, as typed; one under ``MIN_TOKEN_CHARS`` (blank ones included) is
    refused at the prompt, which says so in an ``Error:`` line and asks again."""
    if len(text.strip()) < MIN_TOKEN_CHARS:
        raise click.BadParameter(f"a token needs at least {MIN_TOKEN_CHARS} characters")
    return text


class NoAnswer(Exception):
    """The input ended (or was interrupted) at the prompt of ``question``. ``line_open``:
    the prompt's line was left without its newline."""

    def __init__(self, question: str, line_open: bool = True):
        super().__init__(question)
        self.question, self.line_open = question, line_open


class Prompts:
    """The questions, asked with click's prompts (stdin; works under the CLI runner). An
    answer the wizard cannot use is refused at its prompt with one ``Error:`` line and the
    question asked again; input that ends at a prompt raises :class:`NoAnswer`."""

    def choose(self, question: str, choices: tuple[str, ...], default: str) -> str:
        with _answer(question):
            return click.prompt(question, type=click.Choice(choices), default=default, show_choices=True)

    def number(self, question: str, default: int) -> int:
        with _answer(question):
            return click.prompt(question, type=click.IntRange(1, 65535), default=default)

    def url(self, question: str) -> str | None:
        """A coordinator URL, normalised; None for an empty answer. One that is not
        ``http(s)://HOST[:PORT]`` is refused at the prompt, which asks again (as it does
        for a port out of range), rather than ending the wizard after the next question."""
        with _answer(question):
            return click.prompt(question, default="", show_default=False, value_proc=_url_or_none)

    def secret(self, question: str) -> str:
        """A token, not echoed. From a terminal it is read with echo off; from a pipe or
        file (a scripted setup: nothing echoes it there) as a plain line, where getpass
        would warn that it cannot turn echo off."""
        if _is_tty(sys.stdin):
            with _answer(question, line_open=False):  # (click ends the line itself)
                return click.prompt(question, hide_input=True, default="", show_default=False,
                                    value_proc=_token)
        while True:
            click.echo(f"{question}: ", nl=False)
            try:
                line = sys.stdin.readline()
            except KeyboardInterrupt:
                line = ""
            if not line:
                raise NoAnswer(question)
            click.echo("")  # (the answer is not echoed: end the prompt's line)
            try:
                return _token(line.rstrip("\r\n"))
            except click.BadParameter as e:
                click.echo(f"Error: {e.message}")


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no stream, or a closed one
        return False


@contextmanager
def _answer(question: str, line_open: bool = True) -> Iterator[None]:
    """Turns click's ``Abort`` at the prompt of ``question`` (its input ended, or Ctrl+C)
    into :class:`NoAnswer`."""
    try:
        yield
    except click.Abort:
        raise NoAnswer(question, line_open) from None


def ask_token(prompts: Prompts, allow_generate: bool) -> tuple[str | None, bool]:
    """(token, generated). Offers: generate, enter, or (worker) the environment/saved config."""
    choices = ("generate", "enter") if allow_generate else ("saved", "enter")
    how = prompts.choose("Token: generate a new one or enter yours?" if allow_generate else
                         "Token: use $GPUMESH_TOKEN / the saved config, or enter it?",
                         choices, choices[0])
    if how == "generate":
        return config.generate_token(), True
    if how == "saved":
        return None, False
    return prompts.secret("Token (hidden)"), False  # (a short one is refused there)


def wizard(prompts: Prompts) -> Plan:
    role = prompts.choose("Role of this machine", ROLES, "coordinator")
    if role == "coordinator":
        network = prompts.choose("Who may connect? local = this machine only, lan = other machines",
                                 NETWORKS, "local")
        port = prompts.number("Port", DEFAULT_PORT)
        token, generated = ask_token(prompts, allow_generate=True)
        return serve_plan(network, port, token, generated)
    network = prompts.choose("Where is the coordinator? local = this machine, lan = another machine",
                             NETWORKS, "lan")
    url = None
    port = DEFAULT_PORT
    if network == "lan":
        url = prompts.url("Coordinator URL (empty: find it on the LAN)")
    else:
        saved = saved_local_url()  # the port `gpumesh serve` here saved, as the default
        port = prompts.number("Coordinator port", _port(saved) if saved else DEFAULT_PORT)
    token, _ = ask_token(prompts, allow_generate=False)
    return join_plan(network, url, port, token)


def run_plan(plan: Plan) -> None:
    """Replace this process with the planned command; the token travels in the environment."""
    env = dict(os.environ, **plan.env)
    sys.stdout.flush()
    os.execvpe(sys.executable, [sys.executable, "-m", "gpumesh", *plan.argv], env)


@click.command()
@click.option("--run", "run_it", is_flag=True,
              help="Run the resulting command right away [default: only print it].")
def setup(run_it):
    """Answer a few questions (role, network, token); get the exact command to run."""
    try:
        plan = wizard(Prompts())  # (each answer is checked at its prompt, which asks again)
    except NoAnswer as e:
        if e.line_open:
            click.echo("")  # the prompt's line, left open, ends before the error
        fail(f"no answer to {e.question!r}: the input ended (or was interrupted) before the "
             "last question; setup stopped")
    click.echo("")
    for line in plan.lines():
        click.echo(line)
    if run_it:
        click.echo("")
        click.echo(f"[gpumesh] running: {plan.command()}")
        run_plan(plan)
