"""`python -m pagedkv_lab.serve` against the official `openai` client, live.

A server runs in a subprocess on 127.0.0.1 (a free port) with ``tiny-llama``;
the references come from `LLM.generate` / `LLM.chat` in this process, with the
same model, weights and seed. A second server with one sequence slot and a
waiting queue of two serves the 503 and SIGTERM tests.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
try:  # openai 3 and huggingface-hub 2 speak httpx2, its successor; older stacks httpx
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")

from pagedkv_lab import LLM, RequestOutputKind, SamplingParams  # noqa: E402
from pagedkv_lab.serve.metrics import parse_metrics  # noqa: E402

MODEL = "tiny-llama"
STARTUP_S = 180  # a cold start on a busy 2-core machine
PROMPTS = [f"Prompt {i}: the story of" + " x" * i for i in range(8)]


class Server:
    """A `python -m pagedkv_lab.serve` subprocess."""

    def __init__(self, *args: str, log: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "pagedkv_lab.serve", MODEL, "--port",
               str(self.port), "--log-level", "warning", "--disable-access-log", *args]  # fmt: skip
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_S
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="none", max_retries=0, **kw
        )

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def wait_metrics(self, ok, timeout: float = 30.0) -> dict[str, float]:
        """Poll /metrics until ``ok(metrics)``; fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if ok(m):
                return m
            if time.monotonic() > deadline:
                shown = {k: v for k, v in m.items() if "{" in k and "_bucket" not in k}
                pytest.fail(f"metrics never reached the expected state: {shown}")
            time.sleep(0.05)

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(server: Server, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=30, **kw)


@pytest.fixture(scope="module", params=[[], ["--async-scheduling"]], ids=["sync", "async"])
def server(tmp_path_factory, request):
    """The server, its engine stepping synchronously (a CPU's default) or with
    asynchronous scheduling: every test below runs against both. It answers
    ``/tokenizer_info`` (the small server does not)."""
    s = Server(
        "--enable-tokenizer-info-endpoint", *request.param,
        log=tmp_path_factory.mktemp("serve") / "server.log",
    )  # fmt: skip
    yield s
    assert s.stop() == 0, s.log.read_text()[-3000:]


_small: dict[str, Server] = {}


@pytest.fixture
def small_server(tmp_path_factory):
    """One running sequence, two waiting at most, prefix caching on; restarted
    if a test stopped it."""
    s = _small.get("server")
    if s is None or s.proc.poll() is not None:
        log = tmp_path_factory.mktemp("serve-small") / "server.log"
        s = _small["server"] = Server(
            "--max-num-seqs", "1", "--max-waiting", "2", "--shutdown-timeout", "60",
            "--enable-prefix-caching",
            log=log,
        )  # fmt: skip
    yield s


@pytest.fixture(scope="module", autouse=True)
def _stop_small():
    yield
    if "server" in _small:
        _small.pop("server").stop()


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, seed=0)


@pytest.fixture(scope="module")
def hf_model():
    """The server's model as plain transformers (same name, same weights)."""
    from pagedkv_lab.models import load_model

    return load_model(MODEL)[0]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


# ---- the package ----------------------------------------------------------


