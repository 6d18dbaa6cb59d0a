"The package is generated from the notebooks, and the notebooks are committed clean."
import shutil, subprocess, sys, filecmp
from pathlib import Path
import pytest
from conftest import ROOT, BIN

def _nbdev(cmd, cwd):
    exe = BIN/cmd if (BIN/cmd).exists() else Path(sys.executable).parent/cmd
    r = subprocess.run([str(exe)], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout}\n{r.stderr}"

@pytest.fixture(scope='module')
def copy(tmp_path_factory):
    "A copy of the project's sources, so the checks never touch the working tree."
    d = tmp_path_factory.mktemp('sync')
    for f in ('pyproject.toml', 'settings.ini'): shutil.copy(ROOT/f, d/f)
    for sub in ('nbs', 'workbench'):
        shutil.copytree(ROOT/sub, d/sub, ignore=shutil.ignore_patterns('__pycache__', '.ipynb_checkpoints', '*.egg-info'))
    return d

def _diff(a: Path, b: Path, pattern):
    fa = {p.relative_to(a) for p in a.rglob(pattern)}; fb = {p.relative_to(b) for p in b.rglob(pattern)}
    changed = [str(p) for p in sorted(fa & fb) if not filecmp.cmp(a/p, b/p, shallow=False)]
    return changed, sorted(map(str, fa - fb)), sorted(map(str, fb - fa))

def test_package_in_sync_with_notebooks(copy):
    _nbdev('nbdev-export', copy)
    changed, only_repo, only_new = _diff(ROOT/'workbench', copy/'workbench', '*.py')
    assert not (changed or only_new), (f"nbdev-export changes the package: changed {changed}, new {only_new}. "
                                       "Run `make export` and commit the notebooks with the generated code.")

def test_notebooks_are_clean(copy):
    _nbdev('nbdev-clean', copy)
    changed, _, _ = _diff(ROOT/'nbs', copy/'nbs', '*.ipynb')
    assert not changed, f"nbdev-clean changes {changed}: run `make export` (it also cleans) and commit"

def test_notebooks_are_small():
    big = [str(p.relative_to(ROOT)) for p in (ROOT/'nbs').rglob('*.ipynb') if p.stat().st_size > 1_500_000]
    assert not big, f"notebooks over 1.5 MB (embedded plotly.js or widget state?): {big}"

def test_no_control_characters_in_sources():
    "A Python string that held LaTeX (\\beta, \\alpha, \\bar) turns the backslash escapes into control characters."
    import json, re
    bad = [f"{p.relative_to(ROOT)}: {m.group()!r}" for p in sorted((ROOT/'nbs').rglob('*.ipynb'))
           for c in json.loads(p.read_text())['cells'] for m in re.finditer(r'.{0,12}[\x00-\x08\x0b\x0c\x0e-\x1f].{0,12}', ''.join(c['source']))]
    assert not bad, f"control characters in notebook sources (a lost backslash?): {bad[:5]}"
