"Session-scoped fixtures for the whole suite (see workbench.testing)."
import os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('PLOTLY_RENDERER', 'plotly_mimetype')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT/'.venv'/'bin'

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
