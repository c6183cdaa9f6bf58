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
        assert trap.statement and trap.chapter in {"04a", "07", "08"}
        for q in trap.quotes:
            assert q.words and q.figure and q.source.is_explainer, trap.id
        assert trap.sources_text()
    assert not TRAPS["T1"].quotes  # none of the five explanations has it


# -- chapter 11's rules: one noise rule, every verdict of every rule reachable ----

from pagedkv_lab.course.claims import (  # noqa: E402
    VERDICTS,
    Measured,
    arithmetic_rule,
    band_rule,
    c2_rule,
    c3_rule,
    compare,
    every_trace_rule,
    m1_rule,
    memory_bound,
    place,
    s1_rule,
    s2_rule,
    s3_rule,
    s4_rule,
    s5_rule,
    s6_rule,
    split_rule,
    trap_rule,
)


def exact(x: float) -> Measured:
    return Measured(x, 0.0)


def test_the_noise_rule():
    """A value moved by its spread either way: inside the band, outside it, or
    straddling an edge (undecided); no spread (fewer than three repeats)
    decides nothing."""
    assert place(Measured(5, 1), 2, 8) == "in"
    assert place(Measured(10, 1), 2, 8) == "out"
    assert place(Measured(8.5, 1), 2, 8) == "undecided"
    assert place(Measured(5, None), 2, 8) == "undecided"
    assert Measured.repeats([1.21, 1.20, 1.17]) == Measured(1.20, pytest.approx(0.04))
    assert Measured.repeats([1.0, 2.0]).spread is None
    assert Measured.mean_se(10, 0.5) == Measured(10, 1.0)
    assert compare(Measured(3, 0.5), Measured(1, 0.5)) == "greater"
    assert compare(Measured(1, 0.5), Measured(3, 0.5)) == "less"
    assert compare(Measured(1.5, 0.5), Measured(1, 0.5)) == "undecided"
    assert compare(Measured(3, None), Measured(1, 0)) == "undecided"


def reached(*kinds):
    """Every kind a rule returned is a verdict."""
    assert set(kinds) <= set(VERDICTS), set(kinds) - set(VERDICTS)
    return set(kinds)


def test_m1_reaches_each_verdict():
    ms = Measured.mean_se
    assert reached(
        m1_rule((19, 37), ms(19, 0.1), ms(38, 0.1)),
        m1_rule((16, 21), ms(19, 0.1), ms(38, 0.1)),
        m1_rule((16, 21), ms(19, 1.0), ms(38, 0.1)),
        m1_rule((16, 21), ms(10, 0.1), ms(38, 0.1)),
    ) == {"holds", "misattributed", "undecided", "wrong"}


def test_m2_m4_m5_and_the_traps_reach_each_verdict():
    assert reached(every_trace_rule([True, True]), every_trace_rule([True, False])) == {
        "holds", "wrong"}
    assert reached(arithmetic_rule([320], [320]), arithmetic_rule([16], [512])) == {
        "holds", "wrong"}
    assert reached(trap_rule(True), trap_rule(False)) == {"holds", "wrong"}


def test_m3_and_the_band_rules_reach_each_verdict():
    claim = {"internal": 45.0, "external": 13.0}
    good, bad = {"internal": exact(44), "external": exact(14)}, {
        "internal": exact(60), "external": exact(0)}
    near = {"internal": Measured(49, 2), "external": exact(13)}
    kinds = {split_rule({"a": good, "b": good}, claim)[0],
             split_rule({"a": good, "b": bad}, claim)[0],
             split_rule({"a": bad, "b": bad}, claim)[0],
             split_rule({"a": near, "b": bad}, claim)[0]}  # fmt: skip
    assert reached(*kinds) == {"holds", "holds only when", "wrong", "undecided"}
    assert split_rule({"a": good, "b": bad}, claim)[1] == ["a"]
    band = {band_rule({"x": exact(3), "y": exact(4)}, 2.5, 4.5)[0],
            band_rule({"x": exact(3), "y": exact(2)}, 2.5, 4.5)[0],
            band_rule({"x": exact(9), "y": exact(2)}, 2.5, 4.5)[0],
            band_rule({"x": Measured(4.4, 0.2), "y": exact(2)}, 2.5, 4.5)[0]}  # fmt: skip
    assert reached(*band) == {"holds", "holds only when", "wrong", "undecided"}


