"""The vLLM-shaped API after the course: SamplingParams' fields, logprobs,
streaming, seeds, dtypes, prompt dicts, chat, several EOS ids; checked against
transformers wherever it has the same feature."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessor, LogitsProcessorList

from pagedkv_lab import LLM, RequestOutputKind, SamplingParams
from pagedkv_lab.models import build_tokenizer, load_model
from pagedkv_lab.output_processor import IncrementalDetokenizer

PROMPT = [1, 72, 101, 108, 108, 111, 35, 119]
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair():
    return load_model("tiny-llama")


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(pair, request):
    """The engine, stepping synchronously and with asynchronous scheduling: the
    API behaves the same either way."""
    return LLM(pair, kv_cache_memory=2**20, async_scheduling=request.param)


def _hf(model, prompt, max_new_tokens, **kwargs):
    """transformers' greedy generate for one prompt; its new tokens."""
    ids = torch.tensor([prompt])
    kwargs.setdefault("eos_token_id", None)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        **kwargs,
    )
    return out[0, len(prompt) :].tolist()


def _one(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def _assert_idle(llm):
    bm = llm.block_manager
    assert not llm.scheduler.has_unfinished and not llm.output_processor.states
    assert not llm.output_processor.states and not llm.output_processor.external_ids
    assert bm.num_free_blocks == bm.num_blocks


# SamplingParams: vLLM's fields, checked ------------------------------------------


@pytest.mark.parametrize(
    "fields,name",
    [
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(stop_token_ids=[2, "x"]), r"stop_token_ids\[1\]"),
        (dict(stop_token_ids=7), "stop_token_ids"),
        (dict(stop=[""]), r"stop\[0\]"),
        (dict(stop=["a", 3]), r"stop\[1\]"),
        (dict(stop=b"x"), "stop"),
        (dict(min_p=1.5), "min_p"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=1.5), "prompt_logprobs"),
        (dict(seed=-1), "seed"),
        (dict(seed=2.0), "seed"),
        (dict(n=0), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(skip_special_tokens="yes"), "skip_special_tokens"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
        (dict(output_kind="delta"), "output_kind"),
    ],
)
def test_bad_fields_raise_a_value_error_naming_them(fields, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)


def test_vllm_conventions_and_numpy_integers_are_accepted():
    for k in (-1, 0, 5):
        assert SamplingParams(top_k=k).top_k == k
    assert SamplingParams(max_tokens=None).max_tokens is None
    sp = SamplingParams(
        seed=np.int64(5),
        n=np.int32(2),
        max_tokens=np.int64(9),
        top_k=np.int16(3),
        stop_token_ids=np.array([4, 5]),
        stop="x",
    )
    assert (sp.seed, sp.n, sp.max_tokens, sp.top_k) == (5, 2, 9, 3)
    assert all(type(v) is int for v in (sp.seed, sp.n, sp.max_tokens, sp.top_k))
    assert sp.stop_token_ids == (4, 5) and sp.stop == ("x",)


def test_a_numpy_seed_samples_like_the_same_int(llm):
    a = _one(llm, PROMPT, temperature=0.8, max_tokens=8, seed=np.int64(5))
    b = _one(llm, PROMPT, temperature=0.8, max_tokens=8, seed=5)
    assert a.token_ids == b.token_ids


def test_top_k_minus_one_and_zero_both_mean_no_cut(llm):
    runs = [
        _one(llm, PROMPT, temperature=1.0, top_k=k, max_tokens=10, seed=3).token_ids
        for k in (-1, 0)
    ]
    assert runs[0] == runs[1]
    # and a real cut changes what is sampled
    cut = _one(llm, PROMPT, temperature=1.0, top_k=1, max_tokens=10, seed=3)
    assert cut.token_ids == _one(llm, PROMPT, max_tokens=10, **GREEDY).token_ids


