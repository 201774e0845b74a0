"""``nostall serve``, ``fleet`` and ``embed-server``: bad options are usage errors before
a model is read or a server starts (the services themselves: tests/serve)."""

from __future__ import annotations

import pytest
from cli_support import runner, usage_error

from nostall.cli import app


@pytest.mark.parametrize(
    ("command", "args", "says"),
    [
        ("serve", ["--dtype", "int8"], "Invalid value for --dtype: 'int8' is not a cast target"),
        (
            "serve",
            ["--port", "70000"],
            "'--port': 70000 is out of range; give a number in 1..65535",
        ),
        ("serve", ["--port", "0"], "'--port': 0 is out of range"),
        ("serve", ["--gpu-budget-gb", "0"], "--gpu-budget-gb: must be a positive number of GB"),
        ("serve", ["--device", "tpu"], "'tpu' is not a device"),
        ("embed-server", ["--dtype", "int8"], "'int8' is not a cast target"),
        ("embed-server", ["--port", "70000"], "70000 is out of range"),
        ("embed-server", ["--token-budget", "0"], "'--token-budget': 0 is out of range"),
        ("fleet", ["--replicas", "1", "--device", "gpu"], "'gpu' is not one of cuda, cpu"),
        ("fleet", ["--replicas", "1", "--port", "70000"], "70000 is out of range"),
    ],
)
def test_bad_service_options_are_usage_errors(tmp_path, command, args, says):
    # The store does not exist: reading it would be another error.
    result = runner.invoke(app, [command, "--models", str(tmp_path / "no-store"), *args])
    usage_error(result, says)
    assert "no-store" not in result.output
