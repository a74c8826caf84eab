"""The serving wing: `LLM` (`llm`), the serving compile of decoder programs (`compile`), and
the paged engine: its scheduler, which owns the KV cache manager, sampling and the model ranks."""
