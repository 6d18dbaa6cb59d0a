"""Every notebook executes top to bottom in quick mode (`#| slow` cells skipped), one test per notebook, each in a fresh
process. A method notebook's quick run (`res = run_experiment(cfg)`) is the method's one quick run in the suite: the
harness saves it, and the tests after the notebooks check it against the method module's experiment API.

The notebooks start in the background as soon as the suite is collected: one at a time while the rest of the suite
runs (tests/conftest.py queues them and moves this file's tests to the end), then `JOBS` at a time once the suite
waits for them (default: 2, or 1 on a one-core machine; `WORKBENCH_TEST_JOBS=N` sets it), each with its share of the
cores as torch threads. Most of a quick notebook, and most of the other tests, is single-threaded Python, so the two
cores each carry one of the two streams (measured: 4 notebooks, 93 s one by one, 49 s two at a time). Each
notebook's own time is listed after the last test of this file."""
import atexit, contextlib, os, queue, shutil, signal, subprocess, sys, tempfile, threading, time
from concurrent.futures import Future
from pathlib import Path
import pytest
from conftest import ROOT, BIN
from workbench.core import Results, VERDICTS, load_results, save_results
from workbench.registry import METHODS, experiment_api, is_built

NBS = sorted(p for p in (ROOT/'nbs').rglob('*.ipynb')
             if not p.name.startswith('_') and '.ipynb_checkpoints' not in p.parts)
PLATFORM = {'kvcache': ('workbench.inference.kvcache', 'inference/00_kvcache.ipynb')}   # platform notebooks with an experiment
QUICK = {**{s: (m.module, m.notebook) for s, m in METHODS.items() if is_built(m)}, **PLATFORM}

