#!/usr/bin/env python3
"""PyTorch reference for `titan bench train --device cuda`: the same Llama 3 model, batch and sequence,
trained on the same GPU, reporting the same numbers (tokens/s, TFLOP/s with TorchTitan's FLOP count,
MFU, peak memory) as one JSON line.

Mixed precision the way a single-GPU PyTorch user gets it: fp32 weights, gradients and AdamW state,
bf16 autocast for the matmuls, fused AdamW, scaled_dot_product_attention (flash attention on
Hopper). Needs torch; never a dependency of titan.

    python3 scripts/torch_llama_gpu.py --flavor 1B --batch 8 --seq 2048
    python3 scripts/torch_llama_gpu.py --flavor debugmodel --device cpu --steps 2   # smoke test
"""
import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# flavor: (dim, layers, heads, kv_heads, vocab, multiple_of, ffn_multiplier, tied) -- titan's model/families/llama3/flavors.rs
FLAVORS = {
    "debugmodel": (256, 6, 16, 16, 2048, 256, None, False),
    "1B": (2048, 16, 32, 8, 128256, 256, 1.5, True),
    "3B": (3072, 28, 24, 8, 128256, 256, 1.0, True),
    "8B": (4096, 32, 32, 8, 128256, 1024, 1.3, False),
}


def ffn_hidden(dim, multiple_of, mult):
    h = 2 * 4 * dim // 3
    if mult is not None:
        h = int(mult * h)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x, cos, sin):
    # Interleaved pairs, as in titan and Meta's Llama.
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        h = self.attention_norm(x)
        q = rope(self.wq(h).view(b, s, self.heads, self.hd), cos, sin).transpose(1, 2)
        k = rope(self.wk(h).view(b, s, self.kv_heads, self.hd), cos, sin).transpose(1, 2)
        v = self.wv(h).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, dim, layers, heads, kv_heads, vocab, multiple_of, mult, tied, seq):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            Block(dim, heads, kv_heads, ffn_hidden(dim, multiple_of, mult)) for _ in range(layers)
        )
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight
        hd = dim // heads
        freqs = 1.0 / (500000.0 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(seq).float(), freqs)
        self.register_buffer("cos", torch.cos(ang)[None, :, None, :], persistent=False)
        self.register_buffer("sin", torch.sin(ang)[None, :, None, :], persistent=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.output(self.norm(x))


def flops_per_token(model, cfg, seq):
    dim, layers = cfg[0], cfg[1]
    n = sum(p.numel() for p in model.parameters())
    emb = model.tok_embeddings.weight.numel()
    return 6.0 * (n - emb) + 12.0 * layers * dim * seq


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="1B", choices=sorted(FLAVORS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="H100/H200 dense bf16")
    a = ap.parse_args()
    cfg = FLAVORS[a.flavor]
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = Llama(*cfg, seq=a.seq)
    # TorchTitan-style init (normal, std 0.02; norms at one) so the loss starts near ln(vocab).
    for name, p in model.named_parameters():
        if p.dim() > 1:
            nn.init.trunc_normal_(p, std=0.02, a=-0.04, b=0.04)
    model = model.to(dev)
    step_model = torch.compile(model) if a.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=dev.type == "cuda")
    vocab = cfg[4]
    batches = [torch.randint(0, vocab, (a.batch, a.seq + 1), device=dev) for _ in range(4)]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times, losses = [], []
    for i in range(a.warmup + a.steps):
        tokens = batches[i % len(batches)]
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = step_model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        sync()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    tok_s = a.batch * a.seq / median
    tflops = tok_s * flops_per_token(model, cfg, a.seq) / 1e12
    peak = torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None
    print(json.dumps({
        "impl": "pytorch" + ("+compile" if a.compile else ""), "device": dev.type,
        "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
        "torch": torch.__version__, "flavor": a.flavor, "batch": a.batch, "seq": a.seq,
        "step_s_median": median, "tokens_per_s": tok_s, "tflops": tflops,
        "mfu_pct": 100.0 * tflops / a.peak_tflops, "peak_device_mib": peak,
        "loss_first": losses[0], "loss_last": losses[-1],
    }))


if __name__ == "__main__":
    main()
