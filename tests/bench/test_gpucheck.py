"""The GPU check's report: pytest's junit XML read back, and a failed test never an OK check."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nostall.bench.gpucheck import build_report, junit_summary


@pytest.mark.slow
def test_junit_summary_counts_real_pytest_output(tmp_path):
    # Run pytest on a tiny file so the XML is exactly what pytest writes.
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert False\n"
        "@pytest.mark.skip(reason='no gpu')\n"
        "def test_skip(): pass\n"
    )
    xml = tmp_path / "j.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
            str(tmp_path / "test_x.py"),
        ],
        capture_output=True,
        cwd=tmp_path,
    )
    s = junit_summary(str(xml))
    assert (s["passed"], s["failed"], s["skipped"]) == (1, 1, 1)
    assert s["failed_tests"][0].endswith("::test_bad")

    smoke = tmp_path / "smoke.json"
    smoke.write_text(json.dumps({"load": {"equal_to_safetensors": True}}))
    report = build_report(str(xml), str(smoke), 0)
    assert report["ok"] is False  # a failed test is never an OK check
    assert report["smoke"]["load"]["equal_to_safetensors"] is True
    assert report["date"] and report["commit"]
