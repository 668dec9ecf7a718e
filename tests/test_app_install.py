"""The app ships with the package: a plain (non-editable) ``pip install`` puts ``apps/`` in as ``mmaccel.apps``, and the
installed ``mmaccel app`` serves from any directory.

The install test builds a venv with ``--system-site-packages`` (torch, transformers and gradio come from this
environment; nothing is downloaded: ``--no-index --no-deps --no-build-isolation``), installs a copy of the sources into
it (so the build writes nothing into the checkout), starts ``<venv>/bin/mmaccel app`` with ``/`` as its working
directory and polls the page. The checkout's editable install stays visible to the venv (its finder sits in the system
site-packages), so the test proves that the venv's copy is the one that serves: the package is installed without
byte-code, and the files that the serving process compiled land in the venv's ``site-packages``.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STARTUP_S = 180.0  # torch + gradio imports and the build of nine tabs: ~20 s on an idle 2-core machine


def listed_packages() -> tuple[list[str], dict[str, str]]:
    """``[tool.setuptools] packages`` and ``package-dir`` of the repository's pyproject.toml."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    return list(config.get("packages", [])), dict(config.get("package-dir", {}))


def packages_on_disk() -> set[str]:
    """Every folder of ``mmaccel/`` and ``apps/`` that holds Python files, as its installed dotted name."""
    found = set()
    for top, name in ((ROOT / "mmaccel", "mmaccel"), (ROOT / "apps", "mmaccel.apps")):
        for py in top.rglob("*.py"):
            parts = py.parent.relative_to(top).parts
            if "__pycache__" not in parts:
                found.add(".".join((name, *parts)))
    return found


def test_every_package_on_disk_is_listed_and_apps_installs_as_mmaccel_apps():
    """A mapped folder rules out ``packages.find``, so the list is explicit: a package added to ``mmaccel/`` or
    ``apps/`` and not listed would be missing from a wheel while the editable checkout still imports it."""
    packages, package_dir = listed_packages()
    assert package_dir == {"mmaccel.apps": "apps"}, package_dir
    missing = sorted(packages_on_disk() - set(packages))
    assert not missing, (f"pyproject.toml [tool.setuptools] packages lacks {missing}: add "
                         + ", ".join(f'"{m}"' for m in missing) + " to the list, or a plain `pip install .` leaves "
                         "them out")
    stale = sorted(set(packages) - packages_on_disk())
    assert not stale, f"pyproject.toml [tool.setuptools] packages lists {stale}, which hold no Python files"
    assert all(p == "mmaccel" or p.startswith("mmaccel.") for p in packages), "only `mmaccel` may be installed"
    assert len(packages) == len(set(packages)), "a package is listed twice"


def test_the_editable_install_maps_mmaccel_apps_to_the_apps_folder():
    """The rest of the suite imports ``mmaccel.apps`` from the checkout; a stale editable install (made before the
    mapping) would not find it."""
    import mmaccel

    if Path(mmaccel.__file__).resolve().parent != ROOT / "mmaccel":
        pytest.skip(f"mmaccel is imported from {mmaccel.__file__}, not from this checkout")
    try:
        import mmaccel.apps
    except ModuleNotFoundError as exc:
        pytest.fail(f"{exc}: refresh the editable install (pip install -e '.[app]' --no-deps)")
    assert Path(mmaccel.apps.__file__).resolve() == ROOT / "apps" / "__init__.py"


