"""TLR, the Sparsing Law and Puzzle on a model of the user's choice (issue 39, sections 3, 4 and 6): each method's quick
experiment on tiny models of a second architecture (`workbench.testing.tiny_folder`), the checks of the model field and of
settings the model cannot take, and a run on the fake accelerator of tests/test_any_model.py."""
import importlib
import pytest
import torch
from test_any_model import fake_device, _DEV  # noqa: F401  (the fixture, and the fake device it patches in)

TLR, LAW, PUZZLE = 'workbench.compression.lowrank_prune', 'workbench.compression.sparsity_law', 'workbench.compression.puzzle'

_SMALL = {   # module: small overrides of the quick config, so that one run on a tiny model takes a few seconds on one thread
    TLR: dict(points=(('magnitude', '50%', 4, 2), ('wanda', '50%', 4, 2)), history_rank=4, n_blocks=2, n_calib=2, calib_len=16,
              n_eval=3, eval_len=16, workers=1, n_boot=200),
    LAW: dict(chunk_len=16, tol=0.1, grid=64, c_grid=(0.1,), heat_bins=8, speed_tokens=1, speed_repeats=2, decode_tokens=1,
              archs=(('base', 1, 16), ('deep', 2, 8)), steps=8, batch_size=2, seq_len=16, n_eval=2, n_ckpts=2, n_stable=1, n_seeds=2,
              train_bytes=20_000, n_boot=200),
    PUZZLE: dict(seq_len=16, n_bld=4, bld_steps=2, bld_batch=2, n_score=2, n_gkd=4, gkd_len=16, gkd_steps=2, gkd_batch=2, gkd_eval=1,
                 gkd_eval_every=1, n_eval=4, budgets=(0.6,), batch_sizes=(1,), time_all_at=(1,), prompt_len=8, new_tokens=2, repeats=2,
                 repeats_other=2),
}


def _api(module):
    from workbench.registry import experiment_api
    return experiment_api(module)


def _config(module, model, **kw):
    return _api(module).config(mode='quick', model=model, **dict(_SMALL[module], **kw))


@pytest.mark.parametrize('module,arch', [(TLR, 'qwen2'), (TLR, 'gemma3'), (LAW, 'qwen2'), (LAW, 'gemma3'), (PUZZLE, 'qwen2')])
def test_compression_runs_on_a_tiny_model(module, arch):
    "The quick experiment on a tiny model of each architecture it applies to; config, notes and headline name the model."
    from workbench.testing import tiny_folder
    folder = tiny_folder(arch)
    res = _api(module).run_experiment(_config(module, folder))
    assert len(res.rows) and res.config['model'] == folder and folder in res.notes and folder in res.headline
    assert 'SmolLM2' not in res.notes + res.headline
    if module == LAW:                                                             # part A's claims name the model; its rows keep the stored key
        assert sum(c.name.startswith(folder) for c in res.claims) == 2 and set(res.df.part) >= {'smollm2', 'tiny', 'speed'}
    if module == PUZZLE:
        assert res.table('library').variant.isin(['gqa1', 'ffn64', 'ffn32']).any()   # variants of the parent's own shapes (d_ff 128, 2 KV heads)


def test_puzzle_refuses_gemma3_with_the_reason():
    "Gemma-3's decoder layer (post-sub-block norms, local and global rotary embeddings) is outside what Puzzle's variants model."
    from workbench.testing import tiny_folder
    with pytest.raises(ValueError, match=r'Llama-style decoder layers .*gemma3_text model: its sub-block outputs pass through extra RMSNorms'):
        _api(PUZZLE).run_experiment(_config(PUZZLE, tiny_folder('gemma3')))


def test_settings_the_model_cannot_take():
    "Block counts, ranks and KV-head counts are checked against the loaded model's config (the tiny Qwen2: 4 blocks, k_proj 32 x 64, 2 KV heads)."
    from workbench.testing import tiny_folder
    folder = tiny_folder('qwen2')
    with pytest.raises(ValueError, match=r'n_blocks=5 but .* has 4 blocks'): _api(TLR).run_experiment(_config(TLR, folder, n_blocks=5))
    with pytest.raises(ValueError, match=r"rank 48 exceeds .*smallest pruned matrix \(32"):
        _api(TLR).run_experiment(_config(TLR, folder, points=(('magnitude', '50%', 48, 2),), history_rank=48))
    with pytest.raises(ValueError, match=r"gqa_heads \[3\] must divide .*2 KV heads \(4 blocks\)"):
        _api(PUZZLE).run_experiment(_config(PUZZLE, folder, gqa_heads=(3,)))


def test_sparsity_law_needs_a_gated_ffn():
    "Parts A and C score and recompute σ(W_g x) ⊙ W_u x: a block without that FFN is a one-line error naming the model."
    from torch import nn
    from workbench.compression.sparsity_law import _check_gated
    from workbench.models import tiny_llama
    m = tiny_llama(n_layers=2)
    _check_gated(m, 'smollm2-135m')                                               # gated: nothing to say
    m.model.layers[1].mlp = nn.Identity()
    with pytest.raises(ValueError, match=r"gated FFN .*HuggingFaceTB/SmolLM2-135M-Instruct's block 1 has none"): _check_gated(m, 'smollm2-135m')


@pytest.mark.parametrize('module', [TLR, LAW, PUZZLE])
def test_model_field_is_checked(module):
    api = _api(module)
    with pytest.raises(ValueError, match='unknown model'): api.config(mode='quick', model='no-such-model')
    with pytest.raises(TypeError, match='model must be a str'): api.config(mode='quick', model=3)
    with pytest.raises(ValueError, match='pretrained'): api.config(mode='quick', model='tiny-llama')
    with pytest.raises(ValueError, match='model'): api.config(mode='quick', model='')
    assert api.config(mode='full').model == 'smollm2-135m'
    if module == PUZZLE: assert api.config(mode='quick').model == 'tiny'         # Puzzle's own byte-level parent stays the quick default


@pytest.mark.parametrize('module', [TLR, LAW, PUZZLE])
def test_every_input_follows_the_model_device(module, fake_device):  # noqa: F811
    "A small quick run on the fake accelerator: no op mixes tensors on the device and the host, nothing on the device goes to numpy."
    from workbench.testing import tiny_folder
    fake_device.modules(importlib.import_module(module))
    _api(module).run_experiment(_config(module, tiny_folder('qwen2')))
    assert fake_device.on_dev, "nothing ran on the fake device"
    assert not fake_device.errors, sorted(set(fake_device.errors))[:5]
