"""The figures that explanations of PagedAttention repeat, each with its sources.

One place for a claim's wording: `book/claims.md`'s table is generated from
`CLAIMS` (``python -m pagedkv_lab.course.claims book/claims.md``; a test fails when the
page disagrees), chapters 01-03 quote from it, and chapter 11 audits it. Each
`Claim` has the course's one-line statement of it (as in the project's claims
list) and the places it is stated, each `Quote` with the source's own words and
figure. A source is a paper or post of ``book/references.bib`` (by its bibtex
key, with section, figure or table), or one of the circulating explanations by
its own title and section (the explanations are not linked: they are cited by
title, as the course's list of them does).

`TRAPS` does the same for five mistakes in code that explains paged attention:
each with the places the explanations print it (their code, quoted), rendered
as the page's second table.

The rules that turn chapter 11's measurements into verdicts live here too (the
"Rules" section below): one function per claim, pure, each tested to reach
every verdict it can give (``tests/test_claims.py``), and one rule for "within
noise" that every rule reading a measurement uses (`Measured`, `place`,
`compare`). The measurements themselves are the chapters'.
"""

from __future__ import annotations

import re
import statistics
import sys
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

#: The explanations the course answers, by their own titles (their form in brackets).
EXPLAINERS = {
    "a": '"the fragmentation problem" (a post in a blog series on KV caches)',
    "b": '"nano-vLLM Deep Dive", chapter 04 "PagedAttention" (an online course)',
    "c": '"PagedAttention: How vLLM Borrowed OS Virtual Memory to Fix LLM Serving" '
    '(part 5 of the series "Inference Optimization Timeline")',
    "d": '"PagedAttention: Virtual Memory for KV-Cache" (a course chapter)',
    "e": '"KV Cache Fragmentation and the Virtual Memory Solution That '
    'PagedAttention Brought" (an article)',
}

#: Short names of the bibtex keys, for plain-text output.
PAPERS = {
    "kwon2023vllm": "Kwon et al. 2023 (the vLLM paper)",
    "kwon2023vllmblog": "the vLLM blog post (Kwon et al., June 2023)",
    "yu2022orca": "Yu et al. 2022 (Orca)",
    "zheng2024sglang": "Zheng et al. 2024 (SGLang)",
}

#: What each reference is, written before its citation on the book's pages: the
#: vLLM paper and the vLLM blog post have the same authors and year, so their
#: author-year citations alone look the same.
PAPER_LABELS = {
    "kwon2023vllm": "the vLLM paper",
    "kwon2023vllmblog": "the vLLM blog post",
    "yu2022orca": "the Orca paper",
    "zheng2024sglang": "the SGLang paper",
}


@dataclass(frozen=True)
class Source:
    """Where a claim is stated: ``ref`` is a bibtex key of ``book/references.bib``
    or a key of `EXPLAINERS`; ``where`` the section, figure or table."""

    ref: str
    where: str

    @property
    def is_explainer(self) -> bool:
        return self.ref in EXPLAINERS

    def text(self) -> str:
        """Plain text, for notebooks' printed output."""
        name = EXPLAINERS[self.ref] if self.is_explainer else PAPERS[self.ref]
        if self.is_explainer:
            name = name.split(" (")[0]
        return f"{name}, {self.where}"

    def markdown(self) -> str:
        """MyST markdown, with a citation for a paper or post, named before it
        (`PAPER_LABELS`)."""
        if self.is_explainer:
            return f"{EXPLAINERS[self.ref].split(' (')[0]}, {self.where}"
        return f"{PAPER_LABELS[self.ref]} {{cite}}`{self.ref}`, {self.where}"


@dataclass(frozen=True)
class Quote:
    """One place a claim is stated: the source's words and the figure it gives.

    ``form`` is empty when ``words`` are a sentence of the source, quoted as they
    stand; otherwise it says what they were put together from (a chart's title
    and bar labels, say), and they are never shown in quotation marks."""

    words: str
    figure: str
    source: Source
    form: str = ""

    def shown(self) -> str:
        """The words for printing: in quotation marks when they are the source's
        own sentence, else followed by what they were put together from."""
        if self.form:
            return f"{self.words} [{self.form}]"
        return f'"{self.words}"'


@dataclass(frozen=True)
class Claim:
    """A circulating figure: its id, the course's statement of it, where it is
    stated, and the chapters that measure it."""

    id: str
    statement: str
    quotes: tuple[Quote, ...]
    chapters: tuple[str, ...]

    @property
    def source(self) -> Source:
        """The first source: the primary one where a paper states it."""
        return self.quotes[0].source

    def sources_text(self) -> str:
        return "; ".join(q.source.text() for q in self.quotes)


