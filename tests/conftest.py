"Session-scoped fixtures for the whole suite (see workbench.testing)."
import os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('PLOTLY_RENDERER', 'plotly_mimetype')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
# The suite runs as two streams on the cores: the tests in this process and, beside them, the notebooks (one at a time,
# then `WORKBENCH_TEST_JOBS` at once: tests/test_notebooks.py). Each stream gets its share of the cores as threads, set
# here before numpy and torch load (and inherited by every process a test starts). With more threads than cores, an
# OpenMP op waits for a thread the other stream has preempted: measured on 2 cores beside one busy process, EpiCoder's
# tiny run took 34 s with 2 torch threads and 9.5 s with 1 (3,852 small cross-entropy calls, 5.6 ms each at 2 threads).
# OMP_NUM_THREADS set by the caller wins.
_STREAMS = max(1, int(os.environ.get('WORKBENCH_TEST_JOBS') or min(2, os.cpu_count() or 1)))
_SHARE = str(max(1, (os.cpu_count() or 1) // _STREAMS))
for _v in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS'): os.environ.setdefault(_v, os.environ.get('OMP_NUM_THREADS', _SHARE))
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT/'.venv'/'bin'


@pytest.hookimpl(trylast=True)                      # after `-k`/`-m` deselection
def pytest_collection_modifyitems(session, config, items):
    "The notebooks' tests go last, and their notebooks start now in the background (tests/test_notebooks.py), beside the rest of the suite."
    nbs = [i for i in items if i.path.name == 'test_notebooks.py']
    if not nbs or len(nbs) == len(items): return
    items[:] = [i for i in items if i.path.name != 'test_notebooks.py'] + nbs
    nbs[0].module.queue_in_background(nbs)

@pytest.fixture(scope='session')
def root(): return ROOT

@pytest.fixture(scope='session')
def tiny():
    from workbench.testing import tiny_model
    return tiny_model()

@pytest.fixture(scope='session')
def tiny_ids():
    from workbench.testing import tiny_ids
    return tiny_ids()

@pytest.fixture(scope='session')
def smol():
    from workbench.testing import smol
    return smol()

@pytest.fixture(scope='session')
def smol_tok():
    from workbench.testing import smol_tokenizer
    return smol_tokenizer()
