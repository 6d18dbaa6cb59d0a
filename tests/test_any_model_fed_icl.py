"""Fed-ICL on a model of the user's choice (issue 39, sections 3 and 6): the quick experiment on tiny Qwen2 and Gemma-3 folders
(`workbench.testing.tiny_folder`), the model field's checks, what the method needs of a model, and the device of every input."""
import pytest
import torch
from test_any_model import fake_device, _DEV  # noqa
from workbench.collaboration import fed_icl as fi

# Sizes small enough for a tiny model on one thread; TF-IDF retrieval (no MiniLM load). FanOutQA is not installed here, so two
# made-up dev questions stand in for its file: the closed-book unit runs, with the chat template or plain text as the tokenizer has.
TINY = dict(backend='tfidf', n_topics=2, n_entities=3, n_queries=3, rounds=2, fanout_n=1, fanout_tokens=3)
FAKE_DEV = [dict(id=f'q{i}', question=f'Which river is longer, the {a} or the {b}?', answer=a, decomposition=[], evidence=None)
            for i, (a, b) in enumerate([('Nile', 'Rhine'), ('Amazon', 'Thames')])]


@pytest.fixture
def chats(monkeypatch):
    "Fake FanOutQA dev questions; yields the `chat` flag of every generate call the run makes."
    calls, gen = [], fi.generate
    monkeypatch.setattr(fi, 'fanoutqa_dev', lambda: FAKE_DEV)
    monkeypatch.setattr(fi, 'generate', lambda *a, **kw: calls.append(kw.get('chat')) or gen(*a, **kw))
    return calls


@pytest.mark.parametrize('arch', ['qwen2', 'gemma3'])
def test_fed_icl_runs_on_a_tiny_model(arch, chats):
    "The quick experiment end to end; config, notes and headline name the folder; LoRA bytes and chat template come from the model."
    from workbench.testing import tiny_folder
    folder = tiny_folder(arch)
    res = fi.run_experiment(fi.FedICLConfig(mode='quick', model=folder, **TINY))
    assert len(res.rows) and {'zero_shot', 'single', 'gt', 'ub', 'fed', 'free', 'fuse'} <= set(res.df.method)
    assert res.config['model'] == folder and f"LM is {folder}." in res.notes and res.headline.startswith(f"{folder}, accuracy")
    assert 'SmolLM2' not in res.notes + res.headline
    S, n_cl = fi.load_scorer(folder), int(res.table('units').n_clients.iloc[0])                  # the run's model and tokenizer (cached)
    assert chats == [bool(S.tok.chat_template)] == [arch == 'qwen2'] and len(res.table('fanoutqa')) == 1   # gemma3 (base): plain text
    m = S.model
    per = sum(p.in_features + p.out_features for l in m.model.layers for p in (l.self_attn.q_proj, l.self_attn.v_proj))   # A and B per rank
    assert len(m.model.layers) == 4 and res.table('units').lora_bytes.iloc[0] == 2 * n_cl * 8 * per * 4   # r=8, fp32, up and down


def test_fed_icl_model_field_is_checked():
    for bad, err, msg in (('no-such-model', ValueError, 'unknown model'), ('tiny-llama', ValueError, 'pretrained'), ('', ValueError, 'model'),
                          (3, TypeError, 'model must be a str')):
        with pytest.raises(err, match=msg): fi.FedICLConfig(mode='quick', model=bad)
    with pytest.raises(ValueError, match='pretrained'): fi.load_scorer('tiny-llama')
    assert fi.FedICLConfig(mode='quick').model == 'smollm2-135m'


def test_fed_icl_headline_of_old_results_names_the_default_model():
    "A results file written before the model field existed: the headline names SmolLM2, the model those runs used."
    from test_fed_icl import _fake
    from workbench.core import Results
    r = _fake(0.3, n_seeds=2, M=6)
    old = Results('fed_icl', {k: v for k, v in r.config.items() if k != 'model'}, r.rows, seeds=r.seeds,
                  tables={k: r.table(k).to_dict('records') for k in ('comm', 'units')})
    assert 'model' not in old.config and fi.headline(old).startswith('HuggingFaceTB/SmolLM2-135M-Instruct, accuracy after')


def test_fed_icl_says_why_a_model_does_not_fit():
    "What the method needs of a model, as one-line errors: options with distinct first tokens, and q_proj/v_proj for the LoRA bytes."
    from transformers import GPT2Config, GPT2LMHeadModel
    from workbench.models import load_tokenizer
    from workbench.testing import tiny_folder
    sc = fi.MCScorer(None, load_tokenizer(tiny_folder('qwen2')))
    with pytest.raises(ValueError, match='distinct tokens'): sc.option_ids(('blue', 'bluebird', 'red', 'green'))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=16, n_positions=8))   # fused c_attn, no q_proj/v_proj
    with pytest.raises(ValueError, match=r"Linear layers named \['q_proj', 'v_proj'\]; GPT2LMHeadModel has none of them") as e:
        fi.lora_round_bytes(gpt2, 8, 3)
    assert '\n' not in str(e.value)


def test_fed_icl_inputs_follow_the_model_device(fake_device, chats):
    "A small quick run on the fake accelerator: no op mixes device and host tensors, nothing on the device goes to numpy."
    from workbench.testing import tiny_folder
    fake_device.modules(fi); fi.load_scorer.cache_clear()                           # a scorer loaded before would sit on the host
    try: fi.run_experiment(fi.FedICLConfig(mode='quick', model=tiny_folder('qwen2'), **dict(TINY, aggregations=('vote',))))
    finally: fi.load_scorer.cache_clear()
    assert chats == [True]                                                           # generate ran too (qwen2 folder: chat template)
    assert fake_device.on_dev, "nothing ran on the fake device"
    assert not fake_device.errors, sorted(set(fake_device.errors))[:5]
