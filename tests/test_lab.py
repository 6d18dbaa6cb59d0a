"""The main job in a real browser: JupyterLab (started by `tools/lab.py`) driven by Playwright in Debian's chromium.

It opens a notebook with a widget (`nbs/tour.ipynb`, or `tests/lab_fixture.ipynb` while the tour does not exist;
`$WORKBENCH_LAB_NOTEBOOK` picks another), runs all its cells, finds a slider rendered beside a plotly figure, moves
the slider and sees the figure change. A copy of the notebook is served from a temporary folder, so nothing is
written into the repository.
"""
import importlib.util, json, os, re, sys, time, tomllib
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location('workbench_lab', ROOT/'tools'/'lab.py')
lab = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(lab)

CHROMIUM = os.environ.get('WORKBENCH_CHROMIUM', '/usr/bin/chromium')
CHROMIUM_ARGS = ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--disable-background-networking',
                 '--disable-component-update', '--disable-sync', '--no-first-run']
RUN_TIMEOUT = float(os.environ.get('WORKBENCH_LAB_RUN_TIMEOUT', 240))  # s for "run all" (the tour loads a model)

def target_notebook() -> Path:
    "The notebook under test: $WORKBENCH_LAB_NOTEBOOK, else nbs/tour.ipynb once it exists, else the small fixture."
    if os.environ.get('WORKBENCH_LAB_NOTEBOOK'): return Path(os.environ['WORKBENCH_LAB_NOTEBOOK']).resolve()
    tour = ROOT/'nbs'/'tour.ipynb'
    return tour if tour.exists() else ROOT/'tests'/'lab_fixture.ipynb'

def _skip_flags() -> set:
    "nbdev's `tst_flags` (cells `nbdev-test` leaves out, e.g. `#| slow`), plus cells marked `#| eval: false`."
    cfg = tomllib.loads((ROOT/'pyproject.toml').read_text()).get('tool', {}).get('nbdev', {})
    return set(str(cfg.get('tst_flags', '')).split())

_DIRECTIVE = re.compile(r'^\s*#\s*\|\s*([\w-]+)\s*:?\s*(.*)$')

def _directives(src: str) -> dict:
    out = {}
    for line in src.splitlines():
        if not line.strip(): continue
        m = _DIRECTIVE.match(line)
        if not m: break  # directives sit at the top of a cell
        out[m.group(1)] = m.group(2).strip()
    return out

def lab_copy(src, dest_dir, skip_flags=None) -> Path:
    "Copy notebook `src` into `dest_dir` as the browser runs it: no outputs or counts, no cells `nbdev-test` skips."
    # also left out: cells that call nbdev_export (they would export from a folder without the project's config)
    src = Path(src)
    if src.suffix != '.ipynb' or not src.is_file(): raise ValueError(f"src must be an existing .ipynb file, got {src}")
    flags = _skip_flags() if skip_flags is None else set(skip_flags)
    nb = json.loads(src.read_text())
    cells = []
    for c in nb['cells']:
        s = ''.join(c['source']) if isinstance(c['source'], list) else c['source']
        if c['cell_type'] == 'code':
            d = _directives(s)
            if flags & d.keys() or d.get('eval', '').lower() == 'false' or 'nbdev_export(' in s: continue
            c = dict(c, outputs=[], execution_count=None)
        cells.append(c)
    nb['cells'] = cells
    nb['metadata'].setdefault('kernelspec', {'name': 'python3', 'display_name': 'Python 3 (ipykernel)', 'language': 'python'})
    nb['metadata'].pop('widgets', None)  # saved widget state would render stale views
    dest = Path(dest_dir)/src.name
    dest.write_text(json.dumps(nb, indent=1))
    return dest

# ---- in-page probes (JupyterLab exposes `window.jupyterapp` with --LabApp.expose_app_in_browser) ----
JS_KERNEL_IDLE = """(path) => { const w = window.jupyterapp?.shell?.currentWidget;
  return !!w && w.context?.path === path && w.sessionContext?.session?.kernel?.status === 'idle'; }"""
