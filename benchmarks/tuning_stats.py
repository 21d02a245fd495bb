"""How far down its config list each kernel's tuning winner sits, from a cache folder.

For every first-round tuning entry (all valid configs timed, in the strategy's
order) under the given cache folders, per kernel family (the kernel name's
prefix: ``af_mm``, ``af_chain``, ``af_attention``, ...): how many configs were
timed, where the winner was in the list, and what capping the list at its first
``k`` configs would have cost (the best of the first ``k`` against the best of
all, as a slowdown of the kernel); then each family's winning configs, most
frequent first, with their places in the list. The data behind how many configs
a strategy lists, and in which order. ``--json FILE`` also writes every
first-round entry's timings (kernel, config, ms), to try another order or cap
offline. Strategies with large kernels tune only their first few configs
(``max_tuned_configs``): their entries then show where the winner sat among
those. For whole lists, fill the caches with ``autofuser bench
--tune-all-configs`` (``fuse(..., tune_all_configs=True)``).

    python benchmarks/tuning_stats.py /tmp/autofuser-zoo-cache/* --json tuning.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

CAPS = (1, 2, 3, 4, 6, 8, 10, 12)


def family(kernel: str) -> str:
    parts = kernel.split("_")
    return "_".join(parts[:2]) if len(parts) > 2 else kernel


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, default=None, help="write every first-round entry's timings here")
    args = parser.parse_args(argv)
    dumped = []  # every first-round entry, for --json
    rows: dict[str, list[tuple[int, int, list[float]]]] = defaultdict(list)
    won: dict[str, Counter] = defaultdict(Counter)
    for folder in args.folders:
        for path in sorted((folder / "tuning").glob("*.json")):
            try:
                entry = json.loads(path.read_text())
            except ValueError:
                continue
            timings = [t["ms"] for t in entry.get("timings", []) if isinstance(t.get("ms"), (int, float))]
            if entry.get("config_limit") is not None or len(timings) < 2:
                continue
            dumped.append({"folder": folder.name, "kernel": entry["key"]["kernel"], "timings": entry["timings"]})
            best = min(timings)
            place = timings.index(best)
            rows[family(entry["key"]["kernel"])].append((len(timings), place, timings))
            config = json.dumps(entry.get("config", {}), sort_keys=True)
            won[family(entry["key"]["kernel"])][(config, place)] += 1
    print(
        f"{'family':16s} {'kernels':>7s} {'configs':>7s} {'winner index (sorted)':40s} "
        + " ".join(f"{'cap ' + str(k):>9s}" for k in CAPS)
    )
    for name, entries in sorted(rows.items()):
        winners = sorted(w for _, w, _ in entries)
        regrets = []
        for k in CAPS:
            costs = [min(t[:k]) / min(t) - 1.0 for _, _, t in entries]
            regrets.append(f"{100 * statistics.mean(costs):4.1f}/{100 * max(costs):4.0f}%")
        print(
            f"{name:16s} {len(entries):7d} {statistics.mean(n for n, _, _ in entries):7.1f} "
            f"{str(winners)[:40]:40s} " + " ".join(f"{r:>9s}" for r in regrets)
        )
    print("cap k: mean/max slowdown of the kernel had only its first k configs been tuned")
    print("\nwinning configs (count, place in the list, config):")
    for name, counts in sorted(won.items()):
        print(f"{name}:")
        for (config, place), count in counts.most_common():
            print(f"  {count:3d}  #{place:<3d} {config}")
    if args.json is not None:
        args.json.write_text(json.dumps(dumped, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