def test_serve_import_needs_the_extra_and_the_package_does_not_import_it():
    code = (
        "import sys; sys.modules['fastapi'] = None\n"
        "import pagedkv_lab\n"
        "assert 'pagedkv_lab.serve' not in sys.modules\n"
        "try:\n    import pagedkv_lab.serve\n"
        "except ImportError as err:\n    print(err)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "'serve' extra" in out and "pagedkv-lab[serve]" in out, out


def test_kv_cache_memory_parsing():
    from pagedkv_lab.serve.__main__ import parse_memory

    assert parse_memory("268435456") == 268435456
    assert parse_memory("256MiB") == 256 * 2**20
    assert parse_memory("1GiB") == 2**30
    assert parse_memory("0.5") == 0.5


# ---- equal to LLM.generate and LLM.chat ---------------------------------------


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_greedy_completions_equal_generate(server, llm):
    refs = llm.generate(PROMPTS[:4], greedy(24), use_tqdm=False)
    client = server.client()
    for prompt, ref in zip(PROMPTS, refs):
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0
        )
        assert r.object == "text_completion"
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_token_id_prompts_and_several_prompts(server, llm):
    ids = [[1, 72, 105, 33], [1, 50, 51, 52, 53]]
    refs = llm.generate(
        [{"prompt_token_ids": i} for i in ids], greedy(8), use_tqdm=False
    )
    r = server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [o.text for o in refs]
    assert r.usage.prompt_tokens == 9
    # vLLM's return_token_ids, plain and streamed
    extra = {"return_token_ids": True}
    r = server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body=extra
    )
    assert [c.model_extra["token_ids"] for c in r.choices] == [
        o.token_ids for o in refs
    ]
    assert [c.model_extra["prompt_token_ids"] for c in r.choices] == ids
    streamed = {0: [], 1: []}
    for chunk in server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, stream=True,
        extra_body=extra,
    ):  # fmt: skip
        for c in chunk.choices:
            streamed[c.index] += c.model_extra["token_ids"]
    assert list(streamed.values()) == [o.token_ids for o in refs]


def test_streamed_completion_concatenates_to_the_text(server, llm):
    ref = llm.generate(PROMPTS[1], greedy(32), use_tqdm=False)[0]
    chunks = list(
        server.client().completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=32, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32
    assert len(chunks) > 3  # streamed token by token, not in one piece


def test_chat_plain_and_streamed_equal_llm_chat(server, llm):
    messages = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    ref = llm.chat(messages, greedy(20), use_tqdm=False)[0]
    client = server.client()
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=20,
            temperature=0, stream=True,
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_n_and_seed_equal_generate(server, llm):
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=12)
    ref = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    client = server.client()
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], n=3, temperature=0.8, seed=5, max_tokens=12
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.text for o in ref.outputs]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)
    streamed = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPTS[2], n=3, temperature=0.8, seed=5,
        max_tokens=12, stream=True,
    ):  # fmt: skip
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert list(streamed.values()) == [o.text for o in ref.outputs]


def test_vllm_sampling_fields(server, llm):
    extra = {"top_k": 5, "min_p": 0.05, "min_tokens": 6, "repetition_penalty": 1.3,
             "ignore_eos": True}  # fmt: skip
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=10, **extra)
    ref = llm.generate(PROMPTS[3], params, use_tqdm=False)[0]
    r = server.client().completions.create(
        model=MODEL, prompt=PROMPTS[3], temperature=0.7, seed=3, max_tokens=10,
        extra_body=extra,
    )  # fmt: skip
    assert r.choices[0].text == ref.text


def test_stop_strings_and_stop_token_ids(server, llm):
    full = llm.generate(PROMPTS[0], greedy(40), use_tqdm=False)[0]
    # a printable character of the greedy text, after its start
    at = next(
        i
        for i, ch in enumerate(full.text)
        if i > 2 and ch.isascii() and ch.isprintable()
    )
    stop = full.text[at]
    client = server.client()
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop]
    )
    c = r.choices[0]
    assert c.text == full.text[: full.text.index(stop)]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0,
            stop=stop, stream=True,
        )
    )  # fmt: skip
    assert streamed == c.text
    token = full.token_ids[5]
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0,
        extra_body={"stop_token_ids": [token]},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == token
    assert r.usage.completion_tokens == full.token_ids.index(token) + 1


