"""graphpar: compile an ordinary PyTorch model into a plan that runs on many devices."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `graphpar.compile` without importing torch and the compiler for `import graphpar` alone.
    if name == "compile":
        from graphpar.compiler.api import compile

        return compile
    if name == "place":
        from graphpar.placement.api import place

        return place
    raise AttributeError(f"module 'graphpar' has no attribute {name!r}")
