"""Regression and cross-module tests of `workbench.train` beyond the notebook's own: a crash while a checkpoint is
written, resuming a finished run, config drift on resume, `datasets` input with padding, bf16 mixed precision,
`LiveCurves` as the training callback in a kernel, `generate` against transformers' own `generate`, and two processes under `accelerate launch`.
"""
import json, math, os, subprocess, sys, textwrap
from pathlib import Path
import pytest
import torch
from workbench.train import (TrainConfig, History, train, perplexity, generate, generate_ids, checkpoints,
                             latest_checkpoint, load_checkpoint, count_tokens, collate)
import workbench.train as wt
from workbench.models import tiny_llama

V, T = 64, 16
ROOT = Path(__file__).resolve().parents[1]


def _data(n=32, seed=0): return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))

def _model(seed=0, dropout=0.0):
    m = tiny_llama(vocab_size=V, n_layers=1, d_model=32, n_heads=2, max_len=T, seed=seed)
    for layer in m.model.layers: layer.self_attn.attention_dropout = dropout
    return m

def _max_diff(a, b): return max(float((x - y).abs().max()) for x, y in zip(a.state_dict().values(), b.state_dict().values()))

CFG = dict(batch_size=4, lr=3e-3, progress=False)


def test_crash_while_writing_a_checkpoint(tmp_path, monkeypatch):
    "A failure inside torch.save leaves the previous checkpoints intact and nothing half-written; the resume is exact."
    cfg = TrainConfig(steps=20, ckpt_every=5, keep_ckpts=5, **CFG)
    straight = _model(dropout=0.1); train(straight, _data(), cfg, ckpt_dir=tmp_path/'a')
    real_save = torch.save
    def failing_save(obj, f, *a, **k):
        if 'step_0000015' in str(f):
            Path(f).write_bytes(b'half a checkpoint')
            raise OSError('disk full (simulated)')
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(torch, 'save', failing_save)
    d = tmp_path/'b'
    with pytest.raises(OSError, match='disk full'): train(_model(dropout=0.1), _data(), cfg, ckpt_dir=d)
    assert [p.name for p in checkpoints(d)] == ['step_0000005.pt', 'step_0000010.pt']
    assert sorted(p.name for p in d.iterdir()) == ['step_0000005.pt', 'step_0000010.pt']   # the temporary is gone
    monkeypatch.setattr(torch, 'save', real_save)
    torch.manual_seed(99)
    resumed = _model(dropout=0.1); h = train(resumed, _data(), cfg, ckpt_dir=d)
    assert h.step == list(range(1, 21))
    assert _max_diff(straight, resumed) == 0.0


def test_resume_a_finished_run_loads_it(tmp_path):
    "resume=True on a finished run trains nothing and returns the final weights and the full history."
    cfg = TrainConfig(steps=6, **CFG)
    m = _model(); h = train(m, _data(), cfg, ckpt_dir=tmp_path)
    fresh = _model(seed=1); h2 = train(fresh, _data(), cfg, ckpt_dir=tmp_path)
    assert _max_diff(m, fresh) == 0.0 and h2.train_loss == h.train_loss
    ck = load_checkpoint(latest_checkpoint(tmp_path))
    assert ck['step'] == 6 and set(ck) >= {'model', 'optimizer', 'rng', 'schedule', 'history', 'config'}
    assert len(ck['rng']) == 1 and math.isclose(ck['schedule']['lr'], cfg.min_lr)


def _stop(h):
    if h.step[-1] == 2: raise RuntimeError('stop')

def test_resume_with_another_config_warns(tmp_path):
    cfg = TrainConfig(steps=4, ckpt_every=2, **CFG)
    with pytest.raises(RuntimeError, match='stop'): train(_model(), _data(), cfg, ckpt_dir=tmp_path, callbacks=[_stop])
    with pytest.warns(UserWarning, match=r"differs in \['lr', 'min_lr'\]"):
        train(_model(), _data(), TrainConfig(steps=4, ckpt_every=2, **{**CFG, 'lr': 1e-3}), ckpt_dir=tmp_path)


