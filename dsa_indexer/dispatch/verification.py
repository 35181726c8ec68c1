"""How far each registration has been checked, per arch, as data (`dsa-indexer matrix`, docs/matrix.md).

A registration states its evidence with ``verified=(Verified(...), ...)``: a level, the archs it covers (an arch,
a vendor family or ``*``, as ``targets``), and where the evidence lies (a test file, a results file). Only a run on
a device of that arch counts as ``hardware``, and it names the commit that recorded the run and its date. An arch
that no record covers reads as ``read``: nothing ran for it, so a registration added without evidence (a new
vendor's, a plugin's) is never shown as more than read.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Level(str, enum.Enum):
    """The kinds of evidence, strongest first."""

    HARDWARE = "hardware"  # ran on a device of this arch (the commit that recorded the run, its date)
    INTERPRETER = "interpreter"  # the kernel's source ran in Triton's CPU interpreter (CI), compiled for no device
    VENDOR_SCHEMA = "vendor-schema"  # called through operators registered under the vendor's published schemas (CI)
    DOUBLE = "double"  # called against a test double of the vendor library (CI)
    READ = "read"  # the vendor's source and docs read; nothing ran for this arch

    @property
    def strength(self) -> int:
        return len(LEVELS) - LEVELS.index(self)


LEVELS = tuple(Level)
_COMMIT = re.compile(r"[0-9a-f]{7,40}")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


@dataclass(frozen=True)
class Verified:
    """One piece of evidence for one registration on ``archs``.

    ``every_commit``: a hardware run that CI repeats at each commit (the CPU suite on the CPU target), so it has no
    single commit to name."""

    level: Level
    archs: tuple[str, ...]
    evidence: str
    commit: str | None = None
    date: str | None = None
    every_commit: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "level", Level(self.level))
        archs = (self.archs,) if isinstance(self.archs, str) else tuple(self.archs)
        object.__setattr__(self, "archs", archs)
        if not archs or not all(isinstance(a, str) and a for a in archs):
            raise ValueError(f"Verified.archs must name at least one arch, family or '*', got {self.archs!r}")
        if not self.evidence:
            raise ValueError("Verified.evidence must say where the evidence lies (a test file, a results file)")
        if self.level is Level.HARDWARE:
            if not self.every_commit and (self.commit is None or self.date is None):
                raise ValueError(f"Verified: a hardware run names the commit that recorded it and its date "
                                 f"(commit=, date=), or every_commit=True for CI's own machine ({self.evidence})")
        elif self.commit is not None or self.date is not None or self.every_commit:
            raise ValueError(f"Verified: commit / date / every_commit belong to hardware runs; a {self.level.value} "
                             f"check runs in CI at each commit ({self.evidence})")
        if self.commit is not None and not _COMMIT.fullmatch(self.commit):
            raise ValueError(f"Verified.commit must be a git hash (7-40 lowercase hex digits), got {self.commit!r}")
        if self.date is not None and not _DATE.fullmatch(self.date):
            raise ValueError(f"Verified.date must read YYYY-MM-DD, got {self.date!r}")

    def covers(self, arch: str, vendor: str) -> bool:
        return any(a == "*" or a == arch or a == vendor for a in self.archs)

    def describe(self) -> str:
        """One line: the level, then when (hardware) and where the evidence lies."""
        when = ""
        if self.level is Level.HARDWARE:
            when = " (each commit, CI)" if self.every_commit else f" ({self.commit}, {self.date})"
        return f"{self.level.value}{when}: {self.evidence}"

    def to_dict(self) -> dict:
        return {"level": self.level.value, "archs": list(self.archs), "evidence": self.evidence,
                "commit": self.commit, "date": self.date, "every_commit": self.every_commit}


def unverified(arch: str) -> Verified:
    return Verified(Level.READ, (arch,), "no recorded run or test on this arch")


def verification_for(records: tuple[Verified, ...], arch: str, vendor: str) -> Verified:
    """The strongest record covering ``arch`` (a more specific record wins a tie with ``*``), else `unverified`."""
    covering = [r for r in records if r.covers(arch, vendor)]
    if not covering:
        return unverified(arch)
    return max(covering, key=lambda r: (r.level.strength, arch in r.archs, vendor in r.archs))


def ran_on(archs: str | tuple[str, ...], commit: str, date: str, evidence: str) -> Verified:
    """A run on hardware of ``archs``, recorded by ``commit`` on ``date``."""
    return Verified(Level.HARDWARE, archs, evidence, commit=commit, date=date)


# Everything that runs on CPU tensors runs in the CPU suite at every commit (`.ci/run`).
CPU_SUITE = Verified(Level.HARDWARE, ("cpu",), "the CPU test suite (.ci/run)", every_commit=True)
