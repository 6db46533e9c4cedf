"""`make wheel` and an install with no compiler on the host.

The wheel is built once for this module, the way `make wheel` builds it
(``scripts/build-wheel``: the sdist, a wheel built from that sdist, repaired by
auditwheel to a manylinux tag). It is then installed into a fresh venv whose
``PATH`` holds only that venv's ``bin`` and a directory of stub compilers that
record any call, with ``CC=false``: no compiler can be reached, and the stubs
prove none was tried. The installed CLI prints its version, and a handler in
that venv attaches and takes one slot.

Slow (a build, a venv, pip fetching the runtime dependencies from its cache or
the index): about 20 s, so it runs in ``make test`` on one xdist worker.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
COMPILERS = ("cc", "gcc", "c++", "g++", "clang", "x86_64-linux-gnu-gcc", "aarch64-linux-gnu-gcc")

pytestmark = [
    pytest.mark.xdist_group("wheel"),
    pytest.mark.timeout(300),
    pytest.mark.linux("make wheel repairs the wheel to a manylinux tag (auditwheel, patchelf)"),
]


def limited_api_switch() -> bool:
    """setup.py's ``LIMITED_API``, read without running setup.py."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "LIMITED_API" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, bool)
            return value
    raise AssertionError("setup.py has no LIMITED_API switch")


class Built:
    def __init__(self, out: Path, printed: subprocess.CompletedProcess[str], log: str) -> None:
        self.stdout = printed.stdout
        self.stderr = printed.stderr
        self.log = log  # the tools' whole output, which `make wheel` keeps quiet
        (self.wheel,) = out.glob("*.whl")
        (self.sdist,) = out.glob("*.tar.gz")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The wheel, built once for every test of this module."""
    out = tmp_path_factory.mktemp("wheelhouse")
    log = tmp_path_factory.mktemp("wheel-log") / "build.log"
    env = {k: v for k, v in os.environ.items() if k != "V"}
    run = subprocess.run(
        [str(ROOT / "scripts" / "build-wheel"), sys.executable, str(out)],
        env={**env, "BUILD_WHEEL_LOG": str(log)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return Built(out, run, log.read_text())


def test_make_wheel_builds_a_manylinux_wheel_from_an_sdist_that_carries_the_core(
    built: Built,
) -> None:
    name = built.wheel.name
    assert name.startswith(f"gateway_capacity-{VERSION}-"), name
    python, abi, platform = name.removesuffix(".whl").split("-")[2:]
    assert re.fullmatch(r"(manylinux_2_\d+_\w+\.?)+", platform), platform
    # the stable ABI switch decides the tag: one wheel for every CPython >= 3.11, or this one
    expected = ("cp311", "abi3") if limited_api_switch() else ("cp311", "cp311")
    assert (python, abi) == expected
    with zipfile.ZipFile(built.wheel) as whl:
        names = whl.namelist()
        wheel_info = whl.read(f"gateway_capacity-{VERSION}.dist-info/WHEEL").decode()
        metadata = whl.read(f"gateway_capacity-{VERSION}.dist-info/METADATA").decode()
    assert f"Tag: {python}-{abi}-" in wheel_info
    core = [n for n in names if n.startswith("shm_layout/_core.") and n.endswith(".so")]
    if limited_api_switch():
        assert core == ["shm_layout/_core.abi3.so"]
    else:
        assert len(core) == 1, core
    assert "License-Expression: MIT" in metadata
    assert f"gateway_capacity-{VERSION}.dist-info/licenses/LICENSE" in names
    import tarfile

    with tarfile.open(built.sdist) as sdist:
        members = sdist.getnames()
    for path in (
        "shm_layout/_core.c",
        "shm_layout/_layout.h",
        "shm_layout/_guard.h",
        "setup.py",
        "pyproject.toml",
        "LICENSE",
    ):
        assert f"gateway_capacity-{VERSION}/{path}" in members, path


def test_make_wheel_is_quiet_and_prints_the_wheel_path_last(built: Built) -> None:
    """Not a line per file added: the tools' warnings, the sdist's path, the wheel's last."""
    assert "adding '" in built.log  # the tools did talk, into the log
    printed = built.stdout + built.stderr
    assert "adding '" not in printed, printed
    assert len(printed.splitlines()) <= 8, printed
    assert built.stdout.splitlines()[-1] == str(built.wheel)
    assert built.stdout.splitlines()[-2] == str(built.sdist)


def test_the_build_prints_no_deprecation_warning(built: Built) -> None:
    """setuptools' "`project.license` as a TOML table is deprecated ... By 2027-Feb-18"
    and its kin: a deprecation now is a build that stops working later."""
    lines = [line for line in built.log.splitlines() if re.search(r"deprecat", line, re.I)]
    assert not lines, "\n".join(lines)


# A wheel's file name as the docs print it: the name, a `*` or `...` standing for a part
# the reader fills in, and an optional `[extra,...]` as pip takes it after a wheel's path.
DOC_WHEEL = re.compile(r"(?:gateway_capacity-|\.\.\.)[\w.*-]*?\.whl(?:\[(?P<extras>[\w,-]+)\])?")
DOCS = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def doc_wheel_names() -> list[tuple[str, str, str | None]]:
    """(where, wheel name, extras) for every wheel file name README and docs/ print."""
    found = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for match in DOC_WHEEL.finditer(line):
                name = match.group(0).split("[")[0]
                found.append((f"{doc.relative_to(ROOT)}:{number}", name, match.group("extras")))
    return found


