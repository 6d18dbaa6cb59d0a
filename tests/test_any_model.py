"""Methods on a model of the user's choice (issue 39): each method's quick experiment on tiny models of a second
architecture (`workbench.testing.tiny_folder`), and the device checks."""
import pytest


# --- EpiCoder, VocAgnoLM, DocKS-RAG on a second architecture; the device of every input (issue 39, sections 3 and 6) ---
import contextlib
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from workbench.models import load_tokenizer

# The tiny folders are random 4-block models (Qwen2 with SmolLM2's tokenizer, Gemma-3 with Gemma-3's 262k tokenizer):
# the runs check that a method runs end to end on a model it was not written for and that its results name that model.

def _method_api(slug):
    from workbench.registry import METHODS, experiment_api
    return experiment_api(METHODS[slug].module)


_EPICODER_TINY_DOWNSTREAM = dict(n_eval_functions=4, vocab_size=260, seq_len=16, d_model=8, batch_size=2, pretrain_steps=1,
                                 ft_tokens=64, ft_steps=1, scratch_steps=0, n_curve=1)   # the downstream model at its floor: the LLM check is tested here


@pytest.mark.parametrize('arch', ['qwen2', 'gemma3'])
def test_epicoder_runs_on_a_tiny_model(arch):
    "EpiCoder's LLM check (chat template if the tokenizer has one, else plain text) on a tiny model of each architecture."
    from workbench.testing import tiny_folder
    api, folder = _method_api('epicoder'), tiny_folder(arch)
    cfg = api.config(mode='quick', model=folder, llm_samples=1, llm_tokens=8, n_modules=8, n_seed_functions=10, evolve_steps=2,
                     n_samples=4, n_seeds=2, n_humaneval=2, shapes=((2, 1, 1),), n_shape_samples=1, **_EPICODER_TINY_DOWNSTREAM)
    res = api.run_experiment(cfg)
    assert len(res.rows) and len(res.table('llm')) == 2              # one program per method (epicoder, seed_synth)
    assert res.config['model'] == folder and f"LLM generator {folder}" in res.notes


@pytest.mark.parametrize('arch', ['qwen2', 'gemma3'])
def test_vocagnolm_runs_with_a_tiny_teacher(arch):
    "VocAgnoLM with a tiny teacher of each architecture (its vocabulary differs from the student's: the method's point)."
    from workbench.testing import tiny_folder
    api, folder = _method_api('vocagnolm'), tiny_folder(arch)
    cfg = api.config(mode='quick', model=folder, n_seeds=2, n_train_docs=2, n_eval_docs=2, n_teacher_eval_docs=1, warmup_steps=2,
                     steps=3, seq_len=32, batch_size=2)
    res = api.run_experiment(cfg)
    assert len(res.rows) and set(res.df.teacher) == {'none', folder}
    assert tuple(res.config['teachers']) == (folder,) and f"teachers: {folder}" in res.notes and folder in res.headline
    t = res.table('teachers').iloc[0]
    assert t.teacher == folder and t.vocab == len(load_tokenizer(folder))


def test_vocagnolm_takes_a_second_teacher_of_another_architecture():
    "Both teacher roles filled with tiny models: Qwen2 (SmolLM2's 49k tokens) and Gemma-3 (262k tokens)."
    from workbench.testing import tiny_folder
    api, q, g = _method_api('vocagnolm'), tiny_folder('qwen2'), tiny_folder('gemma3')
    cfg = api.config(mode='quick', model=q, teacher2=g, n_seeds=2, n_train_docs=2, n_eval_docs=2, n_teacher_eval_docs=1,
                     warmup_steps=2, steps=3, seq_len=32, batch_size=2)
    assert cfg.teachers == (q, g)
    res = api.run_experiment(cfg)
    assert set(res.df.teacher) == {'none', q, g} and list(res.table('teachers').teacher) == [q, g]
    with pytest.raises(ValueError, match='differ'): api.config(mode='quick', model=q, teacher2=q)
    with pytest.raises(ValueError, match='unknown model'): api.config(mode='quick', teacher2='no-such-model')


@pytest.mark.parametrize('arch', ['qwen2', 'gemma3'])
def test_docks_rag_probes_a_tiny_model(arch):
    "DocKS-RAG's untuned-LLM probe (B4) scored by a tiny model of each architecture; notes, claims and headline name it."
    from workbench.testing import tiny_folder
    api, folder = _method_api('docks_rag'), tiny_folder(arch)
    cfg = api.config(mode='quick', model=folder, n_seeds=2, n_sweep_seeds=1, n_train=12, n_test=4, n_entities=40, kg_epochs=5,
                     epochs=3, tau_grid=(), n_probe=2)
    res = api.run_experiment(cfg)
    assert len(res.rows) and len(res.table('probe')) >= 1
    assert res.config['model'] == folder and f"{folder} probe" in res.notes and f"untuned {folder}" in res.headline
    assert any(f"untuned {folder}" in c.name for c in res.claims)


