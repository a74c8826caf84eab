"""Penalties, logit bias and top log-probabilities: the sampling math against a direct torch
computation row by row, and the engine's tokens against an eager model with the same rules."""

import pytest
import torch
from serve_testutil import eager_penalized_greedy, prompts, reference_adjust

from graphpar.serving.sampling import SamplingParams, adjust_logits, sample_tokens, top_logprobs


def test_adjusted_logits_equal_a_row_by_row_reference():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 12, generator=generator)
    histories = [([1, 2, 3, 3, 3, 7], 2), ([4, 4, 5], 1), ([0, 1], 2), ([9, 9, 9, 11], 0),
                 ([6], 1)]
    params = [SamplingParams(frequency_penalty=0.7, presence_penalty=0.3),
              SamplingParams(logit_bias={5: 3.0, 0: -100}),
              SamplingParams(),  # untouched
              SamplingParams(repetition_penalty=1.5, frequency_penalty=-0.5,
                             logit_bias={9: 2.0}),
              SamplingParams(presence_penalty=-1.0)]
    adjusted = adjust_logits(logits, params, histories)
    for i, (p, (tokens, prompt_len)) in enumerate(zip(params, histories)):
        expected = reference_adjust(logits[i], p, tokens, prompt_len)
        torch.testing.assert_close(adjusted[i], expected, rtol=0, atol=1e-6)
    assert not torch.equal(adjusted[0], logits[0]) and torch.equal(adjusted[2], logits[2])
    assert adjust_logits(logits, [SamplingParams()] * 5, histories) is logits


def test_bias_steers_greedy_but_logprobs_stay_the_models():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    tokens, logprobs = sample_tokens(logits, [SamplingParams(logit_bias={"2": 100})], [None],
                                     histories=[([0], 1)])
    assert tokens == [2]
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]))
    # a frequency penalty on the token generated twice moves greedy to the next best
    tokens, _ = sample_tokens(logits, [SamplingParams(frequency_penalty=1.0)], [None],
                              histories=[([0, 1, 1], 1)])
    assert tokens == [3]


def test_top_logprobs_equal_log_softmax_topk():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    tops = top_logprobs(logits, [3, 0, 20])
    assert tops[1] is None
    for i, k in ((0, 3), (2, 20)):
        values, ids = torch.log_softmax(logits[i], -1).topk(k)
        assert [t for t, _ in tops[i]] == ids.tolist()
        assert [v for _, v in tops[i]] == pytest.approx(values.tolist(), abs=1e-6)


@pytest.mark.parametrize("fields, words", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2]"),
    ({"logit_bias": {3: 101}}, "logit_bias values must be in [-100, 100], got [101.0]"),
    ({"top_logprobs": 21}, "top_logprobs must be between 0 and 20"),
    ({"beam_width": 2, "frequency_penalty": 1}, "not supported with beam search"),
])
def test_out_of_range_values_are_refused(fields, words):
    from graphpar.errors import GenerationError

    with pytest.raises(GenerationError, match=words.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**fields).validate()


def test_engine_applies_bias_and_penalties_like_eager(models, engines):
    module, llm = models("gpt").eval(), engines("gpt")
    (prompt,) = prompts([5], seed=3)
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    penalized = SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=2.0,
                               presence_penalty=0.5)
    biased = SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={"77": 100})
    repeated = SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    outs = llm.generate([prompt] * 4, [plain, penalized, biased, repeated])
    free = outs[0].outputs[0].token_ids
    assert len(set(free)) < len(free)  # the tiny model repeats itself, so the penalty matters
    for out, params in zip(outs[1:], (penalized, biased, repeated)):
        assert out.outputs[0].token_ids == eager_penalized_greedy(module, prompt,
                                                                  params.max_tokens, params)
    assert outs[1].outputs[0].token_ids != free
    assert outs[2].outputs[0].token_ids == [77] * 4


def test_engine_top_logprobs_equal_eager_log_softmax(models, engines):
    module, llm = models("gpt").eval(), engines("gpt")
    (prompt,) = prompts([6], seed=4)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=5, top_logprobs=4,
                                                   ignore_eos=True))
    c = out.outputs[0]
    ids = list(prompt)
    with torch.no_grad():
        for token, top in zip(c.token_ids, c.top_logprobs, strict=True):
            logprobs = torch.log_softmax(module(torch.tensor([ids]))[0, -1].float(), -1)
            values, best = logprobs.topk(4)
            assert [t for t, _ in top] == best.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
            ids.append(token)
    (plain,) = llm.generate([prompt], SamplingParams(max_tokens=2))
    assert plain.outputs[0].top_logprobs is None


def test_naive_baseline_applies_the_same_penalties(models):
    from graphpar.serving.naive import naive_generate

    module = models("gpt").eval()
    (prompt,) = prompts([5], seed=3)
    params = SamplingParams(max_tokens=8, ignore_eos=True, frequency_penalty=2.0,
                            logit_bias={"5": 3.0})
    result = naive_generate(module, [prompt], params)
    assert result.tokens[0] == eager_penalized_greedy(module, prompt, 8, params)


def eager_prompt_logprobs(module, prompt, k):
    """Each prompt token's logprob given those before it, and the k most likely, from one
    eager forward over the whole prompt."""
    with torch.no_grad():
        logprobs = torch.log_softmax(module(torch.tensor([prompt]))[0].float(), -1)
    values, ids = logprobs.topk(k, dim=-1)
    return [None] + [(float(logprobs[p - 1, prompt[p]]),
                      list(zip(ids[p - 1].tolist(), values[p - 1].tolist())))
                     for p in range(1, len(prompt))]


def assert_prompt_logprobs(got, expected):
    assert got[0] is None and len(got) == len(expected)
    for (lp, top), (want_lp, want_top) in zip(got[1:], expected[1:]):
        assert lp == pytest.approx(want_lp, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in want_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=1e-4)


def test_prompt_logprobs_equal_eager_with_the_cache_and_chunks(models, engines):
    from graphpar.serving.llm import LLM

    module = models("gpt").eval()
    (prompt, other) = prompts([21, 9], seed=5)
    expected = eager_prompt_logprobs(module, prompt, 2)
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    llm = engines("gpt")
    llm.generate([prompt], SamplingParams(max_tokens=1))  # its full blocks are now cached
    first, plain = llm.generate([prompt, other], [params, SamplingParams(max_tokens=3)])
    assert first.num_cached_tokens == 0  # computed whole, though cached: every row is needed
    assert_prompt_logprobs(first.prompt_logprobs, expected)
    assert plain.prompt_logprobs is None
    assert first.outputs[0].token_ids == llm.generate([prompt], SamplingParams(
        max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids
    chunked = LLM(module, max_num_seqs=4, block_size=8, num_blocks=64,
                  max_num_batched_tokens=8)  # the prompt comes in 3 chunks
    (out,) = chunked.generate([prompt], params)
    assert_prompt_logprobs(out.prompt_logprobs, expected)


@pytest.mark.slow
def test_prompt_logprobs_and_penalties_on_two_tensor_parallel_ranks(models):
    from graphpar.serving.llm import LLM

    module = models("gpt").eval()
    (prompt,) = prompts([21], seed=5)
    params = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=2,
                            frequency_penalty=2.0)
    with LLM(module, max_num_seqs=4, block_size=8, num_blocks=64, tensor_parallel=2) as llm:
        (out,) = llm.generate([prompt], params)
    assert_prompt_logprobs(out.prompt_logprobs, eager_prompt_logprobs(module, prompt, 2))
    assert out.outputs[0].token_ids == eager_penalized_greedy(module, prompt, 6, params)
