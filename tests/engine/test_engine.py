"""End-to-end engine behaviour on the embedded model: batch invariance, sampling, bad input."""

from __future__ import annotations

import pytest

from engine.config import ModelConfig
from engine.errors import InvalidRequestError, ModelLoadError
from engine.model_loader import load_model
from engine.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def chat(llm, text: str) -> list[int]:
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return llm.tokenizer.encode(rendered, add_special_tokens=False)


def mixed_prompts(llm, n: int) -> list[list[int]]:
    topics = ["rivers", "prime numbers", "bread", "the moon", "chess", "volcanoes", "jazz", "owls"]
    return [chat(llm, f"Tell me {'a lot ' * (i % 5)}about {topics[i % len(topics)]}.") for i in range(n)]


@pytest.fixture(scope="module")
def target_and_reference(smollm_fp32, engine_config):
    from engine.llm import LLM

    llm = LLM(config=engine_config, loaded=smollm_fp32)
    target = chat(llm, "Explain in two sentences why the sky is blue.")
    (ref,) = llm.generate([target], GREEDY)
    return target, ref.samples[0].token_ids


def test_greedy_output_is_identical_in_a_batch_of_16(make_llm, target_and_reference):
    target, reference = target_and_reference
    llm = make_llm()
    prompts = mixed_prompts(llm, 15)
    prompts.insert(7, target)
    results = llm.generate(prompts, GREEDY)
    assert results[7].samples[0].token_ids == reference


@pytest.mark.parametrize("budget", [7, 33, 64])
def test_greedy_output_is_identical_under_chunked_prefill(make_llm, target_and_reference, budget):
    target, reference = target_and_reference
    llm = make_llm(scheduler={"max_num_batched_tokens": budget})
    prompts = mixed_prompts(llm, 3) + [target]
    results = llm.generate(prompts, GREEDY)
    assert results[-1].samples[0].token_ids == reference


def test_greedy_output_is_identical_after_preemption(make_llm, target_and_reference, smollm_fp32):
    target, reference = target_and_reference
    # 9 blocks of 16 tokens: too few for all four to finish together.
    bytes_per_block = 2 * 16 * 3 * 64 * 4 * smollm_fp32.arch.num_hidden_layers
    llm = make_llm(cache={"kv_cache_memory_bytes": 9 * bytes_per_block})
    prompts = [target] + mixed_prompts(llm, 3)
    results = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert results[0].samples[0].token_ids == reference


def test_greedy_output_is_identical_on_a_prefix_cache_hit(make_llm, target_and_reference):
    target, reference = target_and_reference
    llm = make_llm()
    llm.generate([target], SamplingParams(temperature=0.0, max_tokens=1))
    (second,) = llm.generate([target], GREEDY)
    assert second.num_cached_tokens >= 16
    assert second.samples[0].token_ids == reference


def test_seeded_sampling_is_reproducible_whatever_the_batch(make_llm):
    llm = make_llm()
    prompt = chat(llm, "Name a colour.")
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    (alone,) = llm.generate([prompt], params)
    others = mixed_prompts(llm, 5)
    batch = llm.generate(others[:3] + [prompt] + others[3:], [SamplingParams(temperature=1.0, max_tokens=16)] * 3 + [params] + [SamplingParams(temperature=0.8, max_tokens=16)] * 2)
    assert batch[3].samples[0].token_ids == alone.samples[0].token_ids


def test_n_samples_share_the_prompt_blocks(make_llm):
    llm = make_llm()
    prompt = chat(llm, "Write a word that rhymes with cat, and explain the rhyme in detail please.")
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    (result,) = llm.generate([prompt], params)
    assert [len(s.token_ids) for s in result.samples] == [12, 12, 12]
    assert len({tuple(s.token_ids) for s in result.samples}) > 1
    # Samples after the first took the prompt's full blocks from the prefix cache.
    assert result.num_cached_tokens == (len(prompt) - 1) // 16 * 16


def test_stop_string_is_never_in_the_text(make_llm, target_and_reference):
    target, reference = target_and_reference
    llm = make_llm()
    full = llm.tokenizer.decode(reference)
    stop = full[len(full) // 2 : len(full) // 2 + 5]
    (result,) = llm.generate([target], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))
    sample = result.samples[0]
    assert sample.finish_reason == "stop" and sample.stop_reason == stop
    assert stop not in sample.text and full.startswith(sample.text)


