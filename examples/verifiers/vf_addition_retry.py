"""A verifiers 0.4 environment, written as its users write one: 2-digit sums with a second try.

The model answers "37+48="; a wrong answer gets a hint ("+ " too low, "- " too high) and one more try.
The Task's `correct` reward judges the last reply; the Env's `run` adds `first_try` (weight 0.5).
examples/verifiers-addition.yaml trains on it: PYTHONPATH=examples/verifiers (its id is `vf_addition_retry`,
as an installed environment module's is)."""

import random

import verifiers.v1 as vf
from datasets import Dataset


class AdditionConfig(vf.TasksetConfig):
    size: int = 2000
    digits: int = 2
    seed: int = 0


class AdditionData(vf.TaskData):
    answer: str


class AdditionTask(vf.Task[AdditionData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: AdditionData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        top = 10**self.config.digits
        pairs = Dataset.from_list([{"a": rng.randrange(top), "b": rng.randrange(top)} for _ in range(self.config.size)])
        for row in pairs:
            data = AdditionData(prompt=f"{row['a']}+{row['b']}=", answer=str(row["a"] + row["b"]))
            yield AdditionTask(data, self.config.task)


class RetryEnvConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    tries: int = 2


class RetryEnv(vf.Env[RetryEnvConfig]):
    async def run(self, task, agents):
        async with agents.solver.interaction(task) as interaction:
            segment = await interaction.turn()
            tries = 1
            while segment.last_reply != task.data.answer and tries < self.config.tries:
                guess = int(segment.last_reply) if segment.last_reply.isdigit() else -1
                segment = await interaction.turn("+ " if guess < int(task.data.answer) else "- ")
                tries += 1
        interaction.trace.record_reward("first_try", float(tries == 1 and segment.last_reply == task.data.answer), 0.5)


__all__ = ["AdditionTaskset", "RetryEnv"]
