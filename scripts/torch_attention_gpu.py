#!/usr/bin/env python3
"""PyTorch's causal attention (F.scaled_dot_product_attention in bf16, FlashAttention on a recent
GPU) timed on the shapes of `titan bench attention`: median forward and backward ms per call and
TFLOP/s counted the same way (forward 4*b*h*s^2*d/2, backward 2.5 times that). Prints one JSON line.

    python scripts/torch_attention_gpu.py --batch 8 --seq 2048 --heads 32 --kv-heads 8 --head-dim 64
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(a.batch, a.heads, a.seq, a.head_dim, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    dout = torch.randn_like(q)

    rep = a.heads // a.kv_heads

    def attend_gqa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def attend_repeat():
        # Key/value heads repeated: what titan's kernels do by indexing.
        kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)

    # FlashAttention only, so the reference is the kernel PyTorch would use at its best; grouped
    # heads natively where this PyTorch's flash kernel takes them, else repeated.
    flash = sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    flash.__enter__()
    try:
        attend_gqa()
        attend, gqa = attend_gqa, "enable_gqa"
    except (TypeError, RuntimeError):
        attend, gqa = attend_repeat, "repeat_interleave"

    def median_ms(fn):
        for _ in range(a.warmup):
            fn()
        times = []
        for _ in range(a.iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    with torch.no_grad():
        forward_ms = median_ms(attend)

    # Backward alone: each call runs a forward first, outside the timed events.
    times = []
    for i in range(a.warmup + a.iters):
        out = attend()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out.backward(dout)
        end.record()
        torch.cuda.synchronize()
        q.grad = k.grad = v.grad = None
        if i >= a.warmup:
            times.append(start.elapsed_time(end))
    backward_ms = sorted(times)[len(times) // 2]
    flops = 4.0 * a.batch * a.heads * a.head_dim * a.seq**2 / 2
    print(json.dumps({
        "impl": "torch_sdpa_flash", "gqa": gqa, "torch": torch.__version__,
        "batch": a.batch, "seq": a.seq, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
        "forward_ms": forward_ms, "backward_ms": backward_ms,
        "forward_tflops": flops / forward_ms / 1e9, "backward_tflops": 2.5 * flops / backward_ms / 1e9,
    }))


if __name__ == "__main__":
    main()
