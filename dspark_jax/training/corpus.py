"""A built-in three-domain chat corpus that needs no download, for the bundled demo models.

- math: generated grade-school word problems with worked step-by-step solutions ending in
  ``\\boxed{N}``, phrased as GSM8K prompts are (the same closing instruction), each question once;
- code: top-level functions of the running interpreter's standard library (those with a
  docstring, at most `MAX_CODE_CHARS`), asked for as "Write a python function ..." with the
  function's source as the answer;
- chat: English prose of the standard library's module and class docstrings, asked about as a
  user would ("What does the Python module `json` do?") with the docstring as the answer.

Everything is deterministic in the seed and the interpreter (the code and chat domains read its
standard library). Held-out prompts are drawn from items the training records never use.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

DOMAINS = ("math", "code", "chat")
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
MAX_CODE_CHARS = 900
MIN_PROSE_CHARS = 120
MAX_PROSE_CHARS = 900

_NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade", "Kofi",
          "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells",
          "cards", "balloons", "oranges", "crayons")


# ----------------------------------------------------------------------------- math


def _math_problem(rng: np.random.Generator) -> tuple[str, str]:
    """One word problem and its worked solution."""
    name, other = (str(x) for x in rng.choice(_NAMES, 2, replace=False))
    item = str(rng.choice(_ITEMS))
    kind = int(rng.integers(7))
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    if kind == 0:
        a, b = r(5, 60), r(2, 40)
        c = r(1, min(a + b - 1, 30))  # never more than there is
        q = (f"{name} has {a} {item}. {name} buys {b} more and then gives {c} to {other}. "
             f"How many {item} does {name} have now?")
        s = (f"{name} starts with {a} {item}.\nAfter buying {b} more, {name} has {a} + {b} = "
             f"{a + b} {item}.\nAfter giving {c} to {other}, {name} has {a + b} - {c} = "
             f"{a + b - c} {item}.\nThe answer is \\boxed{{{a + b - c}}}.")
    elif kind == 1:
        per, boxes = r(3, 12), r(2, 15)
        q = f"A box holds {per} {item}. How many {item} are in {boxes} boxes?"
        s = (f"Each box holds {per} {item}.\n{boxes} boxes hold {boxes} × {per} = {boxes * per} "
             f"{item}.\nThe answer is \\boxed{{{boxes * per}}}.")
    elif kind == 2:
        kids, each = r(2, 9), r(2, 12)
        total = kids * each
        q = (f"{name} shares {total} {item} equally among {kids} friends. How many {item} does "
             f"each friend get?")
        s = (f"There are {total} {item} and {kids} friends.\nEach friend gets {total} ÷ {kids} = "
             f"{each} {item}.\nThe answer is \\boxed{{{each}}}.")
    elif kind == 3:
        speed, hours = r(3, 12) * 10, r(2, 6)
        q = f"A train travels at {speed} km per hour for {hours} hours. How far does it travel?"
        s = (f"Distance is speed times time.\nThe train travels {speed} × {hours} = "
             f"{speed * hours} km.\nThe answer is \\boxed{{{speed * hours}}}.")
    elif kind == 4:
        price, pct = r(1, 10) * 20, int(rng.choice([10, 20, 25, 50]))  # a whole-dollar discount
        off = price * pct // 100
        q = (f"A jacket costs ${price}. It is on sale for {pct}% off. How much does the jacket "
             f"cost on sale?")
        s = (f"The discount is {pct}% of ${price}, which is {price} × {pct} ÷ 100 = ${off}.\n"
             f"The sale price is {price} - {off} = ${price - off}.\n"
             f"The answer is \\boxed{{{price - off}}}.")
    elif kind == 5:
        w, h = r(2, 20), r(2, 20)
        q = (f"A garden is {w} meters wide and {h} meters long. What is its area in square "
             f"meters?")
        s = (f"The area of a rectangle is width times length.\nThe area is {w} × {h} = {w * h} "
             f"square meters.\nThe answer is \\boxed{{{w * h}}}.")
    else:
        n, cost, paid = r(2, 8), r(2, 9), 0
        total = n * cost
        paid = (total // 10 + 1) * 10
        q = (f"{name} buys {n} notebooks at ${cost} each and pays with ${paid}. How much change "
             f"does {name} get?")
        s = (f"The notebooks cost {n} × {cost} = ${total}.\nThe change is {paid} - {total} = "
             f"${paid - total}.\nThe answer is \\boxed{{{paid - total}}}.")
    return q + MATH_SUFFIX, s


# ----------------------------------------------------------------------------- standard library


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip")
    return sorted(p for p in root.rglob("*.py")
                  if not any(part in skip or part.startswith("_") for part in p.relative_to(root).parts))


def _module_name(path: Path) -> str:
    rel = path.relative_to(Path(sysconfig.get_paths()["stdlib"])).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _prose(doc: str) -> str | None:
    """The docstring's leading paragraphs when they read as English prose, else None."""
    text = doc.strip()
    if ">>>" in text or "::" in text:
        text = text.split(">>>")[0].split("::")[0].strip()
    paragraphs, size = [], 0
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if size + len(para) > MAX_PROSE_CHARS:
            break
        paragraphs.append(para)
        size += len(para) + 2
    text = "\n\n".join(paragraphs)
    letters = sum(c.isalpha() or c.isspace() for c in text)
    if len(text) < MIN_PROSE_CHARS or letters < 0.85 * len(text) or not text[0].isupper():
        return None
    return text