def _q(words: str, figure: str, ref: str, where: str, form: str = "") -> Quote:
    return Quote(words, figure, Source(ref, where), form)


_VLLM, _BLOG = "kwon2023vllm", "kwon2023vllmblog"

CLAIMS: dict[str, Claim] = {
    c.id: c
    for c in [
        Claim(
            "M1",
            "Contiguous max-length reservation leaves only 20-38% of KV memory "
            "holding real tokens (60-80% wasted)",
            (
                _q(
                    "only 20.4% - 38.2% of the KV cache memory is used to store the "
                    "actual token states in the existing systems",
                    "20.4%-38.2%, over Orca (Max), (Pow2) and (Oracle)",
                    _VLLM,
                    "§1 and Fig. 2",
                ),
                _q(
                    "We find that existing systems waste 60% – 80% of memory due to "
                    "fragmentation and over-reservation.",
                    "60%-80% wasted",
                    _BLOG,
                    'section "The Secret Sauce: PagedAttention"',
                ),
                _q(
                    "naive implementations achieve only 20–38% GPU memory utilization",
                    "20-38%",
                    "a",
                    "its first section",
                ),
                _q(
                    "existing systems waste 60–80% of KV cache memory due to "
                    "fragmentation",
                    "60-80% wasted",
                    "b",
                    'section "Why the naive approach wastes 60–80% of GPU memory"',
                ),
                _q(
                    "The vLLM paper (Kwon et al., SOSP 2023) measured the real-world "
                    "consequence: 60-80% of KV cache memory wasted under contiguous "
                    "allocation in production workloads.",
                    "60-80% wasted",
                    "e",
                    'section "The Fragmentation Problem Continuous Batching Exposes"',
                ),
            ),
            ("02", "11"),
        ),
        Claim(
            "M2",
            "Paging reaches ~96% utilization; waste < 4%, only the last partial "
            "block per sequence",
            (
                _q(
                    "vLLM limits all the memory wastes for a request within one block",
                    "96.3% of KV memory holds token states, for vLLM",
                    _VLLM,
                    "§4.3 and Fig. 2",
                ),
                _q(
                    "In PagedAttention, memory waste only happens in the last block "
                    "of a sequence. In practice, this results in near-optimal memory "
                    "usage, with a mere waste of under 4%.",
                    "under 4% wasted",
                    _BLOG,
                    'section "The Secret Sauce: PagedAttention"',
                ),
                _q(
                    "paged attention ... achieving ~96% utilization",
                    "~96%",
                    "a",
                    'section "memory utilization: 30% → 96%"',
                ),
                _q(
                    "<4% wasted — only the last partial block per request",
                    "under 4% wasted",
                    "b",
                    'section "What PagedAttention enables"',
                ),
                _q(
                    "vLLM measured fragmentation below 4% under this scheme, "
                    "compared to 60-80% under contiguous allocation.",
                    "under 4% wasted",
                    "e",
                    'section "PagedAttention: Virtual Memory for the KV Cache"',
                ),
            ),
            ("03", "11"),
        ),
        Claim(
            "M3",
            "Waste breakdown for contiguous: internal ~45%, external ~13%, "
            "reservation ~10% of pool",
            (
                _q(
                    "Memory Waste Breakdown (A100-80GB, Llama-70B, 50 concurrent "
                    "requests): Actual KV Data 32%, Internal Fragmentation 45%, "
                    "External Fragmentation 13%, Reservation Waste 10%",
                    "45% internal, 13% external, 10% reservation",
                    "c",
                    'section "The Two Types of Fragmentation"',
                    "a chart's title and bar labels, joined here: not a sentence "
                    "of the explanation",
                ),
            ),
            ("02", "11"),
        ),
        Claim(
            "M4",
            "KV bytes per token = 2 x layers x kv_heads x head_dim x dtype bytes; "
            "Llama-2-70B fp16: 320 KiB/token, 640 MiB per 2048-token request",
            (
                _q(
                    "KV per token = 2 × 80 × 8 × 128 × 2 = 327,680 bytes ≈ 320 KB ... "
                    "320 KB × 2048 ≈ 640 MB per request",
                    "320 KB per token, 640 MB per 2048 tokens",
                    "c",
                    'section "How Traditional KV Cache Allocation Works"',
                ),
            ),
            ("01", "11"),
        ),
        Claim(
            "M5",
            'Llama-2-7B fp16 needs "about 16 KB per token" and "about 64 MB per '
            '4096-token sequence"',
            (
                _q(
                    "approximately 16 KB per token in float16: 2 × 32 layers × 32 "
                    "heads × 128 head dim × 2 bytes. A 4096-token active sequence "
                    "occupies roughly 64 MB of KV cache.",
                    "16 KB per token, 64 MB per 4096 tokens",
                    "e",
                    'section "The Fragmentation Problem Continuous Batching Exposes"',
                ),
            ),
            ("01", "11"),
        ),
        Claim(
            "M6",
            "With paging, ~3x-4x more concurrent requests fit in the same memory",
            (
                _q(
                    "vLLM processes 2.2× more requests at the same time than Orca "
                    "(Oracle) and 4.3× more requests than Orca (Max)",
                    "4.3x Orca (Max), 2.2x Orca (Oracle); OPT-13B, ShareGPT, 2 req/s",
                    _VLLM,
                    "§6.2 and Fig. 13(a)",
                ),
                _q(
                    "roughly 3× more requests can be in flight simultaneously on the "
                    "same hardware",
                    "~3x",
                    "a",
                    'section "memory utilization: 30% → 96%"',
                ),
                _q(
                    "Limited by actual tokens used — 3–5× more requests",
                    "3-5x",
                    "b",
                    'section "What PagedAttention enables"',
                ),
                _q(
                    "it can fit 2-4x more concurrent requests in the same GPU memory",
                    "2-4x",
                    "c",
                    'section "Why It Is Worth It"',
                ),
            ),
            ("03", "11"),
        ),
        Claim(
            "S1",
            "Paging costs 4-15% extra attention-kernel time, growing with context "
            "(128 -> 4096 tokens)",
            (
                _q(
                    "The overhead ranges from ~4% for short sequences to ~15% for "
                    "long sequences.",
                    "+4.8% at 128 tokens to +15.0% at 4096 (A100-80GB)",
                    "c",
                    'section "Measured Overhead"',
                ),
                _q(
                    "this leads to 20–26% higher attention kernel latency, compared "
                    "to the highly-optimized FasterTransformer implementation",
                    "20-26% over FasterTransformer's kernel",
                    _VLLM,
                    "§7.1 and Fig. 18(a)",
                ),
            ),
            ("04b", "04c", "10", "11"),
        ),
        Claim(
            "S2",
            "End-to-end throughput 2-4x over prior systems at the same latency; up "
            "to 24x over plain HF generate",
            (
                _q(
                    "vLLM improves the throughput of popular LLMs by 2-4× with the "
                    "same level of latency compared to the state-of-the-art systems",
                    "2-4x over FasterTransformer and Orca",
                    _VLLM,
                    "abstract; §6.2 and Fig. 12",
                ),
                _q(
                    "vLLM achieves up to 24x higher throughput compared to HF",
                    "up to 24x over HuggingFace Transformers",
                    _BLOG,
                    'section "Beyond State-of-the-art Performance"',
                ),
            ),
            ("06", "10", "11"),
        ),
        Claim(
            "S3",
            "Iteration-level (continuous) batching: up to 36.9x over static batching",
            (
                _q(
                    "ORCA can significantly outperform NVIDIA FasterTransformer in "
                    "terms of both latency and throughput: 36.9× throughput "
                    "improvement at the same level of latency",
                    "36.9x over FasterTransformer, GPT-3 175B",
                    "yu2022orca",
                    "abstract",
                ),
                _q(
                    "reported up to 36.9x throughput improvement over static "
                    "batching baselines",
                    "36.9x over static batching",
                    "e",
                    "opening paragraph",
                ),
            ),
            ("06", "11"),
        ),
        Claim(
            "S4",
            "Block size 16 is the sweet spot; 32 for long contexts",
            (
                _q(
                    "Block size 16 is the sweet spot ... Increase to 32 for "
                    "long-context workloads.",
                    "16; 32 for long contexts",
                    "c",
                    'section "Conclusion", point 4',
                ),
                _q(
                    "block size 16 is large enough to efficiently utilize the GPU "
                    "and small enough to avoid significant internal fragmentation in "
                    "most workloads",
                    "16 (vLLM's default)",
                    _VLLM,
                    "§7.2 and Fig. 18(b)",
                ),
            ),
            ("03", "04b", "10", "11"),
        ),
        Claim(
            "S5",
            "A LIFO free list beats FIFO by 5-12% L2 hit rate on block writes",
            (
                _q(
                    "In practice, LIFO improves L2 hit rates by 5-12% for the block "
                    "write path.",
                    "5-12% L2 hit rate",
                    "c",
                    'section "The Free Block List" ("Why LIFO, Not FIFO?")',
                ),
            ),
            ("03", "11"),
        ),
        Claim(
            "S6",
            "Swap to CPU beats recompute for long sequences (PCIe ~25 GB/s vs "
            "prefill rate)",
            (
                _q(
                    "For these model sizes, swapping is almost always cheaper than "
                    "recomputation because PCIe bandwidth is much faster than "
                    "prefill computation.",
                    "PCIe Gen4 x16 ~25 GB/s; swap cheaper at every length",
                    "c",
                    'section "When to Swap vs Recompute"',
                ),
                _q(
                    "Our results reveal that swapping incurs excessive overhead with "
                    "small block sizes. ... Thus, recomputation is more efficient when "
                    "the block size is small, while swapping is more efficient when the "
                    "block size is large, though recomputation overhead is never higher "
                    "than 20% of swapping’s latency. For medium block sizes from 16 to "
                    "64, the two methods exhibit comparable end-to-end performance.",
                    "swap slower with small blocks, faster with large ones; recompute's "
                    "overhead never over 20% of swap's latency; comparable end to end "
                    "for blocks of 16-64 (OPT-13B, ShareGPT)",
                    _VLLM,
                    "§7.3 and Fig. 19",
                ),
            ),
            ("09", "11"),
        ),
        Claim(
            "C1",
            "Parallel sampling / beam search share prompt blocks; up to 55% memory "
            "saved, 2.2x throughput",
            (
                _q(
                    "cutting their memory usage by up to 55%. This can translate "
                    "into up to 2.2x improvement in throughput.",
                    "up to 55% memory, up to 2.2x throughput",
                    _BLOG,
                    'section "The Secret Sauce: PagedAttention"',
                ),
                _q(
                    "We show 6.1% - 9.8% memory saving on parallel sampling and "
                    "37.6% - 55.2% on beam search.",
                    "6.1-9.8% parallel, 37.6-55.2% beam (Alpaca)",
                    _VLLM,
                    "§6.3 and Fig. 15",
                ),
            ),
            ("07", "11"),
        ),
        Claim(
            "C2",
            "A shared system prompt of 500 tokens over 64 concurrent chats saves ~70% "
            "KV memory; RAG-like 2000-token context ~80%",
            (
                _q(
                    "Prefix Caching Memory Savings (Llama-70B): Chatbot, 500-token "
                    "system prompt, 64 concurrent requests, 70%; RAG Pipeline, "
                    "2000 tokens, 32 concurrent requests, 80%",
                    "70%; 80%",
                    "c",
                    'section "Memory Savings in Production"',
                ),
            ),
            ("08", "11"),
        ),
        Claim(
            "C3",
            'Radix-tree prefix caching shares "arbitrary substrings", not just '
            "prefixes",
            (
                _q(
                    "SGLang's RadixAttention (Zheng et al., 2024) generalizes this "
                    "from prefixes to arbitrary shared substrings using a radix tree.",
                    "arbitrary substrings",
                    "e",
                    'section "Copy-on-Write Prefix Sharing"',
                ),
            ),
            ("08", "11"),
        ),
    ]
}


