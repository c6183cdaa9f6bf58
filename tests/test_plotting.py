"""The figure helpers chapters 01-03 call, drawn headless, and the experiment
helpers behind chapter 02's reproduction of the vLLM paper's Figure 2."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pagedkv_lab.course import plotting  # noqa: E402
from pagedkv_lab.course.experiments import (  # noqa: E402
    PAPER_FIG2,
    fig2_verdict,
    kinds_mean_se,
    mean_se,
    opt13b_pool_slots,
    paper_kinds,
    reservation_runs,
    sigma_sweep,
)
from pagedkv_lab.sim.contiguous import ContiguousPool  # noqa: E402
from pagedkv_lab.sim.paged import PagedPool  # noqa: E402
from pagedkv_lab.sim.workloads import chat_workload, simulate  # noqa: E402


@pytest.fixture(scope="module")
def results():
    reqs = chat_workload(60, seed=0, arrival_rate=1.0)
    return {
        "paged": simulate(reqs, PagedPool(256, 16, 2048)),
        "max": simulate(reqs, ContiguousPool(2 * 2048 + 100, 2048, fit="buddy")),
    }


def test_every_helper_draws_something(results, tmp_path):
    fig, axes = plt.subplots(3, 3, figsize=(12, 9))
    ax = iter(axes.flat)
    states = plotting.usage_stack(next(ax), results["max"], title="max")
    assert states[0] == "used" and "free" in states
    plotting.state_legend(fig, states, loc="lower center")
    rows = [("paper", PAPER_FIG2["max"], None), ("ours", (20, 10, 60, 10), (18, 22))]
    plotting.split_bars(next(ax), rows, ["a", "b", "c", "d"], plotting.SERIES[:4])
    plotting.gqa_bars(next(ax), ["x", "y"], [128.0, 512.0], [512.0, 512.0], [4, 1])
    fit = np.array([[0, 7], [-1, 300]])
    plotting.capacity_heatmap(next(ax), fit, ["m1", "m2"], ["T4", "L4"])
    reqs = chat_workload(50, seed=0)
    plotting.length_histograms([next(ax), next(ax)], {"W1": reqs}, 2048)
    measured = {"max": ([0.15, 0.2], [0.004, 0.003])}
    plotting.sigma_figure(next(ax), [0.4, 0.8], measured, {"max": 0.204}, [0.15, 0.2])
    plotting.recompute_steps(next(ax), results, [16, 256], {"a and b": 15.3})
    plotting.block_size_sweep(
        next(ax), [8, 16], [0.9, 0.8], [0.05, 0.1], [0, 0.01], [9, 5]
    )
    for a in axes.flat:
        assert a.has_data()
    fig.savefig(tmp_path / "helpers.png")
    plt.close(fig)


def test_rounding_is_drawn_hatched_in_the_external_colour():
    # One category for an allocator's rounding everywhere: external (chapter 02).
    assert plotting.COLORS["rounding"] == plotting.COLORS["external"]
    assert "external" in plotting.LABELS["rounding"]
    assert plotting.state_patch("rounding").get_hatch() == plotting.HATCHES["rounding"]
    assert plotting.state_patch("used").get_hatch() is None


def test_paper_pool_and_kinds():
    assert opt13b_pool_slots() == 15_728  # Table 1's "15.7K"
    runs = reservation_runs([0], capacity=2 * 2048 + 100, num_requests=40)
    for policy, (res,) in runs.items():
        kinds = paper_kinds(res)
        assert sum(kinds) == pytest.approx(100.0)
        assert policy != "oracle" or kinds[2] == 0.0  # no internal fragmentation
    measured, closed = sigma_sweep([0.8], [0, 1], capacity=2 * 2048 + 100)
    (mean,), (se,) = measured["max"]
    assert 0 < mean < 1 and 0 <= se < mean and 0 < closed[0] < 1


def test_the_two_readings_of_the_rounding_move_it_between_two_kinds():
    runs = reservation_runs([0], capacity=2 * 2048 + 100, num_requests=40)
    (res,) = runs["oracle"]
    rounding = 100 * res.fractions()["rounding"]
    external, internal = paper_kinds(res), paper_kinds(res, rounding="internal")
    assert rounding > 0 and sum(internal) == pytest.approx(100.0)
    assert internal[2] == pytest.approx(external[2] + rounding)
    assert internal[3] == pytest.approx(external[3] - rounding)
    with pytest.raises(ValueError):
        paper_kinds(res, rounding="elsewhere")


def test_mean_and_standard_error_over_seeds():
    mean, se = mean_se([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and se == pytest.approx(np.std([1, 2, 3, 4], ddof=1) / 2)
    with pytest.raises(ValueError):
        mean_se([1.0])
    runs = reservation_runs([0, 1], capacity=2 * 2048 + 100, num_requests=40)
    means, ses = kinds_mean_se(runs["max"])
    assert len(means) == len(ses) == 4 and sum(means) == pytest.approx(100.0)


def test_a_verdict_is_decided_only_when_the_whole_error_bar_is():
    assert fig2_verdict(19.0, 0.1, 20.4) == "within"  # 1.4 + 0.2 <= 2
    assert fig2_verdict(17.0, 0.1, 20.4) == "outside"  # 3.4 - 0.2 > 2
    assert fig2_verdict(18.5, 0.1, 20.4) == "undecided"  # 1.9 +- 0.2 straddles 2
    assert fig2_verdict(18.5, 0.0, 20.4) == "within"
