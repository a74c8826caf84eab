"""The serving engine: greedy tokens equal eager generation, beam search and parallel sampling
through copy-on-write, preemption, stop conditions, and bad requests that do not stop the rest."""

import pytest
import torch
from serve_testutil import eager_beam_search, eager_greedy, eager_logprobs, prompts

from graphpar.errors import BackendError, GenerationError
from graphpar.models import get_model
from graphpar.serving.kv_cache_manager import Pool
from graphpar.serving.llm import LLM
from graphpar.serving.naive import naive_generate
from graphpar.serving.sampling import SamplingParams, sample_tokens


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_free(llm):
    bm = llm.engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks() == bm.num_device_blocks
    assert bm.num_free_blocks(Pool.CPU) == bm.num_cpu_blocks


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_greedy_equals_eager_bundled(name, models, engines):
    """6 prompts of different lengths, at most 4 sequences per step: requests join and leave
    the batch while others decode (continuous batching)."""
    module, llm = models(name), engines(name)
    batch = prompts([3, 9, 5, 1, 12, 7], seed=4)
    outputs = llm.generate(batch, SamplingParams(max_tokens=10))
    assert tokens(outputs) == [eager_greedy(module, p, 10) for p in batch]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    assert_all_free(llm)


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama"])
def test_greedy_equals_hugging_face_generate(name, models, engines):
    module, llm = models(name), engines(name)
    batch = prompts([4, 11, 2, 6, 8], seed=5)
    outputs = llm.generate(batch, SamplingParams(max_tokens=12))
    for prompt, out in zip(batch, outputs):
        expected = module.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected
    assert_all_free(llm)


def test_naive_contiguous_generation_gives_the_same_tokens(models, engines):
    module, llm = models("llama"), engines("llama")
    batch = prompts([5, 2, 9, 4, 7], seed=6)
    params = [SamplingParams(max_tokens=n) for n in (3, 8, 5, 1, 6)]
    outputs = llm.generate(batch, params)
    result = naive_generate(module, batch, params, batch_size=3)
    assert tokens(outputs) == result.tokens
    assert [len(t) for t in result.tokens] == [3, 8, 5, 1, 6]


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_beam_search_equals_eager_beam_search(name, models, engines):
    module, llm = models(name), engines(name)
    batch = prompts([3, 7], seed=7)
    before = llm.stats.cow_copies
    outputs = llm.generate(batch, SamplingParams(max_tokens=6, beam_width=3, n=3))
    for prompt, out in zip(batch, outputs):
        assert [c.token_ids for c in out.outputs] == eager_beam_search(module, prompt, 3, 6)
    assert llm.stats.cow_copies > before  # beams share blocks; writes copy the last one
    assert_all_free(llm)


def test_beam_search_with_eos_and_length_penalty(models, engines):
    module, llm = models("hf-gpt2"), engines("hf-gpt2")
    (prompt,) = prompts([5], seed=8)
    params = SamplingParams(max_tokens=5, beam_width=2, n=2, length_penalty=0.5,
                            stop_token_ids=(17,))
    (out,) = llm.generate([prompt], params)
    assert [c.token_ids for c in out.outputs] == eager_beam_search(
        module, prompt, 2, 5, length_penalty=0.5, eos=(0, 17))


def test_parallel_sampling_shares_the_prompt(models, engines):
    module, llm = models("gpt"), engines("gpt")
    (prompt,) = prompts([9], seed=9)
    params = SamplingParams(max_tokens=6, n=3, temperature=1.0, top_k=40, top_p=0.9, seed=11)
    before = llm.stats.cow_copies
    (out,) = llm.generate([prompt], params)
    assert len(out.outputs) == 3
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:  # every sample's KV was right: its logprobs equal a full recompute
        assert c.logprobs == pytest.approx(eager_logprobs(module, prompt, c.token_ids),
                                           abs=1e-4)
    assert llm.stats.cow_copies > before  # the prompt's partial last block was copied
    (again,) = llm.generate([prompt], params)  # the seed makes it reproducible
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_all_free(llm)


