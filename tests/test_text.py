"""Streamed text (jaxpar/inference/text.py): incremental detokenization equals the full decode for a
Llama-2-style byte-fallback tokenizer and a byte-level BPE, both built here; stop strings are cut in
linear work, with nothing of a stop string ever sent."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from jaxpar.inference.text import Detokenizer, StopString, TextStream, is_byte_token

TEXTS = [
    "the cat and the world",
    "café crème brûlée à la carte",
    "中文 and 中文字, 日本語のテキスト",
    "emoji 😀😁 party 🎉 with the cat",
    "naïve façade — “quoted” ½ Ω≈ç√∫",
    "  two leading spaces and two trailing  ",
    "family 👩‍👩‍👧 flag 🇫🇷 tab\tnewline\nend",
    "mixed é中😀a b😂c",
]
LINES = [
    "café crème brûlée à la carte",
    "中文 中国 上下 不是 丁丙 世界",
    "emoji 😀 😁 😂 😃 party",
    "the cat and the dog, naïve façade",
] * 10
PIECES = ["▁the", "▁cat", "▁and", "▁world", "▁café", "▁Hello", "中文", "▁a", "ab"]


def llama_style() -> Tokenizer:
    """Llama-2's layout on a small vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then single
    characters and "▁"-prefixed word pieces (BPE merges left to right). A character outside the
    vocabulary (most CJK, every emoji, tab, newline) is spelled in byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    merges = []
    for char in "▁abcdefghijklmnopqrstuvwxyzHW,é中文":
        vocab.setdefault(char, len(vocab))
    for word in PIECES:
        piece = word[0]
        for char in word[1:]:
            if piece + char not in vocab:
                merges.append((piece, char))
                vocab[piece + char] = len(vocab)
            piece += char
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def metaspace_style() -> Tokenizer:
    """The same vocabulary, split and decoded by Metaspace (Mistral v0.3, Llama with legacy=False): its
    decoder strips the first token's "▁" only."""
    tok = llama_style()
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    metaspace = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), metaspace, decoders.Fuse()])
    return tok


def byte_level() -> Tokenizer:
    """GPT-2's layout: byte-level BPE trained on LINES, so some tokens end inside a character."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=alphabet, special_tokens=["<|endoftext|>"], show_progress=False
    )
    tok.train_from_iterator(LINES, trainer)
    return tok


TOKENIZERS = {"byte-fallback": llama_style(), "metaspace": metaspace_style(), "byte-level": byte_level()}


@pytest.fixture(params=list(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]


def groups(ids: list[int], rng: random.Random | None) -> list[list[int]]:
    """ids one by one (rng None), or in random groups of 1 to 4."""
    out, i = [], 0
    while i < len(ids):
        size = 1 if rng is None else rng.randint(1, 4)
        out.append(ids[i : i + size])
        i += size
    return out


def stream(make, tok, parts: list[list[int]]) -> list[str]:
    """The deltas of a fresh ``make(tok)`` fed ``parts``, the last one final."""
    detok = make(tok)
    return [detok.add(part, final=k == len(parts) - 1) for k, part in enumerate(parts)]


def check_valid_text(make, tok, seeds=range(4)) -> None:
    """For every text of TEXTS: the deltas add up to the full decode, none holds U+FFFD, and (fed one by
    one) everything settled is sent at once: text that neither ends in U+FFFD nor ends with a byte token."""
    for text in TEXTS:
        ids = tok.encode(text).ids
        full = tok.decode(ids)
        for seed in [None, *seeds]:
            deltas = stream(make, tok, groups(ids, None if seed is None else random.Random(seed)))
            assert "".join(deltas) == full, (text, seed, deltas)
            assert not any("\ufffd" in d for d in deltas), (text, seed, deltas)
        deltas = stream(make, tok, groups(ids, None))
        for i in range(1, len(ids)):
            head = tok.decode(ids[:i])
            if not head.endswith("\ufffd") and not is_byte_token(tok.id_to_token(ids[i - 1])):
                assert "".join(deltas[:i]) == head, (text, i)


def test_multibyte_text_streams_to_the_full_decode(tok):
    spelled_in_parts = [i for t in TEXTS for i in tok.encode(t).ids if "\ufffd" in tok.decode([i])]
    assert spelled_in_parts  # the texts do hold tokens that are a fraction of a character
    check_valid_text(Detokenizer, tok)
    check_valid_text(lambda t: TextStream(t, ["zzz"]), tok)


class NaiveDetokenizer:
    """A wrong detokenizer: each token decoded alone."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def add(self, ids, *, final=False):
        return "".join(self.tokenizer.decode([i]) for i in ids)


