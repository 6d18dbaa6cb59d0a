"Cross-module and regression tests of the platform library."
import json, os, subprocess, sys, time
import pytest, torch
from conftest import ROOT, BIN

PY = str(BIN/'python') if (BIN/'python').exists() else sys.executable

def test_import_is_light():
    "`import workbench` stays under 0.5 s and imports no torch."
    code = "import time,sys; t=time.perf_counter(); import workbench, workbench.core, workbench.registry; print(time.perf_counter()-t, 'torch' in sys.modules)"
    best = min(float(subprocess.check_output([PY, '-c', code], cwd=ROOT, text=True).split()[0]) for _ in range(3))
    out = subprocess.check_output([PY, '-c', code], cwd=ROOT, text=True).split()
    assert out[1] == 'False', "importing the package root pulled in torch"
    assert best < 0.5, f"import workbench took {best:.2f} s"

def test_bad_setting_names_key_value_and_allowed():
    r = subprocess.run([PY, '-c', 'from workbench.core import get_settings; get_settings()'], cwd=ROOT,
                       env=dict(os.environ, WORKBENCH_DTYPE='float16'), capture_output=True, text=True)
    assert r.returncode != 0 and "dtype='float16' (from $WORKBENCH_DTYPE)" in r.stderr and "'bfloat16'" in r.stderr

def test_every_registered_method_has_a_spec_field():
    from workbench.registry import METHODS
    assert len(METHODS) == 19

def test_hooks_match_hidden_states_on_smollm2(smol, smol_tok):
    from workbench.hooks import run_with_cache
    batch = smol_tok(['Hello there, general Kenobi.'], return_tensors='pt')
    out, cache = run_with_cache(smol, batch, names='blocks.*.hook_resid_post', output_hidden_states=True)
    assert len(cache) == smol.config.num_hidden_layers == 30
    for i in range(29): torch.testing.assert_close(cache[f'blocks.{i}.hook_resid_post'], out.hidden_states[i + 1])

def test_hooks_removed_and_steering_changes_generation(smol, smol_tok):
    from workbench.hooks import hooks, add_vector
    ids = smol_tok('The weather today is', return_tensors='pt')
    n_hooks = lambda: sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in smol.modules())
    n0 = n_hooks()                       # transformers keeps some hooks of its own
    with torch.no_grad(): base = smol(**ids).logits[0, -1]
    v = torch.randn(smol.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with hooks(smol, [('blocks.10.hook_resid_post', add_vector(v, alpha=8.0))]), torch.no_grad():
        steered = smol(**ids).logits[0, -1]
    with torch.no_grad(): after = smol(**ids).logits[0, -1]
    assert not torch.allclose(base, steered, atol=1e-3)
    torch.testing.assert_close(base, after)
    assert n_hooks() == n0

def test_bf16_close_to_fp32(smol, smol_tok):
    from workbench.testing import smol as load
    bf = load('bfloat16')
    ids = smol_tok('The quick brown fox jumps over the lazy dog because', return_tensors='pt')
    with torch.no_grad():
        l32 = torch.nn.functional.cross_entropy(smol(**ids).logits[0, :-1], ids['input_ids'][0, 1:])
        l16 = torch.nn.functional.cross_entropy(bf(**ids).logits[0, :-1].float(), ids['input_ids'][0, 1:])
    assert abs(l32 - l16) < 0.15, (l32, l16)

def test_results_roundtrip_and_scoreboard(tmp_path):
    "A Results written and read back: rows, claims, verdict recomputed, provenance; the scoreboard shows it."
    from workbench.core import save_results, load_results, Results, judge
    from workbench.measure import claim, paired_t
    from workbench.registry import scoreboard
    rows = [dict(policy=p, seed=s, kl=0.1 * (p == 'h2o') + 0.01 * s) for p in ('morphkv', 'h2o') for s in range(4)]
    def rule(r):
        "Reproduced when MorphKV's KL is below H2O's beyond the paired CI over seeds."
        df = r.df; a = df[df.policy == 'h2o'].kl.values; b = df[df.policy == 'morphkv'].kl.values
        return judge([claim('KL h2o - morphkv', paired_t(a, b))])
    res = Results('morphkv', dict(mode='full', seed=1), rows, seeds=[0, 1, 2, 3])
    res.conclude(rule, [claim('KL h2o - morphkv', paired_t([0.1] * 4, [0.0] * 4))], '50% memory')
    save_results(res, results_dir=tmp_path)
    r = load_results('morphkv', results_dir=tmp_path)
    assert r.verdict == rule(r) and r.versions['transformers'] and len(r.df) == 8 and r.claims[0].n == 4
    row = next(x for x in scoreboard(results_dir=tmp_path) if x['slug'] == 'morphkv')
    assert (row['status'], row['measured']) == (r.verdict, '50% memory')


def test_cached_builds_once_under_two_processes(tmp_path):
    "Two processes asking for the same missing cache entry: one builds it, the other waits and reads it."
    import subprocess, sys, textwrap
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from workbench.core import cached
        def build(d):
            with open({str(tmp_path/'builds.log')!r}, 'a') as f: f.write('built\\n')
            time.sleep(1.5); (d/'w.txt').write_text('weights')
        p = cached('race', {{'n': 1}}, build, cache_dir={str(tmp_path/'cache')!r})
        print(p, (p/'w.txt').read_text())
    """)
    ps = [subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in ps]
    assert all(p.returncode == 0 for p in ps), outs
    assert (tmp_path/'builds.log').read_text() == 'built\n'                 # built once
    assert outs[0][0] == outs[1][0] and outs[0][0].strip().endswith('weights')
