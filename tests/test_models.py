"""Model names: a run directory means its export."""
from pathlib import Path

import pytest

from toolrl.models import resolve_run_model


def test_run_directory_means_its_export(tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{}")
    assert resolve_run_model(str(tmp_path)) == str(tmp_path / "export")
    assert resolve_run_model("smollm2-135m-instruct") == "smollm2-135m-instruct"
    with pytest.raises(FileNotFoundError, match="run directory"):
        resolve_run_model(str(tmp_path.parent))


def test_a_missing_run_or_unknown_model_is_one_line_before_anything_starts(tmp_path, monkeypatch):
    """inference.py --model runs/typo-run took the name for a hub id: 57 s, then a 77-line traceback
    from the hub; an unknown name failed the same way after the executor had started (found in review).
    It runs where runs/ exists (a clean clone has none until a run: CI's did not, so runs/typo-run
    was a hub id there)."""
    import subprocess
    import sys

    from toolrl.models import resolve_run_model

    root = Path(__file__).resolve().parent.parent
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    for bad, needle in (("runs/typo-run", "no such run or model directory: runs/typo-run"),
                        ("nosuch-model", "unknown model 'nosuch-model'")):
        with pytest.raises(FileNotFoundError, match=needle):
            resolve_run_model(bad)
        out = subprocess.run([sys.executable, str(root / "inference.py"), "--model", bad, "what is 2+2?"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"inference.py: {needle}"), lines
        assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert resolve_run_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
