"""Choices of where and in what precision the learner's weights compute (read by the policy and by
`asyncgrpo.config`'s validation). Plain Python, no torch.
"""

# learner.mixed_precision: fp32 | bf16 (GPU only: FSDP2 computes in bf16, reduces gradients and
# keeps weights in fp32).
MIXED_PRECISIONS = ("fp32", "bf16")
# algo.kl.reference_on: same = sharded with FSDP2 like the policy, on the learner's device;
# cpu = a full copy in CPU memory.
REFERENCE_PLACEMENTS = ("same", "cpu")
