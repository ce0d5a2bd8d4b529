"""Dependencies flow one way: service -> exporters -> compressor; inside the compressor, the solver
imports nothing else of it, and the CNN and transformer parts never import each other."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package (dotted) -> modules it must not import (dotted prefixes)
FORBIDDEN = {
    "compressor": {"exporters", "service"},
    "exporters": {"service"},
    "compressor.cnn": {"compressor.transformer"},
    "compressor.transformer": {"compressor.cnn"},
    # the service's sides: the job knows nothing of who runs it; the core nothing of its transport or client
    "service.job": {"service.core", "service.server", "service.client", "service.api"},
    "service.core": {"service.server", "service.client"},
    "service.server": {"service.client"},
    "service.api": {"service.server", "service.client"},
}


def imported_modules(path: Path) -> set[str]:
    """Absolute dotted names of every module `path` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return names


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def offenders(package: str, forbidden: set[str]) -> dict[str, list[str]]:
    files = sorted((ROOT / package.replace(".", "/")).rglob("*.py"))
    assert files, package
    found = {str(f.relative_to(ROOT)): sorted(n for n in imported_modules(f) if any(_inside(n, p) for p in forbidden))
             for f in files}
    return {f: bad for f, bad in found.items() if bad}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_upward_or_sideways(package):
    assert offenders(package, FORBIDDEN[package]) == {}


def test_solver_imports_nothing_else_of_the_compressor():
    compressor = {f"compressor.{p.stem}" for p in (ROOT / "compressor").iterdir()
                  if p.stem not in ("solver", "__init__", "__pycache__")}
    assert compressor >= {"compressor.cnn", "compressor.transformer", "compressor.calibration"}
    assert offenders("compressor.solver", compressor) == {}


def test_the_checker_sees_relative_imports(tmp_path):
    """The rule must not be vacuous: a relative import across the parts is caught."""
    names = imported_modules(ROOT / "compressor" / "cnn" / "pipeline.py")
    assert "compressor.progress" in names and "compressor.layerstats" in names


def test_the_client_side_reaches_the_server_only_through_the_api():
    """Besides the command line (which also starts a server and runs local jobs), the client's modules import
    nothing of the server side: they speak to it through `service.api`."""
    client = {str(p.relative_to(ROOT)) for p in (ROOT / "service" / "client").glob("*.py")}
    assert "service/client/cli.py" in client
    found = {f: bad for f, bad in offenders("service.client", {"service.server", "service.core"}).items()
             if f != "service/client/cli.py"}
    assert found == {}