@dataclass(frozen=True)
class Trap:
    """A mistake that code explaining paged attention makes: what it does, the
    chapter that shows it failing, and each place we found it in the circulating
    explanations (a `Quote` whose words are the code as printed there, whose
    figure says what the code does). No quote: none of them has it."""

    id: str
    statement: str
    chapter: str
    quotes: tuple[Quote, ...]

    def sources_text(self) -> str:
        if not self.quotes:
            return "none of the circulating explanations the course answers"
        return "; ".join(q.source.text() for q in self.quotes)


TRAPS: dict[str, Trap] = {
    t.id: t
    for t in [
        Trap(
            "T1",
            "softmax computed inside each block and the blocks' outputs summed or "
            "averaged, instead of merged with a running maximum and normaliser",
            "04a",
            (),
        ),
        Trap(
            "T2",
            "a prefix-cache key made from a block's own tokens (or its tokens and "
            "position), though the block's K/V depend on every earlier token",
            "08",
            (
                _q(
                    "h = hash_block(token_block)",
                    "the key hashes the block's own tokens",
                    "a",
                    'section "prefix caching falls out naturally"',
                ),
                _q(
                    'data = f"{token_ids}:{block_position}".encode()',
                    "the key hashes the block's tokens and its position",
                    "c",
                    'section "Hash-Based Prefix Deduplication"',
                ),
            ),
        ),
        Trap(
            "T3",
            "a block registered in the prefix cache before its K/V are written",
            "08",
            (
                _q(
                    "self.prefix_cache[h] = phys  # will be populated during prefill",
                    "registered when allocated, filled later",
                    "a",
                    'section "prefix caching falls out naturally"',
                ),
                _q(
                    "self.cache[h] = block_id ... return block_id, False  # Cache miss "
                    "- must compute KV",
                    "registered on a miss, before its K/V are computed",
                    "c",
                    'section "Hash-Based Prefix Deduplication"',
                ),
            ),
        ),
        Trap(
            "T4",
            "'LRU' eviction that walks a dictionary in insertion order, which is "
            "first-in-first-out",
            "08",
            (
                _q(
                    "# Evict least-recently-used cached block ... for h, block_id in "
                    "list(self.cache.items()):",
                    "its LRU eviction takes the first free block in insertion order",
                    "c",
                    'section "Hash-Based Prefix Deduplication"',
                ),
            ),
        ),
        Trap(
            "T5",
            "a reference count that defaults to 1 for blocks it has never seen, "
            "which turns a double free into two owners of one block",
            "07",
            (
                _q(
                    "self.ref_counts: Dict[int, int] = defaultdict(lambda: 1)",
                    "an unseen block counts as held once",
                    "c",
                    'section "How Copy-on-Write Works"',
                ),
            ),
        ),
    ]
}


