"""Verifiable tasks: problems with a prompt, a reference answer and an exact-match score."""

from asyncgrpo.tasks.arithmetic import ArithmeticTask, Problem

__all__ = ["ArithmeticTask", "Problem"]
