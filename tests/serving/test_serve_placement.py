"""`graphpar serve --placement`: a 2-device placement of two tiny models, each device group a
process of its own behind one front (a real server, the official openai client): each
request's greedy tokens equal eager PyTorch for its model, requests go to the least-loaded
group holding their model, an unknown model is a 404; a group that pipelines both models over
its 2 devices (a stage process per device and model); the placement's usage errors."""

import asyncio
import json
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

from test_api_server import Server  # noqa: E402  (the CLI in a subprocess, its URL)

# Group 0 pipelines both models over 2 devices (2 stages, a decoder block each), group 1 holds
# a second replica of gpt (as AlpaServe replicates a popular model): gpt requests can go to
# either group, llama requests only to group 0.
PLACEMENT = {"devices": 3, "policies": {"alpaserve": {"policy": "alpaserve", "groups": [
    {"devices": [0, 1], "parallel_config": {"stages": 2, "intra_op": 1},
     "models": ["gpt", "llama"]},
    {"devices": [2], "parallel_config": {"stages": 1, "intra_op": 1}, "models": ["gpt"]}]}}}
MODELS = ["--model", "gpt=gpt:tiny", "--model", "llama=llama:tiny"]
# gpt with a long context, so that a stream stays open for seconds (the routing test)
MODEL_FILE = """\
from graphpar.models import get_model


def build():
    spec = get_model("gpt", "tiny", seq_len=512)
    return spec.module, spec.inputs
"""


@pytest.fixture(scope="module")
def placement(tmp_path_factory):
    path = tmp_path_factory.mktemp("placed") / "placement.json"
    path.write_text(json.dumps(PLACEMENT))
    return path


@pytest.fixture(scope="module")
def server(placement, tmp_path_factory):
    model_file = tmp_path_factory.mktemp("model") / "gpt512.py"
    model_file.write_text(MODEL_FILE)
    server = Server(["--placement", str(placement), "--policy", "alpaserve",
                     "--model", f"gpt={model_file}", "--model", "llama=llama:tiny"],
                    tmp_path_factory.mktemp("cwd"))
    yield server
    assert server.stop() == 143, server.stderr
    assert "graphpar serve: stopped" in server.stderr


def _routed(server) -> dict[tuple[str, str], float]:
    """graphpar_router_requests_total per (group, model), from the front's /metrics."""
    counts = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("graphpar_router_requests_total{"):
            labels, value = line[len("graphpar_router_requests_total{"):].split("} ")
            fields = dict(item.split("=") for item in labels.split(","))
            counts[fields["group"].strip('"'), fields["model"].strip('"')] = float(value)
    return counts


