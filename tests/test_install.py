"""The package outside this repository: a wheel built from the checkout, installed into a fresh virtual environment
in a temporary folder, runs `workbench list` and a quick method there, with its results and cache folders taken from
the environment (no settings.ini, no notebooks)."""
import json, os, subprocess, sys, sysconfig
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICK_METHOD = 'bsr'   # a method whose quick run trains tiny models on data it makes (no corpora, no pretrained weights)

@pytest.fixture(scope='module')
def venv(tmp_path_factory):
    d = tmp_path_factory.mktemp('install')
    r = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q', '-w', str(d/'dist'), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    whl = next((d/'dist').glob('workbench-*.whl'))
    subprocess.run([sys.executable, '-m', 'venv', str(d/'venv')], check=True, timeout=300)
    py = d/'venv'/'bin'/'python'
    # the dependencies come from this environment's site-packages (a .pth line: offline and fast); workbench itself
    # only from the wheel (a .pth line does not run the editable-install hook that lives in that folder)
    site = Path(subprocess.check_output([str(py), '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'], text=True).strip())
    (site/'deps.pth').write_text(sysconfig.get_paths()['purelib'] + '\n')
    r = subprocess.run([str(py), '-m', 'pip', 'install', '-q', '--no-deps', '--no-index', '--force-reinstall', str(whl)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    work = d/'elsewhere'; work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith('WORKBENCH_') and k != 'PYTHONPATH'}
    from workbench.core import get_settings
    env.update(HF_HUB_OFFLINE='1', WORKBENCH_DATA_DIR=str(d/'data'), WORKBENCH_CACHE_DIR=str(get_settings().cache_path), PYTHONNOUSERSITE='1')
    return dict(py=py, bin=d/'venv'/'bin', cwd=work, env=env, data=d/'data', whl=whl)

def _run(v, *args, timeout=600):
    return subprocess.run([*args], cwd=v['cwd'], env=v['env'], capture_output=True, text=True, timeout=timeout)

def test_the_wheel_holds_the_package_data(venv):
    import zipfile
    names = zipfile.ZipFile(venv['whl']).namelist()
    assert {'workbench/methods.json', 'workbench/results.schema.json', 'workbench/core.py'} <= set(names)
    meta = next(n for n in names if n.endswith('METADATA'))
    text = zipfile.ZipFile(venv['whl']).read(meta).decode()
    assert 'License-Expression: Apache-2.0' in text and 'Requires-Dist: torch>=' in text and 'torch==' not in text
    assert any(n.endswith('licenses/LICENSE') for n in names)

def test_import_comes_from_the_wheel(venv):
    r = _run(venv, str(venv['py']), '-c', 'import workbench, workbench.core as c; print(workbench.__file__); print(c.repo_root()); print(c.get_settings().results_path)')
    assert r.returncode == 0, r.stderr
    f, root, res = r.stdout.split()
    assert str(venv['bin'].parent) in f and not f.startswith(str(ROOT))
    assert root == 'None' and res == str(venv['data']/'results')

def test_workbench_list_outside_the_checkout(venv):
    r = _run(venv, str(venv['bin']/'workbench'), 'list')
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()[2:]
    assert len(rows) == 19 and any(l.split()[0] == QUICK_METHOD for l in rows)

def test_quick_method_outside_the_checkout(venv):
    from workbench.registry import METHODS, experiment_api
    try: experiment_api(METHODS[QUICK_METHOD].module)
    except ValueError: pytest.skip(f'{QUICK_METHOD} does not offer the experiment API yet')
    r = _run(venv, str(venv['bin']/'workbench'), 'run', QUICK_METHOD, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert 'verdict:' in r.stdout and 'quick mode writes no results' in r.stdout
    r = _run(venv, str(venv['bin']/'workbench'), 'run', QUICK_METHOD, '--set', 'nonexistent_field=1')
    assert r.returncode == 2 and 'has no field' in r.stderr
