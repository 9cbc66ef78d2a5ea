"""An agent for env.name=agent (docs/ENVIRONMENTS.md, Bring your own agent): plain OpenAI-client
code that gives the model a calculator.

It asks the problem; when the reply calls the calculator as "[a*b]" (or "[a+b]"), it computes the
value itself and sends "=<value>" back as the user's next message, then takes the following reply
as the answer. Returns 1.0 for the right answer, else 0.0 (the episode's environment reward).

    asyncgrpo train env.name=agent env.agent.fn=agent_calculator:calculator_agent \\
        env.agent.chat_template='...' env.max_turns=2     # with examples/ on PYTHONPATH
"""

from __future__ import annotations

import re

from openai import OpenAI

CALL = re.compile(r"\[(\d+)([*+])(\d+)\]")


def calculator_agent(problem: dict, base_url: str, api_key: str) -> float:
    # max_retries=0: the server's refusals (400, 409) are final; retrying them only costs time.
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60.0)
    messages = [{"role": "user", "content": problem["prompt"]}]
    reply = _ask(client, messages)
    call = CALL.search(reply)
    if call:
        left, op, right = int(call.group(1)), call.group(2), int(call.group(3))
        value = left * right if op == "*" else left + right
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"={value}"}]
        reply = _ask(client, messages)
    return 1.0 if reply.strip() == str(problem["answer"]).strip() else 0.0


def _ask(client: OpenAI, messages: list[dict]) -> str:
    # model, temperature and max_tokens are the training run's, whatever is sent here.
    response = client.chat.completions.create(model="policy", messages=messages)
    return response.choices[0].message.content or ""
