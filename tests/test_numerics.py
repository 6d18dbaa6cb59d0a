"""Floating-point checks on inputs of known answer, with tolerances set from float32's error bound and the conditioning
of each quantity, not from what one CPU happened to give; and the same checks rerun under PyTorch's other CPU kernel
sets, so results that depend on the vector kernels a CPU runs show up on any machine.

float32 has machine epsilon eps = 2^-23 ~ 1.2e-7. A dot product of length n carries an absolute error up to about
n eps sum|x_i y_i| (the gamma_n bound); the constants below are those dimension factors, so each bound holds on any
CPU and is still 10^3 to 10^5 times tighter than what a wrong result would give. Each test also shows its bound has
power: a plausible wrong answer (a neighbouring singular value, a perturbed input) falls outside it.

`ATEN_CPU_CAPABILITY` (avx512 / avx2 / default) picks PyTorch's own vector kernels (softmax, reductions, attention);
MKL (`MKL_ENABLE_INSTRUCTIONS`, `MKL_CBWR`) and oneDNN (`ONEDNN_MAX_CPU_ISA`) pick theirs for matrix products and
LAPACK. The last test reruns this file under AVX2 kernels (MKL and oneDNN capped to AVX2), and under the scalar default
with MKL in its vendor-neutral `MKL_CBWR=COMPATIBLE` code path: roughly what an AMD EPYC runs. That path alone
reproduces the TLR notebook's old failure on this Intel machine (gram and full SVD truncations 1.2e-5 apart at
sigma ~ 10, against an absolute 1e-5)."""
import math, os, subprocess, sys
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT

pytestmark = pytest.mark.numerics
eps32 = torch.finfo(torch.float32).eps


def test_kernel_set_is_the_requested_one():
    "Under the rerun below, PyTorch really runs the kernel set asked for (a CPU without AVX2 gets the default set)."
    want = os.environ.get('WORKBENCH_EXPECT_CAPABILITY')
    got = torch.backends.cpu.get_cpu_capability()
    if want is None: assert got in ('DEFAULT', 'AVX2', 'AVX512', 'ZVECTOR', 'SVE256', 'NO AVX'), got
    else: assert got == (want if want == 'DEFAULT' or torch.cpu._is_avx2_supported() else 'DEFAULT'), (want, got)


# ---- SVD: LAPACK and matrix products (MKL) -------------------------------------------------------------------------

def _known_spectrum(m, n, s, seed=0):
    "M = Q1 diag(s) Q2^T in float64 with orthonormal Q1 (m, p), Q2 (n, p): its singular values are exactly s (p,)."
    g = torch.Generator().manual_seed(seed)
    Q1, Q2 = (torch.linalg.qr(torch.randn(k, len(s), generator=g, dtype=torch.float64))[0] for k in (m, n))
    return (Q1 * s) @ Q2.T, Q1, Q2