def quote(claim_id: str, index: int = 0) -> str:
    """A claim's words as its source puts them, with the source, for printing."""
    q = CLAIMS[claim_id].quotes[index]
    return f"{claim_id}: {q.shown()} ({q.source.text()})"


# Rules: measurements to verdicts (chapter 11) ----------------------------------

#: The seven verdicts, in the order chapter 11 defines them.
VERDICTS = ("holds", "holds only when", "wrong", "misattributed", "needs a GPU",
            "undecided", "unmeasured")  # fmt: skip


@dataclass(frozen=True)
class Measured:
    """A measured value and its spread: how far another run of the same
    measurement could put it. ``spread`` is None when the run cannot say
    (fewer than three repeats of a timing), and 0 for a count or arithmetic,
    which another run repeats exactly."""

    value: float
    spread: float | None = 0.0

    @classmethod
    def repeats(cls, values: Seq[float]) -> Measured:
        """A timing repeated: the median, spread by the range of the repeats
        (half of it either side of the median would undercount a skewed
        range, so the whole range is the spread). Fewer than three repeats
        have no median worth the name: no spread."""
        values = [float(v) for v in values]
        if len(values) < 3:
            return cls(statistics.median(values) if values else float("nan"), None)
        return cls(statistics.median(values), max(values) - min(values))

    @classmethod
    def mean_se(cls, mean: float, se: float, z: float = 2.0) -> Measured:
        """A mean over seeded traces, spread by ``z`` standard errors (chapter
        02's error bar)."""
        return cls(mean, z * se)


