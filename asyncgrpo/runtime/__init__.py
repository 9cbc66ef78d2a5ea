"""Process-level plumbing every role uses: placement on nodes and cores, fault injection, deferred
interrupts, private files, peak memory, timed phases, a local Ray cluster's token and CPU count. A
light layer: nothing here imports torch, vLLM, Ray, ZeroMQ, msgpack or numpy, nor anything of the
package but the schema (and the contract); what needs them takes it as an argument
(`resources.pin_to_cores`) or lives above, in the layer that has it (the wire's transport:
asyncgrpo/wire/reach.py). tests/unit/test_import_graph.py holds it to that."""
