"""The check every pipelined step in these tests passes: a `PipelineCompiled` or a
`TokenPipeline` run equals eager PyTorch + torch.optim, and the bytes measured between stages
equal the programs' prediction."""


def assert_matches_eager(pipe, processes=False):
    check = pipe.check(processes=processes)
    assert {"loss", "gradients", "parameters", "optimizer state"} <= set(check.errors)
    assert check.errors["parameters"].tensors == check.errors["gradients"].tensors > 0
    assert check.errors["loss"].max_abs_error < 1e-5
    assert check.within_tolerance, "\n".join(check.lines())
    run = pipe.last_run
    assert sum(run.bytes_sent) == pipe.predicted_bytes > 0  # measured == predicted
    return run
