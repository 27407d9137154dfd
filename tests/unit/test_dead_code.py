"""No dead code in kvdiag/: vulture finds no unused name. A name that kvdiag's own strings reference as
``"module:name"`` (an engine's factory, the self-test's case function) counts as used: the test reads them from the
source. tests/support/vulture_whitelist.py lists the other names used in ways vulture cannot see, each with its user.
vulture comes with the test extra (pyproject.toml)."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def referenced_names(folder: Path) -> set[str]:
    """The ``name`` of every string constant ``"kvdiag.module:name"`` in ``folder``'s Python files."""
    from test_import_graph import REFERENCE

    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and REFERENCE.fullmatch(node.value) \
                    and node.value.startswith("kvdiag.") and ":" in node.value:
                names.add(node.value.partition(":")[2])
    return names


def test_the_registry_strings_are_read_as_uses():
    names = referenced_names(REPO / "kvdiag") | referenced_names(REPO / "kernels")
    assert {"run", "BuiltinEngine", "VllmEngine"} <= names, names


def rendered_scripts(folder: Path) -> list[str]:
    """The reproducer templates (kvdiag/proof/*_script.py) as kvdiag writes them for each engine they have lines
    for (``fill.engine_lines``): a template holds each engine's version of a function one after the other."""
    from kvdiag.proof.fill import ONLY, engine_lines

    out = []
    for path in sorted((REPO / "kvdiag" / "proof").glob("*_script.py")):
        text = path.read_text(encoding="utf-8")
        for engine in ("vllm", "builtin") if ONLY in text else (None,):
            (folder / f"{path.stem}_{engine}.py").write_text(engine_lines(text, engine), encoding="utf-8")
            out.append(str(folder / f"{path.stem}_{engine}.py"))
    return out


def test_vulture_finds_no_dead_code(tmp_path):
    strings = tmp_path / "referenced.py"
    names = referenced_names(REPO / "kvdiag") | referenced_names(REPO / "kernels")
    strings.write_text("".join(f"_.{n}\n" for n in sorted(names)), encoding="utf-8")
    cmd = [sys.executable, "-m", "vulture", "kvdiag", "kernels", "tests/support/vulture_whitelist.py", str(strings),
           *rendered_scripts(tmp_path), "--min-confidence", "60",
           "--exclude", "kvdiag/assets,*/kvdiag/proof/*_script.py"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode in (0, 3), out.stderr  # 3: vulture found dead code
    findings = out.stdout.strip()
    assert not findings, "dead code (delete it, or whitelist a real false positive in " \
                         "tests/support/vulture_whitelist.py with its user):\n" + findings
