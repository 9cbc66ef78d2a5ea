"""`asyncgrpo simulate RUN_DIR [key=value ...]`: a discrete-event model of a run, calibrated from
the run's own measured phase times, that predicts throughput, idle fractions and staleness for
other settings (more generators, another staleness bound, more learner ranks, slower pushes).

    settings.py     Settings: what to simulate (the run's config keys plus sim.* knobs), overrides
    calibration.py  Calibration.from_run(run_dir): what the run measured, per call and per step
    envwaits.py     the rounds of environment calls a call of episodes waits (env.latency_s each)
    events.py       the discrete-event engine: processes, processor sharing, per-phase clocks
    model.py        simulate(calibration, settings) -> Result: the generators, dispatch, learner
    report.py       run_command: the table and the JSON line `asyncgrpo simulate` prints

The model (docs/SIMULATOR.md states every assumption): each generator runs the real loop of
asyncgrpo/rollout/generator.py (load the newest weights -> ask for tickets -> one vLLM call -> score ->
send; a call whose episodes call an environment waits for its answers with the engine free for
the next call), the dispatcher of asyncgrpo/queue/dispatch.py grants each call's slots to whichever
generator asks under the staleness rules of asyncgrpo/contract.py and hands each step its slots, and the
learner runs the step of asyncgrpo/learner/learner.py (ack_wait -> gen_wait -> train -> push; a
push is visible to the generators when it ends). Each actor has its own hardware, unless sim.cores
makes them share a machine's cores (processor sharing, after taking out of the calibration the
sharing its own run had). Pure Python (no torch, no numpy), so it runs anywhere in well under a
second.
"""
