#!/usr/bin/env python3
"""Trains a Hugging Face Llama folder with PyTorch's AdamW on the windows titan's data loader reads
from a uint32 token shard, and prints each step's loss and gradient norm as JSON, so a titan run of
the same weights, data and optimizer can be compared step by step.

    python3 scripts/hf_train_parity.py HF_DIR --tokens FILE.bin --batch 2 --seq 64 --steps 20 \
        --lr 3e-3 --warmup 2 --document-start 1

With --document-start the attention is block-causal, as titan's `[model] attn_mask_type =
"block_causal"`: position_ids restart at 0 at every document start and at each window's first
token, and a 4-D mask lets a token see only the earlier tokens of its own document. Without it,
plain causal attention. The schedule is titan's (linear warm-up from 1/(warmup+1), then linear
decay over the remaining steps to 0, `src/train/lr.rs`); gradients are clipped as
`clip_grad_norm_` does. With --targets (supervised fine-tuning) the labels of tokens that are not
targets are -100 and the loss is `cross_entropy(ignore_index=-100)`, the mean over the rest.
Needs torch and transformers (never a dependency of titan itself).
"""
import argparse
import json

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def lr_factor(step, warmup, total):
    if step <= warmup:
        return step / (warmup + 1)
    decay = total - warmup
    return 1.0 - min((step - warmup) / (decay + 1), 1.0)


def document_positions(row, start):
    positions, following = [], 0
    for token in row:
        if token == start:
            following = 0
        positions.append(following)
        following += 1
    return positions


def block_causal_inputs(inputs, start):
    """position_ids and the additive 4-D mask of block-causal attention over `inputs`."""
    positions = torch.tensor([document_positions(r, start) for r in inputs.tolist()])
    document = (positions == 0).cumsum(-1)
    seq = inputs.shape[1]
    same = document[:, :, None] == document[:, None, :]
    allowed = same & torch.tril(torch.ones(seq, seq, dtype=torch.bool))
    mask = torch.zeros(allowed.shape, dtype=torch.float32)
    mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return positions, mask[:, None]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("--tokens", required=True, help="a little-endian uint32 token shard")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--document-start", type=int)
    ap.add_argument(
        "--targets",
        help="a uint8 file aligned with --tokens: 0 where the token is not a target "
        "(a chat sample's prompt: its label is -100, as ignore_index skips it)",
    )
    a = ap.parse_args()

    torch.use_deterministic_algorithms(True)
    tokens = np.fromfile(a.tokens, dtype="<u4").astype(np.int64)
    counts = np.fromfile(a.targets, dtype=np.uint8) if a.targets else np.ones(len(tokens), np.uint8)
    window = a.seq + 1
    windows = len(tokens) // window
    model = AutoModelForCausalLM.from_pretrained(
        a.hf_dir, torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=a.lr, betas=tuple(a.betas), eps=a.eps, weight_decay=a.weight_decay
    )
    taken, out = 0, []
    for step in range(1, a.steps + 1):
        rows, masks = [], []
        for _ in range(a.batch):
            w = taken % windows
            rows.append(tokens[w * window:(w + 1) * window])
            masks.append(counts[w * window:(w + 1) * window])
            taken += 1
        ids = torch.tensor(np.stack(rows))
        inputs = ids[:, :-1]
        counted = torch.tensor(np.stack(masks)[:, 1:] != 0)
        targets = torch.where(counted, ids[:, 1:], torch.full_like(ids[:, 1:], -100))
        kwargs = {}
        if a.document_start is not None:
            kwargs["position_ids"], kwargs["attention_mask"] = block_causal_inputs(
                inputs, a.document_start
            )
        logits = model(input_ids=inputs, **kwargs).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
        )
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, a.max_norm if a.max_norm > 0 else float("inf"))
        for group in opt.param_groups:
            group["lr"] = a.lr * lr_factor(step, a.warmup, a.steps)
        opt.step()
        out.append({"step": step, "loss": loss.item(), "grad_norm": norm.item()})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