def place(m: Measured, low: float, high: float) -> str:
    """The one rule for "within noise": where ``m`` lies against the band
    ``[low, high]`` that a claim (with its rule's tolerance) puts it in.
    ``"in"`` when ``m``'s value moved by its spread either way stays in the
    band, ``"out"`` when it stays out, ``"undecided"`` when the spread
    straddles an edge or there is no spread: a difference smaller than the
    measurement's own spread decides nothing."""
    if m.spread is None:
        return "undecided"
    lo, hi = m.value - m.spread, m.value + m.spread
    if low <= lo and hi <= high:
        return "in"
    if hi < low or lo > high:
        return "out"
    return "undecided"


def compare(a: Measured, b: Measured) -> str:
    """``"greater"``, ``"less"`` or ``"undecided"``: ``a`` against ``b``,
    by the same rule (the difference must exceed both spreads together)."""
    if a.spread is None or b.spread is None:
        return "undecided"
    gap, noise = a.value - b.value, a.spread + b.spread
    return "greater" if gap > noise else "less" if gap < -noise else "undecided"


def _some_all(results: dict[str, str]) -> tuple[str, list[str]]:
    """The common shape of a verdict over cases (policies, baselines,
    workloads): ``holds`` if every case is in, ``holds only when`` if some are
    and every other is out, ``wrong`` if every case is out, else ``undecided``
    (a case within noise could change the answer). Also the cases that are in."""
    inside = [k for k, r in results.items() if r == "in"]
    if "undecided" in results.values():
        return "undecided", inside
    if len(inside) == len(results):
        return "holds", inside
    return ("holds only when" if inside else "wrong"), inside


