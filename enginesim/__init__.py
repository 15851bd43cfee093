"""enginesim: a simulated vLLM/SGLang engine with a real prefix cache, events and metrics."""
