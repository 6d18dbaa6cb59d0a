"""The docs site: it builds offline, loads nothing from the network, shows rendered plotly figures and math in a
real browser (Debian's headless Chromium), and README.md is in sync with `nbs/index.ipynb`."""
import json, os, re, shutil, signal, socket, subprocess, sys, time, urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT/'tools'/'build_docs.py'

# a tag that makes the browser fetch something: its src/href/data/srcset points off the machine
EXTERNAL_TAG = re.compile(r'<(script|link|img|iframe|source|audio|video|embed|object|track|image|use)\b[^>]*?'
                          r'\b(src|href|data|srcset|xlink:href)\s*=\s*["\']?\s*(https?:)?//', re.I)
# CSS that fetches a font, image or stylesheet from off the machine
EXTERNAL_CSS = re.compile(r'(url\(\s*["\']?\s*(https?:)?//|@import\s+["\']\s*(https?:)?//)', re.I)
PLOTLY_DIV = re.compile(r'class="plotly-graph-div"')
MATH_NODE = re.compile(r'<(span|div) class="math[ "]')


def _chromium():
    return shutil.which('chromium') or shutil.which('chromium-browser') or shutil.which('google-chrome')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]


def _kill(p):
    "Stop a process we started, and the process group it leads."
    if p is None or p.poll() is not None: return
    try: os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError: return
    try: p.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL); p.wait(10)


@pytest.fixture(scope='session')
def docs(tmp_path_factory):
    "The site, built from scratch into a temporary folder (with its README beside it, not over README.md)."
    d = tmp_path_factory.mktemp('docs')
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(BUILD), '--out', str(d/'site'), '--stage', str(d/'stage'),
                        '--readme', str(d/'README.md')], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    secs = time.perf_counter() - t0
    assert r.returncode == 0, f"tools/build_docs.py failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    print(f"docs build: {secs:.1f} s")
    return {'site': d/'site', 'readme': d/'README.md', 'tmp': d, 'log': r.stdout}


def test_external_patterns_catch_requests():
    "The scanners below would see an external script, stylesheet, font or image (so their silence means something)."
    assert EXTERNAL_TAG.search('<script src="https://cdn.jsdelivr.net/npm/mathjax@4/tex-chtml.js"></script>')
    assert EXTERNAL_TAG.search("<link rel='stylesheet' href='//fonts.googleapis.com/css?family=Lato'>")
    assert EXTERNAL_TAG.search('<img class="x" src=http://example.com/a.png>')
    assert not EXTERNAL_TAG.search('<a href="https://github.com/x">x</a> <script src="_static/plotly.min.js"></script>')
    assert EXTERNAL_CSS.search("@font-face{src:url('https://fonts.gstatic.com/a.woff2')}")
    assert EXTERNAL_CSS.search('@import "https://example.com/a.css";')
    assert not EXTERNAL_CSS.search('src: url("../webfonts/fa-solid-900.woff2")')


def test_site_loads_nothing_from_the_network(docs):
    site = docs['site']
    pages = sorted(site.rglob('*.html'))
    assert (site/'index.html').is_file(), "the site has no index.html"
    bad = []
    for p in pages:
        t = p.read_text(encoding='utf-8', errors='replace')
        bad += [f"{p.relative_to(site)}: {m.group(0)[:120]}" for m in EXTERNAL_TAG.finditer(t)]
        bad += [f"{p.relative_to(site)}: {m.group(0)}" for m in EXTERNAL_CSS.finditer(t)]
        if re.search(r'require(\.min)?\.js', t): bad.append(f"{p.relative_to(site)}: loads require.js (breaks plotly.js)")
    for p in sorted(site.rglob('*.css')):
        bad += [f"{p.relative_to(site)}: {m.group(0)}" for m in EXTERNAL_CSS.finditer(p.read_text(errors='replace'))]
    assert not bad, "the site fetches from off the machine:\n" + '\n'.join(bad[:30])
    # MathJax 3 and plotly.js are served from the site itself
    mj = site/'_static'/'mathjax'/'tex-chtml.js'
    assert mj.is_file() and re.search(r'VERSION="3\.', mj.read_text(errors='replace')), "no local MathJax 3 in _static/mathjax"
    assert (site/'_static'/'mathjax'/'output'/'chtml'/'fonts'/'woff-v2').is_dir(), "MathJax's fonts are missing"
    assert (site/'_static'/'plotly.min.js').stat().st_size > 1_000_000, "no local plotly.js in _static"
    for p in pages:
        t = p.read_text(encoding='utf-8', errors='replace')
        if MATH_NODE.search(t):
            assert '_static/mathjax/tex-chtml.js' in t, f"{p.relative_to(site)} has math but not the local MathJax"
        if PLOTLY_DIV.search(t):
            assert '_static/plotly.min.js' in t.split('</head>')[0], \
                f"{p.relative_to(site)}: plotly.js must load in <head>, before any inline Plotly.newPlot"


def test_readme_in_sync(docs):
    fresh = docs['readme'].read_text(encoding='utf-8')
    assert fresh.strip(), "the README generated from nbs/index.ipynb is empty"
    current = (ROOT/'README.md').read_text(encoding='utf-8') if (ROOT/'README.md').is_file() else ''
    assert current == fresh, ("README.md is out of date with nbs/index.ipynb (or data/results/*.json): run `make docs` "
                              "to regenerate it")


