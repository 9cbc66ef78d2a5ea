"""The driver: what `asyncgrpo train` runs in its own process, around the Ray actors (and
`asyncgrpo replay`, a learner on a recorded stream in this process: replay.py).

    driver (this process)                  Ray actors
    ---------------------                  ----------
    prepare: model (warm start), resume point, data, Ray
    actors: start learner rank(s)  ------>  LearnerActor: binds the group PULL and weight PUB sockets
            start generators       ------>  GeneratorActor x N: vLLM engine, connects to both sockets
            weight rendezvous (if the weight backend has one)
    evaluation: eval at start, probes at start
    loop: learner.train_steps(k)           generators ask for slots within the staleness bound
          write metrics, progress, samples
          a generator's process died: actors.restart_generator (its next incarnation rejoins)
    learner.finish() -> Shutdown           generators load the final weights and return
    evaluation: eval at end, probes at end
    actors: stop                           (asyncgrpo.train writes summary.json)

Modules:

    preflight.py      before anything heavy: the reward functions and the judge, the model
                      directory, the weight-push plan, the KV cache, memory per actor
    prepare.py        before any actor: the device, the model, the resume point, the data, Ray
    actors.py         the actors' lifecycle: placement, start, weight rendezvous, restarts, stop
    learner_ranks.py  the learner ranks' placement group and their LearnerActors
    engine_pool.py    generators kept alive between a study's runs (rollout.engine_pool)
    loop.py           the training loop: steps, metrics, progress, samples, generator restarts
    evaluation.py     held-out accuracy and the vLLM-vs-learner log-prob probes
    remote.py         calls to actors with a deadline, the actors' `control` concurrency group
    replay.py         `asyncgrpo replay`: one learner rank on a recorded stream, no actors
    replay_evaluation.py  a replay's held-out evaluations, on vLLM in its own process

`asyncgrpo.train.train` runs the phases in order. Only the entry points import this package:
`asyncgrpo.train` and `asyncgrpo.cli` (which runs the preflight for `check=true`, makes SIGTERM an
interrupt and turns `TrainingFailed` into an exit code); tests/unit/test_import_graph.py holds it
to that.
"""


class TrainingFailed(RuntimeError):
    """The run cannot go on: a resource is missing, an actor died or stopped answering."""