@pytest.mark.parametrize('shape', [(30, 20), (20, 30), (96, 200)])
@pytest.mark.parametrize('route', ['gram', 'full'])
def test_truncated_svd_on_a_known_spectrum(shape, route):
    """|s_i - sigma_i| <= (m+n) eps sigma_1^2/sigma_i through the Gram matrix (sigma_1 for a direct SVD), and the rank-r
    truncation within (m+n) eps sigma_1^3/(sigma_r^2 - sigma_{r+1}^2) of the best one (Davis-Kahan): the notebook's bounds."""
    from workbench.compression.lowrank_prune import truncated_svd
    (m, n), p = shape, min(shape)
    s_true = torch.logspace(1, -1, p, dtype=torch.float64)                  # sigma from 10 to 0.1: condition number 100
    M, Q1, Q2 = _known_spectrum(m, n, s_true)
    for r in (1, 5, p // 2, p - 1):
        U, s, V = truncated_svd(M.float(), r, route)
        tol = (m + n) * eps32 * (s_true[0] ** 2 / s_true[:r] if route == 'gram' else s_true[0].expand(r))
        err = (s.double() - s_true[:r]).abs()
        assert (err <= tol).all(), (r, (err / tol).max().item())
        if r > 1: assert not ((s.double() - s_true[1:r + 1]).abs() <= tol).all()     # a neighbour's value is outside
        best = (Q1[:, :r] * s_true[:r]) @ Q2[:, :r].T
        e2, t2 = ((U * s) @ V.T).double().sub(best).norm(), (m + n) * eps32 * s_true[0] ** 3 / (s_true[r - 1] ** 2 - s_true[r] ** 2)
        assert e2 <= t2, (r, (e2 / t2).item())


def test_tlr_refine_exact_cases():
    "Full rank gives W back, to (m+n) eps ||W||_2 per entry; nothing pruned gives W exactly (the gap is 0, so is its patch)."
    from workbench.compression.lowrank_prune import tlr_refine, magnitude_mask
    g = torch.Generator().manual_seed(0)
    W = torch.randn(40, 60, generator=g); P = magnitude_mask(W, 0.5); m, n = W.shape
    bound = (m + n) * eps32 * torch.linalg.matrix_norm(W.double(), 2).item()
    for svd in ('gram', 'full'):
        err = (tlr_refine(W, P, 40, 3, svd=svd).dense() - W).abs().max().item()
        assert err <= bound, (svd, err / bound)
        assert torch.equal(tlr_refine(W, torch.ones_like(P), 3, 3, svd=svd).dense(), W)
    assert (tlr_refine(W, P, 20, 3).dense() - W).abs().max().item() > 1e3 * bound   # rank 20 of 40 is not W: the bound has power


# ---- softmax, reductions and attention: ATen's vector kernels --------------------------------------------------------

def test_kl_from_logits_on_known_answers():
    """KL is shift-invariant (KL(z, z + c) = 0) and has a closed form for two outcomes; float32 log-softmax errs per entry by
    about eps (range of the logits + log V), so |KL - KL*| <= 4 eps (R_p + R_q + 2 log V) (+ eps KL for the final products)."""
    from workbench.measure import kl_from_logits
    g = torch.Generator().manual_seed(0)
    V = 49152
    z = 4 * torch.randn(8, V, generator=g)
    R = (z.max(-1).values - z.min(-1).values).max().item()
    for c in (0.5, 30.0):
        kl = kl_from_logits(z, z + c, 'none')
        tol = 4 * eps32 * (2 * R + 2 * math.log(V))
        assert kl.abs().max().item() <= tol, (c, kl.abs().max().item() / tol)
    a = torch.tensor([[2.0, -1.0]]); b = torch.tensor([[0.5, 0.25]])            # two outcomes: p = sigmoid(3), q = sigmoid(0.25)
    p, q = torch.sigmoid(torch.tensor(3.0, dtype=torch.float64)), torch.sigmoid(torch.tensor(0.25, dtype=torch.float64))
    ref = (p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))).item()
    tol = 4 * eps32 * (3.0 + 0.25 + 2 * math.log(2)) + eps32 * ref
    assert abs(kl_from_logits(a, b).item() - ref) <= tol
    assert abs(kl_from_logits(a, b + torch.tensor([[0.0, 1e-4]])).item() - ref) > tol   # a 1e-4 change of one logit is outside


def test_sum_of_many_float32_values():
    """A float32 sum (and mean) of n values is within log2(n) eps sum|x| of the exact sum: PyTorch sums in a cascade, whose
    blocking depends on the kernels. (Its float32 `vector_norm` does not keep this bound: about 90 eps relative at n = 2^20.)"""
    x = torch.randn(2 ** 20, generator=torch.Generator().manual_seed(0)) + 0.1
    exact = x.double().sum().item(); tol = math.log2(x.numel()) * eps32 * x.abs().double().sum().item()
    assert abs(x.sum().item() - exact) <= tol
    assert abs(x.mean().item() - exact / x.numel()) <= tol / x.numel()
    assert abs((x + 1e-3).sum().item() - exact) > tol                          # 1e-3 more per entry: outside


