"""The learner rank: the policy it trains and how each step goes.

    actor.py        LearnerActor: a rank as a Ray actor, its parts built in the actor's process
    parts.py        a rank's parts from config: process group, policy, rank 0's queue and sender
    learner.py      Learner: a step's phases (take groups, update, push weights) over its parts
    intake.py       rank 0's group intake: the ack wait, the take, re-publishing to rejoiners
    policy.py       Policy: the model under FSDP2, AdamW, the LR schedule, the KL reference
    update.py       one optimizer step: advantages, loss over micro-batches, clipping, step
    batch.py        scored groups -> padded training tensors
    schedule.py     the learning-rate schedule
    publication.py  delayed weight publication for train.fixed_staleness
    admission.py    train.staleness_control=divergence: the step's divergence to the bound, the bound to rank 0's queue
    precision.py    where and in what precision the weights compute (no torch)
    metrics.py      the step's metrics, defined once
    checkpoint.py   sharded, atomic checkpoints and finding the newest one
    resume.py       what a checkpoint records of its run, whether a resume may continue it
    export.py       the policy in Hugging Face format
"""
