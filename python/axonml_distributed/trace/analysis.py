"""What a job's flight records say (`python -m axonml_distributed.trace analyze`): for each group, which
call each rank was at, the first call at which ranks diverged (called different collectives, or the
same one differently), and the first call that not every rank completed, with who never entered it and
who left no record; the sends and receives each rank had not completed; and, when the records kept
them (AXONML_FLIGHT_RECORDER_STACKS), where in the program each rank made the diverging call."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# What makes two ranks' calls the same call (their sequence numbers aside).
_IDENTITY = ("kind", "dtype", "count", "root", "op")


@dataclass
class GroupAnalysis:
    """One group's verdict. Ranks are global."""

    name: str
    ranks: list[int]
    # Per member with a record: where it was ("completed #4 all_reduce(...), then #5 broadcast(...)
    # failed").
    where: dict[int, str] = field(default_factory=dict)
    # The first call (sequence number) that members called differently, and those that called it
    # differently from the most (of a tie: from the lowest rank), with each member's call.
    diverged_at: int | None = None
    diverging_ranks: list[int] = field(default_factory=list)
    calls_at_divergence: dict[int, str] = field(default_factory=dict)
    # The first call not every member completed, what it was, and the members that never entered it.
    stuck_at: int | None = None
    stuck_call: str | None = None
    never_entered: list[int] = field(default_factory=list)
    # Members of the group of which the records hold nothing (killed, or never failed in Python).
    no_record: list[int] = field(default_factory=list)
    # Per member: its sends and receives not completed ("recv(4 x float32 from rank 0, tag 0) scheduled").
    pending_p2p: dict[int, list[str]] = field(default_factory=dict)
    # Per member: the Python stack of its diverging call ("fn at file:line", innermost first), if kept.
    frames_at_divergence: dict[int, list[str]] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [f"group {self.name}:"]
        for rank, where in sorted(self.where.items()):
            out.append(f"  rank {rank}: {where}")
        for rank in self.no_record:
            out.append(f"  rank {rank}: no record (killed, or it never failed in Python)")
        for rank, pending in sorted(self.pending_p2p.items()):
            out.append(f"  rank {rank}: not completed: {'; '.join(pending)}")
        if self.diverged_at is not None:
            calls = ", ".join(f"rank {r} called {c}" for r, c in sorted(self.calls_at_divergence.items()))
            out.append(
                f"  ranks diverged first at #{self.diverged_at}: {_ranks(self.diverging_ranks)} called it "
                f"differently ({calls})"
            )
            for rank, frames in sorted(self.frames_at_divergence.items()):
                out.append(f"    rank {rank} called it from: " + " <- ".join(frames))
        if self.stuck_at is not None:
            line = f"  first call not completed by every rank: #{self.stuck_at} {self.stuck_call}"
            if self.never_entered:
                line += f"; {_ranks(self.never_entered)} never entered it"
            if self.no_record:
                line += f"; no record from {_ranks(self.no_record)}"
            out.append(line)
        elif self.diverged_at is None and not self.pending_p2p:
            out.append("  every rank completed every recorded call")
        return out


@dataclass
class Analysis:
    groups: list[GroupAnalysis]
    # Each rank's error, as its dump recorded it.
    errors: dict[int, str]

    def lines(self) -> list[str]:
        out = []
        for group in self.groups:
            out += group.lines()
        for rank, error in sorted(self.errors.items()):
            out.append(f"rank {rank} failed with: {error}")
        return out

    def summary(self) -> str:
        """One line: the first divergence, else the first call not every rank completed, else the first
        send or receive not completed."""
        for group in self.groups:
            if group.diverged_at is not None:
                return (
                    f"group {group.name}: ranks diverged at #{group.diverged_at}: "
                    f"{_ranks(group.diverging_ranks)} called it differently"
                )
        for group in self.groups:
            if group.stuck_at is not None:
                text = f"group {group.name}: #{group.stuck_at} {group.stuck_call} was not completed"
                if group.never_entered:
                    text += f"; {_ranks(group.never_entered)} never entered it"
                if group.no_record:
                    text += f"; {_ranks(group.no_record)} left no record"
                return text
        for group in self.groups:
            for rank, pending in sorted(group.pending_p2p.items()):
                return f"group {group.name}: rank {rank}'s {pending[0]}"
        return "every rank completed every recorded call"