def test_mmaccel_app_without_gradio_names_the_extra(monkeypatch, capsys):
    """Without gradio, ``mmaccel app`` exits 2 with one line naming the fix; it does not blame the working directory."""
    import mmaccel
    from mmaccel.cli import main

    monkeypatch.setitem(sys.modules, "gradio", None)  # `import gradio` raises ModuleNotFoundError(name="gradio")
    for name in [m for m in sys.modules if m == "mmaccel.apps" or m.startswith("mmaccel.apps.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(mmaccel, "apps", raising=False)
    assert main(["app", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'mmaccel[app]'" in err and "repository root" not in err, err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_sources(dest: Path) -> Path:
    """The repository's top-level files (pyproject.toml, README.md, ...) and the two package folders, without byte-code
    (the trained weights, benchmarks and records are not part of the package)."""
    dest.mkdir()
    for item in ROOT.iterdir():
        if item.is_file():
            shutil.copy2(item, dest / item.name)
    for folder in ("mmaccel", "apps"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(encoding="utf-8", errors="replace")[-n:]


@pytest.mark.slow  # 30-60 s on 2 cores; covered in part by faster tests; CI stays inside 25 minutes
def test_mmaccel_app_serves_from_a_plain_install(tmp_path):
    """``pip install`` (not editable) into a fresh venv, ``cd /``, ``mmaccel app --port P`` serves the workbench, and
    the serving process runs the venv's copy of ``mmaccel`` and ``mmaccel.apps``, not the checkout's."""
    pytest.importorskip("gradio", reason="the app needs the `app` extra: pip install -e '.[app]'")
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE",
                                                             "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")}
    env.update(HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", TOKENIZERS_PARALLELISM="false",
               PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                   env=env, timeout=120)
    python = venv / "bin" / "python"
    # the venv sees this environment's pip and setuptools through --system-site-packages; --no-compile leaves the
    # byte-code to the serving process, which is how the test sees which copy it imported
    pip = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          "--no-compile", str(copy_sources(tmp_path / "src"))],
                         check=False, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, env=env, cwd="/").stdout.strip())
    installed = site / "mmaccel"
    assert (installed / "apps" / "workbench.py").is_file() and (installed / "apps" / "tabs" / "__init__.py").is_file()
    assert not (site / "apps").exists(), "a top-level `apps` package was installed"
    assert not list(installed.rglob("*.pyc")), "the install compiled byte-code: the check below would prove nothing"
    script = venv / "bin" / "mmaccel"
    assert script.read_text().splitlines()[0] == f"#!{python}", "the console script runs another interpreter"

    port, log_path = free_port(), tmp_path / "app.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(script), "app", "--port", str(port), "--device", "cpu", "--threads", "1",
                                 "--model", str(ROOT / "assets" / "models" / "micro-lm")],
                                cwd="/", env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url, deadline, status = f"http://127.0.0.1:{port}/", time.monotonic() + STARTUP_S, None
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while time.monotonic() < deadline and status != 200:
            assert proc.poll() is None, f"`mmaccel app` exited with {proc.returncode}:\n{tail(log_path)}"
            try:
                with opener.open(url, timeout=10) as response:
                    status, page = response.status, response.read().decode("utf-8", "replace")
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1.0)
        assert status == 200, f"no answer from {url} in {STARTUP_S:.0f} s:\n{tail(log_path)}"
        assert 'content="Gradio"' in page or "gradio" in page.lower(), page[:500]
        with opener.open(url + "config", timeout=30) as response:
            config = json.loads(response.read())
        assert config["title"] == "mmaccel workbench" and "tab-longctx" in json.dumps(config)
        # what the serving process imported, it compiled next to the source it read: the venv's copy
        for module in (installed / "cli.py", installed / "apps" / "workbench.py",
                       installed / "apps" / "tabs" / "vision.py"):
            assert list((module.parent / "__pycache__").glob(f"{module.stem}.*.pyc")), (
                f"the serving process did not import {module}:\n{tail(log_path)}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)

    probe = ("import importlib.util, json, mmaccel, mmaccel.apps.workbench as w; "
             "print(json.dumps([mmaccel.__file__, w.__file__, importlib.util.find_spec('apps') is None]))")
    found = subprocess.run([str(python), "-c", probe], check=False, capture_output=True, text=True, env=env, cwd="/",
                           timeout=300)
    assert found.returncode == 0, found.stderr[-3000:]
    package, workbench, no_top_level_apps = json.loads(found.stdout.strip().splitlines()[-1])
    assert Path(package).resolve() == (installed / "__init__.py").resolve(), f"mmaccel came from {package}"
    assert Path(workbench).resolve() == (installed / "apps" / "workbench.py").resolve(), f"came from {workbench}"
    assert no_top_level_apps, "`import apps` resolves from / in the venv"
