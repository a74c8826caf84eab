"""Helpers of the serving tests: tiny models and eager references (no cache, no graphpar)."""

import pytest
import torch

from graphpar.models import get_model


def hf_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64,
                                     vocab_size=256, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def hf_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=256,
                                      max_position_embeddings=64, bos_token_id=0,
                                      eos_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


MODELS = {
    "gpt": lambda: get_model("gpt", "tiny", seq_len=64).module,
    "llama": lambda: get_model("llama", "tiny", seq_len=64).module,  # GQA: 4 heads, 2 kv heads
    "hf-gpt2": hf_gpt2,
    "hf-llama": hf_llama,
}


def prompts(lengths, vocab=256, seed=0, low=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=generator).tolist() for n in lengths]


def eager_greedy(module, prompt, max_tokens):
    """Greedy tokens by re-running the whole model on the whole sequence: no cache at all."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            out = module(torch.tensor([ids]))
            logits = out.logits if hasattr(out, "logits") else out
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def eager_logprobs(module, prompt, tokens):
    """log p(token | prefix) for each generated token, by full recompute."""
    ids, result = list(prompt), []
    with torch.no_grad():
        for token in tokens:
            out = module(torch.tensor([ids]))
            logits = out.logits if hasattr(out, "logits") else out
            result.append(float(torch.log_softmax(logits[0, -1].float(), -1)[token]))
            ids.append(token)
    return result


def eager_beam_search(module, prompt, width, max_tokens, length_penalty=1.0, eos=()):
    """Beam search as graphpar's engine (and Hugging Face's BeamSearchScorer) defines it, by full
    recompute: the 2*width best extensions, EOS extensions ranked < width become hypotheses
    scored sum logprob / generated ** length_penalty, stop when width hypotheses beat the best
    running beam or at max_tokens. Returns the hypotheses' generated tokens, best first."""
    beams = [(list(prompt), 0.0)]
    hyps = []
    start = len(prompt)

    def score(total, n):
        return total / (max(n, 1) ** length_penalty)

    def add(h):
        hyps.append(h)
        hyps.sort(key=lambda x: -x[0])
        del hyps[width:]
    while True:
        with torch.no_grad():
            rows = []
            for tokens, _ in beams:
                out = module(torch.tensor([tokens]))
                rows.append((out.logits if hasattr(out, "logits") else out)[0, -1])
        scores = torch.log_softmax(torch.stack(rows).float(), -1)
        scores = scores + torch.tensor([b[1] for b in beams])[:, None]
        vocab = scores.shape[-1]
        values, flat = scores.flatten().topk(min(2 * width, scores.numel()))
        new = []
        for rank, (v, i) in enumerate(zip(values.tolist(), flat.tolist())):
            b, t = i // vocab, i % vocab
            if t in eos:
                if rank < width:
                    add((score(v, len(beams[b][0]) + 1 - start), beams[b][0] + [t]))
                continue
            new.append((beams[b][0] + [t], v))
            if len(new) == width:
                break
        beams = new
        n = len(beams[0][0]) - start if beams else 0
        at_limit = bool(beams) and n >= max_tokens
        done = not beams or at_limit
        if not done and len(hyps) >= width:
            done = hyps[-1][0] >= score(max(b[1] for b in beams), n)
        if done:
            if at_limit:
                for tokens, total in beams:
                    add((score(total, n), tokens))
            return [h[1][start:] for h in hyps]


def reference_adjust(row, params, tokens, prompt_len):
    """One row, written out as OpenAI and vLLM define it: bias, repetition, frequency and
    presence, each token by itself."""
    row = row.clone()
    for token, bias in params.logit_bias:
        row[token] += bias
    for token in set(tokens):
        if params.repetition_penalty != 1.0:
            p = params.repetition_penalty
            row[token] = row[token] / p if row[token] > 0 else row[token] * p
    for token in set(tokens[prompt_len:]):
        count = tokens[prompt_len:].count(token)
        row[token] -= params.frequency_penalty * count + params.presence_penalty
    return row


def eager_penalized_greedy(module, prompt, max_tokens, params):
    """Greedy under penalties by re-running the whole model on the whole sequence."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            row = module(torch.tensor([ids]))[0, -1].float()
            ids.append(int(reference_adjust(row, params, ids, len(prompt)).argmax()))
    return ids[len(prompt):]


def run_interleaved(target, args: list[tuple], timeout: float) -> None:
    """`target(*a)` for each `a` in `args`, each in its own thread, the interpreter switching
    threads as often as Python allows (races between them show up), all joined."""
    import sys
    import threading

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=target, args=a) for a in args]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=timeout)
    finally:
        sys.setswitchinterval(interval)
