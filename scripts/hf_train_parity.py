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
With --lora-adapters (a titan checkpoint's model.safetensors holding `{linear}.lora_a.weight` and
`{linear}.lora_b.weight`) the linears that have adapters become LoRA linears written here,
`base(x) + alpha/rank · (x·Aᵀ)·Bᵀ`, every other weight frozen, and AdamW trains the adapters
alone; --lora-out writes their final values (titan's names and RoPE layout) as JSON.
With --param-groups (JSON: a list of {"match": [patterns], "lr", "weight_decay", "betas"}, as
titan's `[[optimizer.param_groups]]`) each parameter, by its titan name, goes to the first group
a pattern of which matches it (`*` any characters), the rest to the default group; the schedule
scales every group's lr.
With --optimizer Muon, `torch.optim.Muon` (--muon JSON: titan's `[optimizer]` Muon keys) updates
every 2-D weight but the embedding and the output head, and `torch.optim.AdamW` the rest at
`adamw_lr`; with `ns_dtype = "float32"` PyTorch's own Newton–Schulz runs with float32 in place of
bfloat16 (its module sees a `torch` whose bfloat16 is float32), nothing else changed.
With --state-dtype bfloat16 every optimizer state tensor is rounded to bf16 after each step
(titan's `[optimizer] state_dtype = "bfloat16"`: bf16 storage, fp32 arithmetic).
With --param-dtype bfloat16 the model computes as FSDP2's `MixedPrecisionPolicy(param_dtype=
bfloat16, reduce_dtype=float32)` has it (titan's `[training] mixed_precision_param = "bfloat16"`):
each step the float32 master weights are cast to a bfloat16 copy of the model, which runs the
forward and backward in bfloat16 (its logits cast to float32 for the loss, as TorchTitan's
cross-entropy does); its gradients, cast to float32, are the masters' for clipping and AdamW.
Needs torch and transformers (never a dependency of titan itself).
"""
import argparse
import copy
import fnmatch
import json
import types

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


# titan's linear names inside a block, and transformers' module paths for them.
HF_LINEARS = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
}


class LoRALinear(torch.nn.Module):
    """A frozen linear plus a trained low-rank update: base(x) + scale · (x·Aᵀ)·Bᵀ."""

    def __init__(self, base, a, b, scale):
        super().__init__()
        self.base, self.scale = base, scale
        self.lora_a = torch.nn.Parameter(a.clone())
        self.lora_b = torch.nn.Parameter(b.clone())

    def forward(self, x):
        return self.base(x) + self.scale * ((x @ self.lora_a.T) @ self.lora_b.T)


HF_TO_TITAN = [
    ("self_attn.q_proj", "attention.wq"),
    ("self_attn.k_proj", "attention.wk"),
    ("self_attn.v_proj", "attention.wv"),
    ("self_attn.o_proj", "attention.wo"),
    ("self_attn.q_norm", "attention.q_norm"),
    ("self_attn.k_norm", "attention.k_norm"),
    ("mlp.gate_proj", "feed_forward.w1"),
    ("mlp.down_proj", "feed_forward.w2"),
    ("mlp.up_proj", "feed_forward.w3"),
    ("post_attention_layernorm", "ffn_norm"),
    ("input_layernorm", "attention_norm"),
]


def titan_name(hf_name):
    """A transformers Llama/Qwen3 parameter's name in titan (TorchTitan's)."""
    fixed = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    name = hf_name.removeprefix("model.")
    for hf, titan in HF_TO_TITAN:
        name = name.replace(hf, titan)
    return name


def param_groups(model, spec, a):
    """torch.optim param groups from titan's `[[optimizer.param_groups]]` (JSON)."""
    groups = [{"params": [], "base_lr": a.lr} for _ in spec] + [{"params": [], "base_lr": a.lr}]
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        titan = titan_name(name)
        at = next(
            (i for i, g in enumerate(spec) if any(fnmatch.fnmatchcase(titan, m) for m in g["match"])),
            len(spec),
        )
        groups[at]["params"].append(p)
    for g, s in zip(groups, spec):
        if "lr" in s:
            g["base_lr"] = s["lr"]
        if "weight_decay" in s:
            g["weight_decay"] = s["weight_decay"]
        if "betas" in s:
            g["betas"] = tuple(s["betas"])
    return [g for g in groups if g["params"]]


class _Float32Torch(types.SimpleNamespace):
    """`torch` as torch.optim._muon sees it with ns_dtype float32: bfloat16 means float32."""

    bfloat16 = torch.float32

    def __getattr__(self, name):
        return getattr(torch, name)


def muon_optimizers(model, a, lr):
    """torch.optim.Muon on the blocks' matrices and AdamW on the rest (titan's split)."""
    import torch.optim._muon as muon_module

    keys = json.loads(a.muon)
    if keys.get("ns_dtype", "bfloat16") == "float32":
        muon_module.torch = _Float32Torch()
    matrices, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        titan = titan_name(name)
        is_matrix = p.ndim == 2 and titan not in ("tok_embeddings.weight", "output.weight")
        (matrices if is_matrix else rest).append(p)
    muon = torch.optim.Muon(
        [{"params": matrices, "base_lr": lr}],
        lr=lr,
        weight_decay=a.weight_decay,
        momentum=keys.get("momentum", 0.95),
        nesterov=keys.get("nesterov", True),
        ns_coefficients=tuple(keys.get("ns_coefficients", (3.4445, -4.775, 2.0315))),
        eps=keys.get("ns_eps", 1e-7),
        ns_steps=keys.get("ns_steps", 5),
        adjust_lr_fn=keys.get("adjust_lr_fn", "original"),
    )
    adamw_lr = keys.get("adamw_lr", lr)
    adamw = torch.optim.AdamW(
        [{"params": rest, "base_lr": adamw_lr}],
        lr=adamw_lr,
        betas=tuple(a.betas),
        eps=a.eps,
        weight_decay=a.weight_decay,
    )
    return [muon, adamw]


def rope_heads(model, linear):
    """Heads whose rows titan keeps interleaved (q and k): HF's halves are a row permutation."""
    cfg = model.config
    return {"attention.wq": cfg.num_attention_heads, "attention.wk": cfg.num_key_value_heads}.get(
        linear
    )


def to_hf_rows(b, heads):
    rank = b.shape[1]
    return b.reshape(heads, -1, 2, rank).transpose(1, 2).reshape(-1, rank)


def to_titan_rows(b, heads):
    rank = b.shape[1]
    return b.reshape(heads, 2, -1, rank).transpose(1, 2).reshape(-1, rank)


def add_lora(model, path, alpha):
    """Wraps every linear with adapters in `path` (titan's names); returns {titan stem: module}."""
    from safetensors.torch import load_file

    saved = load_file(path)
    model.requires_grad_(False)
    adapted = {}
    for name in saved:
        if not name.endswith(".lora_a.weight"):
            continue
        stem = name[: -len(".lora_a.weight")]
        _, layer, linear = stem.split(".", 2)
        a, b = saved[f"{stem}.lora_a.weight"], saved[f"{stem}.lora_b.weight"]
        heads = rope_heads(model, linear)
        if heads:
            b = to_hf_rows(b, heads)
        parent_path, attr = HF_LINEARS[linear].split(".")
        parent = getattr(model.model.layers[int(layer)], parent_path)
        module = LoRALinear(getattr(parent, attr), a, b, alpha / a.shape[0])
        setattr(parent, attr, module)
        adapted[stem] = (module, heads)
    return adapted


def adapters_json(adapted):
    out = {}
    for stem, (module, heads) in adapted.items():
        b = module.lora_b.detach()
        out[f"{stem}.lora_a.weight"] = module.lora_a.detach().flatten().tolist()
        out[f"{stem}.lora_b.weight"] = (to_titan_rows(b, heads) if heads else b).flatten().tolist()
    return out


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
    ap.add_argument("--param-groups", help="titan's [[optimizer.param_groups]] as JSON")
    ap.add_argument(
        "--optimizer",
        choices=["AdamW", "Adam", "Muon"],
        default="AdamW",
        help="titan's [optimizer] name: Adam adds the weight decay to the gradient (L2)",
    )
    ap.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--muon", default="{}", help="titan's [optimizer] Muon keys as JSON")
    ap.add_argument("--lora-adapters", help="a titan model.safetensors holding the adapters")
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--lora-out", help="where to write the final adapters (JSON)")
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
    adapted = add_lora(model, a.lora_adapters, a.lora_alpha) if a.lora_adapters else {}
    params = [p for p in model.parameters() if p.requires_grad]
    spec = json.loads(a.param_groups) if a.param_groups else []
    groups = param_groups(model, spec, a) if spec else [{"params": params, "base_lr": a.lr}]
    if a.optimizer == "Muon":
        opts = muon_optimizers(model, a, a.lr)
    else:
        optimizer = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[a.optimizer]
        opts = [optimizer(groups, lr=a.lr, betas=tuple(a.betas), eps=a.eps, weight_decay=a.weight_decay)]
    # bf16 mixed precision: the compute copy the forward and backward run on.
    compute = copy.deepcopy(model).to(torch.bfloat16) if a.param_dtype == "bfloat16" else model
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
        if compute is not model:
            with torch.no_grad():
                for c, m in zip(compute.parameters(), model.parameters()):
                    c.copy_(m)
                    c.grad = None
        logits = compute(input_ids=inputs, **kwargs).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
        )
        for opt in opts:
            opt.zero_grad()
        loss.backward()
        if compute is not model:
            for c, m in zip(compute.parameters(), model.parameters()):
                m.grad = None if c.grad is None else c.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(params, a.max_norm if a.max_norm > 0 else float("inf"))
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * lr_factor(step, a.warmup, a.steps)
            opt.step()
            if a.state_dtype == "bfloat16":
                for state in opt.state.values():
                    for t in state.values():
                        if torch.is_tensor(t) and t.is_floating_point() and t.dim() > 0:
                            t.copy_(t.to(torch.bfloat16).to(torch.float32))
        out.append({"step": step, "loss": loss.item(), "grad_norm": norm.item()})
    if a.lora_out:
        with open(a.lora_out, "w") as f:
            json.dump(adapters_json(adapted), f)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
