"""One typed trajectory for every agent format (Doctor-RAG's indexed components).

A failed ReAct-style episode becomes a list of steps labelled as the paper
labels them, so a diagnosis can name its culprit and a repair can keep the
prefix before it:

    [Step k] (Reasoning)      a thought
    [Action j] (Search)       a search (or lookup) query, j counts actions only
    [Evidence j] (Information) what action j returned
    [Step k] (Answer)         the final answer; reasoning and answer share k
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class StepKind(str, Enum):
    REASONING = "reasoning"
    SEARCH = "search"
    EVIDENCE = "evidence"
    ANSWER = "answer"


class Tool(str, Enum):
    SEARCH = "search"
    LOOKUP = "lookup"      # ReAct's Lookup[keyword]: the next sentence with it on the current page


_LABEL = {StepKind.REASONING: "[Step {k}] (Reasoning)", StepKind.ANSWER: "[Step {k}] (Answer)",
          StepKind.SEARCH: "[Action {k}] (Search)", StepKind.EVIDENCE: "[Evidence {k}] (Information)"}


@dataclass(frozen=True)
class Step:
    kind: StepKind
    index: int            # k for reasoning/answer, j for search/evidence (1-based)
    text: str             # the thought, the query, the observation or the answer
    tool: Tool | None = None     # searches only

    @property
    def label(self) -> str:
        return _LABEL[self.kind].format(k=self.index)


@dataclass(frozen=True)
class Trajectory:
    """A parsed episode; `line` is its 1-based line in the input file."""

    line: int
    question: str
    prediction: str | None        # None: the agent halted without an answer
    gold: tuple[str, ...]         # gold answer and aliases
    steps: tuple[Step, ...]
    source_format: str
    task: str = "qa"              # "qa" or "fever" (labels SUPPORTS / REFUTES / NOT ENOUGH INFO)
    meta: dict = field(default_factory=dict, compare=False)

    def of(self, kind: StepKind) -> list[Step]:
        return [s for s in self.steps if s.kind is kind]

    def position(self, label: str) -> int:
        """Index into `steps` of the step with this label (ValueError if absent)."""
        for i, s in enumerate(self.steps):
            if s.label == label:
                return i
        raise ValueError(f"no step {label!r} in the trajectory of line {self.line}")

    def evidence_before(self, position: int) -> list[Step]:
        return [s for s in self.steps[:position] if s.kind is StepKind.EVIDENCE]

    def evidence_for(self, action: Step) -> Step | None:
        return next((s for s in self.steps if s.kind is StepKind.EVIDENCE and s.index == action.index), None)

    def render(self, upto: int | None = None) -> str:
        """The labelled steps as text (the first `upto` of them)."""
        return "\n".join(f"{s.label}: {s.text}" for s in self.steps[:upto])


class TrajectoryBuilder:
    """Turns (Thought | Action | Observation) events into typed, indexed steps."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.k = 0          # reasoning/answer counter
        self.j = 0          # action counter
        self.awaiting = False       # an action without its observation yet
        self.answer: str | None = None
        self.invalid_actions = 0    # actions the environment rejected or nobody could parse

    def thought(self, text: str) -> None:
        text = text.strip()
        if text:
            self.k += 1
            self.steps.append(Step(StepKind.REASONING, self.k, text))

    def action(self, tool: str, argument: str) -> None:
        tool = tool.strip().lower()
        if tool == "finish":
            self.k += 1
            self.answer = argument.strip()
            self.steps.append(Step(StepKind.ANSWER, self.k, self.answer))
            self.awaiting = False
            return
        self.j += 1
        self.steps.append(Step(StepKind.SEARCH, self.j, argument.strip(), Tool(tool)))
        self.awaiting = True

    def observation(self, text: str) -> None:
        if self.awaiting:           # an observation after finish ("Episode finished") is not evidence
            self.steps.append(Step(StepKind.EVIDENCE, self.j, text.strip()))
            self.awaiting = False

    def invalid_action(self, text: str) -> None:
        """An action that is not tool[argument]: counted, not a step."""
        self.invalid_actions += 1
        self.awaiting = False

    def retract(self) -> None:
        """The environment answered "Invalid action": the last action did not happen."""
        self.invalid_actions += 1
        if self.steps and self.steps[-1].kind is StepKind.ANSWER:
            self.steps.pop()
            self.k -= 1
            self.answer = next((s.text for s in reversed(self.steps) if s.kind is StepKind.ANSWER), None)
        elif self.steps and self.steps[-1].kind is StepKind.SEARCH:
            self.steps.pop()
            self.j -= 1
        self.awaiting = False