def test_logprobs(server, llm):
    ref = llm.generate(PROMPTS[4], greedy(10, logprobs=2), use_tqdm=False)[0]
    client = server.client()
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[4], max_tokens=10, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    for i, (token, entries) in enumerate(zip(ref.token_ids, ref.outputs[0].logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(entries[token].logprob, abs=1e-4)
        # greedy: the chosen token is the most likely one
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()))
        assert lp.top_logprobs[i][lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    for item in content:
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert item.logprob == pytest.approx(tops[0])
        assert item.bytes == list(item.token.encode())


# ---- echo, prompt log-probabilities, the tokenizer ------------------------------


def test_echo_scores_the_prompt_as_a_teacher_forced_forward(server, llm, hf_model):
    """``echo`` with ``max_tokens=0`` (what a scoring client sends): each
    prompt's text, then per token its text, its log-probability (None for the
    first) equal to one transformers forward over the prompt, and the most
    likely tokens; nothing generated."""
    import torch

    tok = llm.get_tokenizer()
    prompts = [[1, 72, 101, 108, 108, 111, 44, 32], [1] + list(range(40, 70))]
    r = server.client().completions.create(
        model=MODEL, prompt=prompts, echo=True, logprobs=2, max_tokens=0
    )
    assert r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    for ids, choice in zip(prompts, r.choices):
        with torch.no_grad():
            theirs = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        lp = choice.logprobs
        assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
        assert lp.tokens == [tok.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        lengths = [len(t) for t in lp.tokens]
        assert lp.text_offset == [sum(lengths[:i]) for i in range(len(ids))]
        for pos in range(1, len(ids)):
            want = theirs[pos - 1]
            assert lp.token_logprobs[pos] == pytest.approx(want[ids[pos]].item(), abs=1e-4)
            top = lp.top_logprobs[pos]
            assert lp.top_logprobs[pos][lp.tokens[pos]] == lp.token_logprobs[pos]
            assert max(top.values()) == pytest.approx(want.max().item(), abs=1e-4)
            assert 2 <= len(top) <= 3  # the token and the 2 most likely


def test_echo_before_generated_tokens_plain_and_streamed(server, llm):
    """``echo`` with generation, as a loglikelihood client sends it: the prompt
    then the completion, one ``logprobs`` run across both, equal to
    `LLM.generate`'s; a stream carries the same pieces."""
    prompt = PROMPTS[3]
    params = greedy(5, logprobs=1, prompt_logprobs=1)
    ref = llm.generate(prompt, params, use_tqdm=False)[0]
    kw = dict(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=5,
              temperature=0)  # fmt: skip
    c = server.client().completions.create(**kw).choices[0]
    assert c.text == prompt + ref.text
    ids = ref.prompt_token_ids + ref.token_ids
    entries = ref.prompt_logprobs + ref.outputs[0].logprobs
    assert len(c.logprobs.tokens) == len(ids)
    for i in range(1, len(ids)):
        assert c.logprobs.token_logprobs[i] == pytest.approx(
            entries[i][ids[i]].logprob, abs=1e-4
        )
        assert c.logprobs.tokens[i] == entries[i][ids[i]].decoded_token
    text, logprobs = "", {k: [] for k in ("tokens", "text_offset", "token_logprobs")}
    for chunk in server.client().completions.create(stream=True, **kw):
        text += chunk.choices[0].text
        for k in logprobs:
            logprobs[k] += getattr(chunk.choices[0].logprobs, k)
    assert text == c.text
    assert logprobs["tokens"] == c.logprobs.tokens
    assert logprobs["text_offset"] == c.logprobs.text_offset
    assert logprobs["token_logprobs"][1:] == pytest.approx(c.logprobs.token_logprobs[1:])
    # vLLM's prompt_logprobs field: per prompt token, {token id: logprob, rank, text}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0}
    (choice,) = _post(server, "/v1/completions", json=body).json()["choices"]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ref.prompt_token_ids)
    for pos, entry in enumerate(plp[1:], start=1):
        token = ref.prompt_token_ids[pos]
        assert list(entry) == [str(token)]
        mine = ref.prompt_logprobs[pos][token]
        assert entry[str(token)]["rank"] == mine.rank
        assert entry[str(token)]["logprob"] == pytest.approx(mine.logprob, abs=1e-4)
        assert entry[str(token)]["decoded_token"] == mine.decoded_token


def test_tokenizer_endpoints_answer_with_the_models_tokenizer(server, llm):
    """vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` (the
    server was started with ``--enable-tokenizer-info-endpoint``)."""
    from pagedkv_lab.tokenizing import chat_prompts

    tok = llm.get_tokenizer()
    text = "Hello, wörld!"
    r = _post(server, "/tokenize", json={"prompt": text, "add_special_tokens": False})
    ids = tok(text, add_special_tokens=False).input_ids
    assert r.status_code == 200
    assert r.json() == {"count": len(ids), "max_model_len": llm.max_model_len,
                        "tokens": ids, "token_strs": None}  # fmt: skip
    r = _post(server, "/tokenize", json={"model": MODEL, "prompt": text})
    assert r.json()["tokens"] == [tok.bos_token_id] + ids  # special tokens by default
    messages = [{"role": "user", "content": "Hi"}]
    r = _post(server, "/tokenize", json={"messages": messages, "return_token_strs": True})
    (chat,) = chat_prompts(tok, messages)
    assert r.json()["tokens"] == chat["prompt_token_ids"]
    assert r.json()["token_strs"] == tok.convert_ids_to_tokens(chat["prompt_token_ids"])
    r = _post(server, "/detokenize", json={"tokens": [tok.bos_token_id] + ids})
    assert r.json() == {"prompt": tok.bos_token + text}
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("</s>", "<s>", "<pad>")
    assert info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == llm.max_model_len  # the tokenizer sets none
    for path, body, field, status in (
        ("/detokenize", {"tokens": [1, 5000]}, "tokens", 400),
        ("/detokenize", {"tokens": [-1]}, "tokens", 400),
        ("/detokenize", {"tokens": [1] * 2049}, "tokens", 400),
        ("/tokenize", {"prompt": "x" * 2100}, "prompt", 400),
        ("/tokenize", {}, "prompt", 400),
        ("/tokenize", {"prompt": "Hi", "messages": messages}, "prompt", 400),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages", 400),
        ("/tokenize", {"prompt": "Hi", "continue_final_message": True},
         "continue_final_message", 400),
        ("/tokenize", {"model": "gpt-4", "prompt": "Hi"}, "model", 404),
    ):  # fmt: skip
        r = _post(server, path, json=body)
        assert r.status_code == status, (path, body, r.text)
        assert r.json()["error"]["param"] == field, (path, body, r.text)
        assert field in r.json()["error"]["message"] or status == 404


def test_tokenizer_info_needs_its_flag(small_server):
    """Without ``--enable-tokenizer-info-endpoint`` there is no such route, as
    in vLLM; ``/tokenize`` is served all the same."""
    assert httpx.get(f"{small_server.url}/tokenizer_info", timeout=30).status_code == 404
    assert _post(small_server, "/tokenize", json={"prompt": "Hi"}).status_code == 200


# ---- load, disconnects, bad input -------------------------------------------


def test_load_64_concurrent_clients(server, llm):
    """320 requests (half streamed) from 64 threads: every reply equal to its
    `LLM.generate` reference, every block free afterwards, memory steady.

    RSS tolerance: the engine allocates its weights and KV pool up front, so
    steady-state serving should not grow the process. A warm-up round of the
    same shape first brings Python's and glibc's heaps to their high-water
    mark; after it, 320 more requests grew RSS by well under 1 MiB here. 16 MiB
    leaves room for allocator noise and still catches a leak of ~50 KB per
    request (one request's output, logprobs or stream state kept alive).
    """
    combos = [(p, m) for p in PROMPTS for m in (4, 9, 13, 16)]
    outs = llm.generate(
        [p for p, _ in combos],
        [greedy(m, ignore_eos=True) for _, m in combos],
        use_tqdm=False,
    )
    ref = {combo: o.text for combo, o in zip(combos, outs)}
    client = server.client(timeout=120)

    def one(i: int):
        prompt, max_tokens = combos[i % len(combos)]
        kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
        if i % 2:
            r = client.completions.create(**kw)
            return (prompt, max_tokens), r.choices[0].text, r.usage.completion_tokens
        text, tokens = "", None
        for chunk in client.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw
        ):
            text += chunk.choices[0].text if chunk.choices else ""
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        return (prompt, max_tokens), text, tokens

    def round_(n: int):
        with cf.ThreadPoolExecutor(64) as pool:
            return list(pool.map(one, range(n)))

    round_(64)  # warm-up
    before, rss0 = server.metrics(), server.rss_mib()
    results = round_(320)
    after = server.wait_metrics(lambda m: m["vllm:num_requests_running"] == 0)
    rss1 = server.rss_mib()
    assert len(results) == 320
    wrong = [(k, text) for k, text, n in results if text != ref[k] or n != k[1]]
    assert not wrong, wrong[:3]
    assert after["vllm:num_requests_waiting"] == 0
    assert after["pagedkv:kv_blocks_used"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["pagedkv:kv_blocks_free"] == after["pagedkv:kv_blocks_total"]
    done = after["vllm:request_success_total"] - before["vllm:request_success_total"]
    assert done == 320
    generated = (
        after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    )
    assert generated == sum(k[1] for k, _, _ in results)
    assert rss1 - rss0 < 16, (rss0, rss1)


def _aborted(m: dict[str, float]) -> float:
    return m[
        'vllm:request_success_total{model_name="tiny-llama",engine="0",finished_reason="abort"}'
    ]


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = server.metrics()
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 1500,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, timeout=60
    ) as r:
        assert r.status_code == 200
        chunks, lines = [], r.iter_lines()  # (dropping the iterator closes it)
        for line in lines:
            if line.startswith("data:"):
                chunks.append(json.loads(line[5:]))
                if len(chunks) == 3:
                    break
        assert server.metrics()["pagedkv:kv_blocks_used"] > 0
    # leaving the block closes the connection mid-stream
    after = server.wait_metrics(
        lambda m: (
            _aborted(m) == _aborted(before) + 1
            and m["pagedkv:kv_blocks_used"] == 0
            and m["vllm:num_requests_running"] == 0
        )
    )
    generated = (
        after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    )
    assert generated < 1500


