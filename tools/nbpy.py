"""Edit notebooks as plain text: `to-py` writes a notebook's cells to a text file, `to-nb` writes them back.

Usage:
  python tools/nbpy.py to-py NOTEBOOK.ipynb [OUT.py]    (default: stdout)
  python tools/nbpy.py to-nb IN.py NOTEBOOK.ipynb       (creates the notebook, or updates it in place)

Each cell starts with a marker line `# %% [code] id=<id>` or `# %% [markdown] id=<id>` (a marker without
`id=` gets a fresh id); everything up to the next marker is the cell's source, unprefixed. Updating keeps the
notebook's metadata and, for every code cell whose id and source are unchanged, its saved outputs.
"""
import json, os, re, secrets, sys
from pathlib import Path

MARK = re.compile(r'^# %% \[(code|markdown|raw)\](?: id=([A-Za-z0-9_-]+))?\s*$')

def to_py(nb_path) -> str:
    nb = json.loads(Path(nb_path).read_text())
    out = []
    for c in nb['cells']:
        src = ''.join(c['source'])
        out.append(f"# %% [{c['cell_type']}] id={c.get('id') or secrets.token_hex(4)}\n{src}\n")
    return '\n'.join(out)

def parse(text: str) -> list[dict]:
    cells, cur = [], None
    for line in text.splitlines(keepends=True):
        m = MARK.match(line)
        if m:
            cur = dict(cell_type=m[1], id=m[2] or secrets.token_hex(4), lines=[]); cells.append(cur)
        elif cur is None:
            if line.strip(): raise ValueError(f"text before the first cell marker: {line!r}")
        else: cur['lines'].append(line)
    for c in cells:
        src = ''.join(c.pop('lines')).rstrip('\n')   # one blank line separates cells in the text form
        c['source'] = src
    ids = [c['id'] for c in cells]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup: raise ValueError(f"repeated cell ids: {dup}")
    return cells

def _lines(src: str) -> list[str]: return src.splitlines(keepends=True)

def to_nb(py_path, nb_path):
    cells = parse(Path(py_path).read_text())
    nb_path = Path(nb_path)
    if nb_path.exists(): nb = json.loads(nb_path.read_text())
    else: nb = dict(cells=[], metadata=dict(kernelspec=dict(display_name='python3', language='python', name='python3')),
                    nbformat=4, nbformat_minor=5)
    old = {c.get('id'): c for c in nb['cells']}
    new = []
    for c in cells:
        o = old.get(c['id'])
        cell = dict(cell_type=c['cell_type'], id=c['id'], metadata={}, source=_lines(c['source']))
        if c['cell_type'] == 'code':
            same = o is not None and o['cell_type'] == 'code' and ''.join(o['source']) == c['source']
            cell['execution_count'] = o.get('execution_count') if same else None
            cell['outputs'] = o.get('outputs', []) if same else []
        new.append(cell)
    nb['cells'] = new
    tmp = nb_path.with_suffix('.ipynb.tmp')
    tmp.write_text(json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"); os.replace(tmp, nb_path)

if __name__ == '__main__':
    a = sys.argv[1:]
    if len(a) >= 2 and a[0] == 'to-py':
        text = to_py(a[1])
        if len(a) > 2: Path(a[2]).write_text(text)
        else: sys.stdout.write(text)
    elif len(a) == 3 and a[0] == 'to-nb': to_nb(a[1], a[2])
    else: sys.exit(__doc__)
