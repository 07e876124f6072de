"""The console script `cedar-train` (pyproject.toml: `trainer.cli.main:main`) finds its Hydra configs from the
package's location, whatever the working directory: its entry function run from another directory composes the job,
and a non-editable install (the wheel's files: every subpackage, and conf/ as trainer/conf/) does too."""

import subprocess
import sys
import tomllib

import pytest

from tests.trainer.harness import REPO, env

ENTRY = "import sys; from trainer.cli.main import main; sys.argv[0] = 'cedar-train'; main()"


def _entry(args: list[str], cwd, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ENTRY, *args], cwd=cwd, env=env(PYTHONPATH=str(REPO), **extra),
                          capture_output=True, text=True, timeout=300)


def test_the_entry_function_composes_from_another_directory(tmp_path):
    r = _entry(["--cfg", "job"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "max_steps: 400" in r.stdout and "name: v41_tiny" in r.stdout
    assert not any(tmp_path.iterdir())  # printing the config starts no run


def test_a_bad_override_from_another_directory_is_one_line(tmp_path):
    r = _entry(["trainer.max_step=1"], tmp_path)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "did you mean trainer.max_steps" in r.stderr, r.stderr


def test_every_package_is_installed():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    project = pyproject["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(REPO).parts) for top in ("trainer", "model", "data", "optim", "kernels")
             for p in (REPO / top).rglob("__init__.py")}
    assert found <= set(project["packages"])
    assert project["package-dir"]["trainer.conf"] == "conf"
    assert pyproject["project"]["scripts"]["cedar-train"] == "trainer.cli.main:main"


@pytest.mark.slow
def test_an_installed_console_script_runs_from_any_directory(tmp_path):
    target, cwd = tmp_path / "site", tmp_path / "elsewhere"
    cwd.mkdir()
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                        "--target", str(target), str(REPO)], env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert (target / "trainer" / "conf" / "model" / "v41_tiny.yaml").is_file()
    # The installed files only: the checkout is neither on the path nor the working directory.
    run = subprocess.run([sys.executable, str(target / "bin" / "cedar-train"), "--cfg", "job"], cwd=cwd,
                         env=env(PYTHONPATH=str(target)), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "max_steps: 400" in run.stdout
    code = "import trainer; print(trainer.__file__, trainer.CONF_DIR)"
    where = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env(PYTHONPATH=str(target)),
                           capture_output=True, text=True, timeout=120).stdout.split()
    assert where == [str(target / "trainer" / "__init__.py"), str(target / "trainer" / "conf")]