def analyze(content: dict[str, Any]) -> Analysis:
    """The verdict of a flight-record file's content (`record.load`)."""
    dumps: dict[int, dict[str, Any]] = {int(rank): dump for rank, dump in content["ranks"].items()}
    groups: dict[str, list[int]] = {}
    entries: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    p2p: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for rank, dump in dumps.items():
        for name, config in dump["pg_config"].items():
            groups[name] = [int(r) for r in config["ranks"].strip("[]").split(",") if r.strip()]
            entries.setdefault(name, {}).setdefault(rank, {})
        for entry in dump["entries"]:
            group = entry["process_group"][0]
            if entry.get("is_p2p"):
                p2p.setdefault(group, {}).setdefault(rank, []).append(entry)
            else:
                entries[group][rank][entry["collective_seq_id"]] = entry
    errors = {rank: dump["error"] for rank, dump in dumps.items() if dump.get("error")}
    return Analysis([_group(name, groups[name], entries[name], p2p.get(name, {})) for name in groups], errors)


def _group(
    name: str,
    ranks: list[int],
    calls: dict[int, dict[int, dict[str, Any]]],
    p2p: dict[int, list[dict[str, Any]]],
) -> GroupAnalysis:
    result = GroupAnalysis(name, ranks, no_record=[r for r in ranks if r not in calls])
    for rank, by_seq in calls.items():
        result.where[rank] = _where(by_seq)
    for rank, sent in p2p.items():
        pending = [f"{e['call']} {e['state']}" for e in sent if e["state"] != "completed"]
        if pending:
            result.pending_p2p[rank] = pending
    # Divergence: the first sequence number two members recorded differently.
    for seq in sorted({seq for by_seq in calls.values() for seq in by_seq}):
        at = {rank: by_seq[seq] for rank, by_seq in calls.items() if seq in by_seq}
        kinds = Counter(_identity(e) for e in at.values())
        if len(kinds) > 1:
            # The call most members made (of a tie, the lowest rank's) is the usual one.
            lowest = _identity(at[min(at)])
            usual = max(kinds, key=lambda k: (kinds[k], k == lowest))
            result.diverged_at = seq
            result.diverging_ranks = sorted(r for r, e in at.items() if _identity(e) != usual)
            result.calls_at_divergence = {r: e["call"] for r, e in at.items()}
            result.frames_at_divergence = {r: _frames(e) for r, e in at.items() if e.get("frames")}
            break
    # The first call a member with a record did not complete. A call before the oldest one a member's
    # ring holds was completed there (later calls followed); one after its newest was never entered.
    for seq in sorted({seq for by_seq in calls.values() for seq in by_seq}):
        found = {rank: by_seq.get(seq) for rank, by_seq in calls.items()}
        if all(_completed(seq, e, calls[rank]) for rank, e in found.items()):
            continue
        result.stuck_at = seq
        result.stuck_call = next(e["call"] for e in found.values() if e is not None)
        result.never_entered = sorted(
            rank for rank, e in found.items() if e is None and not _completed(seq, e, calls[rank])
        )
        break
    return result


def _completed(seq: int, entry: dict[str, Any] | None, by_seq: dict[int, dict[str, Any]]) -> bool:
    if entry is None:
        return bool(by_seq) and min(by_seq) > seq
    return bool(entry["state"] == "completed")


def _identity(entry: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(entry.get(key) for key in _IDENTITY)


def _where(by_seq: dict[int, dict[str, Any]]) -> str:
    if not by_seq:
        return "no call recorded"
    completed = [seq for seq, e in by_seq.items() if e["state"] == "completed"]
    last = by_seq[max(by_seq)]
    text = (
        f"completed #{max(completed)} {by_seq[max(completed)]['call']}"
        if completed
        else "completed no recorded call"
    )
    if last["state"] != "completed":
        text += f", then {last['call']} {last['state']}"
    return text


def _frames(entry: dict[str, Any]) -> list[str]:
    """An entry's stack as torch's analyzer prints frames: "fn at file:line", innermost first."""
    return [f"{f['name']} at {f['filename']}:{f['line']}" for f in entry["frames"]]


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
