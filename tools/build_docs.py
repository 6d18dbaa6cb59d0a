"""Build the offline docs site and README.md from the notebooks.

    python tools/build_docs.py [--out DIR] [--readme PATH] [--stage DIR] [--force] [--readme-only]

1. Execute `nbs/index.ipynb` afresh into the staging copy (its scoreboard reads `data/results/*.json`, so the
   site and the README always show the current results); the notebook in `nbs/` is never changed.
2. Process every notebook with nbdev's `proc_nbs()` (show_doc pages, `#| hide`, exported code as nbdev shows it);
   cells marked with nbdev's test flags (`#| slow`: the full experiments) are shown but never run.
3. Stage the processed notebooks for myst-nb: front matter -> title cell, `#|` lines -> cell tags, show_doc
   markdown -> markdown cells, plotly JSON -> HTML drawn by a local plotly.js, widget views dropped (each widget
   is followed by a static figure of the same data), plus the sidebar: Get started / Methods by field / Library.
4. Run Sphinx (myst-nb, sphinx-book-theme, `docs/conf.py`) into `_site/`; nothing on a page loads from the network.
5. Write `README.md` from the executed index notebook (`--readme-only` does only steps 1 and 5).

Notebook names (files or folders) starting with `_` or `.` are scratch and never built.
"""
from __future__ import annotations
import argparse, json, os, re, shutil, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT/'nbs'
DOCS = ROOT/'docs'
INDEX = 'index.ipynb'
TOUR = 'tour.ipynb'
PLOTLY_MIME = 'application/vnd.plotly.v1+json'
WIDGET_MIME = 'application/vnd.jupyter.widget-view+json'


class DocsError(RuntimeError):
    "A docs build failed; the message says which notebook or step, and why."


def _env():
    "The environment every step runs in: offline hubs, plotly as JSON, the package and settings of this checkout."
    for k, v in dict(HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1', HF_DATASETS_OFFLINE='1',
                     PLOTLY_RENDERER='plotly_mimetype', TOKENIZERS_PARALLELISM='false').items():
        os.environ[k] = v
    os.environ.setdefault('WORKBENCH_ROOT', str(ROOT))
    # jsonschema (imported by nbformat, imported by myst-nb) imports rfc3987_syntax if present, which compiles a
    # grammar for 2-4 s; only the 'iri' format check needs it, and notebooks have no such field
    sys.modules.setdefault('rfc3987_syntax', None)
    if str(ROOT) not in sys.path: sys.path.insert(0, str(ROOT))   # the package must be importable for show_doc
    pp = os.environ.get('PYTHONPATH', '')
    if str(ROOT) not in pp.split(os.pathsep): os.environ['PYTHONPATH'] = os.pathsep.join(p for p in (str(ROOT), pp) if p)


def is_scratch(rel: Path) -> bool:
    "True if any part of the relative path starts with `_` or `.` (scratch, checkpoints): never built."
    return any(p.startswith(('_', '.')) for p in Path(rel).parts)


def notebooks(nbs: Path = NBS) -> list[Path]:
    "The notebooks the site is built from, relative to `nbs`, sorted."
    return sorted(p.relative_to(nbs) for p in nbs.rglob('*.ipynb') if not is_scratch(p.relative_to(nbs)))


def _write_if_changed(path: Path, text: str) -> bool:
    "Write `text` to `path` unless it already holds it (keeps mtimes, so Sphinx rebuilds only what changed)."
    path = Path(path)
    if path.is_file() and path.read_text(encoding='utf-8') == text: return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f'.{path.name}.tmp')
    tmp.write_text(text, encoding='utf-8'); os.replace(tmp, path)
    return True


def _src(cell) -> str:
    s = cell.get('source', '')
    return ''.join(s) if isinstance(s, list) else s


def _text(v) -> str: return ''.join(v) if isinstance(v, list) else str(v)


# ---------------------------------------------------------------- 1. the index notebook, executed afresh
def execute_index(stage: Path) -> Path:
    "Execute `nbs/index.ipynb` (from `nbs/`, as Jupyter would) into `stage/nbs/index.ipynb`; return that path."
    src = NBS/INDEX
    if not src.is_file():
        raise DocsError(f"{src.relative_to(ROOT)} is missing: it is the site's home page and the source of README.md")
    from execnb.shell import CaptureShell
    dest = stage/'nbs'/INDEX
    dest.parent.mkdir(parents=True, exist_ok=True)
    cwd = Path.cwd()
    try:
        os.chdir(NBS)
        CaptureShell().execute(src, dest, exc_stop=True)
    except Exception as e:
        raise DocsError(f"executing nbs/{INDEX} failed: {type(e).__name__}: {e}") from e
    finally: os.chdir(cwd)
    return dest