def test_each_request_runs_its_model_on_a_group_holding_it(server):
    from serve_testutil import eager_greedy

    from graphpar.cli.common import load_target
    from graphpar.models import get_model

    assert "device group 0 (devices 0-1, 2 pipeline stages): gpt, llama" in server.stderr
    assert "device group 1 (device 2): gpt in process" in server.stderr
    client = server.client(max_retries=0)
    assert [m.id for m in client.models.list().data] == ["gpt", "llama"]
    prompts = {"gpt": [[3, 1, 4, 1, 5], [2, 7, 1, 8]], "llama": [[1, 6, 1, 8, 0, 3]]}

    async def all_of_them():
        async_client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
        outs = await asyncio.gather(*(async_client.completions.create(
            model=name, prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True}) for name, ps in prompts.items() for prompt in ps))
        await async_client.close()
        return outs
    outs = iter(asyncio.run(all_of_them()))
    for name, ps in prompts.items():
        module = (get_model("gpt", "tiny", seq_len=512).module.eval() if name == "gpt"
                  else load_target(None, "llama:tiny").real_module().eval())
        for prompt in ps:
            out = next(outs)
            expected = eager_greedy(module, prompt, 6)
            assert out.model == name
            assert out.choices[0].logprobs.tokens == [
                bytes([t]).decode("utf-8", errors="replace") for t in expected]
    routed = _routed(server)
    assert ("group1", "llama") not in routed
    assert routed[("group0", "llama")] == 1

    with pytest.raises(openai.NotFoundError, match="'mistral' does not exist"):
        client.completions.create(model="mistral", prompt="hi", max_tokens=2)
    bad = httpx.post(server.url + "/v1/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    # an error of the group's own server comes back as it sent it
    long = client.with_options(max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        long.completions.create(model="llama", prompt="hi", max_tokens=-1)


def test_requests_go_to_the_least_loaded_group(server):
    """While a gpt stream is open on one group (500 tokens: seconds), the next gpt request
    goes to the other; the stream dropped, the group's request ends and the front's gauge
    comes back to 0."""
    client = server.client(max_retries=0)
    before = _routed(server)
    stream = client.completions.create(model="gpt", prompt=[5, 5, 5], max_tokens=500,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # the stream is open: its group has one request in flight
    first = {k for k, v in _routed(server).items() if v > before.get(k, 0)}
    assert len(first) == 1 and next(iter(first))[1] == "gpt"
    client.completions.create(model="gpt", prompt=[6, 6], max_tokens=2)
    stream.close()
    after = _routed(server)
    second = {k for k, v in after.items() if v > before.get(k, 0)} - first
    assert second == {("group1" if first == {("group0", "gpt")} else "group0", "gpt")}
    for _ in range(100):
        if server.metric("graphpar_router_requests_in_flight") == 0:
            break
        time.sleep(0.05)
    assert server.metric("graphpar_router_requests_in_flight") == 0


@pytest.mark.slow
def test_a_pipelined_group_serves_both_models(tmp_path):
    """A 2-device placement, AlpaServe's shape: one group pipelines both models (2 stages, a
    decoder block each), so each device holds half of each model; the openai client gets each
    model's eager greedy tokens, streamed and not. (The default tests' server has such a
    group beside a one-device replica.)"""
    from serve_testutil import eager_greedy

    from graphpar.cli.common import load_target

    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"devices": 2, "policies": {"alpaserve": {"groups": [
        {"devices": [0, 1], "parallel_config": {"stages": 2, "intra_op": 1},
         "models": ["gpt", "llama"]}]}}}))
    server = Server(["--placement", str(path), "--policy", "alpaserve", *MODELS], tmp_path)
    try:
        assert "device group 0 (devices 0-1, 2 pipeline stages): gpt, llama" in server.stderr
        client = server.client(max_retries=0)
        prompts = {"gpt": [3, 1, 4, 1, 5], "llama": [2, 7, 1, 8, 2, 8]}

        async def both():
            async_client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
            outs = await asyncio.gather(*(async_client.completions.create(
                model=name, prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True}) for name, prompt in prompts.items()))
            await async_client.close()
            return outs
        for (name, prompt), out in zip(prompts.items(), asyncio.run(both())):
            module = load_target(None, f"{name}:tiny").real_module().eval()
            expected = [bytes([t]).decode("utf-8", errors="replace")
                        for t in eager_greedy(module, prompt, 6)]
            assert out.model == name and out.choices[0].logprobs.tokens == expected
            streamed = client.completions.create(model=name, prompt=prompt, max_tokens=6,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
            assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    finally:
        assert server.stop() == 143, server.stderr


def test_placement_usage_errors(placement, tmp_path):
    from graphpar.cli.main import build_parser
    from graphpar.cli.serve import _check, _Group, _placement_groups, _targets
    from graphpar.errors import UsageError

    def groups(path, *argv):
        args = build_parser().parse_args(["serve", "--placement", str(path), *argv])
        _check(args)
        return _placement_groups(args, [n for n, _ in _targets(args)])
    assert groups(placement, "--policy", "alpaserve", *MODELS) == [
        _Group([0, 1], ["gpt", "llama"], 2), _Group([2], ["gpt"])]

    def placed(name, config, devices=(0, 1)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"policies": {"alpaserve": {"groups": [
            {"devices": list(devices), "parallel_config": config, "models": ["gpt"]}]}}}))
        return path
    pipelined = placed("pipelined", {"stages": 2, "intra_op": 1, "stage_layers": [1, 1]})
    assert groups(pipelined, "--policy", "alpaserve", "--model", "gpt=gpt:tiny") == [
        _Group([0, 1], ["gpt"], 2, [1, 1])]
    sharded = tmp_path / "sharded.json"
    sharded.write_text(json.dumps({"policies": {"alpaserve": {"groups": [
        {"devices": [0, 1], "parallel_config": {"stages": 1, "intra_op": 2},
         "models": ["gpt"]}]}}}))
    assert groups(sharded, "--policy", "alpaserve", "--model", "gpt=gpt:tiny") == [
        _Group([0, 1], ["gpt"])]
    for path, argv, words in (
            (placement, ["--policy", "sr", *MODELS], "no such policy; it has alpaserve"),
            (placement, ["--policy", "alpaserve", "--model", "gpt=gpt:tiny"],
             "give --model NAME=MODEL for llama"),
            (placement, ["--policy", "alpaserve", *MODELS, "--model", "x=gpt:tiny"],
             "--model x: policy alpaserve .* does not place it"),
            (placement, [*MODELS], "together"),
            (placement, ["--policy", "alpaserve"], "needs --model"),
            (placed("both", {"stages": 2, "intra_op": 2}, range(4)),
             ["--policy", "alpaserve", "--model", "gpt=gpt:tiny"],
             r"groups\[0\]: devices \[0, 1, 2, 3\] run 2 stages x 2 intra-op; .* not both"),
            (placed("mismatch", {"stages": 3, "intra_op": 1}),
             ["--policy", "alpaserve", "--model", "gpt=gpt:tiny"],
             r"groups\[0\]: 3 stage\(s\) x 1 intra-op is not its 2 device\(s\)"),
            (placed("layers", {"stages": 2, "intra_op": 1, "stage_layers": [2]}),
             ["--policy", "alpaserve", "--model", "gpt=gpt:tiny"],
             r"stage_layers \[2\]: give one count")):
        with pytest.raises(UsageError, match=words):
            groups(path, *argv)