JS_RUN_ALL = "() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); return true; }"
# every non-empty code cell: executed (model count) and showing it ([n] in its prompt); any error outputs
JS_PROGRESS = """() => { const nb = window.jupyterapp.shell.currentWidget.content;
  const r = {cells: 0, pending: 0, errors: [], kernel: window.jupyterapp.shell.currentWidget.sessionContext?.session?.kernel?.status};
  for (const cell of nb.widgets) { const m = cell.model;
    if (m.type !== 'code' || !m.sharedModel.getSource().trim()) continue;
    r.cells++;
    const prompt = cell.node.querySelector('.jp-InputPrompt')?.textContent.trim() ?? '';
    if (m.executionCount == null || !/^\\[\\d+\\]:?$/.test(prompt)) r.pending++;
    for (let i = 0; i < m.outputs.length; i++) { const o = m.outputs.get(i).toJSON();
      if (o.output_type === 'error') r.errors.push(`${o.ename}: ${o.evalue}`); } }
  return r; }"""
# the first output showing a slider and a rendered plotly figure: mark it for the locators below
JS_MARK_TARGET = """() => { for (const o of document.querySelectorAll('.jp-OutputArea-output')) {
    if (o.querySelector('.widget-slider [role=slider]') && o.querySelector('.js-plotly-plot .main-svg')) {
      o.setAttribute('data-lab-test', 'target'); return true; } }
  return false; }"""
# what a figure shows: every trace's path `d`, image href and the titles' text
JS_FIGURE = """() => { const p = document.querySelector('[data-lab-test=target] .js-plotly-plot');
  if (!p) return null;
  const d = [...p.querySelectorAll('.main-svg .trace path, .main-svg .trace image, .main-svg .hm image, .main-svg .imagelayer image')].map(e => e.getAttribute('d') ?? e.getAttribute('href') ?? '');
  const t = [...p.querySelectorAll('.gtitle, .g-xtitle, .g-ytitle')].map(e => e.textContent);
  return JSON.stringify({d, t}); }"""

def _drive(page, url, nb_name, run_timeout):
    "Open the notebook, run all cells, find the widget, move its slider, see the figure change."
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    page.goto(f'{url}/lab/tree/{nb_name}?reset', wait_until='domcontentloaded')
    page.wait_for_function(JS_KERNEL_IDLE, arg=nb_name, timeout=90_000)
    page.evaluate(JS_RUN_ALL)
    t0, r = time.time(), None
    while time.time() - t0 < run_timeout:
        r = page.evaluate(JS_PROGRESS)
        assert not r['errors'], f"a cell raised: {r['errors']}"
        if r['cells'] and not r['pending']: break
        time.sleep(0.5)
    else: pytest.fail(f"cells still running after {run_timeout:.0f} s: {r}")
    run_s = time.time() - t0
    page.wait_for_function(JS_MARK_TARGET, timeout=60_000)  # widgets render after the kernel replies
    slider = page.locator('[data-lab-test=target] .widget-slider [role=slider]').first
    assert slider.is_visible(), "the widget's slider is not visible"
    assert page.locator('[data-lab-test=target] .js-plotly-plot .main-svg').first.is_visible(), "the plotly figure is not visible"
    try: page.wait_for_function(f"() => {{ const f = ({JS_FIGURE})(); return !!f && JSON.parse(f).d.some(x => x); }}", timeout=30_000)
    except PlaywrightTimeout: pytest.fail(f"the figure beside the slider drew no trace in 30 s: {page.evaluate(JS_FIGURE)}")
    before, value = page.evaluate(JS_FIGURE), slider.get_attribute('aria-valuenow')
    slider.focus()
    for _ in range(3): slider.press('ArrowRight')
    if slider.get_attribute('aria-valuenow') == value:  # already at its maximum: move the other way
        for _ in range(3): slider.press('ArrowLeft')
    assert slider.get_attribute('aria-valuenow') != value, f"the slider did not move from {value}"
    moved = slider.get_attribute('aria-valuenow')
    try: page.wait_for_function(f"(before) => {{ const f = ({JS_FIGURE})(); return !!f && f !== before && JSON.parse(f).d.some(x => x); }}",
                                arg=before, timeout=30_000)
    except PlaywrightTimeout: pytest.fail(f"the figure did not change in 30 s after the slider moved from {value} to {moved}")
    after = json.loads(page.evaluate(JS_FIGURE)); before = json.loads(before)
    assert after['d'] != before['d'] or after['t'] != before['t']  # a trace or a title was redrawn
    return run_s

