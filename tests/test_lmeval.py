"""lm-evaluation-harness, unmodified, evaluates `python -m pagedkv_lab.serve`.

The server runs ``tiny-llama`` with ``--enable-tokenizer-info-endpoint``; the
real ``lm_eval`` command line evaluates it with its ``local-completions`` model
(tokenizer backend ``auto``, which finds the server's ``/tokenizer_info`` and
``/tokenize`` and uses them) on two tiny local tasks (`tests/lm_eval_tasks`):
one multiple choice (loglikelihood requests: token ids, ``echo``,
``logprobs=1``, ``max_tokens=1``) and one generate_until. Then the samples lm-eval
logged are checked against `LLM`, in this process, with the same weights.

lm-eval is not a dependency of the package: the ``eval`` extra brings it, and
`make test-eval` installs it in a virtual environment of its own and runs this
file. Elsewhere the test is skipped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip(
    "lm_eval", reason="lm-eval is not installed; `make test-eval` runs this test"
)

from pagedkv_lab import LLM, SamplingParams  # noqa: E402

MODEL = "tiny-llama"
TASKS = Path(__file__).parent / "lm_eval_tasks"
STARTUP_S = 180  # a cold start on a busy 2-core machine
EVAL_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    """``python -m pagedkv_lab.serve tiny-llama --enable-tokenizer-info-endpoint``;
    stopped with SIGTERM afterwards, which must exit 0."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "pagedkv_lab.serve", MODEL, "--port", str(port),
           "--enable-tokenizer-info-endpoint", "--log-level", "warning",
           "--disable-access-log"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    assert code == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def evaluation(server_url, tmp_path_factory) -> dict:
    """Run ``lm_eval`` (the harness's own command line, in a subprocess, no
    network): its aggregated results, its logged samples per task, its log."""
    out = tmp_path_factory.mktemp("lm_eval")
    cmd = [
        sys.executable, "-m", "lm_eval",
        "--model", "local-completions",
        "--model_args", f"model={MODEL},base_url={server_url}/v1/completions",
        "--include_path", str(TASKS),
        "--tasks", "pagedkv_choice,pagedkv_generate",
        "--output_path", str(out),
        "--log_samples",
    ]  # fmt: skip
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_CACHE": str(out / "cache")}  # fmt: skip
    run = subprocess.run(
        cmd, capture_output=True, text=True, timeout=EVAL_S,
        env={**os.environ, **offline}, cwd=out,
    )  # fmt: skip
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-5000:]
    (results,) = out.rglob("results_*.json")
    samples = {
        task: [json.loads(line) for line in path.read_text().splitlines()]
        for task in ("pagedkv_choice", "pagedkv_generate")
        for path in out.rglob(f"samples_{task}_*.jsonl")
    }
    return {"results": json.loads(results.read_text()), "samples": samples, "log": log}


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, seed=0)


def test_lm_eval_uses_the_servers_tokenizer_and_reports_each_metric(evaluation):
    assert "Using tokenizer remote" in evaluation["log"], evaluation["log"][-3000:]
    results = evaluation["results"]["results"]
    assert 0 <= results["pagedkv_choice"]["acc,none"] <= 1
    assert 0 <= results["pagedkv_generate"]["exact_match,none"] <= 1
    samples = evaluation["samples"]
    assert [len(samples["pagedkv_choice"]), len(samples["pagedkv_generate"])] == [6, 3]
    # the metric is the mean of the per-document scores lm-eval logged
    accs = [s["acc"] for s in samples["pagedkv_choice"]]
    assert results["pagedkv_choice"]["acc,none"] == pytest.approx(sum(accs) / len(accs))


def _encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into token ids, with
    the server's tokenizer as its remote tokenizer uses it (no special
    tokens): trailing spaces move to the continuation; the whole text is
    encoded and cut where the context's tokens end."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx) :]


def test_loglikelihoods_equal_the_libraries_own(evaluation, llm):
    """Every (context, choice) lm-eval scored: its log-likelihood equals the
    sum of `LLM`'s prompt log-probabilities over the choice's tokens, and its
    is_greedy flag says whether each of them was the most likely."""
    tok = llm.get_tokenizer()
    scored, prompts = [], []
    for sample in evaluation["samples"]["pagedkv_choice"]:
        for args, ((logprob, greedy),) in zip(
            sample["arguments"].values(), sample["resps"]
        ):
            ctx, cont = _encode_pair(tok, args["arg_0"], args["arg_1"])
            assert ctx and cont
            scored.append((len(ctx), float(logprob), greedy == "True"))
            prompts.append({"prompt_token_ids": ctx + cont})
    assert len(scored) == 17
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (start, theirs, their_greedy), out in zip(scored, outs):
        ids, plp = out.prompt_token_ids, out.prompt_logprobs
        mine = [plp[i][ids[i]] for i in range(start, len(ids))]
        assert theirs == pytest.approx(sum(lp.logprob for lp in mine), abs=1e-4)
        assert their_greedy == all(lp.rank == 1 for lp in mine)


def test_greedy_generations_equal_the_libraries_own(evaluation, llm):
    """Every generate_until answer equals `LLM.generate`'s greedy text for the
    same token ids, the same length and the same stop strings (the task's
    ``until`` and the end-of-sequence text lm-eval read from the server)."""
    tok = llm.get_tokenizer()
    samples = evaluation["samples"]["pagedkv_generate"]
    prompts, answers = [], []
    for sample in samples:
        args = sample["arguments"]["gen_args_0"]
        context, gen = args["arg_0"], args["arg_1"]
        assert gen["until"] == ["\n"] and gen["max_gen_toks"] == 16
        prompts.append({"prompt_token_ids": tok(context, add_special_tokens=False).input_ids})
        answers.append(sample["resps"][0][0])
    params = SamplingParams(temperature=0, max_tokens=16, stop=["\n", tok.eos_token])
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert answers == [o.text for o in outs]
    assert any(answers)  # something was generated