# ---------------------------------------------------------------- README.md from the executed index
_re_directive = re.compile(r'^\s*#\|\s*([\w-]+)\s*:?\s*(.*?)\s*$')


def directives(source: str) -> dict:
    "The `#| key: value` (or `#| flag`) lines of a cell, as a dict (flags map to '')."
    out = {}
    for line in source.splitlines():
        m = _re_directive.match(line)
        if m: out[m.group(1).lower()] = m.group(2).strip().lower()
    return out


def strip_directives(source: str) -> str:
    "`source` without its `#|` lines, and without leading/trailing blank lines."
    return '\n'.join(l for l in source.splitlines() if not _re_directive.match(l)).strip('\n')


def _off(d: dict, key: str) -> bool: return d.get(key) in ('false', 'no', '0')


def readme_markdown(nb: dict) -> str:
    "GitHub-flavoured Markdown of an executed notebook: markdown as is, shown code as ```python, text outputs."
    parts = ['<!-- Generated from nbs/index.ipynb by tools/build_docs.py: do not edit; run `make docs`. -->']
    for cell in nb['cells']:
        src = _src(cell)
        if cell['cell_type'] == 'markdown':
            if src.strip(): parts.append(src.strip('\n'))
            continue
        if cell['cell_type'] != 'code': continue
        d = directives(src)
        if 'hide' in d or _off(d, 'include'): continue
        code = strip_directives(src)
        if code.strip() and not _off(d, 'echo'): parts.append(f"```python\n{code}\n```")
        if _off(d, 'output'): continue
        for o in cell.get('outputs', []):
            if o['output_type'] == 'stream':
                if o.get('name') == 'stdout' and _text(o['text']).strip(): parts.append(f"```\n{_text(o['text']).rstrip()}\n```")
            elif o['output_type'] in ('display_data', 'execute_result'):
                data = o.get('data', {})
                if WIDGET_MIME in data or PLOTLY_MIME in data: continue   # interactive: on the site only
                if 'text/markdown' in data: parts.append(_text(data['text/markdown']).strip('\n'))
                elif 'text/plain' in data and not any(k.startswith(('image/', 'text/html')) for k in data):
                    parts.append(f"```\n{_text(data['text/plain']).rstrip()}\n```")
            elif o['output_type'] == 'error':
                raise DocsError(f"nbs/{INDEX} has an error output: {o.get('ename')}: {o.get('evalue')}")
    return '\n\n'.join(parts) + '\n'


def write_readme(executed_index: Path, dest: Path) -> bool:
    "Write the README from the executed index notebook; True if the file changed."
    return _write_if_changed(dest, readme_markdown(json.loads(Path(executed_index).read_text(encoding='utf-8'))))


# ---------------------------------------------------------------- 2. nbdev processing
def _tst_flags() -> set:
    "nbdev's `tst_flags` (e.g. `notest slow`): cells marked so are the long runs, which a docs build never runs."
    from nbdev.config import get_config
    return set(str(get_config(ROOT).get('tst_flags', '') or '').split())


def _pure_imports(src: str) -> bool:
    "True if the cell holds only import statements (directives, comments and magics aside)."
    import ast
    code = '\n'.join(l for l in src.splitlines() if not l.lstrip().startswith(('#', '%', '!')))
    try: tree = ast.parse(code)
    except SyntaxError: return False
    return bool(tree.body) and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body)

def _docs_needs(src: str, d_) -> bool:
    """Whether nbdev's processing must run this cell: exported code (for show_doc), imports, show_doc.
    Every other cell keeps its saved outputs and is never re-run: a docs build runs no experiment, even one
    written in a cell that also imports something (nbdev would run those)."""
    return bool({'export', 'exports', 'exporti'} & set(d_)) or 'show_doc' in src or _pure_imports(src)