@pytest.mark.parametrize(
    "change,name",
    [
        (dict(top_k=-5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop_token_ids=[2, "x"]), "stop_token_ids"),
        (dict(temperature="hot"), "temperature"),
        (dict(min_tokens=100, max_tokens=3), "min_tokens"),
    ],
)
def test_a_field_changed_after_construction_is_caught_at_the_door(llm, change, name):
    sp = SamplingParams(temperature=0, max_tokens=4)
    for field_name, value in change.items():
        setattr(sp, field_name, value)
    with pytest.raises(ValueError, match=name):
        llm.add_request(PROMPT, sp)
    with pytest.raises(ValueError, match=name):
        llm.add_request("req-x", PROMPT, sp)
    with pytest.raises(ValueError, match=name):
        llm.generate([PROMPT], sp, use_tqdm=False)
    _assert_idle(llm)
    assert _one(llm, PROMPT, max_tokens=3, **GREEDY).finish_reason == "length"


def test_a_changed_top_k_of_minus_one_is_served(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=5, seed=1)
    sp.top_k = -1
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    assert out.finish_reason in ("length", "stop") and out.error is None
    assert (
        out.token_ids
        == _one(llm, PROMPT, temperature=1.0, max_tokens=5, seed=1).token_ids
    )


def test_max_tokens_none_runs_to_the_model_length(pair):
    llm = LLM(pair, kv_cache_memory=2**20, max_model_len=40)
    out = _one(llm, PROMPT, max_tokens=None, **GREEDY)
    assert len(out.token_ids) == 40 - len(PROMPT) and out.finish_reason == "length"


def test_one_sampling_params_class():
    """One `SamplingParams` for the chapters, the engine and the server."""
    import pagedkv_lab.sampling_params as sp

    classes = [c for c in vars(sp).values() if isinstance(c, type) and "Sampling" in c.__name__]
    assert classes == [SamplingParams]


# Penalties, min_tokens, min_p, stop strings against transformers -----------------


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_equals_transformers_greedy(pair, llm, penalty):
    model, _ = pair
    ours = _one(llm, PROMPT, max_tokens=24, repetition_penalty=penalty, **GREEDY)
    assert ours.token_ids == _hf(model, PROMPT, 24, repetition_penalty=penalty)
    plain = _one(llm, PROMPT, max_tokens=24, **GREEDY)
    assert ours.token_ids != plain.token_ids


class _VllmPenalties(LogitsProcessor):
    """vLLM's frequency and presence penalties, written out for transformers."""

    def __init__(self, prompt_len, frequency, presence):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, out, torch.ones_like(out, dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0)


@pytest.mark.parametrize("frequency,presence", [(1.5, 0.0), (0.0, 2.0), (0.5, -1.0)])
def test_frequency_and_presence_penalties_follow_vllm(pair, llm, frequency, presence):
    model, _ = pair
    ours = _one(
        llm,
        PROMPT,
        max_tokens=24,
        frequency_penalty=frequency,
        presence_penalty=presence,
        **GREEDY,
    )
    processor = LogitsProcessorList([_VllmPenalties(len(PROMPT), frequency, presence)])
    assert ours.token_ids == _hf(model, PROMPT, 24, logits_processor=processor)


@pytest.fixture(scope="module")
def two_eos():
    """A model whose generation config (only) ends at a token its greedy
    output reaches third, and at </s>: Llama 3's list case."""
    model, tok = load_model("tiny-llama")
    plain = _hf(model, PROMPT, 12)
    eos = plain[2]
    assert eos not in plain[:2]
    model.generation_config.eos_token_id = [2, eos]
    return model, tok, eos, plain


def test_every_eos_id_of_the_generation_config_stops_a_request(two_eos):
    model, tok, eos, plain = two_eos
    for llm in (
        LLM((model, tok), kv_cache_memory=2**20),
        LLM(model, kv_cache_memory=2**20),
    ):
        assert eos in llm.eos_token_ids and 2 in llm.eos_token_ids
        out = _one(llm, PROMPT, temperature=0, max_tokens=12)
        assert out.token_ids == _hf(model, PROMPT, 12, eos_token_id=[2, eos])
        assert out.token_ids == plain[:3] and out.finish_reason == "stop"
        assert out.outputs[0].stop_reason is None