def test_sampler_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 4.0, 4.5]])
    generators = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    greedy, logprobs = sample_tokens(logits, [SamplingParams()] * 2, [None, None])
    assert greedy == [1, 0]
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))
    for _ in range(20):  # top_k=1 and a tiny top_p leave only the argmax
        drawn, _ = sample_tokens(logits, [SamplingParams(temperature=2.0, top_k=1),
                                          SamplingParams(temperature=2.0, top_p=0.01)],
                                 generators)
        assert drawn == [1, 0]
    seen = set()
    for _ in range(200):  # top_k=2: only the two best tokens ever come out
        drawn, _ = sample_tokens(logits[:1], [SamplingParams(temperature=5.0, top_k=2)],
                                 generators[:1])
        seen.add(drawn[0])
    assert seen == {1, 3}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_tokens_exact(mode, models):
    """A KV pool of 14 blocks of 4 tokens for 8 requests: steps preempt the latest request
    (swap to CPU blocks, or drop and re-prefill) and the tokens do not change."""
    module = models("gpt")
    batch = prompts([5, 9, 3, 7, 6, 8, 4, 2], seed=10)
    expected = [eager_greedy(module, p, 14) for p in batch]
    llm = LLM(module, max_num_seqs=8, block_size=4, num_blocks=14, preemption_mode=mode)
    outputs = llm.generate(batch, SamplingParams(max_tokens=14))
    assert tokens(outputs) == expected
    assert llm.stats.preemptions > 0
    assert (llm.stats.swapped_blocks > 0) == (mode == "swap")
    # Beams share blocks: a preempted beam group is swapped, or under "recompute" recomputed
    # (re-prefilled with the prompt's blocks shared again), never swapped.
    beams = llm.generate(batch[:2], SamplingParams(max_tokens=10, beam_width=3, n=2))
    for prompt, out in zip(batch[:2], beams):
        assert [c.token_ids for c in out.outputs] == eager_beam_search(module, prompt, 3, 10)[:2]
    if mode == "recompute":
        assert llm.stats.swap_preemptions == 0 and llm.stats.swapped_blocks == 0
    assert_all_free(llm)


def test_stop_conditions(models, engines):
    llm = engines("gpt")
    (prompt,) = prompts([4], seed=12)
    (free,) = llm.generate([prompt], SamplingParams(max_tokens=8))
    generated = free.outputs[0].token_ids
    stop_token = generated[3]
    first = generated.index(stop_token)
    out = llm.generate([prompt] * 3, [
        SamplingParams(max_tokens=8, stop_token_ids=(stop_token,)),
        SamplingParams(max_tokens=8, stop=(tuple(generated[1:3]),)),
        SamplingParams(max_tokens=100)])
    assert out[0].outputs[0].token_ids == generated[:first + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[1].outputs[0].token_ids == generated[:3]
    # The context ends at the model's 64 positions: prompt 4 + 60 new tokens.
    assert len(out[2].outputs[0].token_ids) == 60
    assert out[2].outputs[0].finish_reason == "length"


def test_eos_stops_unless_ignored(models, engines):
    module, llm = models("hf-llama"), engines("hf-llama")
    batch = prompts([3, 5, 8], seed=13)
    plain = llm.generate(batch, SamplingParams(max_tokens=20, ignore_eos=True))
    picked = [(i, t) for i, o in enumerate(plain) for t in o.outputs[0].token_ids[:4]]
    i, eos = picked[0]
    module.generation_config.eos_token_id = eos  # make a token the model emits its EOS
    try:
        llm2 = LLM(module, max_num_seqs=4, block_size=8, num_blocks=64)
        out = llm2.generate([batch[i]], SamplingParams(max_tokens=20))[0].outputs[0]
    finally:
        module.generation_config.eos_token_id = 0
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos
    assert out.token_ids == plain[i].outputs[0].token_ids[:len(out.token_ids)]


def test_bad_requests_fail_alone(models):
    llm = LLM(models("gpt"), max_num_seqs=4, block_size=4, num_blocks=6)
    good = prompts([3, 4], seed=14)
    outputs = llm.generate(
        [good[0], [1] * 70, [2] * 20, [], [300], good[1], [5, 6], [7]],
        [SamplingParams(max_tokens=5)] * 5 + [SamplingParams(max_tokens=5),
                                              SamplingParams(top_p=0.0),
                                              SamplingParams(beam_width=5)])
    errors = [o.error for o in outputs]
    assert errors[0] is None and errors[5] is None
    assert "prompt of 70 tokens is too long for the model's context of 64" in errors[1]
    assert "KV cache too small for a request of 25 tokens" in errors[2]
    assert "empty prompt" in errors[3]
    assert "token id 300 is outside the vocabulary" in errors[4]
    assert "top_p must be in (0, 1]" in errors[6]
    assert "5 beams do not fit in a step of at most max_num_seqs=4" in errors[7]
    assert tokens([outputs[0], outputs[5]]) == [eager_greedy(models("gpt"), p, 5) for p in good]


def test_parallel_samples_that_cannot_fit_together(models):
    llm = LLM(models("gpt"), max_num_seqs=8, block_size=4, num_blocks=10)
    (out,) = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=20, n=4,
                                                            temperature=1.0))
    assert "4 parallel samples" in out.error and "KV cache too small" in out.error