def _stage_copy(s: Path, d: Path, flags: set):
    """Copy notebook `s` to `d`, adding `#| eval: false` to cells marked with a test flag (`#| slow`, `#| notest`):
    nbdev's processing runs every cell that imports something, the full experiments included. `d` keeps the
    mtime of `s`, so nbdev's processing cache stays valid."""
    nb = json.loads(s.read_text(encoding='utf-8'))
    for c in nb['cells']:
        if c['cell_type'] != 'code': continue
        d_ = directives(_src(c))
        if 'eval' in d_: continue
        if flags & set(d_) or not _docs_needs(_src(c), d_): c['source'] = '#| eval: false\n' + _src(c)
    d.parent.mkdir(parents=True, exist_ok=True)
    d.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n', encoding='utf-8')
    st = s.stat(); os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))


def _sync_tree(src: Path, dest: Path):
    "Mirror the non-scratch files of `src` into `dest`, keeping mtimes (nbdev's cache compares them)."
    want = {p.relative_to(src) for p in src.rglob('*') if p.is_file() and not is_scratch(p.relative_to(src))}
    if dest.exists():
        for p in sorted(dest.rglob('*'), reverse=True):
            rel = p.relative_to(dest)
            if p.is_file() and rel not in want and rel != Path(INDEX): p.unlink()
            elif p.is_dir() and not any(p.iterdir()): p.rmdir()
    flags = _tst_flags()
    for rel in want:
        if rel == Path(INDEX): continue   # the executed copy is written by execute_index
        s, d = src/rel, dest/rel
        if d.is_file() and d.stat().st_mtime_ns == s.stat().st_mtime_ns: continue
        if s.suffix == '.ipynb':
            try: _stage_copy(s, d, flags)
            except (ValueError, KeyError) as e: raise DocsError(f"nbs/{rel.as_posix()} is not a readable notebook: {e}") from e
        else:
            d.parent.mkdir(parents=True, exist_ok=True); shutil.copy2(s, d)


def process(stage: Path, force=False, n_workers=None) -> Path:
    "Run nbdev's `proc_nbs()` on the staged notebooks; return the folder of processed notebooks (`stage/_proc`)."
    from nbdev.serve import proc_nbs
    import nbdev.serve_drv
    from nbdev.processors import FilterDefaults
    shutil.copy2(ROOT/'pyproject.toml', stage/'pyproject.toml')   # nbdev's config: proc_nbs caches in stage/_proc
    if n_workers is None:   # one changed notebook (the usual case: the index) is quicker in this process
        stale = [r for r in notebooks(stage/'nbs') if force or not (stage/'_proc'/r).is_file()
                 or (stage/'_proc'/r).stat().st_mtime < (stage/'nbs'/r).stat().st_mtime]
        n_workers = 0 if len(stale) <= 1 else min(4, os.cpu_count() or 1)
    cwd = Path.cwd()
    try:
        os.chdir(stage)
        try: cache = Path(proc_nbs(str(stage/'nbs'), n_workers=n_workers, force=force))
        except Exception as e:
            # find the notebook that failed: re-process, one at a time and in this process, what is not done yet
            cache = stage/'_proc'
            for rel in notebooks(stage/'nbs'):
                s, d = stage/'nbs'/rel, cache/rel
                if d.is_file() and d.stat().st_mtime >= s.stat().st_mtime: continue
                try: nbdev.serve_drv.main((s, d, FilterDefaults))
                except Exception as e2:
                    raise DocsError(f"nbdev processing of nbs/{rel.as_posix()} failed: {type(e2).__name__}: {e2}") from e2
            raise DocsError(f"nbdev processing failed ({type(e).__name__}: {e}); no single notebook reproduced it") from e
    finally: os.chdir(cwd)
    return cache


# ---------------------------------------------------------------- 3. staging for myst-nb
_re_attr_link = re.compile(r'\[([^\]]*)\]\(([^)\s]+)\)\{[^}\n]*\}')
_re_callout = re.compile(r'^:::+\s*\{\.callout-(note|tip|warning|important|caution)[^}]*\}[ \t]*$', re.M)
_re_source_link = re.compile(r'^\[source\]\(([^)\s]+)\)\{[^}\n]*\}[ \t]*$', re.M)


def clean_markdown(md: str) -> str:
    "Quarto/nbdev markdown -> MyST: show_doc's [source] link floats right; `{...}` link attributes dropped; callouts."
    md = _re_source_link.sub(lambda m: f'<a href="{m.group(1)}" class="reference external" target="_blank" '
                                       f'style="float:right; font-size:smaller">source</a>\n', md)
    md = _re_attr_link.sub(r'[\1](\2)', md)
    return _re_callout.sub(r':::{\1}', md)