def doc_name_pattern(name: str) -> re.Pattern[str]:
    """A printed name as a pattern: `*` and `...` are the parts a reader fills in, and a
    concrete manylinux tag stands for the one this machine's glibc and arch give."""
    parts = re.split(r"(\*|\.\.\.|manylinux_2_\d+_(?:x86_64|aarch64))", name)
    regex = ""
    for part in parts:
        if part in ("*", "..."):
            regex += ".*"
        elif part.startswith("manylinux_"):
            regex += r"manylinux_2_\d+_\w+"
        else:
            regex += re.escape(part)
    return re.compile(regex)


def test_every_wheel_name_the_docs_print_is_the_one_make_wheel_builds(built: Built) -> None:
    names = doc_wheel_names()
    assert len(names) >= 5, names  # README's build, install and serve lines, systemd.md's
    wrong = [
        f"{where}: {name}"
        for where, name, _ in names
        if not doc_name_pattern(name).fullmatch(built.wheel.name)
    ]
    assert not wrong, f"make wheel built {built.wheel.name}; the docs say:\n" + "\n".join(wrong)
    concrete = [name for _, name, _ in names if "*" not in name and "..." not in name]
    assert concrete, "no doc prints the whole name"


def test_every_wheel_extra_the_docs_install_exists_in_the_wheel(
    built: Built, tmp_path: Path
) -> None:
    """`pip install 'gateway_capacity-...whl[serve]'`: pip installs what the wheel's
    metadata offers as that extra; a name it does not offer only gets a warning."""
    with zipfile.ZipFile(built.wheel) as whl:
        metadata = whl.read(f"gateway_capacity-{VERSION}.dist-info/METADATA").decode()
    offered = set(re.findall(r"^Provides-Extra: (\S+)$", metadata, re.M))
    asked = [(where, extras) for where, _, extras in doc_wheel_names() if extras]
    assert asked, "README installs the serve extra from the wheel"
    missing = [
        f"{where}: [{extras}]" for where, extras in asked if not set(extras.split(",")) <= offered
    ]
    assert not missing, f"the wheel offers {sorted(offered)}; the docs ask for {missing}"
    assert offered <= set(PYPROJECT["project"]["optional-dependencies"])
    # and pip takes the line as printed (the built wheel's path in the doc name's place)
    report = tmp_path / "report.json"
    for extras in sorted({extras for _, extras in asked}):
        run = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report",
             str(report), "--ignore-installed", f"{built.wheel}[{extras}]"],
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert "does not provide the extra" not in run.stderr, run.stderr
        install = json.loads(report.read_text())["install"]
        (ours,) = [item for item in install if item["metadata"]["name"] == "gateway-capacity"]
        assert ours["requested_extras"] == extras.split(","), ours
        names = {item["metadata"]["name"].lower() for item in install}
        for extra in extras.split(","):  # what the extra brings is resolved with it
            for requirement in PYPROJECT["project"]["optional-dependencies"][extra]:
                assert re.split(r"[\[<>=!~; ]", requirement)[0].lower() in names, requirement


@pytest.fixture
def compilerless_env(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path, Path]]:
    """A fresh venv, and an environment in which no compiler can be reached: ``PATH`` is
    the venv's ``bin`` and a directory of stubs that log their own name and fail."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    called = tmp_path / "compilers-called.log"
    for name in COMPILERS:
        stub = stubs / name
        stub.write_text(f'#!/bin/sh\necho {name} >> "{called}"\nexit 1\n')
        stub.chmod(0o755)
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "VIRTUAL_ENV", "GATEWAY_CAPACITY"))
    }
    env.update(
        PATH=f"{venv / 'bin'}:{stubs}",
        CC="false",
        CXX="false",
        LDSHARED="false",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    yield env, venv, called


def test_the_wheel_installs_and_admits_with_no_compiler_reachable(
    built: Built,
    compilerless_env: tuple[dict[str, str], Path, Path],
    tmp_path: Path,
    segment_name: str,
) -> None:
    env, venv, called = compilerless_env
    # what an operator types; a dependency that needed compiling would reach a stub
    install = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", str(built.wheel)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    assert not called.exists(), f"a compiler was called: {called.read_text()}"

    exe = venv / "bin" / "gateway-capacity"
    version = subprocess.run(
        [str(exe), "--version"], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"gateway-capacity {VERSION}"

    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"providers": [{"id": "p1", "maxConcurrent": 2}]}))
    handler = textwrap.dedent(
        f"""
        import json, shm_layout._core as core
        from handler_shim import Admission
        adm = Admission.attach({str(config)!r}, "wheel-1", segment={segment_name!r})
        with adm.slot_blocking("p1", timeout=5.0):
            print(json.dumps({{"core": core.__file__, "admitted": True, "hooks": core.TEST_HOOKS,
                              "hold_lock": hasattr(core.Core, "hold_lock")}}))
        adm.close()
        """
    )
    # -I: the checkout (cwd, PYTHONPATH) must not stand in for the installed wheel
    run = subprocess.run(
        [str(venv / "bin" / "python"), "-I", "-c", handler],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    done = json.loads(run.stdout)
    assert done["admitted"]
    assert done["hooks"] == 0 and not done["hold_lock"], "a wheel has no test entry points"
    assert Path(done["core"]).is_relative_to(venv), done["core"]

    view = subprocess.run(
        [str(exe), "inspect", "--segment", segment_name, "--json"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert view.returncode == 0, view.stdout + view.stderr
    (p1,) = json.loads(view.stdout)["providers"]
    assert p1["counters"]["admitted_total"] == 1 and p1["running"] == 0
    assert not called.exists()