def test_disconnect_while_waiting_for_a_plain_reply(server):
    before = server.metrics()
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 1500,
                       "ignore_eos": True, "temperature": 0}).encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        server.wait_metrics(lambda m: m["vllm:num_requests_running"] == 1)
    after = server.wait_metrics(
        lambda m: (
            _aborted(m) == _aborted(before) + 1 and m["pagedkv:kv_blocks_used"] == 0
        )
    )
    generated = (
        after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    )
    assert generated < 1500


BAD = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 2045}, "max_tokens"),  # prompt + max_tokens over max_model_len
    ({"prompt": "x" * 2100}, "prompt"),  # over max_model_len (2,048)
    ({"prompt": list(range(1, 2100))}, "prompt"),
    ({"prompt": [1, 5000]}, "prompt"),  # a token id outside the vocabulary
    ({"prompt": [[1, 72], [1, 5000]], "echo": True}, "prompt"),
    ({"prompt": [1, -3]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["Hi", ""]}, "prompt"),
    ({"prompt": [[1, 72], []]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n"),
    ({"top_p": 0}, "top_p"),
    ({"logprobs": 50}, "logprobs"),
    ({"logprobs": 21, "echo": True, "max_tokens": 0}, "logprobs"),  # vLLM's limit: 20
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    # vLLM streams an echo, but not prompt_logprobs
    ({"echo": True, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"suffix": "!"}, "suffix"),  # OpenAI fields this server does not implement
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"echo": "loud"}, "echo"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": "many"}, "max_tokens"),
]


