"""RULER-style synthetic retrieval in real Wikipedia haystacks, built deterministically at load time.

Four tasks after RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"), §3: needle (one key, one value), multi-key (one wanted key among
distractor keys), multi-value (every value of one key) and variable tracking (follow a chain of
``VAR X = VAR Y`` assignments back to a number). Needles are retrieval targets that attention
barely touches after they are read, which is exactly what KV cache eviction and coarse
quantization tend to lose, so these tasks are sensitive to compression where perplexity is not.

The haystack is a contiguous run of ``haystack_words`` words from the shipped filler articles
(:func:`.corpus.filler_words`); needles go in at sentence ends near their depth. Every sample is
a pure function of ``(task, seed, sample index)``, so two runs score the same prompts. Settings
reach the builders as lm-eval task metadata (``--metadata '{"haystack_words": 3000}'``):

* ``num_samples`` (default 50), ``haystack_words`` (default 1000, about 1,300 SmolLM2 tokens),
  ``seed`` (default 0); ``num_needles`` for multi-key/multi-value (default 4); ``num_hops`` for
  variable tracking (default 4).

Scoring (:func:`process_results`) is RULER's ``string_match_all``: the fraction of expected
strings found in the generation, case-insensitively.
"""

from __future__ import annotations

import random
import string

from .corpus import filler_words

ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
              "lively", "mellow", "nimble", "odd", "plain", "quiet", "rapid", "silent", "tidy", "upbeat", "vivid",
              "witty", "young", "zesty")
NOUNS = ("anchor", "badger", "candle", "dragon", "ember", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchid", "pebble", "quarry", "river", "saddle", "tunnel",
         "umbrella", "violin", "walrus", "yacht", "zephyr")

INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
         "I will quiz you about the numbers afterwards.\n")
VT_INTRO = ("Memorize and track the chain of variable assignment hidden in the following text.\n")
NEEDLE = "One of the special magic numbers for {key} is: {value}."


def _settings(kwargs: dict, **defaults) -> dict:
    """Pick this builder's settings out of lm-eval's task metadata (which also carries model args)."""
    out = {}
    for name, default in defaults.items():
        value = kwargs.get(name, default)
        lowest = 0 if name == "seed" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
            raise ValueError(f"task setting {name} must be an integer >= {lowest}, got {value!r}")
        out[name] = value
    return out


def _rng(task: str, seed: int, index: int) -> random.Random:
    # A string seed is hashed with SHA-512 by random.Random, so it is stable across runs and
    # interpreters (unlike hash()).
    return random.Random(f"{task}:{seed}:{index}")


def haystack(rng: random.Random, n_words: int) -> list[str]:
    """A contiguous run of ``n_words`` filler words from a random sentence start."""
    pool = filler_words()
    slack = 100  # room to move the start forward to the next sentence
    if n_words + slack > len(pool):
        raise ValueError(f"haystack_words={n_words} exceeds the shipped filler text ({len(pool) - slack} words at most)")
    start = rng.randrange(len(pool) - n_words - slack + 1)
    for _ in range(slack):
        if start == 0 or pool[start - 1].endswith((".", "!", "?")):
            break
        start += 1
    return list(pool[start:start + n_words])


def insert(words: list[str], sentences: list[str], depths: list[float]) -> str:
    """Join ``words`` with each sentence placed after the first sentence end at or past its depth.

    Depths are fractions of the haystack (0 = start, 1 = end); sentences keep their order when
    their depths are sorted, which variable tracking relies on (an assignment must follow the one
    it refers to).
    """
    slots: dict[int, list[str]] = {}
    n = len(words)
    for sent, depth in zip(sentences, depths):
        i = min(int(depth * n), n)
        while 0 < i < n and not words[i - 1].endswith((".", "!", "?")):
            i += 1
        slots.setdefault(i, []).append(sent)
    out = []
    for i in range(n + 1):
        out.extend(slots.get(i, ()))
        if i < n:
            out.append(words[i])
    return " ".join(out)


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in taken:
            taken.add(key)
            return key


def _number(rng: random.Random, taken: set[str]) -> str:
    while True:
        value = str(rng.randint(1_000_000, 9_999_999))
        if value not in taken:
            taken.add(value)
            return value


def _dataset(rows: list[dict]):
    import datasets

    return {"test": datasets.Dataset.from_list(rows)}