def test_c2_c3_reach_each_verdict():
    claimed = {"W3": 70.0, "W4": 80.0}
    short = {"W3": exact(90), "W4": exact(95)}
    kinds = {c2_rule({"W3": exact(70), "W4": exact(80)}, {}, claimed),
             c2_rule(short, {"W3": [200], "W4": [400]}, claimed),
             c2_rule(short, {"W3": [200], "W4": []}, claimed),
             c2_rule({"W3": Measured(73, 3), "W4": exact(95)}, {}, claimed)}  # fmt: skip
    assert reached(*kinds) == {"holds", "holds only when", "wrong", "undecided"}
    assert reached(c3_rule(True), c3_rule(False)) == {"wrong", "holds"}


def test_s1_decides_from_the_shuffled_against_in_order_control():
    """In the band and growing beyond noise holds; out of the band, or falling
    with the context, is wrong; growth within noise is undecided; no GPU (or
    nothing measured) needs one."""
    grow = {512: Measured(0.05, 0.01), 4096: Measured(0.14, 0.01)}
    flat = {512: Measured(0.06, 0.02), 4096: Measured(0.07, 0.02)}
    none = {512: Measured(0.0, 0.005), 4096: Measured(0.01, 0.005)}
    fall = {512: Measured(0.15, 0.005), 4096: Measured(0.05, 0.005)}
    assert s1_rule(grow, gpu=True) == "holds"
    assert s1_rule(none, gpu=True) == "wrong" and s1_rule(fall, gpu=True) == "wrong"
    assert s1_rule(flat, gpu=True) == "undecided"
    assert s1_rule(grow, gpu=False) == s1_rule({}, gpu=True) == "needs a GPU"


def test_s2_decides_each_half_and_is_gated_on_a_measured_floor():
    rate, tput = Measured(3.0, 0.5), Measured(24.0, 2.0)
    assert s2_rule(True, rate, True, tput)[0] == "holds"
    kind, halves = s2_rule(True, rate, True, Measured(5.0, 0.5))
    assert kind == "holds only when" and halves == {"rate": "in", "throughput": "out"}
    assert s2_rule(True, Measured(1.2, 0.1), True, Measured(5.0, 0.5))[0] == "wrong"
    # a short replay decides the throughput half only, and the claim is undecided
    kind, halves = s2_rule(True, rate, False, tput)
    assert kind == "undecided" and halves == {"rate": "undecided", "throughput": "in"}
    assert s2_rule(True, rate, True, Measured(19.0, 2.0))[0] == "undecided"  # noise
    assert s2_rule(False, rate, True, tput)[0] == "needs a GPU"
    assert memory_bound(1.28) and not memory_bound(40.0) and not memory_bound(None)


def test_s3_s4_s5_s6_reach_each_verdict():
    assert reached(s3_rule(True, 1.7), s3_rule(False, 36.0), s3_rule(False, 1.7)) == {
        "misattributed", "holds", "wrong"}
    assert reached(s4_rule(True, Measured(0.03, 0.02)), s4_rule(True, Measured(0.3, 0.02)),
                   s4_rule(True, Measured(0.09, 0.05)),
                   s4_rule(False, Measured(0.0, 0.0))) == {
        "holds only when", "wrong", "undecided", "needs a GPU"}  # fmt: skip
    assert reached(s5_rule(False), s5_rule(True)) == {"unmeasured", "needs a GPU"}
    # swap cheaper at every length is no reason to withhold "holds"
    assert reached(s6_rule(True, Measured(60.0, 5.0)), s6_rule(True, Measured(0.5, 0.1)),
                   s6_rule(True, Measured(1.05, 0.1)), s6_rule(False, None)) == {
        "holds", "wrong", "undecided", "needs a GPU"}  # fmt: skip