def test_min_tokens_equals_transformers_min_new_tokens(two_eos):
    model, tok, eos, plain = two_eos
    llm = LLM((model, tok), kv_cache_memory=2**20)
    for min_tokens in (0, 3, 6):
        ours = _one(llm, PROMPT, temperature=0, max_tokens=12, min_tokens=min_tokens)
        theirs = _hf(
            model, PROMPT, 12, eos_token_id=[2, eos], min_new_tokens=min_tokens
        )
        assert ours.token_ids == theirs
        assert len(ours.token_ids) > min_tokens
    # min_tokens also holds back stop_token_ids
    out = _one(
        llm,
        PROMPT,
        temperature=0,
        max_tokens=12,
        min_tokens=6,
        stop_token_ids=[plain[0]],
        ignore_eos=True,
    )
    assert plain[0] not in out.token_ids[:6]


def test_min_p_of_one_keeps_only_the_most_likely_token(llm):
    sampled = _one(llm, PROMPT, temperature=1.5, min_p=1.0, max_tokens=16, seed=9)
    assert sampled.token_ids == _one(llm, PROMPT, max_tokens=16, **GREEDY).token_ids
    loose = _one(llm, PROMPT, temperature=1.5, min_p=0.0, max_tokens=16, seed=9)
    assert loose.token_ids != sampled.token_ids


def _printable_stop(tok, tokens):
    """A one-character stop string: the text of the first output token that is
    a printable ASCII character not seen earlier in the output; its index."""
    for i, t in enumerate(tokens):
        ch = tok.decode([t])
        if len(ch) == 1 and ch.isascii() and ch.isprintable() and ch != " ":
            if ch not in tok.decode(tokens[:i]) and i >= 2:
                return ch, i
    pytest.skip("no printable output token to stop at")


def test_stop_strings_equal_transformers_stop_strings(pair, llm):
    model, tok = pair
    prompt = [1] + list(range(40, 60))
    plain = _one(llm, prompt, max_tokens=40, **GREEDY).token_ids
    stop, at = _printable_stop(tok, plain)
    theirs = _hf(model, prompt, 40, stop_strings=[stop], tokenizer=tok)
    assert theirs == plain[: at + 1]
    ours = _one(llm, prompt, max_tokens=40, stop=[stop], **GREEDY)
    assert ours.token_ids == theirs
    assert ours.finish_reason == "stop" and ours.outputs[0].stop_reason == stop
    assert ours.text == tok.decode(theirs, skip_special_tokens=True)[:-1]
    kept = _one(
        llm,
        prompt,
        max_tokens=40,
        stop=["\x00never", stop],
        include_stop_str_in_output=True,
        **GREEDY,
    )
    assert kept.text == tok.decode(theirs, skip_special_tokens=True)
    assert kept.text.endswith(stop)
    # before min_tokens, stop strings are not checked
    late = _one(llm, prompt, max_tokens=40, stop=[stop], min_tokens=at + 1, **GREEDY)
    assert len(late.token_ids) > at + 1


def test_a_stop_token_is_its_reason_and_not_in_the_text(llm, pair):
    _, tok = pair
    plain = _one(llm, PROMPT, max_tokens=10, **GREEDY).token_ids
    out = _one(llm, PROMPT, max_tokens=10, stop_token_ids=[plain[3]], **GREEDY)
    assert out.token_ids == plain[: plain.index(plain[3]) + 1]
    assert out.outputs[0].stop_reason == plain[3]
    assert out.text == tok.decode(out.token_ids[:-1], skip_special_tokens=True)


# Log-probabilities against transformers' logits ----------------------------------