@pytest.mark.parametrize('slug', ['epicoder', 'docks_rag'])
def test_model_field_is_checked(slug):
    api = _method_api(slug)
    with pytest.raises(ValueError, match='unknown model'): api.config(mode='quick', model='no-such-model')
    with pytest.raises(ValueError, match='pretrained'): api.config(mode='quick', model='tiny-llama')
    with pytest.raises(ValueError, match='model'): api.config(mode='quick', model='')


# A fake accelerator for the device checks: tensors carry where they would live on a machine with a GPU. `get_device()` and
# `model_device(m)` (for a model moved there) answer DEV, a CPU device of its own; a tensor made without a device is on the
# host; an op whose inputs mix DEV and host tensors, or `.numpy()` of a DEV tensor, is recorded as the error a GPU would raise.
_DEV = torch.device('cpu', 0)


class _FakeDevice(TorchFunctionMode):
    FACTORIES = {'tensor', 'as_tensor', 'zeros', 'ones', 'full', 'empty', 'arange', 'rand', 'randn', 'randint', 'randperm', 'eye',
                 'linspace', 'from_numpy', 'zeros_like', 'ones_like', 'full_like', 'empty_like', 'rand_like', 'randn_like'}
    MIXED_OK = {'__getitem__', '__setitem__', 'index_put_', 'copy_', '__get__', '__set__', '__deepcopy__', '_has_compatible_shallow_copy_type'}

    def __init__(self):
        super().__init__()
        self.errors, self.on_dev = [], 0

    def _error(self, what):
        "Record `what` with the innermost workbench frame that caused it."
        import traceback
        at = [f for f in traceback.extract_stack()[:-2] if '/workbench/' in f.filename]
        self.errors.append(f"{what} at {at[-1].filename.split('/workbench/')[-1]}:{at[-1].lineno}" if at else what)

    @staticmethod
    def where(t):
        w = getattr(t, '_fake_dev', None)
        return False if w is None and isinstance(t, torch.nn.Parameter) else w     # a parameter never moved is on the host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, name = kwargs or {}, getattr(func, '__name__', '')
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        where = [self.where(t) for t in ins]
        big = [w for t, w in zip(ins, where) if t.dim() > 0]                          # 0-dim host tensors mix freely, as on a GPU
        if name not in self.MIXED_OK and True in big and False in big: self._error(f"{name}: inputs on the device and the host")
        if name in ('numpy', '__array__') and True in where: self._error(f"{name} of a tensor on the device")
        out = func(*args, **kwargs)
        if name == '__get__' and getattr(getattr(func, '__self__', None), '__name__', '') == 'device':
            return _DEV if where and where[0] is True else out                       # `x.device` names x's fake device
        if name == '__set__' and len(ins) == 2:                                       # `param.data = moved`
            ins[0]._fake_dev = self.where(ins[1])
            return out
        if name in ('to', 'cpu'):
            devs = [a for a in (*args[1:], kwargs.get('device')) if isinstance(a, (torch.device, str, torch.Tensor))]
            d = devs[0] if devs else None
            mark = False if name == 'cpu' else (self.where(d) if isinstance(d, torch.Tensor) else torch.device(d) == _DEV) if devs \
                else (where[0] if where else None)
        elif kwargs.get('device') is not None: mark = torch.device(kwargs['device']) == _DEV
        elif name in self.FACTORIES and not ins: mark = False                           # made from python data: the host
        else: mark = True if True in where else False if False in where else None
        for o in tree_leaves(out):
            if isinstance(o, torch.Tensor) and mark is not None:
                with contextlib.suppress(AttributeError, RuntimeError): o._fake_dev = mark
                self.on_dev += bool(mark)
        return out


@pytest.fixture
def fake_device(monkeypatch):
    "Patch the device of the platform and of the modules named later (`fd.modules(...)`); yield the recording mode."
    import accelerate, workbench.core, workbench.models, workbench.train
    md = lambda m: _DEV if any(getattr(p, '_fake_dev', None) for p in m.parameters()) else torch.device('cpu')
    def patch(*mods):
        for mod in mods:
            if hasattr(mod, 'get_device'): monkeypatch.setattr(mod, 'get_device', lambda: _DEV)
            if hasattr(mod, 'model_device'): monkeypatch.setattr(mod, 'model_device', md)
    patch(workbench.core, workbench.models, workbench.train)
    monkeypatch.setattr(accelerate.Accelerator, 'device', property(lambda self: _DEV))   # `train` moves models and batches there
    copy_param = torch.nn.Parameter.__deepcopy__
    def deepcopy_param(self, memo):                                                # a copied model stays where it was
        out = copy_param(self, memo)
        with contextlib.suppress(AttributeError): out._fake_dev = self._fake_dev
        return out
    monkeypatch.setattr(torch.nn.Parameter, '__deepcopy__', deepcopy_param)
    fd = _FakeDevice()
    fd.modules = patch
    with fd: yield fd


