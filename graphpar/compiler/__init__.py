"""The compiler wing: capture, passes and lowering driven for a model (`api`, `driver`), pipelined
and token-pipelined training steps, model files, and the certificate (`check`)."""
