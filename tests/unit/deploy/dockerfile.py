"""A Dockerfile read into stages, enough to check what the images would be without a
container engine: each stage's base, and the instructions in effect in it (inherited
from the stage it is built ``FROM``)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Dockerfile:
    args: dict[str, str]
    stages: dict[str, Stage]

    def chain(self, name: str) -> list[Stage]:
        """The stage and those it is built on, nearest first."""
        stages = [self.stages[name]]
        while stages[-1].base in self.stages:
            stages.append(self.stages[stages[-1].base])
        return stages

    def last(self, name: str, instruction: str) -> str | None:
        """The value of the last ``instruction`` in effect in a stage."""
        for stage in self.chain(name):
            values = [value for op, value in stage.instructions if op == instruction]
            if values:
                return values[-1]
        return None

    def all(self, name: str, instruction: str) -> list[str]:
        return [v for s in self.chain(name) for op, v in s.instructions if op == instruction]

    def base_image(self, name: str) -> str:
        base = self.chain(name)[-1].base
        return re.sub(r"\$\{(\w+)\}", lambda m: self.args[m.group(1)], base)

    def entrypoint(self, name: str) -> list[str]:
        value = self.last(name, "ENTRYPOINT")
        assert value is not None, f"stage {name} has no ENTRYPOINT"
        return list(json.loads(value))

    def exposed(self, name: str) -> set[int]:
        return {int(p.split("/")[0]) for v in self.all(name, "EXPOSE") for p in v.split()}


def logical_lines(text: str) -> list[str]:
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    return lines


def parse(path: Path) -> Dockerfile:
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for line in logical_lines(path.read_text()):
        op, _, value = line.partition(" ")
        op, value = op.upper(), value.strip()
        if op == "FROM":
            words = shlex.split(value)
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else words[0]
            stage = stages[name] = Stage(name=name, base=words[0])
        elif op == "ARG" and stage is None:
            key, _, default = value.partition("=")
            args[key] = default
        else:
            assert stage is not None, f"{op} before the first FROM"
            stage.instructions.append((op, value))
    return Dockerfile(args=args, stages=stages)
