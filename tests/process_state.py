"""Whether a process has ended, read from /proc (tests of the engine process)."""

from __future__ import annotations

from pathlib import Path


def process_ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie no one has reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def children_of(pid: int) -> list[int]:
    """The live (not zombie) child processes of ``pid``, read from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                children.append(int(entry.name))
    return children