def test_bad_input_is_400_naming_the_field_and_disturbs_nothing(server, llm):
    ref = llm.generate(PROMPTS[7], greedy(200, ignore_eos=True), use_tqdm=False)[0]
    body = {"model": MODEL, "prompt": PROMPTS[7], "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, timeout=60
    ) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        text = json.loads(first[5:])["choices"][0]["text"]
        # a request in flight while the bad ones come
        for change, field in BAD:
            bad = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **change}
            reply = _post(server, "/v1/completions", json=bad)
            assert reply.status_code == 400, (change, reply.text)
            error = reply.json()["error"]
            assert error["param"] == field and field in error["message"], (
                change,
                error,
            )
            assert error["type"] == "BadRequestError" and error["code"] == 400
        for line in lines:
            if line.startswith("data:") and line != "data: [DONE]":
                text += json.loads(line[5:])["choices"][0]["text"]
    assert text == ref.text
    malformed = _post(server, "/v1/completions", content=b'{"prompt": "Hi", ',
                      headers={"Content-Type": "application/json"})  # fmt: skip
    assert malformed.status_code == 400
    assert "malformed JSON" in malformed.json()["error"]["message"]
    unknown = _post(server, "/v1/completions", json={"model": "gpt-4", "prompt": "Hi"})
    assert unknown.status_code == 404  # vLLM's and OpenAI's answer
    assert unknown.json()["error"]["param"] == "model"
    assert "gpt-4" in unknown.json()["error"]["message"]
    for messages, field in (
        ([], "messages"),
        ([{"role": "wizard", "content": "Hi"}], "messages"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages",
        ),
    ):
        reply = _post(server, "/v1/chat/completions", json={"messages": messages})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}],
            logprobs=True, top_logprobs=30,
        )  # fmt: skip
    # and the server answers as before
    again = llm.generate(PROMPTS[0], greedy(24), use_tqdm=False)[0]
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0
    )
    assert r.choices[0].text == again.text
    m = server.metrics()
    assert m["pagedkv:kv_blocks_used"] == 0 and m["vllm:num_requests_running"] == 0


