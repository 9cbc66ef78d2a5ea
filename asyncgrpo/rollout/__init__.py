"""The generator: sample groups with vLLM, score them, stream them to the learner.

    actor.py        GeneratorActor: a generator as a Ray actor, resettable between pooled runs
    spec.py         GeneratorSpec: who a generator is, where it connects, its starting weights
    parts.py        GeneratorParts and build_parts: the real parts from config and a spec
    generator.py    Generator: the loop (weights, ask, generate, score, send) over its parts
    channel.py      GroupChannel: what the generator sends, numbered groups, acks and heartbeats
    episodes.py     EpisodeRunner: a group's episodes (policy turns, environment answers, the policy mask)
    running.py      Admitted: a granted ticket and the prompt submitted for it
    stats.py        GeneratorStats: the generator's counters and timed phases
    pacing.py       FailpointPace: the failpoints that slow a generator's engine steps
    engine.py       VLLMEngine: sample with log-probs, score fixed sequences, load weights
    tickets.py      the generator's side of dynamic dispatch: ticket requests and grants
    scoring.py      ScoringBatch: a batch whose rewards are being computed
    groups.py       a group's episodes and rewards -> a ScoredGroup message
    sink.py         GroupSink: where the generator's messages go
    waits.py        WaitLimit: how long a wait may last (wire.timeout_s, or a save's bound)
    evaluations.py  generator 0's periodic held-out evaluations
"""