def _first_sentence(doc: str) -> str:
    line = " ".join(doc.strip().split("\n\n")[0].split())
    return line.split(". ")[0].rstrip(".")


@functools.lru_cache(maxsize=1)
def _stdlib_items() -> tuple[tuple[dict, ...], tuple[dict, ...]]:
    code, chat = _read_stdlib()
    return tuple(code), tuple(chat)


def stdlib_items() -> tuple[list[dict], list[dict]]:
    """(code items, chat items) from the standard library, in a fixed order: code items are
    top-level functions with a docstring (name, signature, source); chat items are module and
    class docstrings that read as prose. Read once per process."""
    code, chat = _stdlib_items()
    return [dict(it) for it in code], [dict(it) for it in chat]


def _read_stdlib() -> tuple[list[dict], list[dict]]:
    code, chat = [], []
    for path in _stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        module = _module_name(path)
        doc = ast.get_docstring(tree)
        if doc and (text := _prose(doc)):
            chat.append({"id": f"module:{module}", "question": f"What does the Python module "
                         f"`{module}` do?", "answer": text})
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                doc = ast.get_docstring(node)
                if not node.name.startswith("_") and doc and (text := _prose(doc)):
                    chat.append({"id": f"class:{module}.{node.name}", "question":
                                 f"Explain what the `{node.name}` class in Python's `{module}` "
                                 f"module is for.", "answer": text})
            elif isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                segment = ast.get_source_segment(source, node)
                if not doc or not segment or len(segment) > MAX_CODE_CHARS or node.decorator_list:
                    continue
                summary = _first_sentence(doc)
                if len(summary) < 12 or not summary[0].isalpha():
                    continue
                args = ast.unparse(node.args)
                code.append({"id": f"function:{module}.{node.name}",
                             "question": f"Write a python function `{node.name}({args})` for "
                                         f"this task: {summary}.",
                             "answer": f"```python\n{segment}\n```"})
    return code, chat


# ----------------------------------------------------------------------------- records


def _held_out(item_id: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(item_id.encode()).digest()[:8], "little")
    return h / 2 ** 64 < fraction


def domain_items(domain: str, *, seed: int, math_items: int = 4000) -> list[dict]:
    """Every item of a domain: {"id", "question", "answer"}."""
    if domain == "math":  # `math_items` drawn; a question drawn before is dropped (ids keep i)
        rng = np.random.default_rng(seed)
        items, seen = [], set()
        for i in range(math_items):
            q, a = _math_problem(rng)
            if q not in seen:
                seen.add(q)
                items.append({"id": f"math:{i}", "question": q, "answer": a})
        return items
    code, chat = stdlib_items()
    if domain == "code":
        return code
    if domain == "chat":
        return chat
    raise ValueError(f"domain {domain!r}: expected one of {', '.join(DOMAINS)}")


def split(items: list[dict], held_out_fraction: float) -> tuple[list[dict], list[dict]]:
    """(training items, held-out items), by a hash of each item's id (stable across runs)."""
    held = [it for it in items if _held_out(it["id"], held_out_fraction)]
    keep = [it for it in items if not _held_out(it["id"], held_out_fraction)]
    return keep, held


def iter_records(items: list[dict]) -> Iterator[dict]:
    for it in items:
        yield {"id": it["id"], "conversations": [{"role": "user", "content": it["question"]},
                                                 {"role": "assistant", "content": it["answer"]}]}


def write_corpus(out_dir: str | Path, *, seed: int = 0, held_out_fraction: float = 0.05,
                 math_items: int = 4000) -> dict:
    """Writes OUT/train.jsonl (every domain's training conversations, shuffled), OUT/{domain}.jsonl
    (held-out conversations with their reference answers) and OUT/prompts/{domain}.jsonl (the
    held-out questions as prompt records, with their domain). Returns counts per domain."""
    out = Path(out_dir)
    (out / "prompts").mkdir(parents=True, exist_ok=True)
    train, counts = [], {}
    for domain in DOMAINS:
        keep, held = split(domain_items(domain, seed=seed, math_items=math_items), held_out_fraction)
        train += list(iter_records(keep))
        counts[domain] = {"train": len(keep), "held_out": len(held)}
        with open(out / f"{domain}.jsonl", "w", encoding="utf-8") as f:
            for rec in iter_records(held):
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        with open(out / "prompts" / f"{domain}.jsonl", "w", encoding="utf-8") as f:
            for it in held:
                f.write(json.dumps({"id": it["id"], "domain": domain, "turns": [it["question"]]},
                                   ensure_ascii=False) + "\n")
    order = np.random.default_rng(seed).permutation(len(train))
    with open(out / "train.jsonl", "w", encoding="utf-8") as f:
        for i in order:
            f.write(json.dumps(train[i], ensure_ascii=False) + "\n")
    return counts
