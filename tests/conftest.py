"Session-scoped fixtures for the whole suite (see workbench.testing)."
import os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('PLOTLY_RENDERER', 'plotly_mimetype')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
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
