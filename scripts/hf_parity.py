#!/usr/bin/env python3
"""Loads a folder exported by `titan convert hf-export` (Llama or Qwen3) in Hugging Face transformers and prints, as
JSON, the mean next-token cross-entropy of the given token rows and the logits of the last position
of the first row, so titan's numbers can be compared with transformers' on the same tokens.

    python3 scripts/hf_parity.py HF_DIR --tokens "256,72,101,108;256,87,111,114"

Needs torch and transformers (never a dependency of titan itself).
"""
import argparse
import json

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("--tokens", required=True, help="rows of comma-separated ids, rows split by ';'")
    a = ap.parse_args()
    rows = [[int(t) for t in r.split(",")] for r in a.tokens.split(";")]
    ids = torch.tensor(rows, dtype=torch.long)
    model = AutoModelForCausalLM.from_pretrained(a.hf_dir, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    print(json.dumps({"loss": loss.item(), "last_logits": logits[0, -1].tolist()}))


if __name__ == "__main__":
    main()