def _alive(pid) -> bool:
    import psutil
    try: return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess: return False

@pytest.fixture
def lab_server(tmp_path, notebook):
    "An isolated JupyterLab serving a copy of `notebook`; stopped (kernels too) afterwards."
    root = tmp_path/'root'; root.mkdir()
    nb = lab_copy(notebook, root)
    # IN_TEST puts workbench notebooks in quick mode, as under nbdev-test
    proc, url = lab.start_lab(home=tmp_path/'home', root_dir=root, env={'IN_TEST': '1'}, idle_shutdown=600)
    try: yield url, nb
    finally:
        kernels = lab.stop_lab(proc, url)
        assert proc.poll() is not None, "the JupyterLab server is still running"
        assert not [k for k in kernels if _alive(k)], f"kernel processes survived: {kernels}"

@pytest.fixture
def chromium(tmp_path):
    "Debian's chromium under Playwright (no browser download); skipped when absent, unless under CI."
    try: from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get('CI'): raise
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        msg = f"chromium not found at {CHROMIUM} (apt-get install chromium, or set WORKBENCH_CHROMIUM)"
        if os.environ.get('CI'): pytest.fail(msg)
        pytest.skip(msg)
    home = tmp_path/'browser-home'
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home/'config'), XDG_CACHE_HOME=str(home/'cache'))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS, env=env)
        try: yield browser
        finally: browser.close()

@pytest.mark.browser
@pytest.mark.timeout(RUN_TIMEOUT + 300)
@pytest.mark.parametrize('notebook', [target_notebook()], ids=lambda p: p.name)
def test_widget_in_jupyterlab(chromium, lab_server, tmp_path, notebook):  # chromium first: a skip starts no server
    url, nb = lab_server
    page = chromium.new_page(viewport={'width': 1400, 'height': 1000})
    errors = []
    page.on('pageerror', lambda e: errors.append(f'pageerror: {e}'))
    page.on('console', lambda m: m.type == 'error' and errors.append(f'console: {m.text} @ {m.location.get("url")}'))
    try:
        _drive(page, url, nb.name, RUN_TIMEOUT)
        assert not errors, f"errors in the page: {errors}"
    except BaseException:
        shot = tmp_path/'failure.png'
        try:
            target = page.locator('[data-lab-test=target]')
            if target.count(): target.first.scroll_into_view_if_needed(timeout=5_000)
            page.screenshot(path=str(shot)); print(f"screenshot: {shot}", file=sys.stderr)
        except Exception as e: print(f"no screenshot: {e}", file=sys.stderr)
        raise
    finally: page.close()

