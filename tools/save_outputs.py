"""Execute notebooks in quick mode and save their outputs, so the docs site and GitHub show figures.

Usage: python tools/save_outputs.py [NOTEBOOK ...]   (default: the platform notebooks and the tour)
Widget views are dropped from the saved outputs (they have no state without a kernel and show as errors);
every widget in the notebooks is followed by a static figure. `#| slow`
cells are not run. Finishes with nbdev-clean so the notebooks stay clean.
"""
import json, os, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WIDGET = 'application/vnd.jupyter.widget-view+json'

def strip_widgets(nb_path: Path):
    nb = json.loads(nb_path.read_text())
    for c in nb['cells']:
        outs = []
        for o in c.get('outputs', []):
            d = o.get('data')
            if d and WIDGET in d: continue          # its text fallback is only a repr
            outs.append(o)
        if c['cell_type'] == 'code': c['outputs'] = outs
    nb.get('metadata', {}).pop('widgets', None)
    tmp = nb_path.with_suffix('.ipynb.tmp')
    tmp.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n'); os.replace(tmp, nb_path)

def main(paths):
    paths = [Path(p).resolve() for p in paths] or sorted((ROOT/'nbs').glob('0*.ipynb')) + [ROOT/'nbs'/'tour.ipynb']
    env = dict(os.environ, PLOTLY_RENDERER='plotly_mimetype', HF_HUB_OFFLINE='1', WORKBENCH_MODE='quick')
    for p in paths:
        print(f'executing {p.relative_to(ROOT)}', flush=True)
        r = subprocess.run([str(BIN/'nbdev-test'), '--save', str(p)], cwd=ROOT, env=env)
        if r.returncode: sys.exit(f'{p} failed; its outputs were not saved')
        strip_widgets(p)
        subprocess.run([str(BIN/'nbdev-clean'), '--fname', str(p)], cwd=ROOT, check=True)

if __name__ == '__main__': main(sys.argv[1:])
