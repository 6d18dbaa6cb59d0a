"""The experiment API of every method module: results files that match the schema and whose verdicts can be
recomputed, and `run_experiment` in quick mode in a fresh process."""
import json, os, subprocess, sys
from pathlib import Path
import pytest
from workbench.core import load_results, check_results, results_schema, get_settings, Results
from workbench.registry import METHODS, experiment_api, is_built

RESULTS = sorted(get_settings().results_path.glob('*.json'))


PLATFORM_RESULTS = {'kvcache': 'workbench.inference.kvcache'}   # platform notebooks with an experiment of their own


def _api(slug):
    try: return experiment_api(METHODS[slug].module if slug in METHODS else PLATFORM_RESULTS[slug])
    except ModuleNotFoundError: return None
    except ValueError as e:
        if 'does not offer the experiment API' in str(e): return None
        raise


@pytest.mark.parametrize('path', RESULTS, ids=[p.stem for p in RESULTS])
def test_results_file_matches_the_schema(path):
    rec = json.loads(path.read_text())
    check_results(rec, path.name)
    assert rec['method'] == path.stem
    assert rec['mode'] == 'full', 'committed results are full runs'


@pytest.mark.parametrize('slug', [p.stem for p in RESULTS])
def test_recorded_verdict_is_recomputed_from_the_file(slug):
    api = _api(slug)
    r = load_results(slug)
    assert api is not None, f'{slug} has committed results but its module offers no experiment API'
    assert api.verdict(r) == r.verdict, f'{slug}: verdict(load_results) = {api.verdict(r)!r}, recorded {r.verdict!r}'
    assert r.verdict_rule and r.claims


def test_schema_is_a_valid_json_schema():
    import jsonschema
    jsonschema.Draft202012Validator.check_schema(results_schema())


BUILT = [s for s in METHODS if is_built(s)]

@pytest.mark.parametrize('slug', BUILT)
def test_run_experiment_in_quick_mode_returns_rows(slug, tmp_path):
    "A fresh process: the default config in quick mode, run_experiment, rows and a verdict come back."
    assert _api(slug) is not None, f'{slug} is built but its module offers no experiment API'
    code = (f"from workbench.registry import METHODS\nimport json\napi = METHODS[{slug!r}].api()\n"
            "cfg = api.config(mode='quick')\nres = api.run_experiment(cfg)\n"
            "print(json.dumps(dict(n=len(res.rows), mode=res.mode, verdict=res.verdict, fields=sorted(res.rows[0]))))")
    env = dict(os.environ, HF_HUB_OFFLINE='1', WORKBENCH_MODE='quick', WORKBENCH_CACHE_DIR=os.environ.get('WORKBENCH_CACHE_DIR', str(get_settings().cache_path)))
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out['n'] > 0 and out['mode'] == 'quick' and out['verdict'] in ('reproduced', 'partly', 'not reproduced')
