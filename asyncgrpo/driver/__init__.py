"""The driver: what `asyncgrpo train` runs in its own process, around the Ray actors.

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

Modules: `prepare` (before any actor), `actors` (their lifecycle), `loop` (the training loop),
`evaluation` (eval and the vLLM-vs-learner probes). `asyncgrpo.train.train` runs them in order.
Nothing outside the driver and `asyncgrpo.train` imports this package.
"""


class TrainingFailed(RuntimeError):
    """The run cannot go on: a resource is missing, an actor died or stopped answering."""