def m1_rule(max_traces: tuple[float, float], lowest: Measured, highest: Measured,
            band: tuple[float, float] = (20, 38), tol: float = 2.0) -> str:  # fmt: skip
    """M1: the whole range on max-length reservation (its lowest and highest
    trace each within ``tol`` points of the band's ends: ``holds``); the range
    spread over the policies (the lowest policy mean on its bottom and the
    highest on its top: ``misattributed``); ``undecided`` if an error bar
    straddling a line is all that keeps it from one of those; else ``wrong``."""
    lo, hi = band
    if abs(max_traces[0] - lo) <= tol and abs(max_traces[1] - hi) <= tol:
        return "holds"
    ends = [place(lowest, lo - tol, lo + tol), place(highest, hi - tol, hi + tol)]
    if ends == ["in", "in"]:
        return "misattributed"
    return "undecided" if "out" not in ends else "wrong"


def split_rule(splits: dict[str, dict[str, Measured]], claimed: dict[str, float],
               tol: float = 5.0) -> tuple[str, list[str]]:  # fmt: skip
    """M3: a policy gives the claimed split if every share is within ``tol``
    points of it; `_some_all` over the policies."""
    results = {}
    for policy, shares in splits.items():
        places = [place(shares[k], c - tol, c + tol) for k, c in claimed.items()]
        results[policy] = ("out" if "out" in places else
                           "in" if set(places) == {"in"} else "undecided")  # fmt: skip
    return _some_all(results)


def band_rule(cases: dict[str, Measured], low: float, high: float) -> tuple[str, list[str]]:
    """A figure against a band, case by case (M6's baselines, C1's methods and
    workloads, C2's lengths): `_some_all` over `place`."""
    return _some_all({k: place(m, low, high) for k, m in cases.items()})


def every_trace_rule(meets: Seq[bool]) -> str:
    """M2: ``holds`` if every trace meets the claim's conditions (counts of a
    deterministic simulation, which another run repeats exactly), else
    ``wrong``."""
    return "holds" if meets and all(meets) else "wrong"


def c2_rule(short: dict[str, Measured], fits: dict[str, list], claimed: dict[str, float],
            tol: float = 5.0) -> str:  # fmt: skip
    """C2: ``holds`` if every figure lands (within ``tol`` points) with short
    own parts; ``holds only when`` if each lands at some own-part length swept
    (``fits``: the lengths where it does); ``wrong`` if one lands at none."""
    places = [place(short[w], c - tol, c + tol) for w, c in claimed.items()]
    if set(places) == {"in"}:
        return "holds"
    if "undecided" in places:
        return "undecided"
    return "holds only when" if all(fits[w] for w in claimed) else "wrong"


def arithmetic_rule(claimed: Seq[float], measured: Seq[float], rel: float = 0.05) -> str:
    """M4, M5: a figure of arithmetic ``holds`` if every claimed number equals
    what the formula and the tensors give, within ``rel`` ("about"); else
    ``wrong``."""
    ok = all(abs(m / c - 1) <= rel for c, m in zip(claimed, measured))
    return "holds" if ok else "wrong"


def memory_bound(step_over_floor: float | None, limit: float = 2.0) -> bool:
    """The gate of the rules about serving at scale (S2, S4): whether the run's
    decode steps are close to their physical floor (the bytes a step reads over
    the device's copy bandwidth), within ``limit`` times it. A step that close
    spends most of its time reading weights and K/V, the regime in which
    fitting more requests in memory raises throughput; a step far from it is
    bound by launches or the host, where it does not. Measured, whatever the
    device or the model's size."""
    return step_over_floor is not None and step_over_floor <= limit


def s1_rule(overhead: dict[int, Measured] | None, gpu: bool,
            band: tuple[float, float] = (0.02, 0.17)) -> str:  # fmt: skip
    """S1, paging's cost to one attention kernel: the same kernel over the
    same K/V in shuffled blocks against blocks laid in order (the control;
    against another kernel, such as SDPA, the gap would measure the kernels'
    quality, not paging), by context length. ``needs a GPU`` off a GPU (the
    claim is about a GPU kernel) or with nothing measured; ``holds`` if every
    context is in the band (4-15%, 2 points of slack either side) and the
    longest context costs more than the shortest; ``wrong`` if a context is
    out of the band or the cost falls with the context, beyond noise;
    otherwise ``undecided``."""
    if not gpu or not overhead:
        return "needs a GPU"
    places = [place(m, *band) for m in overhead.values()]
    ends = sorted(overhead)
    trend = compare(overhead[ends[-1]], overhead[ends[0]])
    if "out" in places or trend == "less":
        return "wrong"
    if set(places) == {"in"} and trend == "greater":
        return "holds"
    return "undecided"


