"""The sampler contract and its engines: transformers, vLLM in-process, vLLM's server, a scripted one."""
