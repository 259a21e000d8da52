"""Build the text that ships with leankit's offline lm-eval tasks (``leankit/eval/tasks/data/``).

The shipped files are small, deterministic extracts of two public sources that travel inside the
gensim 4.4.0 wheel (fetched once by :mod:`leankit.data`; nothing is installed):

* ``wiki.jsonl.gz``: Wikipedia articles (CC BY-SA), markup stripped by
  :func:`leankit.data.strip_wiki_markup`, each cut at a paragraph end after at most
  ``--max-chars`` characters. Articles 55-74 of :func:`leankit.data.wiki_articles` form the
  ``perplexity`` split, articles 75-98 the ``filler`` split (haystacks of the retrieval tasks).
  Articles 0-54 are left out: the repository's perplexity measurements tuned and confirmed
  configs on them. Disambiguation pages and lists are skipped (they are not prose).
* ``capitals.json``: the (capital, country) pairs of the ``capital-world`` section of
  ``questions-words.txt`` (word2vec's analogy set, Apache-2.0, as redistributed in gensim's test data).

Run from the repository root; the output is byte-identical on every run::

    python -m eval.build_task_data
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import zipfile
from pathlib import Path

from leankit.data import WIKI_WHEEL, cached_wheel, wiki_articles
from leankit.eval.tasks.corpus import cut

OUT = Path(__file__).resolve().parent.parent / "leankit" / "eval" / "tasks" / "data"
QUESTIONS_MEMBER = "gensim/test/test_data/questions-words.txt"
SPLITS = {"perplexity": range(55, 75), "filler": range(75, 99)}


def wiki_records(max_chars: int) -> list[dict]:
    """One record per shipped article: split, title, source URL and the cut text."""
    arts = wiki_articles()
    recs = []
    for split, idx in SPLITS.items():
        for i in idx:
            title, text = arts[i]
            if "(disambiguation)" in title or title.startswith("List of"):
                continue
            recs.append({"split": split, "index": i, "title": title,
                         "url": "https://en.wikipedia.org/wiki/" + title.replace(" ", "_"),
                         "text": cut(text, max_chars)})
    return recs


def capital_pairs() -> list[list[str]]:
    """Unique ``[capital, country]`` pairs of questions-words.txt's ``capital-world`` section, in file order."""
    with zipfile.ZipFile(cached_wheel(*WIKI_WHEEL)) as z:
        lines = z.read(QUESTIONS_MEMBER).decode("utf-8").splitlines()
    pairs, section = [], None
    for line in lines:
        if line.startswith(":"):
            section = line[1:].strip()
            continue
        if section != "capital-world":
            continue
        a, b, c, d = line.split()
        for pair in ([a, b], [c, d]):
            if pair not in pairs:
                pairs.append(pair)
    return pairs


def main(argv=None) -> None:
    """Write ``wiki.jsonl.gz`` and ``capitals.json`` into the task data folder."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-chars", type=int, default=8000, help="characters kept per article (paragraph-aligned)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    # mtime=0 and no file name in the header: the archive is the same bytes on every run.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        for rec in wiki_records(a.max_chars):
            gz.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
    (out / "wiki.jsonl.gz").write_bytes(buf.getvalue())
    (out / "capitals.json").write_text(json.dumps(capital_pairs(), indent=0) + "\n")
    print(f"wrote {out / 'wiki.jsonl.gz'} ({len(buf.getvalue())} bytes) and {out / 'capitals.json'}")


if __name__ == "__main__":
    main()