def s2_rule(gate: bool, rate: Measured | None, rate_decides: bool,
            throughput: Measured | None, rate_band: tuple[float, float] = (2, 8),
            throughput_band: tuple[float, float] = (24 / 1.25, 24 * 1.25)) -> tuple[str, dict]:  # fmt: skip
    """S2's two halves, each a figure against a band: the request rate the
    paged engine sustains at equal latency over max-length reservation's
    (2-4x, to 8x: the paper's range against Orca (Max)), decided only when
    ``rate_decides`` (a long enough replay, the multiple not a mere bound);
    the throughput over Hugging Face generate's (24x within a factor 1.25).
    ``needs a GPU`` when the ``gate`` (`memory_bound`) is closed; then, per
    half, `place`; both in: ``holds``; one in and the other out: ``holds only
    when``; both out: ``wrong``; any half undecided: ``undecided``. Returns the
    verdict and each half's place."""
    halves = {"rate": place(rate, *rate_band) if rate is not None and rate_decides
              else "undecided",
              "throughput": place(throughput, *throughput_band) if throughput is not None
              else "undecided"}  # fmt: skip
    if not gate:
        return "needs a GPU", halves
    kind, _ = _some_all(halves)
    return kind, halves


def s3_rule(source_compares_systems: bool, fewer: float, claimed: float = 36.9,
            rel: float = 0.2) -> str:  # fmt: skip
    """S3: whether the figure belongs to the mechanism. ``misattributed`` when
    its source measured two whole systems (read from the source's words, not
    from a measurement); otherwise the mechanism alone, in one engine, must
    give it: ``holds`` if ``fewer`` (static over continuous iterations) is
    within ``rel`` of ``claimed`` on either side, else ``wrong``."""
    if source_compares_systems:
        return "misattributed"
    return "holds" if claimed / (1 + rel) <= fewer <= claimed * (1 + rel) else "wrong"


def s4_rule(gate: bool, gap: Measured, tol: float = 0.10) -> str:
    """S4, "block 16 is the sweet spot": block 16's end-to-end throughput
    behind the best size's (``gap``, a fraction, spread by the rounds) read as
    a good default: within ``tol`` is ``holds only when`` (a good default, not
    the best: memory waste only grows with the block, so no size is best on
    both counts); beyond it ``wrong``; by `place` (``undecided`` within noise).
    ``needs a GPU`` when the `memory_bound` gate is closed."""
    if not gate:
        return "needs a GPU"
    return {"in": "holds only when", "out": "wrong", "undecided": "undecided"}[
        place(gap, 0.0, tol)]


def s5_rule(reads_counters: bool) -> str:
    """S5: an L2 hit rate needs a profiler's hardware counters: ``unmeasured``
    unless a run reads them, then ``needs a GPU`` (the counters are a GPU's)."""
    return "needs a GPU" if reads_counters else "unmeasured"


def s6_rule(link: bool, longest: Measured | None) -> str:
    """S6, swap beats recompute for long sequences: ``needs a GPU`` without a
    host-device link (on a CPU a swap copies host memory to host memory);
    else, at the longest length measured, recompute's time over swap's:
    above 1 beyond noise ``holds`` (cheaper at shorter lengths too does not
    contradict "for long sequences"), below 1 beyond noise ``wrong``, else
    ``undecided``."""
    if not link or longest is None:
        return "needs a GPU"
    return {"greater": "holds", "less": "wrong", "undecided": "undecided"}[
        compare(longest, Measured(1.0, 0.0))]


def c3_rule(kv_differ: bool) -> str:
    """C3, radix trees share "arbitrary substrings": sharing a substring's K/V
    is correct only if equal tokens after different prefixes have equal K/V.
    ``wrong`` if they differ (measured on a model: a token's K/V depend on
    every token before it, so no correct cache can share them, and SGLang's
    tree matches from its root, `C3_SOURCE`), ``holds`` if they were equal."""
    return "wrong" if kv_differ else "holds"