# ---- the pieces, without a browser ----
def test_lab_copy_strips_outputs_and_skipped_cells(tmp_path):
    src = tmp_path/'src'; src.mkdir()
    cell = lambda s, **kw: dict(cell_type='code', metadata={}, source=s, outputs=[{'output_type': 'stream', 'name': 'stdout', 'text': 'x'}],
                                execution_count=7, **kw)
    nb = dict(nbformat=4, nbformat_minor=5, metadata={'widgets': {'state': 'big'}},
              cells=[dict(cell_type='markdown', metadata={}, source='# T'), cell('x = 1'), cell('#| slow\nfit()'),
                     cell('#|eval: false\nboom()'), cell('#| hide\nimport nbdev; nbdev.nbdev_export()'), cell('#| export\ny = 2')])
    (src/'t.ipynb').write_text(json.dumps(nb))
    out = json.loads(lab_copy(src/'t.ipynb', tmp_path, skip_flags={'slow', 'notest'}).read_text())
    test_src = [''.join(c['source']) for c in out['cells']]
    assert test_src == ['# T', 'x = 1', '#| export\ny = 2']
    assert all(c['outputs'] == [] and c['execution_count'] is None for c in out['cells'] if c['cell_type'] == 'code')
    assert out['metadata']['kernelspec']['name'] == 'python3' and 'widgets' not in out['metadata']
    with pytest.raises(ValueError): lab_copy(src/'missing.ipynb', tmp_path)

def test_fixture_notebook_has_a_widget():
    nb = json.loads((ROOT/'tests'/'lab_fixture.ipynb').read_text())
    src = '\n'.join(''.join(c['source']) for c in nb['cells'])
    assert 'FigureWidget' in src and 'IntSlider' in src and nb['metadata']['kernelspec']['name'] == 'python3'

def test_start_lab_rejects_bad_arguments(tmp_path):
    with pytest.raises(TypeError): lab.start_lab(home=3)
    with pytest.raises(ValueError): lab.start_lab(home=tmp_path, root_dir=tmp_path/'nope')
    with pytest.raises(ValueError): lab.start_lab(home=tmp_path, port=70000)
    with pytest.raises(TypeError): lab.start_lab(home=tmp_path, token=None)
    with pytest.raises(ValueError): lab.start_lab(home=tmp_path, idle_shutdown=0)
    with pytest.raises(TypeError): lab.write_overrides(tmp_path, {'plugin': 1})


@pytest.mark.parametrize('how', ['SIGINT to the group (Ctrl-C)', 'SIGTERM to make'])
def test_make_lab_stops_everything(tmp_path, how):
    "`make lab` stopped by Ctrl-C or SIGTERM leaves no JupyterLab server and no kernel running."
    import signal, subprocess, urllib.request, psutil
    port, token = lab.free_port(), 'test-token-123'
    env = lab.lab_env(tmp_path/'home', dict(WORKBENCH_LAB_PORT=str(port), WORKBENCH_LAB_TOKEN=token))
    p = subprocess.Popen(['make', '-s', 'lab'], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        url, t0 = f'http://127.0.0.1:{port}', time.time()
        while time.time() - t0 < 120:
            try:
                if urllib.request.urlopen(f'{url}/lab?token={token}', timeout=2).status == 200: break
            except OSError: time.sleep(0.5)
        else: pytest.fail('make lab did not start JupyterLab in 120 s')
        hdr = {'Authorization': f'token {token}', 'Content-Type': 'application/json'}
        k = json.load(urllib.request.urlopen(urllib.request.Request(f'{url}/api/kernels', data=b'{}', headers=hdr, method='POST'), timeout=30))
        time.sleep(2)
        procs = psutil.Process(p.pid).children(recursive=True)
        assert any('jupyter' in ' '.join(x.cmdline()) for x in procs) and any('ipykernel' in ' '.join(x.cmdline()) for x in procs), k
        if how.startswith('SIGINT'): os.killpg(p.pid, signal.SIGINT)      # what a terminal's Ctrl-C does
        else: os.kill(p.pid, signal.SIGTERM)                              # make forwards SIGTERM to its child
        out, _ = p.communicate(timeout=60)
        gone, alive = psutil.wait_procs(procs, timeout=20)
        assert not alive, f"still running after {how}: {[(x.pid, x.cmdline()) for x in alive]}\n{out[-2000:]}"
        with pytest.raises(OSError): urllib.request.urlopen(f'{url}/lab', timeout=2)
        assert 'shutting down the kernels and JupyterLab' in out, out[-2000:]
    finally:
        if p.poll() is None: os.killpg(p.pid, signal.SIGKILL)