def test_metrics_names(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total", "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total", "vllm:time_to_first_token_seconds_bucket",
        "pagedkv:step_duration_seconds_count", "pagedkv:kv_blocks_free",
    ):  # fmt: skip
        assert f"\n{name}{{" in text, name
    m = parse_metrics(text)
    assert m["vllm:prompt_tokens_total"] > 0
    assert m["pagedkv:step_duration_seconds_count"] > 0


def test_the_online_client_drives_the_server(server, llm, capsys, tmp_path):
    """`scripts/vllm_client.py`'s client (`pagedkv_lab.bench.online`): the W1
    trace replayed over HTTP, every request served in full, its tokens equal
    to `LLM.generate`'s greedy tokens."""
    from pagedkv_lab.bench.online import build_trace, client_main

    out = tmp_path / "w1.json"
    client_main(["--url", server.url, "--name", "pagedkv", "--num-requests", "6",
                 "--max-model-len", "256", "--rate", "inf", "--warmup", "0",
                 "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert "requests/s" in text and "TTFT p50/p90/p99" in text
    run = json.loads(out.read_text())["pagedkv"][0]
    assert run["summary"]["failed"] == 0 and run["summary"]["short"] == 0
    requests, prompts = build_trace(6, 256, seed=0)
    refs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [greedy(r.output_len, ignore_eos=True) for r in requests],
        use_tqdm=False,
    )
    assert [r["token_ids"] for r in run["records"]] == [o.token_ids for o in refs]


def test_engine_loop_survives_what_a_request_breaks(llm, monkeypatch):
    """In-process, without HTTP: a chat template that raises fails its own
    request with a 400 and the loop goes on serving."""
    import asyncio

    from pagedkv_lab.serve import EngineLoop, RequestError
    from pagedkv_lab.serve.metrics import ServerMetrics

    def broken(*args, **kwargs):
        raise RuntimeError("roles must alternate")

    monkeypatch.setattr(llm.tokenizer, "apply_chat_template", broken)
    params = SamplingParams(
        temperature=0, max_tokens=5, output_kind=RequestOutputKind.DELTA
    )

    async def run():
        loop = EngineLoop(llm, ServerMetrics(MODEL, llm.max_model_len))
        await loop.start()
        try:
            chat = [{"messages": [{"role": "user", "content": "Hi"}]}]
            with pytest.raises(RequestError) as err:
                await loop.submit(chat, params, time.perf_counter())
            assert err.value.status == 400 and err.value.param == "messages"
            assert "roles must alternate" in err.value.message
            stream = await loop.submit(
                [{"prompt": "Hello"}], params, time.perf_counter()
            )
            tokens = [t async for _, out in stream for t in out.outputs[0].token_ids]
            assert loop.error is None and len(tokens) == 5
        finally:
            await loop.shutdown()

    asyncio.run(run())


# ---- the waiting queue and SIGTERM ---------------------------------------------


def _open_stream(client: httpx.Client, s: Server, max_tokens: int):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "return_token_ids": True}  # fmt: skip
    request = client.build_request("POST", f"{s.url}/v1/completions", json=body)
    return client.send(request, stream=True)