JOBS = max(1, int(os.environ.get('WORKBENCH_TEST_JOBS') or min(2, os.cpu_count() or 1)))   # notebooks at once
THREADS = max(1, (os.cpu_count() or 1) // JOBS)                                              # torch threads each
TIMEOUT = 1200                                                                                # seconds per notebook

# the quick runs land here, removed at exit; set WORKBENCH_QUICK_OUT to keep them (the harness reads it, the library does not)
QUICK_OUT = Path(os.environ.get('WORKBENCH_QUICK_OUT') or tempfile.mkdtemp(prefix='workbench-quick-'))
if not os.environ.get('WORKBENCH_QUICK_OUT'): atexit.register(shutil.rmtree, QUICK_OUT, True)

# `nbdev-test NOTEBOOK` in this process, then every quick-mode `Results` the notebook's namespace holds (`res` first)
# is saved to the folder in argv[2]
RUNNER = r'''
import sys
import nbdev.test as nt
shells = []
class _Shell(nt.CaptureShell):
    def __init__(self, *a, **k): super().__init__(*a, **k); shells.append(self)
nt.CaptureShell = _Shell
nb, out = sys.argv[1], sys.argv[2]
sys.argv = ['nbdev-test', nb]
nt.nbdev_test(path=nb)                             # prints 'Success.' or exits 1
from workbench.core import Results, save_results
ns = shells[-1].user_ns if shells else {}
found = {}
for v in [ns.get('res'), *ns.values()]:
    if isinstance(v, Results) and v.mode == 'quick': found.setdefault(v.method, v)
for r in found.values(): print(f'quick run of {r.method}: {save_results(r, out)}')
'''


def _run(nb: Path) -> tuple:
    "(passed, seconds, log) of `nb` in quick mode in a fresh process of its own process group."
    env = dict(os.environ, WORKBENCH_MODE='quick', HF_HUB_OFFLINE='1', PLOTLY_RENDERER='plotly_mimetype')
    env.setdefault('OMP_NUM_THREADS', str(THREADS))
    py = BIN/'python' if (BIN/'python').exists() else Path(sys.executable)
    QUICK_OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    p = subprocess.Popen([str(py), '-c', RUNNER, str(nb), str(QUICK_OUT)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)   # its own process group: a timeout stops the workers it forked too
    _live.add(p.pid)
    try: out, err = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL); out, err = p.communicate(); err += f'\n(stopped after {TIMEOUT} s)'
    finally:
        with contextlib.suppress(ProcessLookupError): os.killpg(p.pid, signal.SIGKILL)   # whatever it left running
        _live.discard(p.pid)
    return p.returncode == 0 and 'Success' in out + err, time.time() - t0, f"{out[-6000:]}\n{err[-6000:]}"


_runs, _todo, _live, _workers = {}, queue.Queue(), set(), []

def _work():
    while True:
        nb, fut = _todo.get()
        if not fut.set_running_or_notify_cancel(): continue
        try: fut.set_result(_run(nb))
        except BaseException as e: fut.set_exception(e)

def _workers_up_to(n: int):
    "Daemon threads working the queue in order: at least `n` (at most JOBS) of them from now on."
    while len(_workers) < min(n, JOBS):
        _workers.append(t := threading.Thread(target=_work, daemon=True, name=f'notebooks-{len(_workers)}')); t.start()

def _submit(nb: Path, workers: int = 1) -> Future:
    "The run of `nb`, queued once per session."
    _workers_up_to(workers)
    if nb not in _runs: _runs[nb] = Future(); _todo.put((nb, _runs[nb]))
    return _runs[nb]

def queue_in_background(items):
    "Queue the notebooks that the selected `items` of this file need, in their order, on one background worker (tests/conftest.py calls this after collection)."
    for item in items:
        ps = getattr(getattr(item, 'callspec', None), 'params', {})
        if 'nb' in ps or 'slug' in ps: _submit(ps['nb'] if 'nb' in ps else ROOT/'nbs'/QUICK[ps['slug']][1])

def run_notebook(nb: Path) -> tuple:
    "(passed, seconds, log) of `nb` in quick mode: run once per session, whichever test asks first; while a test waits, JOBS run at once."
    return _submit(nb, workers=JOBS).result()

@atexit.register
def _stop_running():
    for pid in list(_live):                               # an interrupted session leaves no notebook running
        with contextlib.suppress(ProcessLookupError): os.killpg(pid, signal.SIGKILL)


@pytest.fixture(scope='module', autouse=True)
def _notebooks_in_order(request):
    "Queue the notebooks this file's selected tests need (if conftest has not), JOBS at once from now on; list their own times at the end."
    queue_in_background([i for i in request.session.items if i.path == request.path])
    _workers_up_to(JOBS)
    yield
    done = sorted(((f.result()[1], nb) for nb, f in _runs.items() if f.done() and not f.exception()), reverse=True)
    tr, cm = (request.config.pluginmanager.get_plugin(n) for n in ('terminalreporter', 'capturemanager'))
    if tr and done:
        with cm.global_and_fixture_disabled() if cm else contextlib.nullcontext():
            tr.write_line(f"\nnotebooks in quick mode, one at a time beside the suite, then {JOBS} at a time, {THREADS} torch thread(s) each: "
                          f"{sum(t for t, _ in done):.0f} s of runs")
            for t, nb in done: tr.write_line(f"{t:8.1f}s  {nb.relative_to(ROOT)}")


@pytest.mark.parametrize('nb', NBS, ids=[str(p.relative_to(ROOT/'nbs')) for p in NBS])
def test_notebook_runs_in_quick_mode(nb):
    ok, took, log = run_notebook(nb)
    print(f'{nb.relative_to(ROOT)}: {took:.1f} s')
    assert ok, f"{nb.name} failed after {took:.0f} s:\n{log}"


# ---- the notebooks' quick runs against the modules' experiment API ---------------------------------------------------

@pytest.mark.parametrize('slug', list(QUICK))
def test_quick_run_matches_the_module_api(slug, tmp_path):
    """The notebook's quick run (the one `test_notebook_runs_in_quick_mode` made, or made now) is `run_experiment` on the
    module's default quick config: rows come back, the module's `verdict` recomputes the recorded verdict, and the
    config is `config(mode='quick')`. (The module's own functions resolve every global: tests/test_experiments.py.)"""
    module, nb = QUICK[slug]
    api = experiment_api(module)
    ok, _, log = run_notebook(ROOT/'nbs'/nb)
    assert ok, f"nbs/{nb} failed in quick mode (see its notebook test):\n{log[-2000:]}"
    assert (QUICK_OUT/f'{slug}.json').is_file(), f"nbs/{nb} ran but holds no quick-mode Results of {slug!r} (`res = run_experiment(cfg)`)"
    r = load_results(slug, QUICK_OUT)
    assert r.mode == 'quick' and len(r.rows) > 0 and r.verdict in VERDICTS, (r.mode, len(r.rows), r.verdict)   # a quick run may be too small: untestable
    assert api.verdict(r) == r.verdict, f'{slug}: verdict(quick run) = {api.verdict(r)!r}, recorded {r.verdict!r}'
    ref = Results(slug, api.config(mode='quick'), r.rows, seeds=r.seeds, claims=r.claims, verdict=r.verdict)
    want = load_results(slug, save_results(ref, tmp_path).parent).config             # through JSON, as the run's config was
    resolved = set(getattr(api.config, 'resolved_fields', ()))                      # fields a run resolves against its model (CoS's layers)
    assert resolved <= set(r.config), sorted(resolved - set(r.config))
    got, want = ({k: v for k, v in c.items() if k not in resolved} for c in (r.config, want))
    assert got == want, {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