@pytest.mark.slow
def test_a_group_of_two_devices_serves_tensor_parallel(tmp_path):
    """A group placed with intra-op 2 on 2 devices: its model runs on 2 gloo ranks (its
    process and one more), tokens equal eager; beside it a one-device group."""
    from serve_testutil import eager_greedy

    from graphpar.cli.common import load_target

    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"policies": {"alpaserve": {"groups": [
        {"devices": [0, 1], "parallel_config": {"stages": 1, "intra_op": 2},
         "models": ["gpt"]},
        {"devices": [2], "parallel_config": {"stages": 1, "intra_op": 1},
         "models": ["llama"]}]}}}))
    server = Server(["--placement", str(path), "--policy", "alpaserve", *MODELS], tmp_path)
    try:
        assert "device group 0 (devices 0-1, tensor parallel): gpt" in server.stderr
        client = server.client(max_retries=0)
        prompt = [3, 1, 4, 1, 5]
        for name in ("gpt", "llama"):
            out = client.completions.create(model=name, prompt=prompt, max_tokens=6,
                                            temperature=0, logprobs=0,
                                            extra_body={"ignore_eos": True})
            module = load_target(None, f"{name}:tiny").real_module().eval()
            assert out.choices[0].logprobs.tokens == [
                bytes([t]).decode("utf-8", errors="replace")
                for t in eager_greedy(module, prompt, 6)]
    finally:
        assert server.stop() == 143, server.stderr


def test_a_missing_model_file_is_a_usage_error_before_any_group_starts(placement, tmp_path,
                                                                       monkeypatch):
    from graphpar.cli.main import build_parser
    from graphpar.errors import UsageError

    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(
        ["serve", "--placement", str(placement), "--policy", "alpaserve", "--model",
         "gpt=missing.py", "--model", "llama=llama:tiny", "--port", "0"])
    with pytest.raises(UsageError) as error:
        args.fn(args)
    assert str(error.value) == ("--model gpt=missing.py: missing.py: no such file; give a "
                                "model file defining build() or a bundled example (gpt:tiny)")