def test_unsupported_head_size_on_the_cuda_kernels(models):
    with pytest.raises(GenerationError, match="head size 16 is not supported"):
        LLM(models("gpt"), kernel="cuda")
    module = get_model("gpt", "tiny", d_model=128, n_heads=2).module  # head size 64
    with pytest.raises(BackendError, match="CUDA device"):
        LLM(module, kernel="cuda")


def test_step_api_and_progress(models, engines, capsys):
    from graphpar.serving.llm import progress_printer

    llm = engines("llama")
    engine = llm.engine
    show = progress_printer(engine, 2, interval=0.0)
    ids = [engine.add_request(p, SamplingParams(max_tokens=3)) for p in prompts([2, 3])]
    finished = engine.run(show)
    show.final(engine)
    assert [o.request_id for o in finished] == ids
    err = capsys.readouterr().err
    assert "2/2 requests" in err and "tok/s generated" in err and "KV" in err
    assert engine.stats.generated_tokens >= 6


def test_stop_strings_need_a_tokenizer_and_are_cut_from_the_text(models):
    assert SamplingParams(stop=("12",)).stop == ("12",)  # text, not token ids (1, 2)
    assert SamplingParams(stop=[[1, 2], "ab"]).stop == ((1, 2), "ab")
    with pytest.raises(GenerationError, match="string or a sequence of token ids"):
        SamplingParams(stop=(3,)).validate()
    module = models("gpt")
    (prompt,) = prompts([4], seed=12)
    generated = eager_greedy(module, prompt, 8)

    def letters(ids):
        return "".join(chr(ord("a") + t % 26) for t in ids)
    stop = letters(generated[2:4])
    at = letters(generated).index(stop)
    plain = LLM(module, max_num_seqs=2, block_size=8, num_blocks=16)
    (out,) = plain.generate([prompt], SamplingParams(max_tokens=8, stop=(stop,)))
    assert "needs a tokenizer" in out.error
    llm = LLM(module, max_num_seqs=2, block_size=8, num_blocks=16, detokenize=letters)
    cut, kept = llm.generate([prompt] * 2, [
        SamplingParams(max_tokens=8, stop=(stop,)),
        SamplingParams(max_tokens=8, stop=(stop,), include_stop_str_in_output=True)])
    for out in (cut, kept):
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].token_ids == generated[:at + len(stop)]
    assert cut.outputs[0].text == letters(generated)[:at]
    assert kept.outputs[0].text == letters(generated)[:at + len(stop)]


def test_min_tokens_masks_eos_and_stop_tokens(engines):
    llm = engines("gpt")
    (prompt,) = prompts([4], seed=12)
    (free,) = llm.generate([prompt], SamplingParams(max_tokens=8))
    generated = free.outputs[0].token_ids
    stop_token = generated[1]
    first = generated.index(stop_token)
    early, late = llm.generate([prompt] * 2, [
        SamplingParams(max_tokens=8, stop_token_ids=(stop_token,)),
        SamplingParams(max_tokens=8, stop_token_ids=(stop_token,), min_tokens=6)])
    assert early.outputs[0].token_ids == generated[:first + 1]
    out = late.outputs[0].token_ids
    assert len(out) >= 6 and stop_token not in out[:6]  # it could not be sampled before 6
    assert out[:first] == generated[:first]  # greedy until the masked token
    (bad,) = llm.generate([prompt], SamplingParams(max_tokens=2, min_tokens=3))
    assert "min_tokens must be between 0 and max_tokens (2), got 3" in bad.error


def test_step_stream_gives_every_running_requests_tokens(engines):
    engine = engines("llama").engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=3)) for p in prompts([2, 5])]
    seen: dict[str, list[int]] = {i: [] for i in ids}
    finished = []
    while engine.has_unfinished_requests():
        for out in engine.step(stream=True):
            seen[out.request_id].append(len(out.outputs[0].token_ids))
            if out.finished:
                finished.append(out.request_id)
    assert seen == {i: [1, 2, 3] for i in ids}  # one output per step, each a token longer
    assert sorted(finished) == sorted(ids)
    for request_id in ids:
        engine.discard_request(request_id)
