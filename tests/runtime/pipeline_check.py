"""The check every pipelined step in these tests passes: a `PipelineCompiled` or a
`TokenPipeline` run equals eager PyTorch + torch.optim, and the bytes between stages, counted
by the plan's definition, equal the programs' prediction; on gloo ranks, the payloads handed to
gloo hold those bytes (packed, with alignment padding at most)."""


def assert_matches_eager(pipe, processes=False):
    check = pipe.check(processes=processes)
    assert {"loss", "gradients", "parameters", "optimizer state"} <= set(check.errors)
    assert check.errors["parameters"].tensors == check.errors["gradients"].tensors > 0
    assert check.errors["loss"].max_abs_error < 1e-5
    assert check.within_tolerance, "\n".join(check.lines())
    run = pipe.last_run
    assert sum(run.bytes_sent) == pipe.predicted_bytes > 0  # the plan's definition
    if processes:
        assert sum(run.bytes_counted) >= sum(run.bytes_sent)
    else:
        assert run.bytes_counted is None  # no wire in one process
    return run
