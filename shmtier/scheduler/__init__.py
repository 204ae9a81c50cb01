"""Code that runs in the scheduler process (vLLM's EngineCore): managers and policies."""