def test_attention_matches_float64():
    """scaled_dot_product_attention (causal, GQA-free) against float64: scores err by up to D eps (|q||k|) / sqrt(D), each
    softmax weight relatively by twice that plus (T + 4) eps, so |o - o*| <= (2 ds + (T + 4) eps) max|v|."""
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 4, 128, 64
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    ds = D * eps32 * (q.abs() @ k.abs().transpose(-1, -2)).max().item() / math.sqrt(D)
    tol = (2 * ds + (T + 4) * eps32) * v.abs().max().item()
    for out in (F.scaled_dot_product_attention(q, k, v, is_causal=True),
                torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf), -1) @ v):
        assert (out.double() - ref).abs().max().item() <= tol, (out.double() - ref).abs().max().item() / tol
    wrong = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(D + 1))   # the scale off by 0.8%: outside
    assert (wrong.double() - ref).abs().max().item() > tol


def test_active_neuron_ffn_matches_the_masked_dense_one():
    "Sparsing Law's active-neuron down projection sums the same products as the masked dense FFN in another order: within F eps sum|a_i w_i|."
    from workbench.compression.sparsity_law import FFNWeights, ffn_active_down, ffn_dense
    g = torch.Generator().manual_seed(0)
    d, Fw = 64, 256
    w = FFNWeights(torch.randn(Fw, d, generator=g) / 8, torch.randn(Fw, d, generator=g) / 8, torch.randn(Fw, d, generator=g) / 16, F.silu)
    x = torch.randn(d, generator=g)
    a = w.inter(x)
    for q in (0.0, 0.5, 0.9):
        cut = torch.full((Fw,), a.abs().quantile(q).item())
        keep = (a.abs() >= cut).float()
        ref = ((a * keep).double() @ w.wd_t.double())
        tol = Fw * eps32 * ((a * keep).abs().double() @ w.wd_t.abs().double())
        assert ((ffn_active_down(w, x, cut).double() - ref).abs() <= tol).all(), q
    assert torch.allclose(ffn_active_down(w, x, torch.zeros(Fw)), ffn_dense(w, x), rtol=0, atol=Fw * eps32 * (a.abs() @ w.wd_t.abs()).max().item())


# ---- the same checks under other kernel sets ------------------------------------------------------------------------

KERNEL_SETS = {'avx2': dict(ATEN_CPU_CAPABILITY='avx2', MKL_ENABLE_INSTRUCTIONS='AVX2', ONEDNN_MAX_CPU_ISA='AVX2', WORKBENCH_EXPECT_CAPABILITY='AVX2'),
               'default': dict(ATEN_CPU_CAPABILITY='default', MKL_CBWR='COMPATIBLE', ONEDNN_MAX_CPU_ISA='SSE41', WORKBENCH_EXPECT_CAPABILITY='DEFAULT')}

@pytest.mark.skipif(os.environ.get('WORKBENCH_EXPECT_CAPABILITY') is not None, reason='already the rerun')
@pytest.mark.parametrize('kernels', list(KERNEL_SETS))
def test_numerics_hold_under_other_cpu_kernels(kernels):
    "This file's checks in a fresh process with PyTorch's AVX2 (or scalar default) kernels and MKL / oneDNN on other code paths."
    env = dict(os.environ, **KERNEL_SETS[kernels])
    r = subprocess.run([sys.executable, '-m', 'pytest', str(ROOT/'tests'/'test_numerics.py'), '-q', '-p', 'no:cacheprovider', '-k', 'not other_cpu_kernels'],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and ' passed' in r.stdout, f"under {KERNEL_SETS[kernels]}:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
