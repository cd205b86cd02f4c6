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
from dataclasses import dataclass, field

import click

from .. import config
from ..limits import DEFAULT_PORT, MIN_TOKEN_CHARS

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
    if not token:
        notes.append("Token: taken from $GPUMESH_TOKEN or the saved config.")
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


class Prompts:
    """The questions, asked with click's prompts (stdin; works under the CLI runner)."""

    def choose(self, question: str, choices: tuple[str, ...], default: str) -> str:
        return click.prompt(question, type=click.Choice(choices), default=default, show_choices=True)

    def number(self, question: str, default: int) -> int:
        return click.prompt(question, type=click.IntRange(1, 65535), default=default)

    def url(self, question: str) -> str | None:
        """A coordinator URL, normalised; None for an empty answer. One that is not
        ``http(s)://HOST[:PORT]`` is refused at the prompt, which asks again (as it does
        for a port out of range), rather than ending the wizard after the next question."""
        return click.prompt(question, default="", show_default=False, value_proc=_url_or_none)

    def secret(self, question: str) -> str:
        return click.prompt(question, hide_input=True)


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
    while True:
        token = prompts.secret("Token (hidden)")
        if len(token.strip()) >= MIN_TOKEN_CHARS:
            return token, False
        click.echo(f"A token needs at least {MIN_TOKEN_CHARS} characters; try again.")


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
    plan = wizard(Prompts())  # (each answer is checked at its prompt, which asks again)
    click.echo("")
    for line in plan.lines():
        click.echo(line)
    if run_it:
        click.echo("")
        click.echo(f"[gpumesh] running: {plan.command()}")
        run_plan(plan)
