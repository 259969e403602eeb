#!/usr/bin/env python3
"""Static instruction counts of a kernel's main loop, from its SASS, without a GPU.

    titan cuda compile --arch sm_90 --out DIR
    cuobjdump -sass DIR/titan_sm_90.cubin > k.sass     # cuobjdump: CUDA toolkit, or triton's copy
    scripts/sass_loop_stats.py k.sass attention_forward_tc64 [more kernels...]

For each kernel it finds the largest loop that holds tensor-core instructions (a backward branch
and its target) and prints how many instructions of each kind one pass of its body issues per
warp: the tensor-core MMAs (HMMA), shared-memory matrix loads (LDSM), special-function ops such as
exp2 (MUFU), fp32 arithmetic, and the rest. Where the body branches, the pass counted is the full
one: the most MMAs, then the fewest instructions (for attention: a tile without the causal mask);
`longest` gives the longest pass's total. The ratio of other instructions to HMMAs tells
whether a loop can keep the tensor cores fed: a warp scheduler issues one instruction per cycle, and
an HMMA occupies the tensor core of its sub-partition for several.
"""

import collections
import re
import sys

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")
KINDS = [
    ("HMMA", ("HMMA",)),
    ("LDSM", ("LDSM",)),
    ("MUFU", ("MUFU",)),
    ("fp32", ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FCHK")),
    ("convert", ("F2FP", "F2F", "I2F", "F2I")),
    ("shuffle", ("SHFL",)),
    ("shared/global", ("LDS", "STS", "LDG", "STG", "LDGSTS", "LDGDEPBAR", "DEPBAR")),
    ("integer", ("IMAD", "IADD3", "ISETP", "LEA", "LOP3", "SHF", "SEL", "IABS", "IMNMX", "MOV")),
]


def kernels(path):
    current, body = None, []
    for line in open(path):
        m = re.search(r"Function : (\S+)", line)
        if m:
            if current:
                yield current, body
            current, body = m.group(1), []
            continue
        m = INSTRUCTION.search(line)
        if m and current:
            predicate = (m.group(2) or "").strip()
            body.append((int(m.group(1), 16), m.group(3), predicate + " " + m.group(4)))
    if current:
        yield current, body


def kind(opcode):
    base = opcode.split(".")[0]
    for name, prefixes in KINDS:
        if base in prefixes:
            return name
    return "other"


def main_loop(body):
    """The loop (a backward branch and its target, holding no EXIT) with the most HMMA instructions,
    the shortest of those on a tie. Backward jumps that close out-of-line code (the fallbacks of
    divergent shuffles) span only part of the real loop's MMAs, so they lose."""
    by_address = {a: i for i, (a, _, _) in enumerate(body)}
    best, best_key = None, None
    for i, (address, opcode, operands) in enumerate(body):
        if not opcode.startswith("BRA"):
            continue
        m = re.search(r"0x([0-9a-f]+)", operands)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= address or target not in by_address:
            continue
        loop = body[by_address[target] : i + 1]
        if any(op.startswith("EXIT") for _, op, _ in loop):
            continue
        key = (sum(op.startswith("HMMA") for _, op, _ in loop), -len(loop))
        if key[0] > 0 and (best_key is None or key > best_key):
            best, best_key = loop, key
    return best


def passes(loop):
    """The full pass through the loop body (the most HMMAs, then the fewest instructions: a tile
    that does all of its work by the cheapest branches) and the longest pass's length."""
    index = {address: i for i, (address, _, _) in enumerate(loop)}
    n = len(loop)
    # best[i]: (-hmma, length, instructions) of the chosen path from i to the back branch.
    best, longest = [None] * (n + 1), [0] * (n + 1)
    best[n] = (0, 0, [])
    for i in range(n - 1, -1, -1):
        _, opcode, operands = loop[i]
        successors = [n] if i == n - 1 else []
        if opcode.startswith("BRA") and i < n - 1:
            m = re.search(r"0x([0-9a-f]+)", operands)
            target = index.get(int(m.group(1), 16)) if m else None
            if target is not None and target > i:
                successors.append(target)
            # Only a plain, unpredicated BRA always jumps (BRA.DIV and the like fall through).
            if operands.lstrip().startswith("@") or opcode != "BRA":
                successors.append(i + 1)
        elif i < n - 1 and not opcode.startswith("EXIT"):
            successors.append(i + 1)
        reachable = [j for j in successors if best[j] is not None]
        if reachable:
            j = min(reachable, key=lambda j: best[j][:2])
            hmma = best[j][0] - (1 if opcode.startswith("HMMA") else 0)
            best[i] = (hmma, best[j][1] + 1, [loop[i]] + best[j][2])
            longest[i] = 1 + max(longest[j] for j in reachable)
    return (best[0][2] if best[0] else None), longest[0]


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    wanted = set(sys.argv[2:])
    found = set()
    print(f"{'kernel':34} {'total':>6} " + " ".join(f"{k:>13}" for k, _ in KINDS) + "   other  other/HMMA  longest")
    for name, body in kernels(sys.argv[1]):
        if name not in wanted:
            continue
        found.add(name)
        loop = main_loop(body)
        if loop is None:
            print(f"{name:34} no loop with HMMA instructions")
            continue
        path, longest = passes(loop)
        if path is None:
            print(f"{name:34} no pass through the loop found")
            continue
        counts = collections.Counter(kind(op) for _, op, _ in path)
        hmma = max(counts["HMMA"], 1)
        cells = " ".join(f"{counts[k]:>13}" for k, _ in KINDS)
        print(
            f"{name:34} {len(path):>6} {cells} {counts['other']:>7} "
            f"{(len(path) - counts['HMMA']) / hmma:>10.2f} {longest:>8}"
        )
    missing = wanted - found
    if missing:
        sys.exit(f"not in {sys.argv[1]}: {', '.join(sorted(missing))}")


if __name__ == "__main__":
    main()