def test_datasets_input_with_padding_matches_list_of_dicts():
    "A datasets.Dataset of ragged rows trains exactly like the same rows as a list of dicts; padding is not counted."
    from datasets import Dataset
    g = torch.Generator().manual_seed(0)
    rows = [dict(input_ids=torch.randint(1, V, (int(n),), generator=g).tolist()) for n in torch.randint(4, T, (24,), generator=g)]
    cfg = TrainConfig(steps=5, **CFG)
    m1, m2 = _model(), _model()
    h1 = train(m1, Dataset.from_list(rows), cfg)
    h2 = train(m2, rows, cfg)
    assert _max_diff(m1, m2) < 1e-6 and h1.tokens == h2.tokens
    # 5 updates x 4 rows = the first 20 rows of epoch 0's seeded order; tokens are counted without padding
    order = wt.epoch_order(24, cfg, 0).tolist()[:20]
    assert h1.tokens == sum(len(rows[i]['input_ids']) for i in order)
    assert count_tokens(collate(rows[:4])) == sum(len(r['input_ids']) for r in rows[:4])


def test_bf16_mixed_precision_then_fp32_in_one_process():
    "bf16 autocast trains; the model gets its own forward back intact; a later fp32 run in the same process works."
    m = _model()
    h = train(m, _data(), TrainConfig(steps=30, mixed_precision='bf16', **CFG))
    assert h.train_loss[-1] < h.train_loss[0] - 0.2, h
    assert 'forward' not in vars(m) and '_original_forward' not in vars(m)   # no autocast wrapper left
    twin = _model(seed=5); twin.load_state_dict(m.state_dict())
    ids = _data(2)
    out, ref = m(ids, output_hidden_states=True), twin(ids, output_hidden_states=True)
    assert out.logits.dtype == torch.float32 and torch.equal(out.logits, ref.logits) and len(out.hidden_states) == 2
    h32 = train(_model(), _data(), TrainConfig(steps=3, **CFG))
    assert len(h32.step) == 3


def test_live_curves_update_one_widget_in_place(monkeypatch):
    "In a kernel LiveCurves, as a train callback, shows one FigureWidget once and keeps it equal to the history."
    import plotly.graph_objects as go
    import IPython.display
    import workbench.viz as wv
    from workbench.viz import LiveCurves
    shown = []
    monkeypatch.setattr(wv, 'in_jupyter', lambda: True)
    monkeypatch.setattr(IPython.display, 'display', lambda *a, **k: shown.append(a[0]))
    lc = LiveCurves.for_training(every_s=0)
    h = train(_model(), _data(), TrainConfig(steps=8, **CFG), eval_data=_data(8, seed=1), callbacks=[lc])
    assert len(shown) == 1 and shown[0] is lc.widget and isinstance(lc.widget, go.FigureWidget)
    train_trace, eval_trace, lr_trace = lc.widget.data
    assert list(train_trace.y) == h.train_loss and list(eval_trace.x) == h.eval_step and list(lr_trace.y) == h.lr
    assert 'update 8' in lc.widget.layout.title.text


@pytest.fixture(scope='module')
def smol():
    from workbench.models import load_model, load_tokenizer
    return load_model('smollm2-135m'), load_tokenizer('smollm2-135m')