def test_eos_finishes_with_stop_and_max_tokens_with_length(make_llm):
    llm = make_llm()
    prompt = chat(llm, "Say hi.")
    (free,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
    tokens = free.samples[0].token_ids
    first_eos = next(i for i, t in enumerate(tokens) if t in (0, 2))  # the model's own end
    (r,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=80))
    assert r.samples[0].finish_reason == "stop" and r.samples[0].stop_reason is None
    assert r.samples[0].token_ids == tokens[: first_eos + 1]
    assert "<|im_end|>" not in r.samples[0].text
    (r,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))
    assert r.samples[0].finish_reason == "length" and r.samples[0].token_ids == tokens[:3]


def test_logprobs_have_the_sampled_token_and_top_k(make_llm):
    llm = make_llm()
    (r,) = llm.generate([chat(llm, "Hi")], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))
    lps = r.samples[0].logprobs
    assert len(lps) == 4
    for token_id, lp in zip(r.samples[0].token_ids, lps):
        assert lp.token_id == token_id and lp.rank == 1 and len(lp.top) == 3
        assert lp.top[0][0] == token_id and lp.logprob == pytest.approx(lp.top[0][1])
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_bad_requests_raise_typed_errors_and_others_keep_running(make_llm):
    llm = make_llm()
    engine = llm.engine
    engine.add_request("good", chat(llm, "Hello"), SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request("long", [5] * engine.max_model_len, SamplingParams())
    with pytest.raises(InvalidRequestError, match="vocab|token ids"):
        engine.add_request("oov", [10**9], SamplingParams())
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=1.5)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert sum(len(o.new_token_ids) for o in outputs) == 7 and outputs[-1].finished


def test_abort_frees_every_block(make_llm):
    llm = make_llm()
    engine = llm.engine
    free_before = engine.pool.num_free_blocks
    engine.add_request("x", chat(llm, "Tell me a long story about dragons."), SamplingParams(max_tokens=100))
    engine.step()
    assert engine.pool.num_free_blocks < free_before
    (out,) = engine.abort("x")
    assert out.finish_reason == "abort" and not engine.has_unfinished()
    assert engine.pool.num_free_blocks == free_before


def test_unknown_and_corrupt_model_files_raise_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(ModelConfig(model=str(tmp_path / "nope.gguf")))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(200)))
    with pytest.raises(ModelLoadError):
        load_model(ModelConfig(model=str(bad)))
    empty_dir = tmp_path / "not-a-model"
    empty_dir.mkdir()
    with pytest.raises(ModelLoadError):
        load_model(ModelConfig(model=str(empty_dir)))


def test_a_bad_prompt_in_a_batch_leaves_nothing_queued_and_the_llm_usable(make_llm):
    from engine.errors import InvalidRequestError

    llm = make_llm()
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="prompt token ids"):
        llm.generate(["hello there", [1, 10**9]], greedy)
    with pytest.raises(InvalidRequestError, match="2 prompts but 1"):
        llm.generate(["a", "b"], [greedy])
    for bad in (123, None, [], [1.5]):
        with pytest.raises(InvalidRequestError):
            llm.generate(bad, greedy)
    with pytest.raises(InvalidRequestError, match="messages"):
        llm.chat([])
    assert not llm.engine.has_unfinished()
    (result,) = llm.generate(["What is 2+2?"], greedy)
    assert len(result.samples[0].token_ids) == 4


@pytest.mark.parametrize(
    "kwargs", [{"temperature": "hot"}, {"max_tokens": 1.5}, {"seed": "x"}, {"n": True}, {"top_p": float("nan")},
               {"stop_token_ids": ["a"]}, {"stop": [1]}],
)
def test_sampling_params_of_the_wrong_type_are_a_typed_error(kwargs):
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64])
def test_a_seed_past_64_bits_is_a_typed_error(seed):
    # A generator cannot take it (torch raises a bare ValueError past 2**64), and the API would answer 500.
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="seed must be a 64-bit integer"):
        SamplingParams(seed=seed)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)