def _figure_math_page(site: Path) -> Path:
    "The first built page (by path) holding both a plotly figure and math."
    for p in sorted(site.rglob('*.html')):
        t = p.read_text(encoding='utf-8', errors='replace')
        if PLOTLY_DIV.search(t) and MATH_NODE.search(t): return p
    pytest.fail("no built page holds both a plotly figure and $-math, so the browser check has nothing to look at; "
                "nbs/05_viz.ipynb (plotly figures via the plotly_mimetype renderer, and LaTeX math) should be one")


def _visible_text(dom: str) -> str:
    "The text a reader sees: no scripts, styles, code blocks, rendered math or SVG, no tags."
    for tag in ('script', 'style', 'pre', 'code', 'mjx-container', 'svg', 'textarea'):
        dom = re.sub(rf'<{tag}\b.*?</{tag}>', ' ', dom, flags=re.S | re.I)
    return re.sub(r'<[^>]+>', ' ', dom)


def _page_requests(netlog: Path, origin: str) -> list[str]:
    "URLs the page itself asked for (initiator = the page's origin), from Chromium's net log."
    text = netlog.read_text(errors='replace').rstrip().rstrip(',')
    try: events = json.loads(text)['events']
    except json.JSONDecodeError: events = json.loads(text + ']}')['events']   # a log cut short at exit
    by_source = {}
    for e in events:
        p = e.get('params') or {}
        s = by_source.setdefault(e.get('source', {}).get('id'), {})
        if 'url' in p: s.setdefault('url', p['url'])
        if 'initiator' in p: s['initiator'] = p['initiator']
    return sorted({s['url'] for s in by_source.values() if s.get('initiator') == origin and 'url' in s})


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_plotly_and_math_render_in_chromium(docs, tmp_path):
    chromium = _chromium()
    if chromium is None:
        if os.environ.get('CI'): pytest.fail("chromium is missing under CI: run `bash tools/setup.sh --browser`")
        pytest.skip("chromium is not installed (run `bash tools/setup.sh --browser`); CI is unset, so skipping")
    site = docs['site']
    page = _figure_math_page(site)
    static = page.read_text(encoding='utf-8')
    n_math = len(MATH_NODE.findall(static))
    port = _free_port()
    origin = f'http://127.0.0.1:{port}'
    url = f'{origin}/{page.relative_to(site).as_posix()}'
    home = tmp_path/'home'
    for d in ('config', 'cache', 'data', 'ud'): (home/d).mkdir(parents=True)
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home/'config'), XDG_CACHE_HOME=str(home/'cache'),
               XDG_DATA_HOME=str(home/'data'))
    server = browser = None
    log = tmp_path/'http.log'
    try:
        server = subprocess.Popen([sys.executable, '-m', 'http.server', '--bind', '127.0.0.1', '--directory', str(site),
                                   str(port)], stdout=subprocess.DEVNULL, stderr=open(log, 'w'), start_new_session=True)
        for _ in range(100):
            try:
                urllib.request.urlopen(f'{origin}/index.html', timeout=2).close(); break
            except OSError: time.sleep(0.1)
        else: pytest.fail(f"http.server did not answer on {origin}: {log.read_text()[-2000:]}")
        netlog = tmp_path/'net.json'
        t0 = time.perf_counter()
        browser = subprocess.Popen(
            [chromium, '--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
             '--disable-component-update', '--disable-sync', '--no-first-run', f'--user-data-dir={home/"ud"}',
             # anything off the machine fails (loopback bypasses the proxy), and every request is logged
             '--proxy-server=http://127.0.0.1:9', f'--log-net-log={netlog}', '--enable-logging=stderr', '--v=0',
             '--virtual-time-budget=10000', '--dump-dom', url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        dom, err = browser.communicate(timeout=180)
        secs = time.perf_counter() - t0
    finally:
        _kill(browser); _kill(server)
    where = f"{page.relative_to(site)} in Chromium ({secs:.1f} s)"
    assert dom.strip(), f"Chromium dumped no DOM for {url}:\n{err[-3000:]}"
    # plotly drew the figure: its SVG and its mode bar exist only after Plotly.newPlot ran
    drawn, modebar = '<svg class="main-svg"' in dom, 'class="modebar' in dom
    assert drawn, f"no plotly SVG on {where}: plotly.js did not draw the figure"
    assert modebar, f"no plotly modebar on {where}"
    # MathJax typeset every formula, and no TeX source is left in the visible text
    n_mjx = dom.count('<mjx-container')
    assert n_mjx >= n_math > 0, f"{n_math} math nodes but {n_mjx} <mjx-container> on {where}: MathJax did not typeset"
    raw = re.findall(r'\\\(.{0,40}|\\\[.{0,40}|\$\$.{0,40}|\$[^$\s<>][^$<>]{0,80}\$', _visible_text(dom))
    assert not raw, f"raw TeX left on {where}: {raw[:5]}"
    console = [l for l in err.splitlines() if 'CONSOLE' in l and re.search(r'Uncaught|Error', l)]
    assert not console, f"JavaScript errors on {where}:\n" + '\n'.join(console[:10])
    # every request the page made went to this server, including MathJax's fonts and plotly.js
    reqs = _page_requests(netlog, origin)
    off = [u for u in reqs if not u.startswith(origin + '/')]
    assert not off, f"{where} requested from off the machine: {off[:10]}"
    assert any('/_static/plotly.min.js' in u for u in reqs), f"plotly.js was not loaded from the site: {reqs}"
    assert any('/_static/mathjax/output/chtml/fonts/' in u for u in reqs), f"MathJax's fonts were not loaded locally: {reqs}"
    n_svg = dom.count('<svg class="main-svg"')
    print(f"rendered {where}: {n_mjx} formulas, {n_svg} plot SVGs, {len(reqs)} local requests")
