"""Streamed text per token: jaxpar/inference/text.py's TextStream against the one api.py had before it.

    python benchmarks/text_stream.py --out benchmarks/results/text_stream.json     # ~1 min on a 2-core CPU

Prints one JSON object (and writes it to ``--out``). The tokenizer is a byte-level BPE (GPT-2's layout)
trained here on a few lines of English, accented Latin, Chinese and emoji; the generated text is those
lines, encoded, repeated. The old ``TextStream`` is read from ``git show REV:jaxpar/inference/api.py``
(``--before``, default eecae29, the commit before text.py) and run from that source.

* ``stop_100kB``: one stop string of 100,000 characters that the text never completes. The old stream
  tests every prefix length of the stop string at every token, so only its first ``--old-tokens`` tokens
  are timed; the new one runs all ``--tokens``.
* ``no_stop``: no stop string, ``--tokens`` tokens. The old stream decodes all ids at every token.

For each: seconds per ``add`` call (one token, not final), mean, median and mean of the last 100, and
whether the text produced equals the full decode of the same ids. Wall-clock times on a shared host are
noisy; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxpar.inference.text import TextStream

ROOT = Path(__file__).resolve().parent.parent
LINES = [
    "The cat sat on the mat, and the dog watched it from the door.",
    "café crème brûlée à la carte, naïve façade",
    "中文 中国 上下 不是 世界 你好",
    "emoji 😀 😁 😂 party 🎉",
]


def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        LINES * 10, trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False)
    )
    return tok


def old_text_stream(rev: str):
    """The TextStream class of jaxpar/inference/api.py at ``rev``, run from that source."""
    source = subprocess.run(
        ["git", "show", f"{rev}:jaxpar/inference/api.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    module = sys.modules["old_api"] = types.ModuleType("old_api")  # dataclasses look their module up
    exec(compile(source, f"{rev}:jaxpar/inference/api.py", "exec"), module.__dict__)
    return module.TextStream


def timed(make, ids: list[int], count: int) -> dict:
    """Feed the first ``count`` ids one per ``add``, each call timed, then ``add([], final=True)``
    (not timed); seconds per call and the text."""
    stream, times, parts = make(), [], []
    for k in range(count):
        start = time.perf_counter()
        parts.append(stream.add([ids[k]]))
        times.append(time.perf_counter() - start)
    parts.append(stream.add([], final=True))
    return {
        "tokens": count,
        "seconds_per_token_mean": statistics.fmean(times),
        "seconds_per_token_median": statistics.median(times),
        "seconds_per_token_mean_last_100": statistics.fmean(times[-100:]),
        "text_equals_full_decode": None,  # filled by the caller
        "_text": "".join(parts),
    }


def scenario(tok, ids, stops, tokens, old_tokens, old_cls) -> dict:
    out = {}
    for name, cls, count in [("after", TextStream, tokens), ("before", old_cls, old_tokens)]:
        if cls is None:
            continue
        result = timed(lambda cls=cls: cls(tok, stops), ids, count)
        result["text_equals_full_decode"] = result.pop("_text") == tok.decode(ids[:count])
        out[name] = result
    if "before" in out:
        out["before_over_after_median"] = (
            out["before"]["seconds_per_token_median"] / out["after"]["seconds_per_token_median"]
        )
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the JSON here too")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--old-tokens", type=int, default=20, help="tokens timed for the old stream, 100 kB stop")
    ap.add_argument("--before", default="eecae29", help="the git revision whose api.py holds the old TextStream")
    args = ap.parse_args(argv)
    tok = tokenizer()
    line_ids = [i for line in LINES for i in tok.encode(line + " ").ids]
    ids = (line_ids * (args.tokens // len(line_ids) + 1))[: args.tokens]
    old_cls = old_text_stream(args.before) if args.before else None
    stop = ("The cat sat on the mat. " * 5000)[:100_000]
    assert stop not in tok.decode(ids)
    result = {
        "load_average_before": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "tokenizer": f"byte-level BPE, {tok.get_vocab_size()} tokens, trained on LINES",
        "before_revision": args.before,
        "stop_100kB": scenario(tok, ids, [stop], args.tokens, args.old_tokens, old_cls),
        "no_stop": scenario(tok, ids, [], args.tokens, args.tokens, old_cls),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
