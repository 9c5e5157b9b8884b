"""Optional dependency groups: `tandem._extras` agrees with pyproject.toml, and a command whose
extra is missing stops before it starts, names the extra and exits 2 without a traceback."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tandem._extras import EXTRAS, needs, require
from tandem.errors import ConfigError, MissingExtraError
from tandem.parties.cli import main

ROOT = Path(__file__).resolve().parents[1]


def hide(monkeypatch: pytest.MonkeyPatch, top: str) -> None:
    """Make ``import top`` (and its submodules) fail for the rest of the test, as if the
    distribution were not installed (a ``None`` entry in sys.modules stops an import)."""
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")] + [top]:
        monkeypatch.setitem(sys.modules, name, None)


def forget(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Drop already imported Tandem modules, and their parent package's attribute for them
    (``from . import x`` looks there first), so the test imports them afresh (restored after)."""
    for name in modules:
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            monkeypatch.delattr(sys.modules[parent], child, raising=False)
        monkeypatch.delitem(sys.modules, name, raising=False)


def _dist(requirement: str) -> str:
    """The normalised distribution name of a requirement string."""
    name = re.split(r"[\s<>=~!;\[]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def test_extras_match_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]

    def names(reqs: list[str]) -> set[str]:
        return {_dist(r) for r in reqs}

    for extra, pairs in EXTRAS.items():
        assert names(optional[extra]) == {dist for dist, _ in pairs}, extra
    assert optional["all"] == [f"tandem[{','.join(sorted(EXTRAS))}]"]
    assert "tandem[all]" in optional["test"]
    core = names(project["dependencies"])
    for pairs in EXTRAS.values():  # an extra's distribution is never a hard dependency
        assert not core & {dist for dist, _ in pairs}


def test_every_third_party_import_is_declared():
    """Each module Tandem imports from outside the standard library comes from a distribution
    that pyproject.toml declares: a hard dependency, or one of the extras `tandem._extras`
    knows (nothing arrives only as another package's dependency)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_dist(r) for r in project["dependencies"]}
    declared |= {_dist(r) for extra in EXTRAS for r in project["optional-dependencies"][extra]}
    imported = set()
    for path in (ROOT / "tandem").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"tandem", "__future__"}
    providers = importlib.metadata.packages_distributions()
    undeclared = {
        module: providers.get(module)
        for module in sorted(third_party)
        if not {_dist(d) for d in providers.get(module, [])} & declared
    }
    assert undeclared == {}


def test_needs_names_the_extra_and_the_install_command(monkeypatch):
    hide(monkeypatch, "sklearn")
    with pytest.raises(MissingExtraError) as info:
        with needs("demo", "the breast-cancer data"):
            from sklearn.datasets import load_breast_cancer  # noqa: F401
    err = info.value
    assert isinstance(err, ConfigError) and err.extra == "demo"
    assert str(err).startswith("the breast-cancer data needs scikit-learn (the 'demo' extra)")
    assert "'sklearn" in str(err)  # the module that failed
    assert str(err).endswith("pip install 'tandem[demo]'")


def test_require_checks_every_module_of_the_extra(monkeypatch):
    require("psi", "alignment")  # installed in the test environment: no error
    hide(monkeypatch, "gmpy2")
    with pytest.raises(MissingExtraError, match=r"needs cryptography and gmpy2 .*'gmpy2'"):
        require("psi", "alignment")


def test_an_unknown_extra_is_a_bug_not_a_user_error():
    with pytest.raises(ValueError, match="unknown extra 'gpu'"):
        require("gpu", "x")


def _cli(capsys, argv: list[str]) -> tuple[int, str]:
    rc = main(argv)
    captured = capsys.readouterr()
    assert captured.out == ""  # no result, and nothing else on stdout
    return rc, captured.err


def test_demo_without_scikit_learn_says_which_extra(monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_PYTHON_CPU", "off")  # leave this process's affinity alone
    hide(monkeypatch, "sklearn")
    rc, err = _cli(capsys, ["demo", "--epochs", "1"])
    assert rc == 2
    assert "tandem demo" in err and "pip install 'tandem[demo]'" in err


def test_demo_trace_without_matplotlib_fails_before_training(monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_PYTHON_CPU", "off")
    hide(monkeypatch, "matplotlib")
    hide(monkeypatch, "sklearn")  # training would need it first: the check must come earlier
    rc, err = _cli(capsys, ["demo", "--trace", "out"])
    assert rc == 2 and "tandem demo --trace" in err
    assert "pip install 'tandem[plot]'" in err and "[demo]" not in err


def test_fl_demo_without_scikit_learn_says_which_extra(monkeypatch, capsys):
    hide(monkeypatch, "sklearn")
    rc, err = _cli(capsys, ["fl", "demo", "--quiet"])
    assert rc == 2 and "tandem fl demo" in err and "pip install 'tandem[demo]'" in err


def test_elastic_demo_plot_without_matplotlib_fails_before_training(monkeypatch, capsys):
    hide(monkeypatch, "matplotlib")
    rc, err = _cli(capsys, ["elastic", "demo", "--quiet", "--plot", "loss.png"])
    assert rc == 2 and "--plot" in err and "pip install 'tandem[plot]'" in err


def test_align_without_the_psi_extra_says_which_extra(monkeypatch, capsys, tmp_path):
    hide(monkeypatch, "gmpy2")
    forget(monkeypatch, "tandem.parties.alignment.psi", "tandem.parties.alignment.ecdh")
    ids = tmp_path / "ids.csv"
    ids.write_text("id\na\n")
    argv = ["align", "--name", "A", "--role", "leader", "--peer", "B=http://127.0.0.1:9"]
    rc, err = _cli(capsys, [*argv, "--ids", str(ids), "--out", str(tmp_path / "out.csv")])
    assert rc == 2 and "tandem align" in err and "pip install 'tandem[psi]'" in err


def test_aligned_rows_files_need_no_extra(monkeypatch, tmp_path):
    """Training and prediction read `tandem align --out` files without the PSI's crypto."""
    hide(monkeypatch, "gmpy2")
    hide(monkeypatch, "cryptography")
    forget(
        monkeypatch,
        *(f"tandem.parties.data.{m}" for m in ("aligned_file", "canonical_ids")),
        *(f"tandem.parties.alignment.{m}" for m in ("ecdh", "psi")),
    )
    from tandem.parties.data.aligned_file import read_aligned, write_aligned

    path = tmp_path / "a.csv"
    write_aligned(path, [2, 0], ["x", "y"])
    assert read_aligned(path).spec_fields()["size"] == 2


def test_a_missing_extra_exits_2_without_a_traceback(tmp_path):
    """The real entry point in a fresh process: one line on stderr, nothing on stdout."""
    code = (
        "import sys; sys.modules['sklearn'] = None; "
        "from tandem.parties.cli import main; sys.exit(main(['fl', 'demo', '--quiet']))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.strip().endswith("pip install 'tandem[demo]'")