def test_generate_matches_transformers_generate(smol):
    "Our cached greedy loop gives the same tokens as transformers' generate, for plain text and for a chat turn."
    model, tok = smol
    ids = tok('The three primary colours are', return_tensors='pt').input_ids
    ref = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert torch.equal(generate_ids(model, ids, 16, eos_id=tok.eos_token_id), ref)
    text = tok.apply_chat_template([dict(role='user', content='Name a fruit.')], tokenize=False, add_generation_prompt=True)
    cids = tok(text, return_tensors='pt', add_special_tokens=False).input_ids
    cref = model.generate(cids, max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert generate(model, tok, 'Name a fruit.', max_new_tokens=24, chat=True) == tok.decode(cref[0, cids.shape[1]:], skip_special_tokens=True)


def test_perplexity_of_smollm2_is_that_of_a_language_model(smol):
    "SmolLM2 on a stdlib docstring: far below uniform (49152), and bf16 agrees with fp32."
    model, tok = smol
    text = json.loads.__doc__ + '\n' + os.path.join.__doc__ + '\n' + sorted.__doc__
    ids = tok(text, return_tensors='pt').input_ids[:, :256]
    ppl = perplexity(model, ids)
    assert 1.5 < ppl < 60, ppl
    assert abs(perplexity(model.to(torch.bfloat16), ids) - ppl) / ppl < 0.1
    model.to(torch.float32)


# ---- several processes: accelerate launch with two CPU processes (gloo) ----

SCRIPT = '''
import sys, torch
from accelerate import PartialState
from workbench.train import train, TrainConfig
from workbench.models import tiny_llama
mode, out = sys.argv[1], sys.argv[2]
data = torch.randint(0, 64, (40, 16), generator=torch.Generator().manual_seed(0))
def model(dropout):
    m = tiny_llama(vocab_size=64, n_layers=1, d_model=32, n_heads=2, max_len=16, seed=0)
    for layer in m.model.layers: layer.self_attn.attention_dropout = dropout
    return m
cfg = TrainConfig(steps=12, batch_size=3, lr=3e-3, ckpt_every=2, progress=False)
def crash(h):
    if h.step[-1] == 7: raise SystemExit('crash after update 7')
res = {}
if mode == 'crash':
    train(model(0.1), data, cfg, ckpt_dir=out + '.ck', callbacks=[crash])
else:
    torch.manual_seed(1234)
    # state dicts are taken after training: under DDP the parameters keep their identity but get new storage
    def run(m, *a, **k): h = train(m, *a, **k); return m.state_dict(), h.to_dict()
    res['resumed'] = run(model(0.1), data, cfg, ckpt_dir=out + '.ck')
    res['straight'] = run(model(0.1), data, cfg, ckpt_dir=out + '.ck0')
    res['plain'] = run(model(0.0), data, TrainConfig(steps=6, batch_size=4, lr=1e-3, progress=False), eval_data=data[:10])
    if PartialState().is_main_process: torch.save(res, out)
'''

def _free_port():
    import socket
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def _launch(script, *args, nproc=2):
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(ROOT)}
    cmd = [sys.executable, '-m', 'accelerate.commands.launch', '--multi_gpu', '--num_processes', str(nproc),
           '--num_machines', '1', '--mixed_precision', 'no', '--dynamo_backend', 'no', '--main_process_port', str(_free_port()), str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_two_processes_under_accelerate_launch(tmp_path):
    """Two CPU processes: same weights as one process with twice the batch; a crash at update 7 (checkpoint at 6)
    resumed to 12 gives the weights of an uninterrupted two-process run, dropout streams included."""
    script = tmp_path/'run.py'; script.write_text(SCRIPT); out = str(tmp_path/'res.pt')
    r = _launch(script, 'crash', out)
    assert r.returncode != 0 and 'crash after update 7' in r.stderr + r.stdout, r.stderr[-3000:]
    assert [p.name for p in checkpoints(out + '.ck')] == ['step_0000004.pt', 'step_0000006.pt']
    assert len(load_checkpoint(out + '.ck/step_0000006.pt')['rng']) == 2      # one RNG state per process
    r = _launch(script, 'resume', out)
    assert r.returncode == 0, r.stderr[-3000:]
    res = torch.load(out, weights_only=True)
    (sd_r, h_r), (sd_s, h_s) = res['resumed'], res['straight']
    assert max(float((sd_r[k] - sd_s[k]).abs().max()) for k in sd_s) < 1e-6
    assert h_r['step'] == list(range(1, 13)) and h_r['tokens'] == 12 * 2 * 3 * 16
    # one process, batch 8 = two processes x batch 4
    one = tiny_llama(vocab_size=64, n_layers=1, d_model=32, n_heads=2, max_len=16, seed=0)
    data = torch.randint(0, 64, (40, 16), generator=torch.Generator().manual_seed(0))
    h1 = train(one, data, TrainConfig(steps=6, batch_size=8, lr=1e-3, progress=False), eval_data=data[:10])
    sd_p, h_p = res['plain']
    assert max(float((one.state_dict()[k] - sd_p[k]).abs().max()) for k in sd_p) < 1e-5
    assert h_p['tokens'] == h1.tokens and abs(h_p['eval_loss'][-1] - h1.eval_loss[-1]) < 1e-5