def front_matter(cell) -> dict:
    "The YAML of a raw `---` front-matter cell, or {}."
    import yaml
    src = _src(cell).strip()
    if cell['cell_type'] != 'raw' or not src.startswith('---'): return {}
    body = src.strip('-').strip()
    try: return yaml.safe_load(body) or {}
    except yaml.YAMLError: return {}


def _md_cell(text: str, cid: str) -> dict: return {'cell_type': 'markdown', 'id': cid, 'metadata': {}, 'source': text}


def _plotly_html(fig: dict) -> str:
    import plotly.io as pio
    return pio.to_html(fig, include_plotlyjs=False, full_html=False, validate=False)


def _outputs(cell, asis: bool):
    "The outputs to keep (plotly -> HTML, widget views and empty results dropped) and the asis markdown to lift."
    keep, lifted = [], []
    for o in cell.get('outputs', []):
        if o['output_type'] == 'stream' and not _text(o.get('text', '')).strip(): continue   # e.g. widgets' '\r'
        if o['output_type'] in ('display_data', 'execute_result'):
            data = o.get('data') or {}
            if WIDGET_MIME in data or not data: continue
            if PLOTLY_MIME in data:
                o = {**o, 'data': {'text/html': _plotly_html(data[PLOTLY_MIME])}}
            elif asis and 'text/markdown' in data:
                md = _text(data['text/markdown']).strip('\n')
                if md.startswith('---'): md = md[3:].lstrip('\n')   # show_doc's leading rule
                lifted.append(clean_markdown(md)); continue
        keep.append(o)
    return keep, lifted


def stage_notebook(nb: dict, name: str) -> tuple[dict, dict]:
    "A processed notebook made ready for myst-nb, and its front matter (title, description, output-file)."
    fm, cells = {}, []
    for i, cell in enumerate(nb['cells']):
        cid = f'{name}-{i}'
        if i == 0 and cell['cell_type'] == 'raw' and (fm := front_matter(cell)):
            head = f"# {fm.get('title') or name}"
            if fm.get('description'): head += f"\n\n> {fm['description']}"
            cells.append(_md_cell(head, cid)); continue
        if cell['cell_type'] == 'raw': continue
        if cell['cell_type'] == 'markdown':
            src = _src(cell)
            if src.strip().startswith('<!-- WARNING: THIS FILE WAS AUTOGENERATED'): continue
            cells.append({**cell, 'id': cid, 'source': clean_markdown(src)}); continue
        d = directives(_src(cell))
        if 'hide' in d or _off(d, 'include'): continue
        keep, lifted = _outputs(cell, asis=d.get('output') == 'asis')
        code = strip_directives(_src(cell))
        tags = list(cell.get('metadata', {}).get('tags', []))
        if _off(d, 'echo'): tags.append('remove-input')
        if _off(d, 'output'): tags.append('remove-output')
        if d.get('code-fold') == 'true': tags.append('hide-input')   # 'show' (nbdev's `#| exports`): shown as is
        shown_code = code.strip() and 'remove-input' not in tags
        if shown_code or (keep and 'remove-output' not in tags):
            if not code.strip() and 'remove-input' not in tags: tags.append('remove-input')
            md = {k: v for k, v in cell.get('metadata', {}).items() if k not in ('tags', 'execution')}
            if tags: md['tags'] = list(dict.fromkeys(tags))
            cells.append({**cell, 'id': cid, 'source': code, 'metadata': md, 'outputs': keep})
        cells += [_md_cell(m, f'{cid}-md{j}') for j, m in enumerate(lifted) if m.strip()]
    if not fm.get('title') and not (cells and cells[0]['cell_type'] == 'markdown' and _src(cells[0]).startswith('# ')):
        cells.insert(0, _md_cell(f'# {name}', f'{name}-title'))   # no title cell: the page still needs a title
    meta = {k: v for k, v in nb.get('metadata', {}).items() if k in ('kernelspec', 'language_info')}
    return {'cells': cells, 'metadata': meta, 'nbformat': 4, 'nbformat_minor': 5}, fm


def _title(page: dict, fallback: str) -> str: return (page.get('title') or fallback).strip()


