"""The experiment API of every method module: results files that match the schema and whose verdicts can be
recomputed, and module functions that need nothing from their notebook. Each method's quick run happens once, in its
notebook's test; tests/test_notebooks.py checks that run against the module's `config`, `run_experiment` and `verdict`."""
import builtins, dis, importlib, inspect, json, types
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


def _global_reads(code):
    "The names `code`, and the code nested in it (lambdas, comprehensions, inner functions), reads as globals."
    for ins in dis.get_instructions(code):
        if ins.opname == 'LOAD_GLOBAL': yield ins.argval
    for c in code.co_consts:
        if isinstance(c, types.CodeType): yield from _global_reads(c)


def _functions(mod):
    "Every function written in `mod`'s file: module functions, methods, properties, and methods patched onto its classes."
    for v in list(vars(mod).values()):
        for f in (vars(v).values() if inspect.isclass(v) and v.__module__ == mod.__name__ else [v]):
            f = getattr(f, '__func__', f)
            for g in ((f.fget, f.fset, f.fdel) if isinstance(f, property) else (f,)):
                if inspect.isfunction(g) and g.__code__.co_filename == mod.__file__: yield g


@pytest.mark.parametrize('slug', BUILT + list(PLATFORM_RESULTS))
def test_module_functions_need_nothing_from_the_notebook(slug):
    """Every global a module function reads is defined in the module (or a builtin): nothing leans on a name that only a
    non-exported notebook cell defines. The notebook runs the same code with its whole namespace; such a name is what
    would make the module's own run differ from the notebook's."""
    mod = importlib.import_module(METHODS[slug].module if slug in METHODS else PLATFORM_RESULTS[slug])
    fs = list(_functions(mod))
    assert fs, f'{mod.__name__}: no functions found'
    missing = sorted({f"{f.__qualname__}: {n}" for f in fs for n in _global_reads(f.__code__) if n not in f.__globals__ and not hasattr(builtins, n)})
    assert not missing, f"{mod.__name__} reads names it never defines (a non-exported notebook import?): {missing}"
