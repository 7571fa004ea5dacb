"""The bank's audit log: `audit.jsonl`, one JSON object per block / unblock / delete / edit /
set-fallback.

`append_audit` writes one entry (who, when, on which host, what, why, at which generation) as a
single appended line; `audit_log` reads them back; `blocked_as_subtree` reads from them which
clusters a block named as subtree roots, so an unblock can undo exactly what a block did.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from memtree.io import utc_timestamp
from memtree.memstore.policy import id_runs


def append_audit(
    root: Path,
    *,
    user: str,
    action: str,
    targets: Mapping[int, Sequence[int]],
    reason: str,
    generation: int,
    request: Mapping[str, Any],
) -> None:
    """One audit line; `request` records what was asked (level, clusters, subtree) beside `targets`,
    every block it covered, so an unblock can undo exactly what a block did."""
    entry = {
        "time": utc_timestamp(),
        "user": user,
        "host": socket.gethostname(),
        "action": action,
        "targets": {str(lv): id_runs(ids) for lv, ids in targets.items()},
        "reason": reason,
        "generation": generation,
        **request,
    }
    line = (json.dumps(entry, sort_keys=True) + "\n").encode()
    fd = os.open(root / "audit.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)  # one write of one line: appends from one writer never interleave
        os.fsync(fd)
    finally:
        os.close(fd)


def audit_log(root: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(root) / "audit.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def blocked_as_subtree(entries: Sequence[dict[str, Any]], level: int) -> list[int]:
    """Level-`level` clusters whose latest block named them as the root of a subtree block.

    An entry records what was asked (`level`, `clusters`, `subtree`); entries written before
    those fields existed are read from `targets`: the shallowest level is what was asked, and
    any deeper level means the subtree came with it. Blocks asked for another way (`by`, e.g. an
    owner's documents) name no cluster and are skipped."""
    latest: dict[int, bool] = {}
    for e in entries:
        if e.get("action") != "block" or not e.get("targets") or e.get("by"):
            continue
        if "level" in e:
            root, ids, sub = int(e["level"]), e["clusters"], e.get("subtree") is True
        else:
            lvs = sorted(int(k) for k in e["targets"])
            root, sub = lvs[0], len(lvs) > 1
            ids = [i for a, b in e["targets"][str(root)] for i in range(a, b)]
        if root == level:
            latest.update((int(c), sub) for c in ids)
    return sorted(c for c, sub in latest.items() if sub)