def test_the_fake_device_catches_misplaced_inputs(fake_device):
    "The check itself can fail: ids left on the host, and a model left on the host, are both recorded."
    from workbench.models import load_model
    from workbench.testing import tiny_folder
    m = load_model(tiny_folder('qwen2'))
    m(torch.tensor([[1, 2, 3]], device=_DEV))
    assert not fake_device.errors and fake_device.on_dev
    m(torch.tensor([[1, 2, 3]]))
    assert any('embedding' in e for e in fake_device.errors)
    fake_device.errors.clear()
    load_model(tiny_folder('qwen2'), device='cpu')(torch.tensor([[1, 2, 3]], device=_DEV))
    assert fake_device.errors


_DEVICE_RUNS = {   # method: the quick config's small overrides for a run on the fake device
    'epicoder': dict(llm_samples=1, llm_tokens=4, n_modules=8, n_seed_functions=10, evolve_steps=2, n_samples=4, n_seeds=2,
                     n_humaneval=2, shapes=((2, 1, 1),), n_shape_samples=1, **_EPICODER_TINY_DOWNSTREAM),
    'vocagnolm': dict(n_seeds=2, n_train_docs=2, n_eval_docs=2, n_teacher_eval_docs=1, warmup_steps=2, steps=3, seq_len=32, batch_size=2),
    'docks_rag': dict(n_seeds=2, n_sweep_seeds=1, n_train=12, n_test=4, n_entities=40, kg_epochs=5, epochs=3, tau_grid=(), n_probe=2),
    'econ': dict(exec_steps=4, n_rl=16, n_test=16, m=2, episodes=64, rounds=(1,), scale_agents=4),
    'pr_loss': dict(n_train=200, steps=10, n_samples=50),
    'mmmc': dict(pretrain_chunk=4, pretrain_max_steps=4, ft_steps=2, n_train=200, n_eval=4, n_val=2, n_probe=2, n_perception=8,
                 probe_every=1, batch_size=8),
    'bsr': dict(steps=4, log_every=2, n_train=64, n_eval=16, n_prompts=8, probe_every=2, bon_prompts=4, bon_pool=8, bon_n=8,
                n_sample=8, batch_size=8),
    'tgdpo': dict(n_pairs=(32,), batch_size=8, sft_steps=4, n_eval=16, ref_samples=2),
    'rmt': dict(steps=4, sweep_steps=2, eval_every=2, n_val=4, batch_size=2, train_rows=64),
}


@pytest.mark.parametrize('slug', list(_DEVICE_RUNS))
def test_every_input_follows_the_model_device(slug, fake_device):
    "A (small) quick run on the fake accelerator: no op mixes tensors on the device and the host, nothing on the device goes to numpy."
    import importlib
    from workbench.registry import METHODS
    from workbench.testing import tiny_folder
    api = _method_api(slug)
    fake_device.modules(importlib.import_module(METHODS[slug].module))
    kw = dict(_DEVICE_RUNS[slug], **({'model': tiny_folder('qwen2')} if slug in ('epicoder', 'vocagnolm', 'docks_rag') else {}))
    api.run_experiment(api.config(mode='quick', **kw))
    assert fake_device.on_dev, "nothing ran on the fake device"
    assert not fake_device.errors, sorted(set(fake_device.errors))[:5]


# --- SAE flow, MASS, the KV-cache sinks experiment on a second architecture; toxic ITI and EVIC (own models) on the fake device ---

def _api_of_module(module):
    from workbench.registry import experiment_api
    return experiment_api(module)


_TINY_SIZES_SAE_MASS_KV = {   # module: a smaller quick config for the tiny models (the quick sizes are kept where they are already small)
    'workbench.interpretability.sae_flow': dict(n_prompts=2, n_new=4, n_eval_windows=16, n_chance=256),
    'workbench.data_selection.mass': dict(pool_size=40, n_ref=12, n_eval=4, steps=2, n_evals=2, batch_size=1, seq_len=32, methods=('full', 'mass')),
    'workbench.inference.kvcache': {},
}