def field_title(folder: str) -> str:
    "A field's sidebar title from its folder name: `kv_cache` -> 'Kv cache'."
    t = re.sub(r'^\d+[_-]', '', folder).replace('_', ' ').replace('-', ' ').strip()
    return t[:1].upper() + t[1:]


def _toctree(caption: str | None, entries: list[str], hidden=True) -> str:
    opts = (':hidden:\n' if hidden else '') + (f':caption: {caption}\n' if caption else '') + ':maxdepth: 2\n'
    return '```{toctree}\n' + opts + '\n' + '\n'.join(entries) + '\n```'


def stage_site(proc: Path, src: Path) -> dict:
    "Stage every processed notebook into `src` (a Sphinx source folder) with the sidebar; return {docname: title}."
    rels = notebooks(proc)
    if Path(INDEX) not in rels: raise DocsError(f"nbdev processing produced no {INDEX}")
    written, pages = set(), {}   # pages: rel -> (docname, front matter, staged notebook)
    for rel in rels:
        try:
            nb, fm = stage_notebook(json.loads((proc/rel).read_text(encoding='utf-8')), rel.stem)
        except Exception as e:
            raise DocsError(f"staging nbs/{rel.as_posix()} for Sphinx failed: {type(e).__name__}: {e}") from e
        if not fm.get('title'): print(f"docs: WARNING: nbs/{rel.as_posix()} has no title cell ('# Title' then '> summary')")
        out_name = Path(str(fm.get('output-file') or rel.with_suffix('.html').name)).with_suffix('.ipynb').name
        dest = rel.parent/out_name
        doc = dest.with_suffix('').as_posix()
        if doc in {d for d, _, _ in pages.values()}:
            raise DocsError(f"nbs/{rel.as_posix()} and another notebook both become page {doc}.html; rename one")
        pages[rel] = (doc, fm, nb)
    # the sidebar: Get started (index, tour, other top-level pages) / Methods by field / Library (API)
    top = [r for r in rels if len(r.parts) == 1]
    library = [r for r in top if re.match(r'0[^_]*_', r.name)]
    started = [r for r in top if r.name == TOUR]
    more = [r for r in top if r not in library and r.name not in (INDEX, TOUR)]
    fields = {}
    for r in rels:
        if len(r.parts) > 1: fields.setdefault(r.parts[0], []).append(r)
    toc = [_toctree('Get started', ['self'] + [pages[r][0] for r in started])]
    if fields:
        field_pages = []
        order = lambda kv: (min([r.name for r in kv[1] if not r.name.startswith('00_')] or [kv[1][0].name]), kv[0])  # by the field's decade
        for folder, rs in sorted(fields.items(), key=order):
            fidx = f'{folder}/index'
            if fidx in {d for d, _, _ in pages.values()}: fidx = f'{folder}/field'
            lines = [f'# {field_title(folder)}', '']
            for r in rs:
                doc, fm, _ = pages[r]
                rel_doc = Path(doc).relative_to(folder).as_posix()
                lines.append(f"- {{doc}}`{rel_doc}`" + (f": {fm['description']}" if fm.get('description') else ''))
            lines += ['', _toctree(None, [Path(pages[r][0]).relative_to(folder).as_posix() for r in rs])]
            written.add(fidx + '.md')
            _write_if_changed(src/(fidx + '.md'), '\n'.join(lines) + '\n')
            field_pages.append(fidx)
        toc.append(_toctree('Methods', field_pages))
    if library: toc.append(_toctree('Library (API)', [pages[r][0] for r in library]))
    if more: toc.append(_toctree('More', [pages[r][0] for r in more]))
    titles = {}
    for rel, (doc, fm, nb) in pages.items():
        if rel == Path(INDEX): nb['cells'].append(_md_cell('\n\n'.join(toc), 'index-toctree'))
        written.add(doc + '.ipynb')
        _write_if_changed(src/(doc + '.ipynb'), json.dumps(nb, indent=1, ensure_ascii=False) + '\n')
        titles[doc] = _title(fm, Path(doc).name)
    # images and other files next to the notebooks
    for p in proc.rglob('*'):
        rel = p.relative_to(proc)
        if p.is_file() and p.suffix not in ('.ipynb', '.yml', '.yaml', '.qmd', '.md', '.py') and not is_scratch(rel):
            written.add(rel.as_posix())
            d = src/rel
            if not (d.is_file() and d.stat().st_mtime >= p.stat().st_mtime):
                d.parent.mkdir(parents=True, exist_ok=True); shutil.copy2(p, d)
    for p in sorted(src.rglob('*'), reverse=True):   # pages whose notebook is gone
        if p.is_file() and p.relative_to(src).as_posix() not in written: p.unlink()
        elif p.is_dir() and not any(p.iterdir()): p.rmdir()
    return titles