def test_logprobs_are_the_models_raw_log_probabilities(pair, llm):
    model, _ = pair
    ids = torch.tensor([PROMPT])
    hf = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    theirs = torch.cat(hf.logits).float().log_softmax(-1)
    # Penalties and temperature do not change the raw log-probabilities.
    out = _one(llm, PROMPT, max_tokens=6, logprobs=3, repetition_penalty=1.0, **GREEDY)
    c = out.outputs[0]
    assert c.token_ids == hf.sequences[0, len(PROMPT) :].tolist()
    assert len(c.logprobs) == 6
    worst = 0.0
    for step, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert next(iter(entry)) == token and entry[token].rank == 1
        top = theirs[step].topk(3)
        assert list(entry) == top.indices.tolist()
        for t, lp in entry.items():
            worst = max(worst, abs(lp.logprob - theirs[step, t].item()))
        assert entry[token].decoded_token is not None
    assert worst < 1e-4
    assert (
        abs(
            c.cumulative_logprob
            - sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs))
        )
        < 1e-4
    )


def test_a_sampled_token_outside_the_top_n_is_listed_with_its_rank(llm):
    out = _one(llm, PROMPT, temperature=5.0, max_tokens=30, seed=2, logprobs=0)
    entries = out.outputs[0].logprobs
    assert all(len(e) == 1 for e in entries)
    ranks = [e[t].rank for t, e in zip(out.token_ids, entries)]
    assert max(ranks) > 1


@pytest.mark.parametrize("budget,caching", [(4096, False), (5, False), (4096, True)])
def test_prompt_logprobs_equal_a_transformers_forward(pair, budget, caching):
    model, tok = pair
    llm = LLM(
        pair,
        kv_cache_memory=2**20,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        block_size=4,
    )
    prompt = [1] + list(range(40, 60))
    with torch.no_grad():
        theirs = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for _ in range(2):  # the second one would hit the prefix cache
        out = _one(llm, prompt, max_tokens=3, prompt_logprobs=2, **GREEDY)
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for pos, entry in enumerate(plp[1:], start=1):
            assert next(iter(entry)) == prompt[pos]
            for t, lp in entry.items():
                assert abs(lp.logprob - theirs[pos - 1, t].item()) < 1e-4
                assert lp.decoded_token == tok.decode([t])  # each token's text
    assert out.token_ids == _hf(model, prompt, 3)
    _assert_idle(llm)


def test_prompt_logprobs_survive_preemption_and_the_models_own_forward(pair):
    model, _ = pair
    llm = LLM(
        pair,
        block_size=4,
        kv_cache_memory=12 * 4 * 512,
        max_num_batched_tokens=6,
        fused_forward=False,
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [
        [1] + torch.randint(3, 259, (19,), generator=gen).tolist() for _ in range(4)
    ]
    sp = SamplingParams(max_tokens=20, prompt_logprobs=0, **GREEDY)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.stats.preemptions > 0
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            theirs = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for pos, entry in enumerate(plp[1:], start=1):
            assert list(entry) == [prompt[pos]]
            assert abs(entry[prompt[pos]].logprob - theirs[pos - 1, prompt[pos]]) < 1e-4
        assert out.token_ids == _hf(model, prompt, 20)
    _assert_idle(llm)


def test_num_cached_tokens_counts_prefix_cache_hits(pair):
    llm = LLM(pair, kv_cache_memory=2**20, enable_prefix_caching=True, block_size=8)
    prompt = [1] + list(range(40, 60))
    first = _one(llm, prompt, max_tokens=2, **GREEDY)
    second = _one(llm, prompt, max_tokens=2, **GREEDY)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 16
    assert second.token_ids == first.token_ids
    m = second.metrics
    assert (
        m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    )


# Streaming ----------------------------------------------------------------------


def _stream(llm, request_id, prompt, params):
    llm.add_request(request_id, prompt, params)
    outs = []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.request_id == request_id]
    return outs


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.9, seed=11, max_tokens=30, ignore_eos=True),
        dict(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1),
        dict(temperature=1.0, seed=5, n=3, max_tokens=12, ignore_eos=True),
    ],
)
def test_delta_chunks_concatenate_to_the_batch_output(llm, params):
    final = _one(llm, "Hello there", **params)
    outs = _stream(
        llm,
        "req-d",
        "Hello there",
        SamplingParams(**params, output_kind=RequestOutputKind.DELTA),
    )
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert len(outs) == max(len(c.token_ids) for c in final.outputs)
    for k, whole in enumerate(final.outputs):
        pieces = [o.outputs[k] for o in outs]
        assert sum((p.token_ids for p in pieces), []) == whole.token_ids
        assert "".join(p.text for p in pieces) == whole.text
        if whole.logprobs is not None:
            assert sum((p.logprobs for p in pieces), []) == whole.logprobs
        assert [p.finish_reason for p in pieces][-1] == whole.finish_reason
    _assert_idle(llm)


