"""The device check's bookkeeping (stdlib only): ``figure STAGE WORK`` prints a stage's key figure
from its files in WORK; ``merge WORK OUT`` writes OUT/junit.xml (every stage's junit XML) and
OUT/results.json (every stage's JSON), so that what ran comes back even if a later stage is cut off.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def figure(stage: str, work: Path) -> str:
    junit = work / f"{stage}.xml"
    if junit.is_file():
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        for suite in ET.parse(junit).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        return (
            f"{passed} passed, {counts['failures'] + counts['errors']} failed, "
            f"{counts['skipped']} skipped"
        )
    data = work / f"{stage}.json"
    if not data.is_file():
        return "-"
    results = json.loads(data.read_text())
    if stage == "bandwidth":
        return "ratio to copy " + " ".join(
            f"{r['num_seqs']}x{r['context']}:{r['ratio']}" for r in results
        )
    if stage == "throughput":
        return "vs transformers " + " ".join(
            f"{n}:{r.get('ratio', '-')}" for n, r in results.items()
        )
    if stage == "versions":
        return (
            f"{results.get('device')} torch {results.get('torch')} triton {results.get('triton')}"
        )
    return "-"


def merge(work: Path, out: Path) -> None:
    root = ET.Element("testsuites")
    for junit in sorted(work.glob("*.xml")):
        for suite in ET.parse(junit).getroot().iter("testsuite"):
            suite.set("name", junit.stem)
            root.append(suite)
    ET.ElementTree(root).write(out / "junit.xml", encoding="utf-8", xml_declaration=True)
    results = {p.stem: json.loads(p.read_text()) for p in sorted(work.glob("*.json"))}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "figure":
        print(figure(sys.argv[2], Path(sys.argv[3])))
    else:
        merge(Path(sys.argv[2]), Path(sys.argv[3]))
