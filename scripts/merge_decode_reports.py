"""Join decode bench reports run in separate GPU-machine calls into one JSON.

python scripts/merge_decode_reports.py OUT.json PART.json [PART.json ...]
"""

import json
import sys

from nostall.bench.decode import merge_reports
from nostall.bench.record import write_report

if len(sys.argv) < 3:
    sys.exit(__doc__)
parts = []
for path in sys.argv[2:]:
    with open(path) as f:
        parts.append(json.load(f))
merged = merge_reports(parts)
write_report(merged, sys.argv[1])
for name, t in merged["targets"].items():
    mark = {True: "met   ", False: "MISSED", None: "      "}[t["met"]]
    print(mark, name, t["value"], t["op"], t["threshold"])
