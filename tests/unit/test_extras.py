"""The install extras: what the spec promises each one installs, and ``[all]`` holding
every user-facing one (README and pyproject.toml must agree)."""

from __future__ import annotations

import re
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: the tomli backport, a dependency there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
#: Extras that are not for users of the package: this repository's tests and benchmarks,
#: and the engines (a cluster of their own, and large), which [all] leaves out on purpose.
NOT_IN_ALL = {"all", "dev", "bench", "dask", "ray"}


def extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def names(reqs: list[str]) -> set[str]:
    """Distribution names of requirement strings (``gpumesh[a,b]`` gives ``gpumesh[a]``...)."""
    out = set()
    for r in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?", r)
        if m.group(1) == "gpumesh":
            out |= {f"gpumesh[{x.strip()}]" for x in m.group(2).split(",")}
        else:
            out.add(m.group(1).lower())
    return out


def test_spec_extras_install_what_they_say():
    ex = extras()
    assert {"gpu", "tunnel", "sysinfo", "notebook", "ui", "all"} <= set(ex)
    assert "ngrok" in names(ex["tunnel"])  # the official ngrok Agent SDK
    assert {"rich", "questionary"} <= names(ex["ui"])
    assert "nvidia-ml-py" in names(ex["gpu"])
    assert "psutil" in names(ex["sysinfo"])
    assert "pandas" in names(ex["notebook"])


def test_all_holds_every_user_facing_extra():
    ex = extras()
    user_facing = set(ex) - NOT_IN_ALL
    assert names(ex["all"]) == {f"gpumesh[{x}]" for x in user_facing}


def test_readme_lists_each_user_facing_extra():
    readme = (ROOT / "README.md").read_text()
    # from a clone ('.[x]': PyPI's "gpumesh" is another project), or the coordinator's wheel
    listed = set(re.findall(r"pip install '(?:gpumesh|\.)\[([a-z]+)\]", readme))
    assert (set(extras()) - NOT_IN_ALL - {"examples"}) | {"all"} <= listed
