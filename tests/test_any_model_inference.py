"""MorphKV and CoS on a model of the user's choice (issue 39, sections 3 and 6): each quick experiment on tiny models of two
architectures (`workbench.testing.tiny_folder`), the model field's checks, layers read from the model, and the device checks."""
import functools, importlib
import pytest
from test_any_model import fake_device, _DEV  # noqa: F401  (the fixture, shared)

# The tiny folders are random 4-block models (Qwen2 with SmolLM2's tokenizer, Gemma-3 with Gemma-3's 262k tokenizer, three
# sliding-window layers and one full-attention layer). Small overrides keep each run to seconds on one thread.
_MORPHKV_TINY = dict(prompt_tokens=48, response_tokens=4, windows=(2,), snapkv_window=4, fact_after=1, speed_steps=1, heldout_tokens=2,
                     heldout_evict=1)
_COS_TINY = dict(keep_layers=(0, -1), n_rep=2, n_mc=10, n_real=50)     # M_q: the first and the last of the 4 blocks


def _api(module):
    from workbench.registry import experiment_api
    return experiment_api(module)


@pytest.mark.parametrize('arch', ['qwen2', 'gemma3'])
def test_morphkv_runs_on_a_tiny_model(arch):
    "Every part of the quick run (references, held-out choice of R, replays, controls, speed); kvpress peers on Qwen2 only (see below)."
    from workbench.testing import tiny_folder
    api, folder = _api('workbench.inference.morphkv'), tiny_folder(arch)
    res = api.run_experiment(api.config(mode='quick', model=folder, **_MORPHKV_TINY, **({'presses': ()} if arch == 'gemma3' else {})))   # kvpress: see the next test
    assert len(res.rows) and res.config['model'] == folder
    assert res.notes.startswith(f"{folder} fp32 on CPU") and res.headline.startswith(f"on {folder}, ")
    assert {'morphkv-sum', 'morphkv-max', 'snapkv', 'full'} <= set(res.df.policy)
    if arch == 'qwen2': assert {'kvpress-snapkv', 'kvpress-knorm'} <= set(res.df.policy)


def test_morphkv_kvpress_peers_refuse_sliding_window_layers():
    "kvpress compresses every layer of a Gemma3ForCausalLM, sliding-window ones too: a one-line error before any work."
    from workbench.testing import tiny_folder
    api = _api('workbench.inference.morphkv')
    with pytest.raises(ValueError, match=r'3 sliding-window layers .*presses=\(\)'):
        api.run_experiment(api.config(mode='quick', model=tiny_folder('gemma3'), **_MORPHKV_TINY))


@pytest.mark.parametrize('arch', ['qwen2', 'gemma3'])
def test_cos_runs_on_a_tiny_model(arch):
    "M_p a tiny model of each architecture, M_q its copy keeping the first and the last block, briefly distilled; results name the model."
    from workbench.testing import tiny_folder
    api, folder = _api('workbench.inference.cos'), tiny_folder(arch)
    res = api.run_experiment(api.config(mode='quick', model=folder, **_COS_TINY))
    assert len(res.rows) and res.config['model'] == folder and list(res.config['keep_layers']) == [0, 3]   # resolved: what ran
    assert f"M_p {folder} (4 layers" in res.notes and f"{folder} with a 2-layer copy" in res.headline
    assert set(res.df['mode']) >= {'standard', 'sd', 'cos', 'ours', 'hf', 'exact_toy', 'exact_real', 'draft'}


def test_cos_layers_come_from_the_model():
    "Kept layers are resolved against the loaded model's depth: the default is the first 4 and the last 2, SmolLM2's 0-3, 28, 29."
    from workbench.testing import tiny_folder
    from workbench.inference.cos import KEEP, CoSConfig, resolve_layers, run_experiment
    assert resolve_layers(KEEP, 30) == (0, 1, 2, 3, 28, 29) and resolve_layers(KEEP, 18) == (0, 1, 2, 3, 16, 17)
    folder = tiny_folder('qwen2')
    with pytest.raises(ValueError, match='layer 7 is out of range: .* has 4 blocks'): run_experiment(CoSConfig(mode='quick', model=folder, keep_layers=(0, 7)))
    with pytest.raises(ValueError, match='distinct layers'): run_experiment(CoSConfig(mode='quick', model=folder))   # 4 + 2 of 4 blocks overlap
    with pytest.raises(ValueError, match='keep_layers'): CoSConfig(mode='quick', keep_layers=())


def test_smollm2_keeps_its_cache_keys():
    "The default run's cached units keep their keys: MorphKV names another model in each unit's key only; CoS records the resolved layers."
    from workbench.core import _unit_config
    from workbench.inference.cos import KEEP, resolve_layers
    from workbench.inference.morphkv import MorphKVConfig
    assert 'model' not in _unit_config(MorphKVConfig(mode='full'))
    assert list(resolve_layers(KEEP, 30)) == [0, 1, 2, 3, 28, 29]                         # the committed run's keep_layers


@pytest.mark.parametrize('module', ['workbench.inference.morphkv', 'workbench.inference.cos'])
def test_model_field_is_checked(module):
    api = _api(module)
    with pytest.raises(ValueError, match='unknown model'): api.config(mode='quick', model='no-such-model')
    with pytest.raises(ValueError, match='pretrained'): api.config(mode='quick', model='tiny-llama')
    with pytest.raises(TypeError, match='model must be a str'): api.config(mode='quick', model=3)
    assert api.config(mode='quick').model == 'smollm2-135m'


@pytest.mark.parametrize('module', ['workbench.inference.morphkv', 'workbench.inference.cos'])
def test_inputs_follow_the_model_device(module, fake_device, monkeypatch, tmp_path):
    "A small quick run on the fake accelerator (tiny Qwen2, kvpress peers and the draft's distillation included): no op mixes device and host tensors."
    import workbench.core
    from workbench.testing import tiny_folder
    api, mod, folder = _api(module), importlib.import_module(module), tiny_folder('qwen2')
    fake_device.modules(mod, importlib.import_module('workbench.inference.kvcache'))
    # `a.expand_as(b)` reads only b's shape (transformers' assisted generation expands a host arange so): no mixed op on a GPU
    monkeypatch.setattr(type(fake_device), 'MIXED_OK', type(fake_device).MIXED_OK | {'expand_as'})
    if module.endswith('morphkv'):
        mod._model.cache_clear(); kw = _MORPHKV_TINY                                     # a model loaded before sits on the host
    else:
        monkeypatch.setattr(mod, '_MODELS', {}); monkeypatch.setattr(mod, '_PAIR', {}); kw = _COS_TINY
        monkeypatch.setattr(workbench.core, 'cached', functools.partial(workbench.core.cached, cache_dir=tmp_path))   # distil here, not read from disk
    try: api.run_experiment(api.config(mode='quick', model=folder, **kw))
    finally:
        if module.endswith('morphkv'): mod._model.cache_clear()
    assert fake_device.on_dev, "nothing ran on the fake device"
    assert not fake_device.errors, sorted(set(fake_device.errors))[:5]
