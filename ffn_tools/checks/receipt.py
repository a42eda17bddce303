"""``ffn-tools verify --receipt OUT``: an output checked against its own receipt (``io.receipt``), without the source.

Every file the receipt lists must be there with its size and digest (BLAKE3; SHA-256 in a receipt of version 1); a
file of the output that the receipt does not list fails too (an output is what its receipt says, nothing more). The
sources are not read (they may be on another machine, or gone): the report says so, and what the receipt records of
them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError, counted
from ..io import receipt
from ..sizes import human
from . import Check

NAMES = {"blake3": "BLAKE3", "sha256": "SHA-256"}  # a digest's algorithm as a sentence names it


@dataclass(kw_only=True)
class ReceiptCheck(Check):
    name = "receipt"

    path: str = ""
    command: str | None = None
    tool: dict = field(default_factory=dict)
    files: int = 0
    nbytes: int = 0
    sources: list[dict] = field(default_factory=list)
    algorithm: str = "blake3"

    def summary(self) -> str:
        made = f"{self.command or 'a library call'} by ffn-tools {self.tool.get('version', '?')}"
        if self.passed:
            return (f"PASS: {self.path} is what its receipt says ({made}): {counted(self.files, 'file')}, "
                    f"{human(self.nbytes)}, each of its size and {NAMES[self.algorithm]}")
        return f"FAIL: {self.path} differs from its receipt ({made}): {counted(len(self.problems), 'problem')}"

    def lines(self) -> list[str]:
        srcs = sum(s["size"] for s in self.sources)
        return [*self.failures(),
                f"sources: not read ({counted(len(self.sources), 'file')}, {human(srcs)}, as the receipt records them: "
                "--receipt checks the output without its source)",
                self.summary()]

    def as_dict(self) -> dict:
        return {**super().as_dict(), "receipt": str(receipt.receipt_path(Path(self.path))), "command": self.command,
                "tool": self.tool, "files": self.files, "bytes": self.nbytes, "sources": self.sources,
                "sources_checked": False}


def read(out: Path) -> dict:
    """The receipt of output ``out``.

    Raises:
        CheckpointError: no output there, no receipt, or one ffn-tools cannot read.
    """
    if not out.exists():
        raise CheckpointError(f"{out}: no such output")
    path = receipt.receipt_path(out)
    try:
        r = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{out}: has no receipt ({path.name}): it was not written by ffn-tools, or by a "
                              "version before receipts, or its receipt was removed") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read this receipt ({e})") from None
    if not isinstance(r, dict) or r.get("receipt") not in receipt.DIGESTS or not isinstance(r.get("outputs"), list):
        raise CheckpointError(f"{path}: not a receipt this version of ffn-tools reads (receipt version "
                              f"{r.get('receipt') if isinstance(r, dict) else '?'}, this one reads "
                              f"{', '.join(map(str, receipt.DIGESTS))})")
    return r


def check(out) -> ReceiptCheck:
    """Every file of ``out`` against its receipt: sizes and digests (BLAKE3; SHA-256 in a version 1 receipt), hashed
    ``receipt.HASHERS`` files at a time."""
    out = Path(out)
    r = read(out)
    algorithm = receipt.DIGESTS[r["receipt"]]
    listed = {o["path"]: o for o in r["outputs"]}
    present = dict(receipt.output_files(out))
    problems = [f"{name}: missing (the receipt lists {human(o['size'])})" for name, o in listed.items()
                if name not in present]
    problems += [f"{name}: not in the receipt" for name in present if name not in listed]
    common = [name for name in listed if name in present]
    for name, (size, digest) in zip(common, receipt.hashed([present[n] for n in common], algorithm)):
        want = listed[name]
        if size != want["size"]:
            problems.append(f"{name}: {size} bytes, the receipt says {want['size']}")
        elif digest != want.get(algorithm):
            problems.append(f"{name}: {NAMES[algorithm]} {digest[:16]}..., the receipt says "
                            f"{str(want.get(algorithm))[:16]}... (same size: its bytes changed)")
    return ReceiptCheck(problems=problems, path=str(out), command=r.get("command"), tool=r.get("tool") or {},
                        files=len(listed), nbytes=sum(o["size"] for o in listed.values()),
                        sources=r.get("sources") or [], algorithm=algorithm)
