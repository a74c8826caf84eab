"""`graphpar serve`: a real server on 127.0.0.1 (a subprocess of the CLI), the official openai
client against it: completions, chat, streaming, n > 1, concurrency, errors, disconnects,
metrics; greedy tokens equal `graphpar generate`; SIGTERM drains and exits 143."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")  # the HTTP client the openai package uses

ROOT = Path(__file__).resolve().parents[2]
MODEL_FILE = """\
from graphpar.models import get_model


def build():
    spec = get_model("gpt", "tiny", seq_len=96)
    return spec.module, spec.inputs
"""
# A chat template short enough for a small context: the messages' text, then "> ".
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}> "


def byte_tokenizer(directory: Path, chat_template: str | None) -> Path:
    """A Hugging Face byte-level tokenizer whose 256 ids fit the tiny models' vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))},
                                     merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(directory))
    return directory


class Server:
    """`graphpar serve ARGS --port 0` in a subprocess; its URL from its 'serving' line."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        self.stderr_lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "graphpar.cli", "serve", *args, "--port", "0",
             "--threads", "1"], cwd=cwd, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        ready = threading.Event()
        self.url = None

        def read() -> None:
            for line in self.proc.stderr:
                self.stderr_lines.append(line)
                found = re.search(r"serving \S+ on (http://\S+) ", line)
                if found:
                    self.url = found.group(1)
                    ready.set()
            ready.set()
        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout=240)
        if self.url is None:
            self.proc.kill()
            raise AssertionError("the server did not start:\n" + "".join(self.stderr_lines))

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    def client(self, **options) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", **options)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name)] in "{ ,":  # name, or name{labels
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return byte_tokenizer(tmp_path_factory.mktemp("tok"), CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "gpt96.py"
    path.write_text(MODEL_FILE)
    return path


@pytest.fixture(scope="module")
def server(tokenizer_dir, model_file, tmp_path_factory):
    # Prefix caching is on by default; a budget of 16 tokens a step chunks longer prompts.
    server = Server([str(model_file), "--tokenizer", str(tokenizer_dir), "--max-num-seqs", "8",
                     "--max-num-batched-tokens", "16", "--served-model-name", "tiny"],
                    tmp_path_factory.mktemp("cwd"))
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


def test_models_health_and_completions(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    out = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len("The quick brown fox")
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens_details.cached_tokens >= 0
    # token ids, lists of them and lists of texts: one choice per prompt (n each)
    batch = client.completions.create(model="tiny", prompt=[[72, 105], [66, 121, 101]], n=2,
                                      max_tokens=4, temperature=0.8, seed=3)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == 5 and batch.usage.completion_tokens == 16


def test_streaming_equals_non_streaming_and_usage(server):
    client = server.client()
    whole = client.completions.create(model="tiny", prompt="Once upon a time", **{
        k: v for k, v in GREEDY.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        model="tiny", prompt="Once upon a time", stream=True,
        stream_options={"include_usage": True}, temperature=0, max_tokens=12,
        extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_with_the_tokenizers_template_streamed_and_not(server):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                           temperature=0, n=2)
    assert whole.object == "chat.completion" and len(whole.choices) == 2
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == whole.choices[1].message.content  # greedy
    # the prompt is the template's text: "Be brief.\nHi\n> "
    assert whole.usage.prompt_tokens == len("Be brief.\nHi\n> ")
    chunks = list(client.chat.completions.create(model="tiny", messages=messages,
                                                 max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content


PROMPTS = [[5, 6, 7, 8], [72, 101, 108, 108, 111], [30] * 20, list(range(40, 90))]


def _served_greedy(server):
    client = server.client()
    return [client.completions.create(model="tiny", prompt=p, temperature=0, max_tokens=10,
                                      logprobs=0, extra_body={"ignore_eos": True})
            for p in PROMPTS]


def test_greedy_tokens_equal_eager_pytorch(server, tokenizer_dir):
    from serve_testutil import eager_greedy

    from graphpar.models import get_model
    from graphpar.serving.tokenizer import Tokenizer

    module = get_model("gpt", "tiny", seq_len=96).module.eval()  # the model file's module
    decode = Tokenizer(str(tokenizer_dir)).decode
    for prompt, response in zip(PROMPTS, _served_greedy(server)):
        expected = eager_greedy(module, prompt, 10)
        assert response.choices[0].text == decode(expected)
        assert "".join(response.choices[0].logprobs.tokens) == "".join(
            decode([t]) for t in expected)


@pytest.mark.slow
def test_greedy_tokens_equal_graphpar_generate(server, model_file, tokenizer_dir, tmp_path):
    from graphpar.cli import main as graphpar_main

    prompts = PROMPTS
    served = _served_greedy(server)
    file = tmp_path / "prompts.txt"
    file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    assert graphpar_main(["generate", str(model_file), "--prompts", str(file), "--max-tokens",
                          "10", "--ignore-eos", "--tokenizer", str(tokenizer_dir), "--out",
                          str(out), "--quiet"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for response, record in zip(served, records):
        choice, expected = response.choices[0], record["outputs"][0]
        assert choice.text == expected["text"]
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(
            expected["cumulative_logprob"], abs=1e-4)
        assert len(choice.logprobs.tokens) == len(expected["token_ids"]) == 10


def test_a_repeated_prompt_reports_cached_tokens(server):
    client = server.client()
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16
    hits = server.metric("graphpar:prefix_cache_hits_total")
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert again.choices[0].text == first.choices[0].text
    assert server.metric("graphpar:prefix_cache_hits_total") >= hits + 32
    assert server.metric("graphpar:prefix_cache_queries_total") >= 80


def test_48_concurrent_requests_all_complete(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                    max_retries=0, timeout=120)
        calls = [client.completions.create(model="tiny", prompt=f"request {i}", max_tokens=8,
                                           temperature=0.7, seed=i, stream=i % 2 == 1)
                 for i in range(48)]
        results = await asyncio.gather(*calls)
        texts = []
        for i, result in enumerate(results):
            if i % 2:
                texts.append("".join([c.choices[0].text async for c in result if c.choices]))
            else:
                texts.append(result.choices[0].text)
        await client.close()
        return texts
    assert len(asyncio.run(run())) == 48
    assert server.metric("graphpar:num_requests_running") == 0


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "temperature": -1}, "temperature", "temperature must be >= 0"),
    ({"prompt": "x", "n": "two"}, "n", "valid integer"),
    ({"prompt": "x", "colour": 3}, "colour", "unknown field"),
    ({"max_tokens": 3}, "prompt", "required field missing"),
    ({"prompt": [1, 2, 999]}, "prompt", "token id 999 is outside the vocabulary"),
    ({"prompt": "x" * 90, "max_tokens": 10}, "max_tokens", "maximum context length is 96"),
    ({"prompt": "x" * 100}, "prompt", "has 100 tokens"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "logprobs must be between 0 and 20"),
    ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs", "between 0 and 20"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", "must be in [-2, 2]"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "must be in (0, 2]"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "keys are token ids"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "must be in [-100, 100]"),
    ({"prompt": "x", "logit_bias": {"999": 1}}, "logit_bias", "token id 999, outside"),
    ({"prompt": "x", "n": 9}, "n", "max_num_seqs=8"),
])
def test_bad_requests_answer_400_with_the_error_object(server, body, param, words):
    response = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"]
    assert error["type"] == "invalid_request_error"


def test_malformed_json_unknown_model_and_the_openai_client_errors(server):
    response = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x",',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]
    client = server.client(max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="nope", prompt="x")
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", top_p=2)
    assert bad.value.body["param"] == "top_p"
    assert httpx.get(server.url + "/nothing").status_code == 404


def test_chat_without_a_template_is_a_clear_400(model_file, tmp_path):
    """A tokenizer with no chat template: completions serve, chat answers 400 naming it."""
    from graphpar.serving.http.protocol import ChatCompletionRequest
    from graphpar.serving.tokenizer import Tokenizer

    plain = Tokenizer(str(byte_tokenizer(tmp_path / "plain", None)))
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(Exception, match="has no chat template"):
        plain.apply_chat_template([m.as_template_input() for m in request.messages])
    with pytest.raises(Exception, match="has no chat template"):
        Tokenizer("bytes").apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_dropped_stream_is_aborted_and_the_server_keeps_serving(server):
    aborted = server.metric('graphpar:request_success_total{finished_reason="abort"')
    for _ in range(2):
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": "a", "max_tokens": 90, "min_tokens": 90,
                "stream": True, "temperature": 0}) as response:
            assert response.status_code == 200  # hang up with 90 tokens to generate
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server.metric("graphpar:num_requests_running") == 0 and server.metric(
                'graphpar:request_success_total{finished_reason="abort"') >= aborted + 2:
            break
        time.sleep(0.1)
    assert server.metric("graphpar:num_requests_running") == 0
    assert server.metric('graphpar:request_success_total{finished_reason="abort"') == aborted + 2
    assert server.metric("graphpar:kv_cache_blocks_used") == 0
    out = server.client().completions.create(model="tiny", prompt="still here", max_tokens=3)
    assert out.usage.completion_tokens == 3


def test_metrics_count_tokens_and_observe_latencies(server):
    server.client().completions.create(model="tiny", prompt="count me", max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert server.metric("graphpar:generation_tokens_total") >= 5
    assert server.metric("graphpar:time_to_first_token_seconds_count") >= 1
    assert server.metric("graphpar:time_per_output_token_seconds_count") >= 1
    assert server.metric("graphpar:kv_cache_blocks_free") > 0
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_waiting", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "e2e_request_latency_seconds_bucket"):
        assert f"graphpar:{name}" in text


def _eager_tops(module, prompt, tokens, k):
    """The k most likely (token id, logprob) at each generated position, by full recompute."""
    import torch

    ids, tops = list(prompt), []
    with torch.no_grad():
        for token in tokens:
            logprobs = torch.log_softmax(module(torch.tensor([ids]))[0, -1].float(), -1)
            values, best = logprobs.topk(k)
            tops.append(list(zip(best.tolist(), values.tolist())))
            ids.append(token)
    return tops


def test_logit_bias_and_penalties_steer_greedy_as_eager(server, tokenizer_dir):
    from serve_testutil import eager_penalized_greedy

    from graphpar.models import get_model
    from graphpar.serving.sampling import SamplingParams
    from graphpar.serving.tokenizer import Tokenizer

    module = get_model("gpt", "tiny", seq_len=96).module.eval()
    decode = Tokenizer(str(tokenizer_dir)).decode
    client = server.client()
    prompt = [30] * 6
    biased = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                       logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    assert biased.choices[0].text == decode([77] * 5)
    free = eager_penalized_greedy(module, prompt, 12, SamplingParams())
    assert len(set(free)) < len(free)  # it repeats itself: the penalty has work to do
    for fields in ({"frequency_penalty": 2.0, "presence_penalty": 0.5},
                   {"extra_body": {"repetition_penalty": 1.8}}):
        extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                        temperature=0, extra_body=extra, **fields)
        expected = eager_penalized_greedy(module, prompt, 12, SamplingParams(**fields, **{
            k: v for k, v in extra.items() if k != "ignore_eos"}))
        assert expected != free
        assert out.choices[0].text == decode(expected)


def test_top_logprobs_equal_eager_log_softmax(server, tokenizer_dir):
    from serve_testutil import eager_greedy

    from graphpar.models import get_model
    from graphpar.serving.tokenizer import Tokenizer

    module = get_model("gpt", "tiny", seq_len=96).module.eval()
    tokenizer = Tokenizer(str(tokenizer_dir))
    client = server.client()
    prompt = [72, 101, 108, 108, 111]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    tokens = eager_greedy(module, prompt, 6)
    assert lp.tokens == [tokenizer.decode([t]) for t in tokens]
    for i, top in enumerate(_eager_tops(module, prompt, tokens, 3)):
        expected = {tokenizer.decode([t]): v for t, v in top}  # greedy: the chosen is the best
        assert lp.top_logprobs[i].keys() == expected.keys()
        assert list(lp.top_logprobs[i].values()) == pytest.approx(list(expected.values()),
                                                                  abs=1e-4)
        assert lp.token_logprobs[i] == pytest.approx(top[0][1], abs=1e-4)
    messages = [{"role": "user", "content": "Hi"}]
    chat_prompt = tokenizer.apply_chat_template(messages)
    for stream in (False, True):
        response = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True,
            top_logprobs=4, stream=stream)
        if stream:
            content = [e for c in response if c.choices and c.choices[0].logprobs
                       for e in c.choices[0].logprobs.content]
        else:
            content = response.choices[0].logprobs.content
        assert len(content) == 5
        chosen = eager_greedy(module, chat_prompt, 5)
        assert [e.token for e in content] == [tokenizer.decode([t]) for t in chosen]
        for entry, top in zip(content, _eager_tops(module, chat_prompt, chosen, 4)):
            assert [e.token for e in entry.top_logprobs] == [tokenizer.decode([t]) for t, _ in top]
            assert [e.logprob for e in entry.top_logprobs] == pytest.approx(
                [v for _, v in top], abs=1e-4)


def test_echo_puts_the_prompt_before_the_completion(server, tokenizer_dir):
    from graphpar.serving.tokenizer import Tokenizer

    client = server.client()
    plain = client.completions.create(model="tiny", prompt=["Hello", "Bye"], max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True})
    echoed = client.completions.create(model="tiny", prompt=["Hello", "Bye"], max_tokens=4,
                                       temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert [c.text for c in echoed.choices] == ["Hello" + plain.choices[0].text,
                                                "Bye" + plain.choices[1].text]
    hi = Tokenizer(str(tokenizer_dir)).encode("Hi")  # as token ids: echo decodes them
    chunks = client.completions.create(model="tiny", prompt=hi, max_tokens=4,
                                       temperature=0, echo=True, stream=True,
                                       extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    again = client.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert streamed == "Hi" + again.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_as_eager(server, tokenizer_dir):
    import torch
    from serve_testutil import eager_greedy

    from graphpar.models import get_model
    from graphpar.serving.tokenizer import Tokenizer

    module = get_model("gpt", "tiny", seq_len=96).module.eval()
    decode = Tokenizer(str(tokenizer_dir)).decode
    prompt = list(range(50, 70))  # 20 tokens: over one step's budget of 16, so two chunks
    generated = eager_greedy(module, prompt, 3)
    with torch.no_grad():
        logprobs = torch.log_softmax(module(torch.tensor([prompt + generated]))[0].float(), -1)
    ids = prompt + generated
    client = server.client()
    for stream in (False, True):
        response = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2,
            stream=stream, extra_body={"ignore_eos": True})
        if stream:
            parts = [c.choices[0].logprobs for c in response if c.choices]
            tokens = [t for p in parts for t in p.tokens]
            token_logprobs = [v for p in parts for v in p.token_logprobs]
            tops = [d for p in parts for d in p.top_logprobs]
        else:
            lp = response.choices[0].logprobs
            tokens, token_logprobs, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
            assert response.choices[0].text == decode(prompt) + decode(generated)
        assert tokens == [decode([t]) for t in ids]
        assert token_logprobs[0] is None and tops[0] is None
        assert token_logprobs[1:] == pytest.approx(
            [float(logprobs[p - 1, ids[p]]) for p in range(1, len(ids))], abs=1e-4)
        for p in range(1, len(ids)):
            values, best = logprobs[p - 1].topk(2)
            expected = {decode([t]): v for t, v in zip(best.tolist(), values.tolist())}
            expected.setdefault(decode([ids[p]]), float(logprobs[p - 1, ids[p]]))
            assert tops[p].keys() == expected.keys()
            assert list(tops[p].values()) == pytest.approx(list(expected.values()), abs=1e-4)


def test_zz_sigterm_drains_and_exits_143(server):
    """Last in the module: the server stops on SIGTERM after answering what is in flight."""
    client = server.client(max_retries=0)
    result = {}

    def call() -> None:
        result["out"] = client.completions.create(model="tiny", prompt="last", max_tokens=80,
                                                  temperature=0,
                                                  extra_body={"min_tokens": 80})
    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.3)
    assert server.stop(signal.SIGTERM) == 143
    thread.join(timeout=30)
    assert result["out"].usage.completion_tokens == 80
    assert "stopped" in server.stderr and "Traceback" not in server.stderr


class InProcessServer:
    """build_app over engines of this process on a real port, uvicorn on a thread."""

    def __init__(self, llms: dict, max_waiting=None) -> None:
        import uvicorn

        from graphpar.serving.async_engine import AsyncEngine
        from graphpar.serving.http.app import ServedModel, bind, build_app
        from graphpar.serving.http.metrics import ServerMetrics
        from graphpar.serving.tokenizer import Tokenizer

        self.loops = [AsyncEngine(llm.engine) for llm in llms.values()]
        app = build_app({name: ServedModel(name, loop, Tokenizer("bytes"))
                         for name, loop in zip(llms, self.loops)}, ServerMetrics(),
                        max_waiting=max_waiting)
        self.sock = bind("127.0.0.1", 0)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __enter__(self):
        for loop in self.loops:
            loop.start()
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        for loop in self.loops:
            loop.shutdown()
        self.sock.close()


def test_overload_answers_429_with_retry_after(engines):
    """--max-waiting: a request over the limit is refused at once (here the limit is 0), with
    OpenAI's error object and Retry-After."""
    with InProcessServer({"gpt": engines("gpt")}, max_waiting=0) as server:
        response = httpx.post(server.url + "/v1/completions",
                              json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0
                          ).completions.create(model="gpt", prompt="hi", max_tokens=2)