def test_cumulative_outputs_grow_and_final_only_waits(llm):
    params = dict(temperature=0, max_tokens=9, ignore_eos=True)
    final = _one(llm, PROMPT, **params)
    outs = _stream(llm, "req-c", PROMPT, SamplingParams(**params))
    assert [len(o.token_ids) for o in outs] == list(range(1, 10))
    assert all(final.token_ids[: len(o.token_ids)] == o.token_ids for o in outs)
    assert outs[-1].text == final.text and outs[-1].finished
    assert all(o.finish_reason is None for o in outs[:-1])
    only = _stream(
        llm,
        "req-f",
        PROMPT,
        SamplingParams(**params, output_kind=RequestOutputKind.FINAL_ONLY),
    )
    assert len(only) == 1 and only[0].token_ids == final.token_ids


def test_streamed_text_never_shows_a_stop_string_that_is_cut(pair, llm):
    _, tok = pair
    prompt = [1] + list(range(40, 60))
    plain = _one(llm, prompt, max_tokens=40, **GREEDY).token_ids
    stop, at = _printable_stop(tok, plain)
    stop = stop + "\x01\x02"  # never completes: the held-back text waits to the end
    params = dict(max_tokens=40, stop=[stop], **GREEDY)
    final = _one(llm, prompt, **params)
    outs = _stream(llm, "req-s", prompt, SamplingParams(**params))
    for o in outs[:-1]:
        assert final.text.startswith(o.text)
        assert len(o.text) <= max(
            0, len(tok.decode(o.token_ids, skip_special_tokens=True)) - 2
        )
    assert outs[-1].text == final.text


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 319), max_size=40), st.booleans())
def test_incremental_detokenizer_concatenates_to_decode(ids, skip):
    tok = build_tokenizer(320)
    det = IncrementalDetokenizer(tok, skip)
    pieces = []
    for t in ids:
        before = len(det.text)
        det.add([t])
        pieces.append(det.text[before:])
    det.flush()
    assert det.text == tok.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) == det.text[: sum(map(len, pieces))]


# add_request / abort_request / step shapes --------------------------------------


def test_vllm_request_ids_and_abort_request(llm):
    sp = SamplingParams(max_tokens=50, **GREEDY)
    assert llm.add_request("req-A", "Hello", sp) == "req-A"
    with pytest.raises(ValueError, match="request_id 'req-A' is already in flight"):
        llm.add_request("req-A", "Hello", sp)
    with pytest.raises(ValueError, match="request_id must be a non-empty string"):
        llm.add_request(7, "Hello", sp)
    llm.add_request("req-B", {"prompt_token_ids": PROMPT}, sp)
    auto = llm.add_request(PROMPT, sp)
    assert isinstance(auto, int)
    seen = {o.request_id for o in llm.step()}
    assert seen == {"req-A", "req-B", auto}
    llm.abort_request(["req-A", "req-B", "unknown"])
    llm.abort_request(auto)
    _assert_idle(llm)
    assert llm.step() == []


