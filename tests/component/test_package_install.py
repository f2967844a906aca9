"""The package is complete (issue 16): every third-party module the code imports is a declared dependency,
and ``pip install .`` into a fresh venv gives a working ``ajet-hpc`` command.

The fresh venv downloads nothing: it reaches this environment's installed dependencies through a ``.pth``
line (which adds the folder to ``sys.path`` without running its own ``.pth`` files, so the editable install
of this checkout stays invisible), and this environment's pip (``--python`` the fresh venv, ``--no-deps
--no-index``) builds and installs the wheel of this checkout. Checked there: ajet_hpc is imported from the
installed wheel, not from the checkout; the wheel's declared requirements are installed in versions they
accept; the console script runs ``launch --dry-run`` on the quickstart from a folder outside the checkout.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from support import REPO

from ajet_hpc.cli import COMMANDS, main

pytestmark = pytest.mark.slow


def imported_top_level(package: Path) -> set[str]:
    """The top-level names of every absolute import in ``package`` (inside functions too)."""
    names: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"ajet_hpc"}


def declared() -> set[str]:
    """Canonical names of the distributions pyproject.toml declares: dependencies and every extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lists = [project["dependencies"], *project.get("optional-dependencies", {}).values()]
    return {canonicalize_name(Requirement(line).name) for requirements in lists for line in requirements}


# Modules of runtime-only extras (not installed here) whose distribution is named otherwise.
NOT_INSTALLED = {"agents": ["openai-agents"], "pydantic_ai": ["pydantic-ai-slim"]}


def test_every_imported_module_is_a_declared_dependency() -> None:
    providers = {**NOT_INSTALLED, **metadata.packages_distributions()}
    names = imported_top_level(REPO / "ajet_hpc")
    assert {"torch", "h5py", "fastapi", "psutil"} <= names  # the scan sees imports, also inside functions
    undeclared = {
        name: providers.get(name)
        for name in sorted(names)
        if not {canonicalize_name(d) for d in providers.get(name, [name])} & declared()
    }
    assert not undeclared, (
        f"imported but not declared in pyproject.toml (module: distributions): {undeclared}"
    )


def test_the_console_command_lists_and_runs_each_tool(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exited:  # the top-level --help exits through argparse
        main(["--help"])
    assert exited.value.code == 0
    listing = capsys.readouterr().out
    assert all(f"  {name} " in listing for name in COMMANDS)
    assert main(["status", str(tmp_path / "no-run")]) == 2  # a command's own errors and exit status
    assert "no-run" in capsys.readouterr().err
    assert main(["inspect", "--help"]) == 0
    assert "usage: ajet-hpc inspect" in capsys.readouterr().out
    assert main([]) == 2


def test_pip_install_gives_a_working_ajet_hpc_command(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "installed-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # this environment's pip and setuptools build and install the wheel into the fresh venv
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps"]
    install += ["--no-index", "--no-build-isolation"]
    done = subprocess.run(
        [*install, str(REPO)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]

    probe = """
import ajet_hpc
from importlib import metadata
from packaging.requirements import Requirement
print(ajet_hpc.__file__)
for line in metadata.requires("ajet_hpc"):
    req = Requirement(line)
    if req.marker is not None:  # an extra's requirement
        continue
    found = metadata.version(req.name)
    assert req.specifier.contains(found, prereleases=True), f"{req}: {found} installed"
"""
    checked = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert checked.stdout.strip().startswith(site), checked.stdout  # the wheel, not the checkout

    command = venv / "bin" / "ajet-hpc"
    dry = subprocess.run(
        [command, "launch", str(REPO / "configs" / "quickstart.yaml"), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert dry.returncode == 0, dry.stderr[-3000:] + dry.stdout[-2000:]
    assert "dry run:" in dry.stdout and "nothing submitted or written" in dry.stdout
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