#: What SGLang's own code says its radix tree matches: the docstring of
#: ``RadixCache.match_prefix`` in ``python/sglang/srt/mem_cache/radix_cache.py``
#: (sgl-project/sglang, commit 006b0e3), which walks from the tree's root node.
C3_SOURCE = ("SGLang's RadixCache.match_prefix "
             "(python/sglang/srt/mem_cache/radix_cache.py): \"Find the longest cached "
             "prefix of key in the radix tree\", walked from the root node")  # fmt: skip


def trap_rule(wrong_version_fails: bool) -> str:
    """A correctness trap is ``wrong`` when its version gives a wrong output
    (or a block with two owners) where the library's gives the right one."""
    return "wrong" if wrong_version_fails else "holds"


# book/claims.md -----------------------------------------------------------------

BEGIN, END = "<!-- claims table: begin -->", "<!-- claims table: end -->"
TRAPS_BEGIN = "<!-- traps table: begin -->"
TRAPS_END = "<!-- traps table: end -->"


#: Chapter 11's section for each claim (M4 and M5 share one).
AUDIT_LABELS = {c: f"audit-{c.lower()}" for c in CLAIMS} | {"M5": "audit-m4"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def claims_table() -> str:
    """The index table of ``book/claims.md``, one row per claim: the statement, each
    source with its figure, and where it is audited and measured."""
    lines = [
        "| # | the claim | as its sources state it | audited in; measured in |",
        "|---|---|---|---|",
    ]
    for c in CLAIMS.values():
        stated = "<br>".join(f"{q.figure}: {q.source.markdown()}" for q in c.quotes)
        chapters = [ch for ch in c.chapters if ch != "11"]
        where = f"{{ref}}`{AUDIT_LABELS[c.id]}`; chapter" + "s" * (len(chapters) > 1)
        where += " " + ", ".join(chapters)
        lines.append(f"| {c.id} | {_cell(c.statement)} | {_cell(stated)} | {where} |")
    return "\n".join(lines)


_WORDS = "no one two three four five six seven eight nine ten eleven twelve".split()


def _count(n: int) -> str:
    """``n`` as a word for the small counts the page states, else as digits."""
    return _WORDS[n] if 0 <= n < len(_WORDS) else str(n)


def _and(items: list[str]) -> str:
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def traps_table() -> str:
    """The traps section of ``book/claims.md``: a paragraph that counts the traps
    and the chapters showing them, then a table of each mistake, where the
    circulating explanations print it (their code, what it does, the explanation
    and section), and the chapter that shows it failing."""
    chapters = sorted({t.chapter for t in TRAPS.values()})
    printed = sum(bool(t.quotes) for t in TRAPS.values())
    intro = (
        f"{_count(len(TRAPS)).capitalize()} correctness traps are shown failing "
        f"beside the right version in chapter 11's\n{{ref}}`audit-traps`, from "
        f"chapter{'s' * (len(chapters) > 1)} {_and(chapters)}. "
        f"{_count(printed).capitalize()} of them appear in the code\nthat the "
        "circulating explanations print; the table quotes that code, from the\n"
        "same module (`pagedkv_lab.course.claims.TRAPS`):"
    )
    lines = [
        intro,
        "",
        "| # | the mistake | where it appears: the code as printed there | shown in |",
        "|---|---|---|---|",
    ]
    for t in TRAPS.values():
        seen = "<br>".join(
            f"`{q.words}` ({q.figure}): {q.source.markdown()}" for q in t.quotes
        )
        seen = seen or "none of the circulating explanations the course answers"
        shown = f"{{ref}}`audit-traps`; chapter {t.chapter}"
        lines.append(f"| {t.id} | {_cell(t.statement)} | {_cell(seen)} | {shown} |")
    return "\n".join(lines)


def _replace(page: str, begin: str, end: str, table: str) -> str:
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(page):
        raise ValueError(f"the page has no {begin} ... {end} markers")
    return pattern.sub(lambda _: f"{begin}\n{table}\n{end}", page)


def render_index(page: str) -> str:
    """``page`` with the text between `BEGIN` and `END` replaced by `claims_table`,
    and between `TRAPS_BEGIN` and `TRAPS_END` by `traps_table` (the traps'
    paragraph and table)."""
    page = _replace(page, BEGIN, END, claims_table())
    return _replace(page, TRAPS_BEGIN, TRAPS_END, traps_table())


def main(argv: list[str]) -> None:
    """``python -m pagedkv_lab.course.claims book/claims.md``: rewrite the page's tables."""
    path = Path(argv[0] if argv else "book/claims.md")
    path.write_text(render_index(path.read_text()))
    print(f"wrote the claims and traps tables of {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