def test_prompt_dicts_serve_like_plain_prompts(llm):
    sp = SamplingParams(max_tokens=5, **GREEDY)
    outs = llm.generate(
        [
            "Hello",
            {"prompt": "Hello"},
            {"prompt_token_ids": llm.tokenizer("Hello").input_ids},
        ],
        sp,
        use_tqdm=False,
    )
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert outs[1].prompt == "Hello" and outs[2].prompt is None
    for bad, message in [
        ({"text": "x"}, "a prompt dict has 'prompt'"),
        ({"prompt": 5}, "'prompt' must be text"),
        ({"prompt_token_ids": [1, 999]}, "token ids must be ints"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate([bad], sp, use_tqdm=False)
    _assert_idle(llm)


def test_stop_strings_without_a_tokenizer_are_refused(pair):
    model, _ = pair
    llm = LLM(model, kv_cache_memory=2**20)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.add_request(PROMPT, SamplingParams(stop=["x"]))
    _assert_idle(llm)


# LLM(...): seeds, dtypes, tokenizer, offline names -------------------------------


def test_seed_seeds_sampling_across_two_engines():
    sp = SamplingParams(temperature=0.8, max_tokens=8)
    runs = [
        LLM("tiny-llama", seed=42, kv_cache_memory=2**20).generate(
            ["Hello", "Hi"], sp, use_tqdm=False
        )
        for _ in range(2)
    ]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    other = LLM("tiny-llama", seed=43, kv_cache_memory=2**20).generate(
        ["Hello", "Hi"], sp, use_tqdm=False
    )
    assert [o.token_ids for o in other] != [o.token_ids for o in runs[0]]


def test_seed_leaves_the_weights_and_weights_seed_changes_them():
    greedy = SamplingParams(max_tokens=8, **GREEDY)

    def tokens(**kw):
        llm = LLM("tiny-llama", kv_cache_memory=2**20, **kw)
        return llm.generate([PROMPT], greedy, use_tqdm=False)[0].token_ids

    assert tokens(seed=1) == tokens() == tokens(seed=np.int64(7))
    assert tokens(weights_seed=1) != tokens()


@pytest.mark.parametrize(
    "dtype,expected",
    [
        ("auto", torch.float32),
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("float32", torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtype_names_work(dtype, expected):
    llm = LLM("tiny-llama", dtype=dtype, kv_cache_memory=2**20)
    assert llm.model.dtype == expected
    assert len(_one(llm, PROMPT, max_tokens=3, **GREEDY).token_ids) == 3


@pytest.mark.parametrize("dtype", ["float64", "int8", torch.int32, 5])
def test_bad_dtypes_name_the_argument(dtype):
    with pytest.raises(ValueError, match="dtype"):
        LLM("tiny-llama", dtype=dtype, kv_cache_memory=2**20)


def test_tokenizer_argument(pair):
    model, tok = pair
    llm = LLM(model, tokenizer=tok, kv_cache_memory=2**20)
    assert _one(llm, "Hello", max_tokens=3, **GREEDY).text is not None
    with pytest.raises(ValueError, match="tokenizer must be a tokenizer object"):
        LLM(model, tokenizer=5, kv_cache_memory=2**20)


def test_a_mistyped_offline_name_fails_before_any_hub_call(monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was called")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_hub)
    for name, close in [("tiny-lama", "tiny-llama"), ("small-qwen", "small-qwen2")]:
        with pytest.raises(ValueError, match=f"did you mean '{close}'"):
            LLM(name)


# chat ---------------------------------------------------------------------------


def test_chat_goes_through_the_chat_template(pair, llm):
    model, tok = pair
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    out = llm.chat(messages, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)[0]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = tok(ids, add_special_tokens=False).input_ids
    assert out.prompt_token_ids == expected
    assert expected.count(1) == 1  # one BOS, written by the template
    assert out.prompt.endswith("<|assistant|>\n")
    assert out.token_ids == _hf(model, expected, 6)
    both = llm.chat(
        [messages, messages[1:]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False
    )
    assert len(both) == 2 and both[0].token_ids == out.token_ids[:2]
    for bad in ({"role": "user"}, [{"content": "x"}], "hello"):
        with pytest.raises(ValueError, match="messages|message"):
            llm.chat(bad, use_tqdm=False)
    _assert_idle(llm)
