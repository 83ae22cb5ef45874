"""Where a py-spy `--format raw` recording spent its samples: the top frames, by self time
and including callees."""
from __future__ import annotations

import collections
import sys
from pathlib import Path


def summarize(path: Path, top: int = 12) -> dict:
    self_time: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        self_time[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n

    def share(counter):
        return [f"{100 * c / total:5.1f}% {frame[:160]}" for frame, c in counter.most_common(top)]

    return {"samples": total, "self": share(self_time) if total else [],
            "inclusive": share(inclusive) if total else []}


if __name__ == "__main__":
    for name in sys.argv[1:]:
        summary = summarize(Path(name))
        print(f"== {name}: {summary['samples']} samples\n self:")
        print("\n".join("  " + s for s in summary["self"]))
        print(" inclusive:")
        print("\n".join("  " + s for s in summary["inclusive"]))
