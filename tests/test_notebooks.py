"Every notebook executes top to bottom in quick mode (`#| slow` cells skipped), one test per notebook."
import os, subprocess, sys, time
import pytest
from conftest import ROOT, BIN

NBS = sorted(p for p in (ROOT/'nbs').rglob('*.ipynb')
             if not p.name.startswith('_') and '.ipynb_checkpoints' not in p.parts)

@pytest.mark.parametrize('nb', NBS, ids=[str(p.relative_to(ROOT/'nbs')) for p in NBS])
def test_notebook_runs_in_quick_mode(nb):
    env = dict(os.environ, WORKBENCH_MODE='quick', HF_HUB_OFFLINE='1', PLOTLY_RENDERER='plotly_mimetype')
    t0 = time.time()
    r = subprocess.run([str(BIN/'nbdev-test'), str(nb)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    took = time.time() - t0
    print(f'{nb.relative_to(ROOT)}: {took:.1f} s')
    assert r.returncode == 0 and 'Success' in r.stdout + r.stderr, f"{nb.name} failed after {took:.0f} s:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"
