"""Step-by-step records of requests being served, and chapter 06's figures of
them: which request computes how many tokens at each step (static against
continuous batching), the KV blocks held over time, and each step's time while
a long prompt is prefilled whole or in chunks.

A timeline is a list of steps; each step is a dict with ``tokens`` (request
index -> tokens computed in that step), ``idle`` (requests that hold a batch place
and blocks but compute nothing: finished members of a static batch) and
``blocks`` (KV blocks held during the step's forward pass).
"""

from __future__ import annotations

import math
import textwrap

import numpy as np

#: Cell values of `timeline_matrix` and their meaning.
WAITING, PREFILL, DECODE, IDLE, DONE = 0, 1, 2, 3, 4


def static_timeline(
    prompt_lens: list[int], output_lens: list[int], batch_size: int, block_size: int
) -> list[dict]:
    """Static batching, exactly as chapter 05a's `run_to_completion` runs it: the
    requests in order, ``batch_size`` at a time; a batch prefills its prompts
    in one step, then decodes until its longest request is done. A finished
    request leaves the batch's forward passes but keeps its blocks (freed when
    the batch ends) and its place in the batch (nobody takes it)."""
    steps = []
    for start in range(0, len(prompt_lens), batch_size):
        batch = range(start, min(start + batch_size, len(prompt_lens)))
        for s in range(max(output_lens[i] for i in batch)):
            # Step s computes the prompt (s = 0) or the token sampled at s - 1;
            # the request's last token is sampled at step output_len - 1.
            running = [i for i in batch if s < output_lens[i]]
            tokens = {i: prompt_lens[i] if s == 0 else 1 for i in running}
            held = sum(
                math.ceil((prompt_lens[i] + min(s, output_lens[i] - 1)) / block_size)
                for i in batch
            )
            steps.append(
                {"tokens": tokens, "idle": set(batch) - set(running), "blocks": held}
            )
    return steps


def record_steps(llm, prompts, params) -> tuple[list, list[dict]]:
    """Serve ``prompts`` with ``llm`` step by step, as `LLM.generate` does, and
    record each step: the tokens each request computed (from the step's plan,
    ``llm.last_plan``) and the blocks held during its forward pass (from
    ``llm.stats``). Returns the outputs in prompt order and the timeline."""
    index = {llm.add_request(p, sp): i for i, (p, sp) in enumerate(zip(prompts, params))}
    outputs, steps = {}, []
    while llm.has_unfinished_requests():
        held_before = llm.stats.blocks_held_sum
        for out in llm.step():
            if out.finished:
                outputs[index[out.request_id]] = out
        plan = llm.last_plan
        tokens: dict[int, int] = {}
        for group, n in zip(plan.groups, plan.num_new_tokens):
            i = index[group.request_id]
            tokens[i] = tokens.get(i, 0) + n
        steps.append(
            {
                "tokens": tokens,
                "idle": set(),
                "blocks": llm.stats.blocks_held_sum - held_before,
            }
        )
    return [outputs[i] for i in range(len(prompts))], steps


def timeline_matrix(steps: list[dict], num_requests: int, prompt_lens) -> np.ndarray:
    """``[request, step]`` -> `WAITING`, `PREFILL` (computing prompt tokens),
    `DECODE`, `IDLE` (holding a place in the batch, computing nothing) or `DONE`."""
    grid = np.full((num_requests, len(steps)), WAITING, dtype=np.int8)
    computed = [0] * num_requests
    last = [-1] * num_requests
    for s, step in enumerate(steps):
        for i, n in step["tokens"].items():
            # a preempted request recomputes: count from its restart
            prefill = computed[i] < prompt_lens[i] or n > 1
            grid[i, s] = PREFILL if prefill else DECODE
            computed[i] += n
            last[i] = s
        for i in step["idle"]:
            grid[i, s] = IDLE
    for i, s in enumerate(last):
        grid[i, s + 1 :][grid[i, s + 1 :] == WAITING] = DONE
    return grid


def plot_batching(
    static: list[dict],
    continuous: list[dict],
    prompt_lens: list[int],
    num_blocks: int,
    title: str,
):
    """Two timelines of the same requests (rows) over steps (columns), static
    and continuous batching, and the KV blocks each held at each step."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from pagedkv_lab.course.plotting import COLORS, SERIES, use_style

    use_style()
    n = len(prompt_lens)
    width = max(len(static), len(continuous))
    palette = ["#f4f4f4", COLORS["internal"], COLORS["used"], "#bbbbbb", "#ffffff"]
    names = ["waiting", "prefill", "decode", "finished, batch place and blocks held",
             "done"]  # fmt: skip
    fig, axes = plt.subplots(
        3, 1, figsize=(7, 6.6), sharex=True, height_ratios=[1, 1, 0.8]
    )
    for ax, steps, label in zip(axes, (static, continuous), ("static", "continuous")):
        grid = timeline_matrix(steps, n, prompt_lens)
        pad = np.full((n, width - grid.shape[1]), 5, dtype=np.int8)
        shown = np.concatenate([grid, pad], axis=1)
        cmap = ListedColormap(palette + ["#ffffff"])
        ax.imshow(shown, aspect="auto", cmap=cmap, vmin=0, vmax=5, interpolation="none")
        ax.set_ylabel("request")
        ax.set_title(f"{label} batching: {len(steps)} steps", fontsize=11)
        ax.tick_params(labelsize=10)
        ax.yaxis.label.set_size(11)
        ax.grid(False)
    # edged patches, so that the palest (waiting) and white (done) show
    handles = [Patch(facecolor=c, edgecolor="#999999", label=t)
               for c, t in zip(palette, names)]  # fmt: skip
    axes[0].legend(
        handles=handles, ncol=3, fontsize=10, loc="lower left", bbox_to_anchor=(0, 1.12)
    )
    ax = axes[2]
    for steps, label, color in ((static, "static", SERIES[1]), (continuous, "continuous", SERIES[0])):
        ax.plot([s["blocks"] for s in steps], color=color, lw=1.2, label=label)
    ax.axhline(num_blocks, color="black", lw=0.8, ls="--", label="pool")
    ax.set_ylabel("KV blocks held")
    ax.set_xlabel("step")
    ax.set_xlim(-0.5, width - 0.5)
    ax.legend(fontsize=10, loc="upper right", ncol=3)
    ax.tick_params(labelsize=10)
    ax.xaxis.label.set_size(11)
    ax.yaxis.label.set_size(11)
    fig.suptitle(textwrap.fill(title, 70), fontsize=11)
    fig.tight_layout()
    return fig


def plot_step_times(runs: dict[str, dict], title: str):
    """Each step's time while a long prompt arrives, one line per setting
    (``runs``: name -> ``{"step_ms": [...], "arrival": step}``), the prompt's
    arrival marked."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from pagedkv_lab.course.plotting import SERIES, use_style

    use_style()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for color, (name, run) in zip(SERIES, runs.items()):
        ax.plot(run["step_ms"], "o-", ms=3, lw=1.2, color=color, label=name)
    arrival = next(iter(runs.values()))["arrival"]
    ax.axvline(arrival, color="black", lw=0.8, ls=":", label="long prompt arrives")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("step time (ms)\n= every decode's gap")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
