"""Diagnostic (issue 69): how well do levels fit at round 0 (on g), at round 1 (on g*w), and at
round t (on g*w of round t) serve the g*w of later rounds? fp32 trajectory of the character GPT
(AdamW, warm-up, cosine, clip 1), 4 workers x B sequences, Preconditioner default Form,
bucket 8192, min_size 1024, ALQ 3 bits. Relative variance = E||Q(x)-x||^2 / ||x||^2 summed over
workers and tensors, computed exactly from the levels (unbiased stochastic rounding). Arguments: sequences per worker, seed, steps, workers per
quantized sum (2: node sums of 2 ranks, as the hierarchical exchange quantizes).

    python docs/results/data/precondition_levels_drift/levels_drift.py 8 0 101 2 > levels_drift_s0.jsonl
"""
import sys, json
import numpy as np, torch
sys.path.insert(0, ".")  # run from the repository root
from horovod_alq.core.quantizer import Quantizer
from horovod_alq.torch.precondition import Preconditioner
from scripts.common.gpt import GPT, char_splits, lr_at, sample_batch

B = int(sys.argv[1]) if len(sys.argv) > 1 else 8
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 121
GROUP = int(sys.argv[4]) if len(sys.argv) > 4 else 2  # 2: node sums of 2 ranks (the hierarchical exchange quantizes those)
D, MIN = 8192, 1024
class A: warmup, steps, lr = 30, 240, 3e-3
torch.set_num_threads(1)
train, val, chars = char_splits()
torch.manual_seed(seed)
model = GPT(len(chars), 128, 4, 4, 64)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
params = list(model.parameters())
pre = Preconditioner(opt, bucket_size=D)
gens = [torch.Generator().manual_seed(seed * 1000 + k) for k in range(4)]

def var(levels, xs):
    lv = np.asarray(levels, np.float64)
    num = den = 0.0
    for x in xs:
        pad = (-x.size) % D
        b = np.concatenate([x, np.zeros(pad, x.dtype)]).reshape(-1, D).astype(np.float64)
        nrm = np.abs(b).max(1, keepdims=True); nrm[nrm == 0] = 1
        r = b / nrm
        j = np.clip(np.searchsorted(lv, r, side="right") - 1, 0, lv.size - 2)
        lo, hi = lv[j], lv[j + 1]
        num += float((((hi - r) * (r - lo)) * nrm**2).sum()); den += float((b**2).sum())
    return num / den

def fit(xs, q0):
    q = Quantizer("alq", 3, D); q.set_levels(q0.levels) if q0 is not None else None
    q.adapt(sum(q.statistics(x) for x in xs)); return q

q0 = q1 = None; fits = {}
out = []
for step in range(STEPS):
    for g in opt.param_groups: g["lr"] = lr_at(step, A)
    grads = []
    for k in range(4):
        x, y = sample_batch(train, B, 64, gens[k]); model.zero_grad(set_to_none=True); model.loss(x, y).backward()
        grads.append([p.grad.detach().clone() for p in params])
    pre.prepare(step)
    xs = []
    for i, p in enumerate(params):
        if p.numel() < MIN: continue
        w = pre.scale(p)
        for k in range(0, 4, GROUP):
            v = sum(grads[k + j][i] for j in range(GROUP)).reshape(-1).numpy()
            xs.append(v * w.reshape(-1).numpy() if w is not None else v.copy())
    if step == 0: q0 = fit(xs, None)
    if step == 1: q1 = fit(xs, q0)
    if step in (0, 1, 2, 5, 10, 20, 30, 40, 60, 80, 100, 120):
        qt = fit(xs, q0)
        row = {"step": step, "fit0": var(q0.levels, xs), "fit1": var(q1.levels, xs) if q1 else None, "own": var(qt.levels, xs)}
        for s, qq in fits.items(): row[f"fit{s}"] = var(qq.levels, xs)
        if step in (10, 30, 60): fits[step] = qt
        row["levels_own"] = [round(float(v), 3) for v in qt.levels]
        print(json.dumps(row), flush=True)
    for p, gs in zip(params, zip(*grads)): p.grad = sum(gs) / 4
    torch.nn.utils.clip_grad_norm_(params, 1.0); opt.step()