# ---------------------------------------------------------------- 4. Sphinx
def _check_out(out: Path):
    "Build only into a new or empty folder, or over a previous site: never into anything else."
    if out.resolve() in (ROOT.resolve(), NBS.resolve(), Path.home().resolve(), Path('/')):
        raise DocsError(f"refusing to build the site into {out}")
    if out.exists():
        if not out.is_dir(): raise DocsError(f"--out {out} is a file")
        if any(out.iterdir()) and not (out/'.buildinfo').is_file():
            raise DocsError(f"--out {out} is not empty and holds no previous site (.buildinfo): refusing to overwrite it")


def _prune(out: Path, docnames):
    "Remove pages of a previous build whose notebook is gone (Sphinx rewrites only what changed, and never deletes)."
    keep = {f'{d}.html' for d in docnames} | {'genindex.html', 'search.html', 'py-modindex.html'}
    for p in out.rglob('*.html'):
        rel = p.relative_to(out).as_posix()
        if not rel.startswith(('_static/', '_sources/', '_images/')) and rel not in keep: p.unlink()


def sphinx_build(src: Path, out: Path, doctrees: Path):
    "Run Sphinx in this process: `src` (staged pages) -> `out` (HTML), configured by docs/conf.py."
    from sphinx.cmd.build import build_main
    _check_out(out)
    rc = build_main(['-b', 'html', '-q', '-c', str(DOCS), '-d', str(doctrees), str(src), str(out)])
    if rc != 0: raise DocsError(f"sphinx-build failed (exit status {rc}); see the messages above")
    _prune(out, [p.relative_to(src).with_suffix('').as_posix() for p in src.rglob('*') if p.suffix in ('.ipynb', '.md')])


# ---------------------------------------------------------------- main
def build(out: Path, stage: Path, readme: Path, readme_only=False, force=False) -> dict:
    "Build the site into `out` (and the README into `readme`); return the seconds each step took."
    _env()
    if not readme_only: _check_out(out)   # before any work
    t = {}
    t0 = time.perf_counter()
    stage.mkdir(parents=True, exist_ok=True)
    executed = execute_index(stage)
    t['index'] = time.perf_counter() - t0
    changed = write_readme(executed, readme)
    print(f"docs: {readme} {'written' if changed else 'unchanged'}")
    if readme_only: return t
    t1 = time.perf_counter()
    _sync_tree(NBS, stage/'nbs')
    proc = process(stage, force=force)
    t['process'] = time.perf_counter() - t1
    t2 = time.perf_counter()
    titles = stage_site(proc, stage/'src')
    t['stage'] = time.perf_counter() - t2
    t3 = time.perf_counter()
    sphinx_build(stage/'src', out, stage/'doctrees')
    t['sphinx'] = time.perf_counter() - t3
    print(f"docs: {len(titles)} pages in {out}")
    return t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--out', type=Path, default=ROOT/'_site', help='folder for the built site (default: _site)')
    ap.add_argument('--readme', type=Path, default=ROOT/'README.md', help='where to write the README (default: README.md)')
    ap.add_argument('--stage', type=Path, default=None,
                    help='staging folder (default: _stage for the default --out, else a sibling <out>.stage)')
    ap.add_argument('--readme-only', action='store_true', help='only execute the index notebook and write the README')
    ap.add_argument('--force', action='store_true', help="ignore nbdev's processing cache")
    a = ap.parse_args(argv)
    out = a.out.resolve()
    stage = (a.stage or (ROOT/'_stage' if out == (ROOT/'_site').resolve() else out.with_name(out.name + '.stage'))).resolve()
    t0 = time.perf_counter()
    try: t = build(out, stage, a.readme.resolve(), readme_only=a.readme_only, force=a.force)
    except DocsError as e:
        print(f"docs: ERROR: {e}", file=sys.stderr); return 1
    steps = ', '.join(f'{k} {v:.1f} s' for k, v in t.items())
    print(f"docs: built in {time.perf_counter() - t0:.1f} s ({steps})")
    return 0


if __name__ == '__main__':
    sys.exit(main())