class OldTextStream:
    """TextStream as jaxpar/inference/api.py had it (commit eecae29): all ids decoded at every token, the
    new text sent only if the whole decode starts with the text sent so far."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def add(self, ids: list[int], *, final: bool = False) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids)
        if not final:
            hold = max([k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])], default=0)
            text = text[: len(text) - hold]
        if (not final and text.endswith("\ufffd")) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new


def test_the_checks_fail_for_a_naive_detokenizer(tok):
    with pytest.raises(AssertionError):
        check_valid_text(NaiveDetokenizer, tok, seeds=[])


def byte(b: int) -> int:
    return TOKENIZERS["byte-fallback"].token_to_id(f"<0x{b:02X}>")


def test_text_is_not_cut_short_when_a_later_byte_rewrites_a_run():
    """Issue 32, finding 11: "[" as a byte token, then a byte that makes its run invalid UTF-8.
    ByteFallback then decodes the whole run as U+FFFD per byte, so the decode of the first token ("[")
    is not a prefix of the full decode, and the old stream sent "[" and nothing after, ever."""
    tok = TOKENIZERS["byte-fallback"]
    words = tok.encode("the cat and the world and the cat sat on the café").ids
    ids = [byte(0x5B), byte(0x80), *words, byte(0xC3), byte(0xA9), byte(0xFF), *words]
    full = tok.decode(ids)
    assert tok.decode(ids[:1]) == "[" and not full.startswith("[")
    assert full.startswith("\ufffd\ufffd the cat") and "\ufffd\ufffd\ufffd the" in full
    old = stream(lambda t: OldTextStream(t, []), tok, groups(ids, None))
    assert "".join(old) == "[" and len(ids) > 30  # the failure seen: "[" for 30-odd tokens
    for seed in [None, 0, 1]:
        parts = groups(ids, None if seed is None else random.Random(seed))
        assert "".join(stream(lambda t: TextStream(t, []), tok, parts)) == full


def random_ids(tok, rng: random.Random) -> list[int]:
    return [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randint(1, 40))]


def test_random_ids_stream_to_the_full_decode(tok):
    """Invalid byte sequences included: the deltas add up to the full decode, U+FFFD as it renders them."""
    rng = random.Random(0)
    for _ in range(300):
        ids = random_ids(tok, rng)
        for parts in (groups(ids, None), groups(ids, rng)):
            assert "".join(stream(Detokenizer, tok, parts)) == tok.decode(ids), ids


def test_the_old_stream_fails_on_random_byte_fallback_ids():
    tok, rng = TOKENIZERS["byte-fallback"], random.Random(0)
    cases = [random_ids(tok, rng) for _ in range(100)]
    wrong = [
        ids
        for ids in cases
        if "".join(stream(lambda t: OldTextStream(t, []), tok, groups(ids, None))) != tok.decode(ids)
    ]
    assert len(wrong) > 10


def test_special_tokens_and_no_tokenizer():
    tok = TOKENIZERS["byte-fallback"]
    ids = [1, *tok.encode("the cat").ids, 2, 1, *tok.encode("and 中文").ids, 2]
    assert "".join(stream(Detokenizer, tok, groups(ids, None))) == tok.decode(ids) == "the cat and 中文"
    run = [byte(0xC3), 2, byte(0xA9)], [byte(0x46), 1, byte(0xFF)]  # decode drops <s>, </s> first: one run each
    assert [tok.decode(r) for r in run] == ["é", "\ufffd\ufffd"]
    assert ["".join(stream(Detokenizer, tok, groups(r, None))) for r in run] == ["é", "\ufffd\ufffd"]
    assert stream(Detokenizer, None, [[5], [6, 7]]) == ["", ""]
    assert stream(lambda t: TextStream(t, ["x"]), None, [[5], [6, 7]]) == ["", ""]


def test_each_token_decodes_a_short_window():
    tok = TOKENIZERS["byte-fallback"]
    ids = tok.encode(" ".join(["the cat and the world 中文 café"] * 60)).ids
    assert len(ids) > 400
    detok = Detokenizer(tok)
    text = "".join(detok.add([i]) for i in ids) + detok.add([], final=True)
    assert text == tok.decode(ids)
    assert detok.decoded <= 3 * len(ids)  # all ids at every token would be len(ids)² / 2


# ------------------------------------------------------------------------------------------ stop strings


def chars(text: str) -> list[int]:
    """Ids of the one-character pieces of the byte-fallback tokenizer ("▁" for a space): they decode to
    ``text`` as is, unless it begins with a space."""
    tok = TOKENIZERS["byte-fallback"]
    return [tok.token_to_id("▁" if c == " " else c) for c in text]


def deltas_of(text_ids: list[list[int]], stops: list[str], final_last: bool = True) -> tuple[list[str], TextStream]:
    ts = TextStream(TOKENIZERS["byte-fallback"], stops)
    last = len(text_ids) - 1
    return [ts.add(part, final=final_last and k == last) for k, part in enumerate(text_ids)], ts


def test_a_stop_string_split_across_tokens_is_cut_before_it():
    tok = TOKENIZERS["byte-fallback"]
    ids = tok.encode("the cat and the world").ids
    deltas, ts = deltas_of([[i] for i in ids], ["e ca"])
    assert "".join(deltas) == "th" and ts.stopped
    deltas, ts = deltas_of([[i] for i in ids], ["d th"])
    assert deltas[:3] == ["the", " cat", " an"] and "".join(deltas) == "the cat an" and ts.stopped


def test_held_text_is_released_when_the_stop_string_fails():
    deltas, ts = deltas_of([[i] for i in chars("xcacab")], ["cab"], final_last=False)
    assert deltas == ["x", "", "", "ca", "", ""] and ts.stopped  # "ca" held, released at the second "c"
    deltas, ts = deltas_of([[i] for i in chars("xcaz")], ["cab"])
    assert deltas == ["x", "", "", "caz"] and not ts.stopped


def test_overlapping_prefixes():
    deltas, ts = deltas_of([[i] for i in chars("abaabab")], ["abab"])
    assert deltas == ["", "", "", "aba", "", "", ""] and ts.stopped


def test_several_stops_the_first_completed_wins():
    deltas, ts = deltas_of([chars("the cat")], ["cat", "he c"])
    assert deltas == ["t"] and ts.stopped  # "he c" is complete before "cat"
    deltas, _ = deltas_of([chars("xabc")], ["bc", "abc"])
    assert deltas == ["x"]  # both end at "c": the longer starts earlier


def reference_cut(text: str, stops: list[str]) -> int | None:
    """Where the text is cut: at the start of the stop string that ends first (the longest on a tie)."""
    found = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    return min(found)[0] + min(found)[1] if found else None


def test_stops_against_a_brute_force_reference():
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 30)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        ts, sent, seen = TextStream(TOKENIZERS["byte-fallback"], stops), "", ""
        for part in groups(chars(text), rng):
            sent += ts.add(part)
            seen += TOKENIZERS["byte-fallback"].decode(part)
            if not ts.stopped:  # held: exactly the longest end of the text that begins a stop string
                hold = max((k for s in stops for k in range(1, len(s)) if seen.endswith(s[:k])), default=0)
                assert sent == seen[: len(seen) - hold], (text, stops, seen)
        sent += ts.add([], final=True)
        cut = reference_cut(text, stops)
        assert sent == (text if cut is None else text[:cut]) and ts.stopped == (cut is not None), (text, stops)


def test_a_100kB_stop_string_costs_linear_work():
    """2,000 one-character tokens against two 100 kB stop strings whose prefixes the text keeps
    matching; the old hold-back tested every prefix length at every token (O(len(stop)²) per token)."""
    stops = ["ab" * 50_000, ("aab" * 33_334)[:100_000]]
    rng = random.Random(0)
    text = "".join(rng.choice(["a", "b", "ab", "aab"]) for _ in range(600))[:998] + "bb" + "ab" * 500
    deltas, ts = deltas_of([[i] for i in chars(text)], stops, final_last=False)
    assert len(deltas) == 2000 and not ts.stopped
    assert "".join(deltas) == text[: len(text) - 1000]  # the 1,000 characters that begin stops[0]: held
    assert ts.add([], final=True) == text[-1000:]
    for s in ts.stops:
        assert s.steps <= 2 * (len(text) + len(s.stop))
    assert sum(s.steps for s in ts.stops) < 500_000  # the old hold-back: ~2,000 · 10^10 / 2 comparisons


def test_a_stop_string_automaton_alone():
    s = StopString("abab")
    assert [s.feed(c) for c in "abaabab"] == [False] * 6 + [True]
    assert s.state == 2  # "ab" of the match may begin the next one
    with pytest.raises(ValueError):
        StopString("")


# ------------------------------------------------------------------------ moved from tests/test_api.py


def test_text_stream_holds_back_a_stop_string_until_it_is_decided():
    vocab = {w: i for i, w in enumerate(["[UNK]"] + [f"w{i}" for i in range(10)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    ids = lambda text: tokenizer.encode(text).ids
    stream = TextStream(tokenizer, ["w3 w4"])
    assert stream.add(ids("w1")) == "w1"
    assert stream.add(ids("w3")) == " "  # "w3" may begin the stop string: held back
    assert stream.add(ids("w5")) == "w3 w5"
    assert stream.add(ids("w3 w4 w6")) == " " and stream.stopped  # cut before the stop string
    assert stream.add(ids("w7"), final=True) == ""
