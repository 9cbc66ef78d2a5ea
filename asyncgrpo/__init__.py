"""asyncgrpo: asynchronous, off-policy GRPO with vLLM generators, ZeroMQ and an FSDP2 learner."""

__version__ = "0.1.0"