def test_several_models_routed_by_name(engines, models):
    """Two models behind one server: each request runs on the model it names (tokens equal
    that model's eager greedy tokens), concurrently."""
    from serve_testutil import eager_greedy

    prompt = [3, 1, 4, 1, 5]
    with InProcessServer({"gpt": engines("gpt"), "llama": engines("llama")}) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["gpt", "llama"]

        async def both():
            async_client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
            outs = await asyncio.gather(*(async_client.completions.create(
                model=name, prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True}) for name in ("gpt", "llama")))
            await async_client.close()
            return outs
        for name, out in zip(("gpt", "llama"), asyncio.run(both())):
            expected = eager_greedy(models(name), prompt, 6)
            assert out.model == name
            assert out.choices[0].logprobs.tokens == [
                bytes([t]).decode("utf-8", errors="replace") for t in expected]
        missing = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"


def test_serve_model_options():
    """--model NAME=MODEL: files and bundled examples; the usage errors."""
    from graphpar.cli.main import build_parser
    from graphpar.cli.serve import _check, _targets

    def parse(*argv):
        args = build_parser().parse_args(["serve", *argv])
        _check(args)
        return [(n, o.model, o.example) for n, o in _targets(args)]
    assert parse("--model", "a=gpt:tiny", "--model", "b=m.py") == [
        ("a", None, "gpt:tiny"), ("b", "m.py", None)]
    assert parse("--example", "gpt:tiny") == [("gpt:tiny", None, "gpt:tiny")]
    assert parse("m.py", "--served-model-name", "x") == [("x", "m.py", None)]
    from graphpar.errors import UsageError
    for argv, words in ((["--model", "a"], "give NAME=MODEL"),
                        (["--model", "a=gpt:tiny", "--model", "a=llama:tiny"], "given twice"),
                        (["--model", "a=gpt:tiny", "--example", "gpt:tiny"], "not both"),
                        ([], "needs a model file"),
                        (["--example", "gpt:tiny", "--port", "70000"], "--port")):
        with pytest.raises(UsageError, match=words):
            parse(*argv)


@pytest.mark.slow
def test_greedy_tokens_on_two_tensor_parallel_ranks(tokenizer_dir, model_file, tmp_path):
    """`graphpar serve --tensor-parallel 2`: the same greedy text as eager PyTorch."""
    from serve_testutil import eager_greedy

    from graphpar.models import get_model
    from graphpar.serving.tokenizer import Tokenizer

    server = Server([str(model_file), "--tokenizer", str(tokenizer_dir), "--tensor-parallel",
                     "2", "--served-model-name", "tiny"], tmp_path)
    try:
        module = get_model("gpt", "tiny", seq_len=96).module.eval()
        decode = Tokenizer(str(tokenizer_dir)).decode
        for prompt, response in zip(PROMPTS, _served_greedy(server)):
            assert response.choices[0].text == decode(eager_greedy(module, prompt, 10))
        assert server.stop(signal.SIGINT) == 130
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
