"""requires= pieces without a network: requirement parsing, matching, cache eviction."""

from __future__ import annotations

import json
import os

import pytest

from gpumesh import packages
from gpumesh.worker.envs import EnvCache, InstallError, env_key


def test_requirements_are_canonical_and_order_free():
    a = packages.parse_requirements(["Scikit_Learn>=1.4", "xgboost"])
    b = packages.parse_requirements(["xgboost", "scikit-learn>=1.4"])
    assert a == b == ("scikit-learn>=1.4", "xgboost")
    assert env_key(a) == env_key(list(reversed(a))) != env_key(("xgboost",))


def test_unmet_checks_names_and_versions():
    have = {"scikit-learn": "1.3.2", "numpy": "2.0.0rc1"}
    assert packages.unmet(["scikit-learn>=1.4", "numpy>=1.26", "six"], have) == ["scikit-learn>=1.4", "six"]
    assert packages.unmet(["Scikit_Learn<1.4"], have) == []
    assert packages.unmet(["numpy>=2"], have) == ["numpy>=2"]  # 2.0.0rc1 comes before 2.0


def _fake_env(root, key, size, used):
    d = root / key
    (d / "site").mkdir(parents=True)
    (d / "requires.json").write_text(json.dumps({"requires": [key], "bytes": size}))
    (d / "ready").write_bytes(b"")
    os.utime(d / "ready", (used, used))
    return d


def test_eviction_is_lru_within_the_cap_and_spares_what_is_in_use(tmp_path):
    cache = EnvCache(tmp_path, cap_bytes=250, uv="/nonexistent/uv")
    old = _fake_env(tmp_path, "a" * 24, 100, 1000)
    mid = _fake_env(tmp_path, "b" * 24, 100, 2000)
    new = _fake_env(tmp_path, "c" * 24, 100, 3000)
    cache._in_use[old.name] = 1  # a task of this worker runs in it
    assert cache.evict() == [mid]  # the oldest not in use goes; 200 <= 250 then
    assert old.exists() and new.exists() and not mid.exists()
    cache.release(old.name)
    cache.cap_bytes = 100
    assert cache.evict() == [old]


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    cache = EnvCache(tmp_path, cap_bytes=10**9, uv="/bin/false")
    with pytest.raises(InstallError, match="uv could not install"):
        cache.acquire(["six"])
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    assert cache._in_use == {}


#: What uv 0.5 prints when a requirement needs a newer Python: the reason comes first,
#: then lines that say nothing of it.
UV_NO_SOLUTION = """\
Using Python 3.10.13 environment at: /usr/bin/python3
Resolved 0 packages in 12ms
  x No solution found when resolving dependencies:
  `-> Because the current Python version (3.10.13) does not satisfy Python>=3.11 and all
      versions of pandas>=3 depend on Python>=3.11, we can conclude that pandas>=3 cannot be used.
      And because you require pandas>=3, we can conclude that your requirements are
      unsatisfiable.

      hint: Pre-releases are available for `pandas` in the requested range
Downloading a
Downloading b
Downloading c
Downloading d
Downloading e
Downloading f
"""


def _fake_uv(tmp_path, output: str):
    uv = tmp_path / "uv"
    uv.write_text(f"#!/bin/sh\ncat >&2 <<'OUT'\n{output}OUT\nexit 1\n")
    uv.chmod(0o755)
    return str(uv)


def test_a_failed_build_keeps_the_lines_of_uvs_reason_in_order(tmp_path):
    cache = EnvCache(tmp_path / "envs", cap_bytes=10**9, uv=_fake_uv(tmp_path, UV_NO_SOLUTION))
    with pytest.raises(InstallError) as e:
        cache.acquire(["pandas>=3"])
    assert str(e.value) == (
        "uv could not install ['pandas>=3']: Using Python 3.10.13 environment at: "
        "/usr/bin/python3 / x No solution found when resolving dependencies: / `-> Because "
        "the current Python version (3.10.13) does not satisfy Python>=3.11 and all / "
        "versions of pandas>=3 depend on Python>=3.11, we can conclude that pandas>=3 cannot "
        "be used. / And because you require pandas>=3, we can conclude that your requirements "
        "are / unsatisfiable. / hint: Pre-releases are available for `pandas` in the requested range")


def test_uvs_output_without_a_reason_keeps_its_last_lines_and_a_long_one_is_cut():
    from gpumesh.worker import envs
    lines = [f"line {i}" for i in range(10)]
    assert envs.uv_reason("\n".join(lines)) == " / ".join(lines[-envs.TAIL_LINES:])
    long = "\n".join(f"because {i} " + "x" * 100 for i in range(40))
    got = envs.uv_reason(long)
    assert len(got) == envs.MAX_REASON_CHARS and got.startswith("because 0 ") and got.endswith("...")