def test_full_waiting_queue_is_503(small_server):
    s = small_server
    with httpx.Client(timeout=60) as http:
        running = _open_stream(http, s, 2000)
        lines = running.iter_lines()  # kept: dropping the iterator closes the stream
        next(line for line in lines if line.startswith("data:"))
        waiting = [_open_stream(http, s, 4) for _ in range(2)]
        s.wait_metrics(lambda m: m["vllm:num_requests_waiting"] == 2)
        full = _post(s, "/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        assert full.status_code == 503, full.text
        assert "waiting queue is full" in full.json()["error"]["message"]
        for r in [running, *waiting]:
            r.close()
    s.wait_metrics(lambda m: m["vllm:num_requests_running"] == 0
                   and m["vllm:num_requests_waiting"] == 0
                   and m["pagedkv:kv_blocks_used"] == 0)  # fmt: skip
    ok = _post(s, "/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert ok.status_code == 200


def test_prefix_cache_metrics(small_server):
    s = small_server
    prompt = list(range(3, 103))  # 100 tokens: 6 full blocks of 16
    before = s.metrics()
    for _ in range(2):
        reply = _post(s, "/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert reply.status_code == 200
    after = s.metrics()
    hits = (
        after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    )
    queries = (
        after["vllm:prefix_cache_queries_total"]
        - before["vllm:prefix_cache_queries_total"]
    )
    assert hits == 96 and queries == 200  # the second request found 6 blocks cached
    assert 0 < after["pagedkv:prefix_cache_hit_rate"] <= 1
    # cached-free blocks can be handed out: they count as free, not used
    assert after["pagedkv:kv_blocks_used"] == 0


def test_sigterm_finishes_in_flight_and_exits_0(small_server):
    s = small_server
    with httpx.Client(timeout=60) as http:
        stream = _open_stream(http, s, 600)
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while True:  # new connections are refused at once
            try:
                socket.create_connection(("127.0.0.1", s.port), timeout=1).close()
            except OSError:
                break
            assert time.monotonic() < deadline, "still accepting after SIGTERM"
            time.sleep(0.05)
        chunks = [
            json.loads(x[5:])
            for x in lines
            if x.startswith("data:") and "[DONE]" not in x
        ]
    # the request in flight got every one of its tokens
    tokens = sum(
        len(c["choices"][0]["token_ids"]) for c in [json.loads(first[5:]), *chunks]
    )
    assert tokens == 600 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert s.proc.wait(60) == 0, s.log.read_text()[-3000:]
    assert "Traceback" not in s.log.read_text()


def test_console_script(capsys):
    from pagedkv_lab.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0 and "--max-waiting" in capsys.readouterr().out
    script = Path(sys.executable).parent / "pagedkv-lab"
    if script.exists():  # installed by pip install -e '.[serve]'
        out = subprocess.run([script, "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "serve MODEL" in out.stdout
