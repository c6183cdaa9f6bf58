"""Chapter 11's helpers: the audit figure and the measurements it reads."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from pagedkv_lab.course.audit_plots import VERDICT_COLORS, plot_claims  # noqa: E402
from pagedkv_lab.course.experiments import (  # noqa: E402
    ALPACA_MEAN_OUTPUT,
    ALPACA_MEAN_PROMPT,
    pressure_run,
    prompts_for,
)


def test_plot_claims_draws_claims_and_measurements_and_skips_none():
    shares = [("a share", "M1", (20, 38), 18.4), ("a point", "M2", (96, 96), 97.0)]
    multiples = [("a multiple", "M6", (3, 4), 4.3), ("not measured", "S2", (2, 4), None)]
    verdicts = {"M1": "misattributed", "M2": "holds", "M6": "holds only when",
                "S2": "needs a GPU"}  # fmt: skip
    fig = plot_claims(shares, multiples, verdicts, title="t", multiple_label="x")
    dots = [line for ax in fig.axes for line in ax.lines if line.get_marker() == "o"]
    assert len(dots) == 3  # the None row draws its claim only
    labels = {t.get_text() for t in fig.legends[0].get_texts()}
    assert labels == {"claimed", "misattributed", "holds", "holds only when"}
    assert set(verdicts.values()) <= set(VERDICT_COLORS)
    plt.close(fig)


def test_a_lower_bound_is_drawn_as_one():
    """A multiple that is only a lower bound (S2's when no engine crossed the
    latency bound) is a right-pointing triangle, with its own legend entry."""
    shares = [("a share", "M1", (20, 38), 18.4)]
    multiples = [("at least", "S2", (2, 4), 1.0, True), ("a multiple", "M6", (3, 4), 4.3)]
    verdicts = {"M1": "holds", "S2": "undecided", "M6": "holds"}
    fig = plot_claims(shares, multiples, verdicts, title="t", multiple_label="x")
    markers = [line.get_marker() for line in fig.axes[1].lines if line.get_marker() in "o>"]
    assert markers.count(">") == 1 and markers.count("o") == 1
    labels = {t.get_text() for t in fig.legends[0].get_texts()}
    assert {"undecided", "a lower bound (at least)"} <= labels
    plt.close(fig)


def test_alpaca_means_follow_the_papers_ratios():
    # §6.1: ShareGPT's prompts 8.4x longer and outputs 5.8x longer than Alpaca's
    assert round(ALPACA_MEAN_PROMPT, 1) == 19.2
    assert round(ALPACA_MEAN_OUTPUT, 1) == 58.3


def test_pressure_run_reports_recompute_per_generated_token():
    from pagedkv_lab.sampling_params import SamplingParams

    prompts = prompts_for([40, 30, 50, 20])
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4
    r = pressure_run("tiny-llama", prompts, params, block_size=8,
                     kv_cache_memory=24 * 8 * 512, max_model_len=128)  # fmt: skip
    assert r["generated"] == sum(len(t) for t in r["tokens"]) == 160
    assert r["recomputed_per_token"] == r["recomputed"] / r["generated"]


def test_a_row_can_be_coloured_by_its_own_result():
    """Two rows of one claim, one on its figure and one off it, take their own
    colours, and the legend names the rows' results."""
    from pagedkv_lab.course.audit_plots import ROW_COLORS

    shares = [("on", "C1", (55, 55), 55.0), ("off", "C1", (55, 55), 17.0)]
    multiples = [("a multiple", "M6", (2.5, 4.5), 4.4)]
    colour_of = {"on": "on the claimed figure", "off": "off the claimed figure",
                 "a multiple": "on the claimed figure"}  # fmt: skip
    fig = plot_claims(shares, multiples, colour_of, title="t", multiple_label="x")
    dots = [line for line in fig.axes[0].lines if line.get_marker() == "o"]
    assert [d.get_color() for d in dots] == [ROW_COLORS["on the claimed figure"],
                                             ROW_COLORS["off the claimed figure"]]
    labels = {t.get_text() for t in fig.legends[0].get_texts()}
    assert labels == {"claimed", "on the claimed figure", "off the claimed figure"}
    plt.close(fig)