@pytest.mark.parametrize('arch', ['qwen2', 'gemma3'])
@pytest.mark.parametrize('module', list(_TINY_SIZES_SAE_MASS_KV))
def test_sae_flow_mass_kvcache_run_on_a_tiny_model(module, arch):
    "The quick experiment on a tiny model of each architecture; config and notes name the model that ran."
    from workbench.testing import tiny_folder
    api, folder = _api_of_module(module), tiny_folder(arch)
    res = api.run_experiment(api.config(mode='quick', model=folder, **_TINY_SIZES_SAE_MASS_KV[module]))
    assert len(res.rows) and res.config['model'] == folder and folder in res.notes
    if module.endswith('kvcache'): assert folder in res.headline
    if module.endswith('sae_flow'):
        assert len(res.df[res.df.kind == 'sae']) == 6 and res.df[res.df.kind == 'sae'].explained_variance.notna().all()
    if module.endswith('mass'): assert 'continually pretrained' in res.notes


def test_sae_flow_blocks_come_from_the_model():
    "Blocks are checked against the loaded model's config (the tiny Qwen2 has 4), not SmolLM2's 30."
    from workbench.testing import tiny_folder
    api, folder = _api_of_module('workbench.interpretability.sae_flow'), tiny_folder('qwen2')
    cfg = api.config(mode='quick', model=folder, first_layer=3, n_layers=2)        # blocks 3..4: valid on SmolLM2, not here
    with pytest.raises(ValueError, match='has 4 blocks'): api.run_experiment(cfg)
    assert api.config(mode='quick', first_layer=20, n_layers=10).layers[-1] == 29   # no SmolLM2 bound in the config itself


@pytest.mark.parametrize('module', ['workbench.interpretability.sae_flow', 'workbench.inference.kvcache', 'workbench.data_selection.mass'])
def test_sae_flow_mass_kvcache_model_field_is_checked(module):
    api = _api_of_module(module)
    with pytest.raises(ValueError, match='unknown model'): api.config(mode='quick', model='no-such-model')
    with pytest.raises(TypeError, match='model must be a str'): api.config(mode='quick', model=3)
    if not module.endswith('mass'):                                               # MASS's default is the registry's scratch model
        with pytest.raises(ValueError, match='pretrained'): api.config(mode='quick', model='tiny-llama')


_DEVICE_RUNS_SAE_MASS_KV_ITI_EVIC = {   # module: small overrides of the quick config for a run on the fake device
    'workbench.interpretability.sae_flow': dict(_TINY_SIZES_SAE_MASS_KV['workbench.interpretability.sae_flow'], model='qwen2'),
    'workbench.data_selection.mass': _TINY_SIZES_SAE_MASS_KV['workbench.data_selection.mass'],       # the default: tiny Llama from scratch
    'workbench.inference.kvcache': dict(model='qwen2'),
    'workbench.interpretability.toxic_iti': dict(steps=4, n_probe_pairs=20, n_prompts=4, n_new=6, n_ppl_rows=4, toy_steps=10, markov_steps=4,
                                                 alphas=(1.0,)),
    'workbench.data_selection.evic': dict(n_seeds=2, n_per_domain=8, n_test=4, batch_size=4, steps=16, rounds=2, window=8, pretrain_steps=4,
                                          n_show=2, eval_every=4, methods=('mtl', 'oracle', 'static', 'evic', 'random')),
    # EVIC keeps proj_dim=None here: gradients from torch.autograd.grad carry no fake-device mark, so the harness would take the
    # projection's `R.to(X.device)` for a host tensor; RandomProjector builds R on the CPU and moves it to X's device (read, not run).
}


@pytest.mark.parametrize('module', list(_DEVICE_RUNS_SAE_MASS_KV_ITI_EVIC))
def test_sae_flow_mass_kvcache_toxic_iti_evic_inputs_follow_the_model_device(module, fake_device):
    "A small quick run on the fake accelerator: no op mixes tensors on the device and the host, nothing on the device goes to numpy."
    import importlib
    from workbench.testing import tiny_folder
    api, kw = _api_of_module(module), dict(_DEVICE_RUNS_SAE_MASS_KV_ITI_EVIC[module])
    if kw.get('model') in ('qwen2', 'gemma3'): kw['model'] = tiny_folder(kw['model'])
    fake_device.modules(importlib.import_module(module))
    api.run_experiment(api.config(mode='quick', **kw))
    assert fake_device.on_dev, "nothing ran on the fake device"
    assert not fake_device.errors, sorted(set(fake_device.errors))[:5]


# --- `workbench list`'s models column agrees with the configs ---

def test_models_column_matches_the_configs():
    "A method listed as running 'any' pretrained decoder has a `model` field that refuses the scratch model; one listed as 'its own' has none."
    import dataclasses
    from workbench.registry import METHODS
    for m in METHODS.values():
        has = any(f.name == 'model' for f in dataclasses.fields(m.api().config))
        assert has == (m.models.kind == 'any'), f"{m.slug}: listed as {m.models}, but its config {'has' if has else 'has no'} `model` field"
        if has and m.slug != 'mass':                                             # MASS's default is the scratch model, trained on its pool
            with pytest.raises(ValueError, match='pretrained'): m.api().config(mode='quick', model='tiny-llama')
