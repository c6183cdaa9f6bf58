"""The claims index: one source of truth for each claim's wording and sources."""

import re
from pathlib import Path

import pytest

from pagedkv_lab.course.claims import CLAIMS, EXPLAINERS, PAPERS, quote, render_index

ROOT = Path(__file__).resolve().parents[1]


def test_every_claim_of_the_project_list_is_covered():
    expected = [f"M{i}" for i in range(1, 7)] + [f"S{i}" for i in range(1, 7)]
    expected += [f"C{i}" for i in range(1, 4)]
    assert list(CLAIMS) == expected


def test_book_claims_page_is_the_generated_table():
    page = (ROOT / "book" / "claims.md").read_text()
    assert render_index(page) == page, (
        "book/claims.md disagrees with pagedkv_lab.course.claims: run "
        "`python -m pagedkv_lab.course.claims book/claims.md`"
    )


def test_every_source_is_a_reference_or_a_known_explainer():
    bib = (ROOT / "book" / "references.bib").read_text()
    keys = set(re.findall(r"@\w+\{([^,]+),", bib))
    for claim in CLAIMS.values():
        assert claim.quotes, claim.id
        for q in claim.quotes:
            assert q.words and q.figure and q.source.where
            ref = q.source.ref
            assert ref in EXPLAINERS or (ref in keys and ref in PAPERS), ref
            assert q.source.text() and q.source.markdown()


def test_the_blog_figures_are_cited_by_their_reference():
    blog = [
        q
        for c in CLAIMS.values()
        for q in c.quotes
        if q.source.ref == "kwon2023vllmblog"
    ]
    figures = " ".join(q.figure for q in blog)
    assert "60%-80%" in figures and "under 4%" in figures


def test_quote_names_the_source():
    assert quote("M1").startswith('M1: "only 20.4%')
    assert "The Two Types of Fragmentation" in quote("M3")
    with pytest.raises(KeyError):
        quote("M9")


def test_words_put_together_are_never_in_quotation_marks():
    # M3's words are a chart's title and bar labels, not a sentence.
    m3 = CLAIMS["M3"].quotes[0]
    assert m3.form and quote("M3").startswith("M3: Memory Waste Breakdown")
    assert '"' not in m3.shown() and m3.form in m3.shown()
    for claim in CLAIMS.values():
        for q in claim.quotes:
            assert q.shown().startswith('"') == (not q.form), q.words


def test_the_paper_and_the_blog_post_read_differently_on_the_page():
    # Same authors and year: an author-year citation alone renders them alike.
    paper, blog = (q.source for q in CLAIMS["M1"].quotes[:2])
    assert paper.markdown().split("{cite}")[0] != blog.markdown().split("{cite}")[0]
    assert "blog" in blog.markdown().split("{cite}")[0]


def test_every_explanation_that_repeats_a_figure_is_listed():
    def stating(cid, figure):
        return {q.source.ref for q in CLAIMS[cid].quotes if figure in q.figure}

    # 60-80% wasted: the blog post, "nano-vLLM Deep Dive" and the "KV Cache
    # Fragmentation" article; under 4%: the blog post and the same two.
    assert stating("M1", "60-80%") == {"b", "e"}
    assert stating("M2", "under 4%") == {"kwon2023vllmblog", "b", "e"}


def test_traps_cite_the_explanations_that_print_them():
    from pagedkv_lab.course.claims import TRAPS

    assert list(TRAPS) == [f"T{i}" for i in range(1, 6)]
    for trap in TRAPS.values():
        assert trap.statement and trap.chapter in {"04", "07", "08"}
        for q in trap.quotes:
            assert q.words and q.figure and q.source.is_explainer, trap.id
        assert trap.sources_text()
    assert not TRAPS["T1"].quotes  # none of the five explanations has it