def niah_sample(task: str, seed: int, index: int, haystack_words: int, num_needles: int, multivalue: bool) -> dict:
    """One needle sample: ``num_needles`` needles, one asked key (all needles share it when ``multivalue``)."""
    rng = _rng(task, seed, index)
    words = haystack(rng, haystack_words)
    keys: set[str] = set()
    values: set[str] = set()
    asked = _key(rng, keys)
    needles, answers = [], []
    for j in range(num_needles):
        key = asked if (multivalue or j == 0) else _key(rng, keys)
        value = _number(rng, values)
        needles.append(NEEDLE.format(key=key, value=value))
        if key == asked:
            answers.append(value)
    order = list(range(num_needles))
    rng.shuffle(order)  # the asked needle is not always the first one inserted
    depths = sorted(rng.random() for _ in range(num_needles))
    text = insert(words, [needles[k] for k in order], depths)
    if multivalue:
        question = f"What are all the special magic numbers for {asked} mentioned in the provided text?"
        prefix = f"The special magic numbers for {asked} mentioned in the provided text are"
    else:
        question = f"What is the special magic number for {asked} mentioned in the provided text?"
        prefix = f"The special magic number for {asked} mentioned in the provided text is"
    return {"input": f"{INTRO}{text}\n{question}\n", "gen_prefix": prefix, "outputs": answers,
            "depths": depths, "haystack_words": haystack_words}


def vt_sample(task: str, seed: int, index: int, haystack_words: int, num_hops: int) -> dict:
    """One variable-tracking sample: ``VAR A = <number>``, then ``num_hops`` assignments ``VAR B = VAR A`` ..."""
    rng = _rng(task, seed, index)
    words = haystack(rng, haystack_words)
    names: set[str] = set()

    def var() -> str:
        while True:
            name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if name not in names:
                names.add(name)
                return name

    value = str(rng.randint(10_000, 99_999))
    chain = [var() for _ in range(num_hops + 1)]
    statements = [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
    depths = sorted(rng.random() for _ in statements)
    text = insert(words, statements, depths)
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    prefix = (f"Answer: According to the chain of variable assignment in the text above, {len(chain)} variables "
              f"are assigned the value {value}, they are:")
    return {"input": f"{VT_INTRO}{text}\n{question}\n", "gen_prefix": prefix, "outputs": chain,
            "depths": depths, "haystack_words": haystack_words}


def niah_single(**kwargs):
    """lm-eval ``custom_dataset`` of ``leankit_niah_single``: one needle per haystack."""
    s = _settings(kwargs, num_samples=50, haystack_words=1000, seed=0)
    return _dataset([niah_sample("niah_single", s["seed"], i, s["haystack_words"], 1, False)
                     for i in range(s["num_samples"])])


def niah_multikey(**kwargs):
    """lm-eval ``custom_dataset`` of ``leankit_niah_multikey``: the asked key among distractor keys."""
    s = _settings(kwargs, num_samples=50, haystack_words=1000, seed=0, num_needles=4)
    return _dataset([niah_sample("niah_multikey", s["seed"], i, s["haystack_words"], s["num_needles"], False)
                     for i in range(s["num_samples"])])


def niah_multivalue(**kwargs):
    """lm-eval ``custom_dataset`` of ``leankit_niah_multivalue``: every value of one key."""
    s = _settings(kwargs, num_samples=50, haystack_words=1000, seed=0, num_needles=4)
    return _dataset([niah_sample("niah_multivalue", s["seed"], i, s["haystack_words"], s["num_needles"], True)
                     for i in range(s["num_samples"])])


def variable_tracking(**kwargs):
    """lm-eval ``custom_dataset`` of ``leankit_vt``: follow one assignment chain of ``num_hops`` hops."""
    s = _settings(kwargs, num_samples=50, haystack_words=1000, seed=0, num_hops=4)
    return _dataset([vt_sample("vt", s["seed"], i, s["haystack_words"], s["num_hops"])
                     for i in range(s["num_samples"])])


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of ``references`` that occur in ``prediction`` (case-insensitive), RULER's metric."""
    pred = prediction.lower()
    return sum(ref.lower() in pred for ref in references) / len(references)


def process_results(doc: dict, results: list[str]) -> dict:
    """lm-eval ``process_results``: ``{"match": string_match_all(generation, expected)}``."""
    return {"match": string_match_all(results[0].strip(), doc["outputs"])}
